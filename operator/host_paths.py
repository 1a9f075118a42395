"""Which node directories a BlendDeployment may mount: only those under allowed prefixes.

Anyone who may create a BlendDeployment must not gain the node's filesystem through it (a
hostPath of `/` or `/etc/kubernetes` would hand them the node). Host paths a spec sets (a
hostPath model source, `accelerator.driverHostPath`, `accelerator.hccnConfHostPath`) must
lie under one of the operator's allowed prefixes (`--host-path-prefix`, env
HOLEBLEND_OPERATOR_HOST_PATH_PREFIXES, chart value `hostPathPrefixes`). The defaults admit
what an Ascend node needs and a conventional model directory, nothing else.

The prefixes reach the API models through pydantic's validation context
(`validation_context`); without one the defaults apply, so `holeblend-operator render` and
the operator reject the same specs unless the operator was configured otherwise.
"""

import posixpath
from typing import Any

DEFAULT_HOST_PATH_PREFIXES = (
    "/usr/local/Ascend",  # driver and CANN toolkits (MindCluster / vllm-ascend layout)
    "/etc/hccn.conf",  # NPU network settings read by HCCL for multi-NPU pods
    "/data/models",  # model weights staged on the nodes
)
CONTEXT_KEY = "host_path_prefixes"


def validation_context(prefixes: tuple[str, ...] = DEFAULT_HOST_PATH_PREFIXES) -> dict[str, Any]:
    """The pydantic validation context that carries the allowed prefixes."""
    return {CONTEXT_KEY: tuple(prefixes)}


def prefixes_of(context: dict[str, Any] | None) -> tuple[str, ...]:
    return (context or {}).get(CONTEXT_KEY, DEFAULT_HOST_PATH_PREFIXES)


def has_dot_dot(path: str) -> bool:
    return ".." in path.split("/")


def is_under(path: str, prefix: str) -> bool:
    """`path` is `prefix` or inside it, compared by whole path components."""
    prefix = prefix.rstrip("/") or "/"
    return path == prefix or path.startswith(prefix if prefix == "/" else prefix + "/")


def check_host_path(path: str, prefixes: tuple[str, ...]) -> str:
    """`path` normalised if it lies under an allowed prefix, else ValueError with the fix."""
    if has_dot_dot(path):
        raise ValueError(f"{path!r} contains '..'; write the directory without it")
    clean = posixpath.normpath(path)
    if not any(is_under(clean, prefix) for prefix in prefixes):
        allowed = ", ".join(prefixes) or "none"
        raise ValueError(
            f"{path!r} is outside the host paths this operator allows ({allowed}); "
            "use a path under one of them, or ask the cluster admin to add a prefix "
            "(operator setting hostPathPrefixes)"
        )
    return clean
