"""The runtime ConfigMap: the blend settings every engine pod reads from `HOLEBLEND_CONFIG`.

The file is JSON with sorted keys so equal settings give byte-equal data. The tuner changes
`recomputeRatio` live: it records the ratio in status.recomputeRatio, the reconcile re-renders
this ConfigMap with it, and the kubelet refreshes the mounted file (the volume is mounted
without subPath for that reason); the runtime re-reads the file. That is why the ratio is
kept out of `config_hash`, the pod-template annotation that rolls the pods on every other
change.
"""

import hashlib
import json

from holeblend_operator.api import BlendDeployment, BlendDeploymentSpec
from holeblend_operator.quantity import quantity_bytes
from holeblend_operator.render.labels import RUNTIME_CONFIG, object_meta
from holeblend_operator.render.naming import lookup_name, runtime_config_name

CONFIG_KEY = "blend.json"
CONFIG_DIR = "/etc/holeblend"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_KEY}"
# Bumped when a key changes meaning, so a runtime can refuse a file it does not understand.
FORMAT_VERSION = 1
# Keys the runtime picks up without a restart; everything else rolls the pods.
LIVE_KEYS = frozenset({"recomputeRatio"})


def effective_recompute_ratio(bd: BlendDeployment) -> float:
    """The ratio the pods run with: see `effective_ratio`."""
    status = bd.status
    return effective_ratio(bd.spec, status.recompute_ratio, status.tuning.base_ratio)


def effective_ratio(spec: BlendDeploymentSpec, tuned: float | None, base: float | None) -> float:
    """The tuner's ratio (status.recomputeRatio) while tuning is on, clamped to the bounds;
    else the spec's.

    A tuned ratio counts only while it derives from the spec's current ratio
    (status.tuning.baseRatio): a person who edits spec.blend.recomputeRatio gets that value.
    The only input render takes from the status.
    """
    tuning, spec_ratio = spec.tuning, spec.blend.recompute_ratio
    if not tuning.enabled or tuned is None or base != spec_ratio:
        return spec_ratio
    return min(max(tuned, tuning.min_ratio), tuning.max_ratio)


def lookup_server_url(bd: BlendDeployment) -> str | None:
    """In-cluster URL of the lookup server's Service, None when it is disabled."""
    server = bd.spec.lookup_server
    if not server.enabled:
        return None
    host = f"{lookup_name(bd.metadata.name)}.{bd.metadata.namespace}.svc"
    return f"http://{host}:{server.port}"


def runtime_config(bd: BlendDeployment) -> dict:
    """The settings the runtime reads, camelCase like the API."""
    blend, model = bd.spec.blend, bd.spec.model
    return {
        "formatVersion": FORMAT_VERSION,
        "model": {"name": model.name, "dtype": str(model.dtype)},
        "mode": str(blend.mode),
        "separator": blend.separator,
        "checkLayers": list(blend.check_layers),
        "recomputeRatio": effective_recompute_ratio(bd),
        "selection": str(blend.selection),
        "chunkSize": blend.chunk_size,
        "minSegmentTokens": blend.min_segment_tokens,
        "segmentContext": str(blend.segment_context),
        "kv": _kv_tiers(bd),
        "lookupServerUrl": lookup_server_url(bd),
        "shadowSampleRate": bd.spec.tuning.shadow_sample_rate,
    }


def _kv_tiers(bd: BlendDeployment) -> dict:
    kv = bd.spec.blend.kv
    local_bytes = quantity_bytes(kv.local_cpu_bytes, "spec.blend.kv.localCpuBytes")
    return {"localCpuBytes": local_bytes, "sharedUrl": kv.shared_url}


def config_json(config: dict) -> str:
    return json.dumps(config, sort_keys=True, indent=2) + "\n"


def config_hash(bd: BlendDeployment) -> str:
    """Hash of the settings that need a pod restart (all but LIVE_KEYS)."""
    restart_settings = {k: v for k, v in runtime_config(bd).items() if k not in LIVE_KEYS}
    return hashlib.sha256(config_json(restart_settings).encode()).hexdigest()[:16]


def runtime_configmap(bd: BlendDeployment) -> dict:
    name = runtime_config_name(bd.metadata.name)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(bd, name, RUNTIME_CONFIG),
        "data": {CONFIG_KEY: config_json(runtime_config(bd))},
    }
