"""vLLM flags and environment variables the operator sets itself, with the spec field to use.

`engine.extraArgs` and `engine.env` must not override them: a tenant could move the port
away from the probes and the Service, drop the KV connector, or see devices the pod was not
given (the device plugins' and container runtimes' *_VISIBLE_DEVICES variables). The engine
renderer and the API models both read these tables, so they cannot drift apart.
"""

# flag -> the spec field that sets it
RESERVED_FLAGS = {
    "--host": "nothing: the engine listens on all addresses of its pod",
    "--port": "engine.port",
    "--served-model-name": "model.servedName",
    "--model": "model.source",
    "--dtype": "model.dtype",
    "--max-model-len": "model.maxModelLen",
    "--revision": "model.source.hub.revision",
    "--tensor-parallel-size": "engine.tensorParallelSize",
    "-tp": "engine.tensorParallelSize",
    "--kv-transfer-config": "blend (the operator wires its own KV connector)",
    "--kv-connector": "blend (the operator wires its own KV connector)",
}

# variable -> the spec field that sets it
RESERVED_ENV = {
    "HOLEBLEND_CONFIG": "blend (the operator mounts the blend settings file)",
    "HOLEBLEND_METRICS_PORT": "engine.metricsPort",
    "ASCEND_RT_VISIBLE_DEVICES": "accelerator.count",
    "ASCEND_VISIBLE_DEVICES": "accelerator.count",
    "CUDA_VISIBLE_DEVICES": "accelerator.count",
    "NVIDIA_VISIBLE_DEVICES": "accelerator.count",
    "HCCL_SOCKET_IFNAME": "accelerator.networkInterface",
    "GLOO_SOCKET_IFNAME": "accelerator.networkInterface",
    "TP_SOCKET_IFNAME": "accelerator.networkInterface",
    "NCCL_SOCKET_IFNAME": "accelerator.networkInterface",
    "HOME": "nothing: the engine's home is a scratch volume the operator mounts",
}


def _flag_regex(flag: str) -> str:
    # vLLM reads '_' as '-' in long flags; '--port=9000' sets --port too.
    return flag[:2] + flag[2:].replace("-", "[-_]") if flag.startswith("--") else flag


# The same checks as CEL, for the CRD (the API server's messages are shorter than ours).
RESERVED_FLAGS_RULE = (
    "self.all(a, !a.matches('^("
    + "|".join(_flag_regex(flag) for flag in RESERVED_FLAGS)
    + ")(=.*)?$'))"
)
RESERVED_ENV_RULE = (
    "self.all(e, !(e.name in [" + ", ".join(f"'{name}'" for name in RESERVED_ENV) + "]))"
)
UNIQUE_ENV_RULE = "self.all(e, self.exists_one(f, f.name == e.name))"


def flag_name(arg: str) -> str | None:
    """The flag an argument sets ('--port=9000' -> '--port'; vLLM also reads '_' as '-')."""
    if not arg.startswith("-"):
        return None
    name = arg.split("=", 1)[0]
    return name[:2] + name[2:].replace("_", "-") if name.startswith("--") else name


def reserved_flag_problem(args: list[str]) -> str | None:
    """Why `args` may not be passed to vLLM, or None."""
    for arg in args:
        name = flag_name(arg)
        if name in RESERVED_FLAGS:
            return f"{arg!r} is set by the operator; set {RESERVED_FLAGS[name]} instead"
    return None


def reserved_env_problem(names: list[str]) -> str | None:
    """Why these variable names may not be set, or None."""
    seen: set[str] = set()
    for name in names:
        if name in RESERVED_ENV:
            return f"{name} is set by the operator; set {RESERVED_ENV[name]} instead"
        if name in seen:
            return f"{name} is set twice; keep one entry"
        seen.add(name)
    return None


# Label and annotation keys of the engine pod template that are the operator's.
RESERVED_METADATA_PREFIXES = ("app.kubernetes.io/", "blend.holeblend.io/")
