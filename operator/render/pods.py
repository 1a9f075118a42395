"""What the engine and lookup-server pods share: probes, resources, pod hardening.

Security contexts follow the Pod Security Standards (README, "Pod Security Standards"):
the lookup server and the CPU and NVIDIA engines meet `restricted`; Ascend engines need the
node's driver mounted from hostPath, which no level but `privileged` admits, and keep the
image's user (see `ascend_container_security`).
"""

# Neither pod talks to the Kubernetes API, and service-link variables such as <NAME>_PORT
# can collide with the engine's own VLLM_* settings.
POD_HARDENING = {"automountServiceAccountToken": False, "enableServiceLinks": False}

# Any non-root uid works: the images need no passwd entry, HOME points at a scratch volume.
NON_ROOT_UID = 65532

RESTRICTED_POD_SECURITY = {
    "runAsNonRoot": True,
    "runAsUser": NON_ROOT_UID,
    "runAsGroup": NON_ROOT_UID,
    "seccompProfile": {"type": "RuntimeDefault"},
}
RESTRICTED_CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}


def ascend_pod_security() -> dict:
    # The image's user (root in the vllm-ascend images): the NPU device nodes and driver
    # files belong to root and the HwHiAiUser group, whose gid each node's driver install
    # picks, so a fixed non-root uid could not open them. The syscall filter still applies.
    return {"seccompProfile": {"type": "RuntimeDefault"}}


def ascend_container_security() -> dict:
    # Root keeps its default capabilities: without CAP_DAC_OVERRIDE it could not open the
    # HwHiAiUser-owned devices. The root filesystem stays writable: CANN writes compiled
    # operators (kernel_meta) into the working directory and logs under $HOME/ascend.
    return {"allowPrivilegeEscalation": False}


def health_probe(path: str, **timing: int) -> dict:
    """An HTTP probe on the container's `http` port."""
    return {"httpGet": {"path": path, "port": "http"}, **timing}


def probe_budget_seconds(probe: dict) -> int:
    """Longest time a probe may keep failing before the kubelet acts on it."""
    period = probe.get("periodSeconds", 10)
    return probe.get("initialDelaySeconds", 0) + period * probe.get("failureThreshold", 3)


def resources(requests: dict[str, str], limits: dict[str, str]) -> dict:
    """Container resources with keys in a stable order and empty sections left out."""
    both = {"requests": requests, "limits": limits}
    return {key: dict(sorted(value.items())) for key, value in both.items() if value}
