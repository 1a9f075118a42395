"""The runtime ConfigMap: the blend settings every engine pod reads from `HOLEBLEND_CONFIG`.

The file's format (names, defaults, `formatVersion`, live keys) is defined once in
`holeblend_contract.blend_settings`; this module only fills it in from a BlendDeployment.
The file is JSON with sorted keys so equal settings give byte-equal data. The tuner changes
`recomputeRatio` live: it records the ratio in status.recomputeRatio, the reconcile re-renders
this ConfigMap with it, and the kubelet refreshes the mounted file (the volume is mounted
without subPath for that reason); the runtime re-reads the file. That is why the ratio is
kept out of `config_hash`, the pod-template annotation that rolls the pods on every other
change.
"""

import hashlib
import json

from holeblend_contract.blend_settings import (
    CONFIG_DIR,
    CONFIG_ENV,
    CONFIG_KEY,
    CONFIG_PATH,
    FORMAT_VERSION,
    LIVE_KEYS,
    BlendSettings,
    KVSettings,
    ModelSettings,
)
from holeblend_operator.api import (
    AcceleratorType,
    BlendDeployment,
    BlendDeploymentSpec,
    legacy_engine_url,
)
from holeblend_operator.quantity import quantity_bytes
from holeblend_operator.render.labels import RUNTIME_CONFIG, object_meta
from holeblend_operator.render.naming import lookup_name, runtime_config_name

__all__ = ["CONFIG_DIR", "CONFIG_ENV", "CONFIG_KEY", "CONFIG_PATH", "FORMAT_VERSION", "LIVE_KEYS"]


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


def blend_settings(bd: BlendDeployment) -> BlendSettings:
    """The settings the runtime reads, as the contract types them."""
    blend, model = bd.spec.blend, bd.spec.model
    return BlendSettings(
        format_version=FORMAT_VERSION,
        model=ModelSettings(
            name=model.name,
            served_name=model.served_name,
            dtype=model.dtype,
            max_model_len=model.max_model_len,
        ),  # fmt: skip
        mode=blend.mode,
        separator=blend.separator,
        check_layer=blend.check_layer,
        recompute_ratio=effective_recompute_ratio(bd),
        selection=blend.selection,
        filter_layers=tuple(blend.filter_layers),
        min_segment_tokens=blend.min_segment_tokens,
        segment_context=blend.segment_context,
        store_policy=blend.store_policy,
        kv=_kv_tiers(bd),
        lookup_server_url=lookup_server_url(bd),
        shadow_sample_rate=bd.spec.tuning.shadow_sample_rate,
        quality_proxies=bd.spec.tuning.quality_proxies,
        shadow_budget=bd.spec.tuning.shadow_budget,
        shadow_idle_samples=shadow_idle_samples(bd),
        shadow_idle_seconds=float(bd.spec.tuning.interval_seconds),
        engine_url=engine_url(bd),
    )


def shadow_idle_samples(bd: BlendDeployment) -> int:
    """The idle floor (blend.json `shadowIdleSamples` per `shadowIdleSeconds`): while tuning
    is on, the tuner's minSamples per intervalSeconds, so that after a change of ratio one
    interval of a lightly loaded pod gives a reading; 0 with tuning off (nothing waits for
    the samples; the budget alone bounds the shadows)."""
    tuning = bd.spec.tuning
    return tuning.min_samples if tuning.enabled and tuning.quality_proxies else 0


def runs_vllm_with_connector(bd: BlendDeployment) -> bool:
    """vLLM pods that blend through the KV connector (not holeblend-serve's CPU pods, and not
    plain vLLM with blend.mode off)."""
    return bd.spec.accelerator.type != AcceleratorType.CPU and str(bd.spec.blend.mode) != "off"


def scores_quality_proxies(bd: BlendDeployment) -> bool:
    """Whether vLLM pods send shadow requests to their own API server: the proxies are on
    and the connector runs."""
    return bd.spec.tuning.quality_proxies and runs_vllm_with_connector(bd)


def engine_url(bd: BlendDeployment) -> str | None:
    """The vLLM pod's own API server, where its shadow requests go, while it scores the
    proxies: HOLEBLEND_ENGINE_URL's value where an older spec still sets it in engine.env
    (it may carry a root path), else http://127.0.0.1:<engine.port>. None otherwise
    (holeblend-serve scores in-process)."""
    if not scores_quality_proxies(bd):
        return None
    return legacy_engine_url(bd.spec) or f"http://127.0.0.1:{bd.spec.engine.port}"


def runtime_config(bd: BlendDeployment) -> dict:
    """The file's content: camelCase like the API, every key of the contract present."""
    return blend_settings(bd).to_wire()


def _kv_tiers(bd: BlendDeployment) -> KVSettings:
    kv = bd.spec.blend.kv
    local_bytes = quantity_bytes(kv.local_cpu_bytes, "spec.blend.kv.localCpuBytes")
    return KVSettings(
        local_cpu_bytes=local_bytes,
        admission=kv.admission,
        store_dtype=kv.store_dtype,
        shared_url=kv.shared_url,
    )


def config_hash(bd: BlendDeployment) -> str:
    """Hash of the settings that need a pod restart (all but LIVE_KEYS)."""
    restart_settings = blend_settings(bd).restart_settings()
    return hashlib.sha256(json.dumps(restart_settings, sort_keys=True).encode()).hexdigest()[:16]


def runtime_configmap(bd: BlendDeployment) -> dict:
    name = runtime_config_name(bd.metadata.name)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(bd, name, RUNTIME_CONFIG),
        "data": {CONFIG_KEY: blend_settings(bd).to_json()},
    }
