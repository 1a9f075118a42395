"""What a tenant may not set on the engine pods: flags, variables and annotations.

`engine.extraArgs`, `engine.env` and `engine.podAnnotations` must not override what the
operator sets, undo what the blend needs, or leave the pod's security bounds: a tenant could
move the port away from the probes and the Service, drop or replace the KV connector, read
another deployment's shared-tier keys (`HOLEBLEND_DEPLOYMENT`), see devices the pod was not
given (the device plugins' *_VISIBLE_DEVICES variables) or run unconfined by AppArmor.

Every table here is the single source of three checks: the CRD's CEL rules (the API server),
the API models' validators (`holeblend-operator render` and the operator), and the tests that
hold the tables against the renderers (every flag and variable they set is listed) and
against the parsers that read the arguments (vLLM's and holeblend-serve's).

How a flag is recognised (vLLM's FlexibleArgumentParser and argparse, which our own CLIs use):

- `--flag value` and `--flag=value`;
- `_` read as `-` in a long flag's name (`--tensor_parallel_size`);
- any prefix of a long flag (`--por`, `--kv-transfer`): argparse's `allow_abbrev`, on in vLLM,
  takes a unique prefix as the flag. Rather than track which prefixes are unique among the
  ~300 flags of each vLLM version, every non-empty prefix of a reserved flag is refused: a
  prefix that is not unique is an error in vLLM anyway, and no vLLM flag is itself a prefix
  of a reserved one (tests/vllm checks this against the installed vLLM). Short flags the
  same way (`-t` abbreviates `-tp`);
- `--flag.key value` and `--flag.key=value`: vLLM merges dotted arguments into the JSON flag
  `--flag` and appends it after every other argument, so `--kv-transfer-config.kv_connector=X`
  would replace the operator's whole connector config;
- `--no-flag` (BooleanOptionalAction) is listed next to `--flag` where the operator sets one.
"""

import re

from holeblend_contract import serve_settings
from holeblend_contract.blend_settings import CONFIG_ENV
from holeblend_contract.shared_tier import DEPLOYMENT_ENV, PASSWORD_ENV

_CONNECTOR = (
    "nothing: the operator wires its own KV connector (blend.mode: off runs vLLM without one)"
)
_EAGER = (
    "nothing: the blend runs the model's modules outside vLLM's compiled graphs, so the "
    "operator keeps eager mode on"
)
_NO_PREFIX_CACHING = (
    "nothing: vLLM's own prefix hits would make it skip the blend's range, so the operator "
    "turns prefix caching off (blend.mode: off leaves vLLM's default, on)"
)
_NO_HYBRID_KV = (
    "nothing: the KV connector needs one KV cache group, so the operator disables the "
    "hybrid KV cache manager"
)

# flag -> the spec field to use instead (or why nothing may set it)
RESERVED_FLAGS = {
    # Set by the operator on vLLM (render/engine.py) and on holeblend-serve (render/serve.py).
    "--host": "nothing: the engine listens where the operator's --pod-listen-address says",
    "--port": "engine.port",
    "--config": (
        "nothing: the operator mounts the blend settings file for holeblend-serve, and a vLLM "
        "config file could set any of these flags"
    ),
    "--served-model-name": "model.servedName",
    "--model": "model.source",
    "--dtype": "model.dtype",
    "--max-model-len": "model.maxModelLen",
    "--revision": "model.source.hub.revision",
    "--tensor-parallel-size": "engine.tensorParallelSize",
    "-tp": "engine.tensorParallelSize",
    # What the blend needs, and its negations.
    "--kv-transfer-config": _CONNECTOR,
    "--kv-connector": _CONNECTOR,
    # vLLM replaces the connector with its own offloading connector when these are set.
    "--kv-offloading-size": _CONNECTOR,
    "--kv-offloading-backend": _CONNECTOR,
    "--enforce-eager": _EAGER,
    "--no-enforce-eager": _EAGER,
    "--enable-prefix-caching": _NO_PREFIX_CACHING,
    "--no-enable-prefix-caching": _NO_PREFIX_CACHING,
    "--disable-hybrid-kv-cache-manager": _NO_HYBRID_KV,
    "--no-disable-hybrid-kv-cache-manager": _NO_HYBRID_KV,
    "--block-size": "accelerator.type (the operator sets the block size its attention needs)",
    # vLLM pods while the quality proxies are on (render/engine.py): the shadow requests run
    # at the lowest priority, after every user request.
    "--scheduling-policy": "nothing: the operator sets --scheduling-policy priority on vLLM "
    "pods while tuning.qualityProxies is on, so that the shadow requests run after user "
    "requests (which keep their arrival order among themselves); with it off vLLM keeps "
    "its default, fcfs",
    "--scheduler-cls": "nothing: the operator sets its scheduler class on vLLM pods while "
    "tuning.qualityProxies is on, so that a shadow request yields to user requests "
    "(tuning.shadowChunkTokens sizes its steps)",
}
assert all(re.fullmatch(r"--?[a-z0-9]+(-[a-z0-9]+)*", flag) for flag in RESERVED_FLAGS)

# variable -> the spec field that sets it (or why nothing may)
RESERVED_ENV = {
    CONFIG_ENV: "blend (the operator mounts the blend settings file)",
    "HOLEBLEND_METRICS_PORT": "engine.metricsPort",
    DEPLOYMENT_ENV: "nothing: it is the deployment's own namespace/name, the prefix of its "
    "shared-tier keys",
    PASSWORD_ENV: "blend.kv.sharedPasswordSecret",
    # holeblend-serve reads these only when the flag is absent, and the operator passes it.
    "HOLEBLEND_SERVE_CONFIG": "blend (the operator passes --config to holeblend-serve)",
    "HOLEBLEND_SERVE_HOST": "nothing: the engine listens where the operator's --pod-listen-address says",
    "HOLEBLEND_SERVE_PORT": "engine.port",
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
# Every other HOLEBLEND_* variable is the operator's too (today's and tomorrow's), except
# the ones the runtime documents for users: these names, and holeblend-serve's flags.
OPERATOR_ENV_PREFIX = "HOLEBLEND_"
USER_ENV = {
    # Accepted so that specs written before spec.tuning.qualityProxies stay valid; the
    # operator warns until it is removed (api.spec_notices).
    "HOLEBLEND_ENGINE_URL": "deprecated: the vLLM pods' API server for the shadow quality "
    "proxies, which spec.tuning.qualityProxies now turns on with the URL rendered; remove it",
    "HOLEBLEND_ATTENTION": "forces holeblend-serve's attention backend",
    "HOLEBLEND_CACHE_DIR": "holeblend-serve's converted-model cache",
}
USER_ENV_PREFIXES = (serve_settings.ENV_PREFIX,)

# Label and annotation keys of the engine pod template that are the operator's.
RESERVED_METADATA_PREFIXES = ("app.kubernetes.io/", "blend.holeblend.io/")

# Annotation key prefix -> why a tenant may not set it. The operator sets the pods' security
# profiles in their securityContext (RuntimeDefault seccomp); these annotations would
# replace them, or reach past the pod spec into the container runtime.
DENIED_ANNOTATION_PREFIXES = {
    # Pod Security Standards, baseline and restricted: only runtime/default or localhost/*;
    # `unconfined` turns AppArmor off. Still honoured by the kubelet next to the field.
    "container.apparmor.security.beta.kubernetes.io/": "an AppArmor profile (unconfined "
    "turns AppArmor off)",
    # The seccomp annotations of Kubernetes before 1.19 (still read by older kubelets).
    "seccomp.security.alpha.kubernetes.io/": "a seccomp profile (unconfined turns it off)",
    "container.seccomp.security.alpha.kubernetes.io/": "a seccomp profile (unconfined turns "
    "it off)",
    # Annotations that container runtimes read when a runtime class allows them: host
    # devices, user namespaces, cgroups, a VM's kernel and hypervisor, sandbox mounts.
    "io.kubernetes.cri-o.": "CRI-O's runtime settings (devices, user namespaces, cgroups)",
    "io.kubernetes.cri.": "containerd's CRI settings",
    "io.katacontainers.": "Kata Containers' VM settings (kernel, hypervisor, hooks)",
    "dev.gvisor.": "gVisor's sandbox settings (mounts, platform)",
}


# --- flags ---------------------------------------------------------------------------------


def flag_name(arg: str) -> str | None:
    """The option an argument names, as vLLM reads it: the part before '=' or a dotted key,
    with '_' read as '-' in a long flag ('--kv_transfer_config.kv_role=x' ->
    '--kv-transfer-config'); None for a value or a bare '-'/'--'."""
    if not arg.startswith("-"):
        return None
    dashes = "--" if arg.startswith("--") else "-"
    name = re.split(r"[=.]", arg[len(dashes) :], maxsplit=1)[0]
    if not name:
        return None
    return dashes + (name.replace("_", "-") if dashes == "--" else name)


def reserved_flag(arg: str) -> str | None:
    """The reserved flag `arg` sets, abbreviates or sets a key of; None when it is free."""
    name = flag_name(arg)
    if name is None:
        return None
    return next((flag for flag in RESERVED_FLAGS if flag.startswith(name)), None)


def reserved_flag_problem(args: list[str]) -> str | None:
    """Why `args` may not be passed to the engine, or None."""
    for arg in args:
        flag = reserved_flag(arg)
        if flag is None:
            continue
        if flag_name(arg) != flag:
            what = f"{arg!r} abbreviates {flag} (vLLM takes any unique prefix of a flag), which"
        elif re.match(r"-+[^=]*\.", arg):
            what = f"{arg!r} sets a key of {flag}, which"
        else:
            what = f"{arg!r}"
        return (
            f"{what} is reserved by the operator; {_fix('engine.extraArgs', RESERVED_FLAGS[flag])}"
        )
    return None


def _fix(field: str, instead: str) -> str:
    if instead.startswith("nothing: "):
        return f"remove it from {field} ({instead.removeprefix('nothing: ')})"
    return f"remove it from {field} and set {instead} instead"


def _prefix_pattern(words: list[str], dash: str) -> str:
    """A regex that matches every non-empty prefix of `words` and nothing else."""
    trie: dict = {}
    for word in words:
        node = trie
        for char in word:
            node = node.setdefault(char, {})

    def alternatives(node: dict) -> str:
        return "|".join(
            (dash if char == "-" else char) + (f"({alternatives(child)})?" if child else "")
            for char, child in sorted(node.items())
        )

    return alternatives(trie)


_LONG = [flag[2:] for flag in RESERVED_FLAGS if flag.startswith("--")]
_SHORT = [flag[1:] for flag in RESERVED_FLAGS if not flag.startswith("--")]
# The flag name ends at '=' (a value), '.' (a dotted key) or the end of the argument.
RESERVED_FLAG_PATTERN = (
    f"^(--({_prefix_pattern(_LONG, '[-_]')})|-({_prefix_pattern(_SHORT, '-')}))([=.]|$)"
)
RESERVED_FLAGS_RULE = f"self.all(a, !a.matches('{RESERVED_FLAG_PATTERN}'))"
RESERVED_FLAGS_MESSAGE = (
    "extraArgs must not set flags the operator sets, abbreviate them, negate them or set "
    "their keys (--flag.key): "
    + ", ".join(RESERVED_FLAGS)
    + "; remove them from engine.extraArgs and use their spec fields (see Reserved flags in docs/api.md)"
)


# --- environment ---------------------------------------------------------------------------


def _operator_env(name: str) -> bool:
    return name.startswith(OPERATOR_ENV_PREFIX) and not (
        name in USER_ENV or name.startswith(USER_ENV_PREFIXES)
    )


def reserved_env_problem(names: list[str]) -> str | None:
    """Why these variable names may not be set, or None."""
    seen: set[str] = set()
    for name in names:
        if name in RESERVED_ENV:
            return f"{name} is set by the operator; {_fix('engine.env', RESERVED_ENV[name])}"
        if _operator_env(name):
            return (
                f"{name}: {OPERATOR_ENV_PREFIX}* variables are the operator's, except "
                f"{', '.join(USER_ENV)} and {', '.join(p + '*' for p in USER_ENV_PREFIXES)}; "
                "remove it from engine.env"
            )
        if name in seen:
            return f"{name} is set twice; keep one entry"
        seen.add(name)
    return None


def _cel_list(items) -> str:
    return "[" + ", ".join(f"'{item}'" for item in items) + "]"


RESERVED_ENV_RULE = (
    f"self.all(e, !(e.name in {_cel_list(RESERVED_ENV)}) && "
    f"(!e.name.startsWith('{OPERATOR_ENV_PREFIX}') || e.name in {_cel_list(USER_ENV)}"
    + "".join(f" || e.name.startsWith('{prefix}')" for prefix in USER_ENV_PREFIXES)
    + "))"
)
RESERVED_ENV_MESSAGE = (
    "env must not set variables the operator sets ("
    + ", ".join(RESERVED_ENV)
    + f", and every other {OPERATOR_ENV_PREFIX}* but "
    + ", ".join([*USER_ENV, *(p + "*" for p in USER_ENV_PREFIXES)])
    + "); remove them from engine.env and use their spec fields (see Reserved flags in docs/api.md)"
)
UNIQUE_ENV_RULE = "self.all(e, self.exists_one(f, f.name == e.name))"


# --- annotations ---------------------------------------------------------------------------


def denied_annotation_problem(keys) -> str | None:
    """Why one of these pod annotation keys may not be set, or None."""
    for key in keys:
        for prefix, what in DENIED_ANNOTATION_PREFIXES.items():
            if key.startswith(prefix):
                return (
                    f"{key!r} would set {what}; remove it from engine.podAnnotations "
                    "(the operator sets the pod's security profiles)"
                )
    return None


DENIED_ANNOTATIONS_RULE = (
    "self.all(k, "
    + " && ".join(f"!k.startsWith('{prefix}')" for prefix in DENIED_ANNOTATION_PREFIXES)
    + ")"
)
DENIED_ANNOTATIONS_MESSAGE = (
    "podAnnotations must not set security profiles or container-runtime settings (keys under "
    + ", ".join(DENIED_ANNOTATION_PREFIXES)
    + "); remove them from engine.podAnnotations"
)
