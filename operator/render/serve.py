"""CPU engine pods: `holeblend-serve` (the blend engine) instead of vLLM.

On `accelerator.type: cpu` the engine container runs
`holeblend-serve --config /etc/holeblend/blend.json --host 0.0.0.0 --port <engine.port>`,
followed by `engine.extraArgs` (holeblend-serve flags such as `--queue-size 16`). It reads
the same mounted blend.json as the vLLM connector and re-reads its live keys. Probes:
startup and readiness on `/ready` (the model is loaded and warmed up; 503 while draining
on SIGTERM), liveness on `/healthz`. The pod's grace period is at least the preStop pause
plus the server's drain and close (`STOP_SECONDS`). GPU and NPU pods keep vLLM (see engine.py).
"""

from holeblend_contract.blend_settings import CONFIG_PATH
from holeblend_operator.api import AcceleratorType, BlendDeployment
from holeblend_operator.render.pods import health_probe

SERVE_COMMAND = "holeblend-serve"
READY_PATH = "/ready"
HEALTH_PATH = "/healthz"
# How long holeblend-serve takes to stop after SIGTERM at its defaults: --drain-timeout (30 s)
# for queued and running requests, --shutdown-timeout (3 s) for connections still open, and a
# few seconds to join its threads and send its last calibration pairs.
STOP_SECONDS = 30 + 3 + 5


def runs_holeblend_serve(bd: BlendDeployment) -> bool:
    return bd.spec.accelerator.type == AcceleratorType.CPU


def serve_args(bd: BlendDeployment) -> list[str]:
    args = ["--config", CONFIG_PATH, "--host", "0.0.0.0", "--port", str(bd.spec.engine.port)]
    return [*args, *bd.spec.engine.extra_args]


def serve_probes() -> dict:
    # The reference model loads in seconds once its converted weights are cached, but the
    # first start converts the GGUF (about a minute on 2 cores): the startup probe allows 5.
    return {
        "startupProbe": health_probe(READY_PATH, periodSeconds=5, failureThreshold=60),
        "readinessProbe": health_probe(READY_PATH, periodSeconds=5, failureThreshold=2),
        "livenessProbe": health_probe(
            HEALTH_PATH, periodSeconds=15, timeoutSeconds=5, failureThreshold=4
        ),
    }


def serve_container_fields(bd: BlendDeployment) -> dict:
    """What replaces vLLM's command, args and probes in a CPU engine container."""
    return {"command": [SERVE_COMMAND], "args": serve_args(bd), **serve_probes()}
