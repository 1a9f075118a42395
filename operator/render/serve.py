"""CPU engine pods: `holeblend-serve` (the blend engine) instead of vLLM.

On `accelerator.type: cpu` the engine container runs
`holeblend-serve --config /etc/holeblend/blend.json --host <listen address> --port <engine.port>`
(the operator's --pod-listen-address, 0.0.0.0 unless set),
followed by `engine.extraArgs` (holeblend-serve flags such as `--queue-size 16`). It reads
the same mounted blend.json as the vLLM connector and re-reads its live keys. Probes:
startup and readiness on `/ready` (the model is loaded and warmed up; 503 while draining
on SIGTERM), liveness on `/healthz`. The pod's grace period is at least the preStop pause
plus the server's drain and close (`stop_seconds`: the pod's own `--drain-timeout` and
`--shutdown-timeout`). GPU and NPU pods keep vLLM (see engine.py).
"""

import math

from holeblend_contract.blend_settings import CONFIG_PATH
from holeblend_contract.serve_settings import DRAIN_TIMEOUT_S, SHUTDOWN_TIMEOUT_S, env_name
from holeblend_operator.api import AcceleratorType, BlendDeployment
from holeblend_operator.render.pods import health_probe
from holeblend_operator.settings import DEFAULT_POD_LISTEN_ADDRESS

SERVE_COMMAND = "holeblend-serve"
READY_PATH = "/ready"
HEALTH_PATH = "/healthz"
# How long holeblend-serve takes to stop after SIGTERM: --drain-timeout for queued and running
# requests, --shutdown-timeout for connections still open, and a few seconds to join its
# threads and send its last calibration pairs.
JOIN_SECONDS = 5


def runs_holeblend_serve(bd: BlendDeployment) -> bool:
    return bd.spec.accelerator.type == AcceleratorType.CPU


def stop_seconds(bd: BlendDeployment) -> int:
    """How long holeblend-serve takes to stop after SIGTERM with the drain and close this
    pod's engine.extraArgs and engine.env give it (38 s at the defaults)."""
    drain = seconds_setting(bd, "--drain-timeout", DRAIN_TIMEOUT_S)
    shutdown = seconds_setting(bd, "--shutdown-timeout", SHUTDOWN_TIMEOUT_S)
    return math.ceil(drain + shutdown) + JOIN_SECONDS


def seconds_setting(bd: BlendDeployment, flag: str, default: float) -> float:
    """A holeblend-serve timeout as its argparse reads it: the last `flag VALUE` or
    `flag=VALUE` in engine.extraArgs, else its HOLEBLEND_SERVE_* variable in engine.env.
    A value the server refuses (not a number, not above 0) stops the pod at start, and an
    infinite one cannot be waited for: both leave the default."""
    text = None
    args = bd.spec.engine.extra_args
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            text = args[i + 1]
        elif arg.startswith(flag + "="):
            text = arg.removeprefix(flag + "=")
    if text is None:
        name = env_name(flag.removeprefix("--").replace("-", "_"))
        text = next((var.value for var in bd.spec.engine.env if var.name == name), None)
    try:
        seconds = float(text)
    except (TypeError, ValueError):
        return default
    return seconds if 0 < seconds < math.inf else default


def serve_args(bd: BlendDeployment, listen_address: str = DEFAULT_POD_LISTEN_ADDRESS) -> list[str]:
    args = ["--config", CONFIG_PATH, "--host", listen_address, "--port", str(bd.spec.engine.port)]
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


def serve_container_fields(
    bd: BlendDeployment, listen_address: str = DEFAULT_POD_LISTEN_ADDRESS
) -> dict:
    """What replaces vLLM's command, args and probes in a CPU engine container."""
    args = serve_args(bd, listen_address)
    return {"command": [SERVE_COMMAND], "args": args, **serve_probes()}
