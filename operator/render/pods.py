"""What the engine and lookup-server pods share: probes, resources, pod hardening."""

# Neither pod talks to the Kubernetes API, and service-link variables such as <NAME>_PORT
# can collide with the engine's own VLLM_* settings.
POD_HARDENING = {"automountServiceAccountToken": False, "enableServiceLinks": False}


def health_probe(path: str, **timing: int) -> dict:
    """An HTTP probe on the container's `http` port."""
    return {"httpGet": {"path": path, "port": "http"}, **timing}


def resources(requests: dict[str, str], limits: dict[str, str]) -> dict:
    """Container resources with keys in a stable order and empty sections left out."""
    both = {"requests": requests, "limits": limits}
    return {key: dict(sorted(value.items())) for key, value in both.items() if value}
