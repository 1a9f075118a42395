"""The engine Deployment: vLLM pods running the hole-mode blending runtime."""

import json
import posixpath

from holeblend_contract import blend_settings as contract
from holeblend_operator.api import (
    LEGACY_ENGINE_URL_ENV,
    AcceleratorType,
    BlendDeployment,
    EnvVar,
    ModelSource,
)
from holeblend_operator.quantity import quantity_bytes
from holeblend_operator.render import accelerator as accel
from holeblend_operator.render import serve
from holeblend_operator.render.images import engine_image
from holeblend_operator.render.labels import ENGINE, engine_selector, object_meta, standard_labels
from holeblend_operator.render.naming import engine_name, runtime_config_name
from holeblend_operator.render.pods import POD_HARDENING, health_probe, probe_budget_seconds
from holeblend_operator.render.runtime_config import (
    CONFIG_DIR,
    CONFIG_PATH,
    config_hash,
    runs_vllm_with_connector,
    scores_quality_proxies,
)
from holeblend_operator.render.shared_tier import shared_tier_env
from holeblend_operator.settings import DEFAULT_POD_LISTEN_ADDRESS

MODEL_DIR = "/models"
# vLLM pods' own KV tier (the connector's directory, one file per segment): a memory-backed
# volume of its own, sized for blend.kv.localCpuBytes (`kv_volume_size`), apart from
# /dev/shm, which vLLM's workers use and which engine.shmSize sizes.
KV_VOLUME = "kv-cache"
KV_DIR = "/var/cache/holeblend/kv"
# Room on that volume beyond the budget: the directory makes room before each write, but
# tensor-parallel ranks write their shards at once (a rank that still finds the volume
# full evicts more, never fails the request).
KV_VOLUME_HEADROOM_BYTES = 256 << 20
CONFIG_HASH_ANNOTATION = "blend.holeblend.io/runtime-config-hash"
# The KV-connector contract with the runtime: vLLM imports the class from this module.
CONNECTOR_CLASS = "HoleBlendConnector"
CONNECTOR_MODULE = "holeblend_runtime.vllm_connector"
# The connector exports its holeblend_* series on this env's port (vLLM owns /metrics).
METRICS_PORT_ENV = "HOLEBLEND_METRICS_PORT"
# Where the connector's metrics listen (the engine's --host); absent: 0.0.0.0.
METRICS_HOST_ENV = "HOLEBLEND_METRICS_HOST"
# The old opt-in to the vLLM pods' quality proxies in engine.env (spec.tuning.qualityProxies
# replaces it); still honoured: its value becomes blend.json's engineUrl.
ENGINE_URL_ENV = LEGACY_ENGINE_URL_ENV
# vLLM's scheduling policy while the quality proxies are on: the shadow requests ask for the
# lowest priority, and user requests (priority 0 unless they say otherwise) keep their
# arrival order ahead of them. vLLM's default, fcfs, ignores priorities. Priority orders
# only vLLM's waiting queue: the scheduler class makes a running shadow yield too
# (runtime/vllm_connector/scheduler.py).
PRIORITY_FLAGS = ("--scheduling-policy", "priority")
SCHEDULER_FLAG = "--scheduler-cls"
METRICS_PORT_NAME = "blend-metrics"
HEALTH_PATH = "/health"
# Stopping engine: wait this long (the pod still serves) so endpoints drop it before vLLM
# gets SIGTERM; the rest of terminationGracePeriodSeconds lets in-flight requests finish.
PRE_STOP_SLEEP_SECONDS = 15
# Time for scheduling and pulling a multi-GiB image, on top of the startup probe's budget.
ROLLOUT_MARGIN_SECONDS = 600


def model_argument(source: ModelSource) -> str:
    """What `vllm serve` loads: a directory of the mounted volume, or the hub id."""
    if source.pvc is not None:
        return posixpath.normpath(posixpath.join(MODEL_DIR, source.pvc.path.lstrip("/")))
    if source.host_path is not None:
        return MODEL_DIR
    return source.hub.id


def model_volumes(source: ModelSource) -> list[dict]:
    if source.pvc is not None:
        claim = {"claimName": source.pvc.claim_name, "readOnly": True}
        return [{"name": "model", "persistentVolumeClaim": claim}]
    if source.host_path is not None:
        return [{"name": "model", "hostPath": {"path": source.host_path.path, "type": "Directory"}}]
    return []


def model_volume_mounts(source: ModelSource) -> list[dict]:
    if source.hub is not None:
        return []
    return [{"name": "model", "mountPath": MODEL_DIR, "readOnly": True}]


def kv_transfer_config(
    blend_step_tokens: int | None = None,
    shadow_chunk_tokens: int | None = None,
    lookup_deadline_ms: int | None = None,
    kv_dir: str | None = KV_DIR,
) -> str:
    """vLLM's --kv-transfer-config: our connector, which reads the blend settings file and
    keeps its KV tier in `kv_dir` (None: the connector's default, under /dev/shm);
    `blend_step_tokens` (spec.engine.blendStepTokens) and `lookup_deadline_ms`
    (spec.engine.lookupDeadlineMs) when set; `shadow_chunk_tokens`
    (spec.tuning.shadowChunkTokens) while the pods score the quality proxies."""
    extra: dict[str, object] = {"holeblend_config": CONFIG_PATH}
    if kv_dir is not None:
        extra["kv_dir"] = kv_dir
    if blend_step_tokens is not None:
        extra["blend_step_tokens"] = blend_step_tokens
    if lookup_deadline_ms is not None:
        extra["lookup_deadline_ms"] = lookup_deadline_ms
    if shadow_chunk_tokens is not None:
        extra[contract.SHADOW_CHUNK_TOKENS_KEY] = shadow_chunk_tokens
    config = {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
        # A load that fails (its blocks reported by the connector) is recomputed by vLLM
        # instead of failing the request (vLLM's default policy is "fail").
        "kv_load_failure_policy": "recompute",
    }
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


# Flags every hole-mode vLLM pod needs, and why:
# - eager mode: the blend runs the model's modules outside vLLM's graphs (LMCache #3229);
# - no prefix caching: vLLM's own prefix hits would make it skip the blend's range start;
# - no hybrid KV cache manager: the connector is not SupportsHMA (one KV cache group).
# Chunked prefill stays on: the connector writes the whole covered range before vLLM
# computes the rest (its blend spread over steps while vLLM parks the request; external
# tokens are outside vLLM's token budget), so chunks only split the uncached tail; its
# accounting is re-derived on every call (preemption-safe).
BLEND_FLAGS = ("--enforce-eager", "--no-enable-prefix-caching", "--disable-hybrid-kv-cache-manager")
# Tokens per KV block: vllm-ascend's attention needs 128; 16 is vLLM's CUDA default.
BLOCK_SIZES = {AcceleratorType.ASCEND: 128, AcceleratorType.NVIDIA: 16}


def blend_flags(bd: BlendDeployment) -> list[str]:
    """The connector's flags; none when blending is off (plain vLLM)."""
    if str(bd.spec.blend.mode) == "off":
        return []
    chunk = bd.spec.tuning.shadow_chunk_tokens if scores_quality_proxies(bd) else None
    engine = bd.spec.engine
    transfer = kv_transfer_config(engine.blend_step_tokens, chunk, engine.lookup_deadline_ms)
    flags = [*BLEND_FLAGS, "--kv-transfer-config", transfer]
    block_size = BLOCK_SIZES.get(bd.spec.accelerator.type)
    return flags if block_size is None else [*flags, "--block-size", str(block_size)]


def vllm_args(bd: BlendDeployment, listen_address: str = DEFAULT_POD_LISTEN_ADDRESS) -> list[str]:
    model, engine = bd.spec.model, bd.spec.engine
    args = ["serve", model_argument(model.source)]
    args += ["--served-model-name", model.served_name or model.name]
    args += ["--host", listen_address, "--port", str(engine.port)]
    args += ["--dtype", str(model.dtype)]
    args += ["--tensor-parallel-size", str(engine.tensor_parallel_size)]
    if model.max_model_len is not None:
        args += ["--max-model-len", str(model.max_model_len)]
    if model.source.hub is not None and model.source.hub.revision is not None:
        args += ["--revision", model.source.hub.revision]
    return [*args, *blend_flags(bd), *priority_flags(bd), *engine.extra_args]


def priority_flags(bd: BlendDeployment) -> list[str]:
    """`--scheduling-policy priority` while the pods score the quality proxies (their shadow
    requests run at the lowest priority) and the scheduler class under which a shadow
    already prefilling sits out every step a user request waits or prefills in, and
    prefills at most spec.tuning.shadowChunkTokens per step beside decoding ones (rendered
    into the connector's settings); none otherwise (vLLM's defaults)."""
    if not scores_quality_proxies(bd):
        return []
    return [*PRIORITY_FLAGS, SCHEDULER_FLAG, contract.SHADOW_SCHEDULER_CLS]


def engine_env(bd: BlendDeployment, listen_address: str = DEFAULT_POD_LISTEN_ADDRESS) -> list[dict]:
    """Our variables first, then the user's; a user variable replaces ours of the same name.
    The connector's metrics listen where the engine does (`listen_address`; the variable is
    left out at the default, 0.0.0.0, the connector's own)."""
    metrics = [EnvVar(name=METRICS_PORT_ENV, value=str(bd.spec.engine.metrics_port))]
    if listen_address != DEFAULT_POD_LISTEN_ADDRESS:
        metrics.append(EnvVar(name=METRICS_HOST_ENV, value=listen_address))
    ours = [
        EnvVar(name="HOLEBLEND_CONFIG", value=CONFIG_PATH),
        *(metrics if exports_connector_metrics(bd) else []),
        *accel.accelerator_env(bd),
        *accel.scratch_env(bd.spec.accelerator),
    ]
    user_names = {var.name for var in bd.spec.engine.env}
    kept = [var for var in ours if var.name not in user_names]
    shared = [var for var in shared_tier_env(bd) if var["name"] not in user_names]
    return [*map(env_entry, kept), *shared, *map(env_entry, bd.spec.engine.env)]


def env_entry(var: EnvVar) -> dict:
    """A variable as the API server stores it: an empty value is left out (EnvVar.Value is
    `omitempty`), so a rendered "" would never match the live object and every reconcile
    would patch it again."""
    return {"name": var.name, "value": var.value} if var.value else {"name": var.name}


def exports_connector_metrics(bd: BlendDeployment) -> bool:
    """vLLM pods with the connector export its metrics on their own port; holeblend-serve
    (CPU pods) and plain vLLM (blending off) have none."""
    return not serve.runs_holeblend_serve(bd) and str(bd.spec.blend.mode) != "off"


def container_ports(bd: BlendDeployment) -> list[dict]:
    engine = bd.spec.engine
    ports = [{"name": "http", "containerPort": engine.port, "protocol": "TCP"}]
    if exports_connector_metrics(bd):
        metrics = {"name": METRICS_PORT_NAME, "containerPort": engine.metrics_port}
        ports.append(metrics | {"protocol": "TCP"})
    return ports


def probes() -> dict:
    # Loading a large model takes minutes: the startup probe allows 30 of them before the
    # liveness probe starts counting, so slow loads are not killed in a restart loop.
    return {
        "startupProbe": health_probe(HEALTH_PATH, periodSeconds=10, failureThreshold=180),
        "readinessProbe": health_probe(HEALTH_PATH, periodSeconds=10, failureThreshold=3),
        "livenessProbe": health_probe(
            HEALTH_PATH, periodSeconds=15, timeoutSeconds=5, failureThreshold=4
        ),
    }


def engine_container(bd: BlendDeployment, listen_address: str) -> dict:
    engine, accelerator = bd.spec.engine, bd.spec.accelerator
    container = {
        "name": "engine",
        "image": engine_image(engine.image, accelerator.type),
        "imagePullPolicy": engine.image_pull_policy,
        "command": ["vllm"],
        "args": vllm_args(bd, listen_address),
        "env": engine_env(bd, listen_address),
        "ports": container_ports(bd),
        "resources": accel.container_resources(bd),
        "volumeMounts": engine_volume_mounts(bd),
        "securityContext": accel.container_security(accelerator),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRE_STOP_SLEEP_SECONDS}}},
    }
    container |= probes()
    if serve.runs_holeblend_serve(bd):
        container |= serve.serve_container_fields(bd, listen_address)
    return container


def engine_volume_mounts(bd: BlendDeployment) -> list[dict]:
    # The config directory is mounted whole (no subPath) so the kubelet refreshes the file
    # when the tuner changes the ratio.
    return [
        {"name": "runtime-config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "shm", "mountPath": "/dev/shm"},
        *kv_volume_mounts(bd),
        *model_volume_mounts(bd.spec.model.source),
        *accel.host_volume_mounts(bd),
        *accel.scratch_volume_mounts(bd.spec.accelerator),
    ]


def kv_volume_size(bd: BlendDeployment) -> str:
    """sizeLimit of vLLM pods' KV volume: blend.kv.localCpuBytes plus
    KV_VOLUME_HEADROOM_BYTES, in whole MiB. The kubelet mounts a memory-backed emptyDir as a
    tmpfs of that size, and its pages count against the pod's memory limit."""
    budget = quantity_bytes(bd.spec.blend.kv.local_cpu_bytes, "spec.blend.kv.localCpuBytes")
    return f"{-(-(budget + KV_VOLUME_HEADROOM_BYTES) // (1 << 20))}Mi"


def kv_volume_mounts(bd: BlendDeployment) -> list[dict]:
    if not runs_vllm_with_connector(bd):  # holeblend-serve keeps its tier in-process
        return []
    return [{"name": KV_VOLUME, "mountPath": KV_DIR}]


def kv_volumes(bd: BlendDeployment) -> list[dict]:
    if not runs_vllm_with_connector(bd):
        return []
    return [{"name": KV_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": kv_volume_size(bd)}}]


def engine_volumes(bd: BlendDeployment) -> list[dict]:
    config = {"name": runtime_config_name(bd.metadata.name)}
    shm = {"medium": "Memory", "sizeLimit": bd.spec.engine.shm_size}
    return [
        {"name": "runtime-config", "configMap": config},
        {"name": "shm", "emptyDir": shm},
        *kv_volumes(bd),
        *model_volumes(bd.spec.model.source),
        *accel.host_volumes(bd),
        *accel.scratch_volumes(bd.spec.accelerator),
    ]


def pod_spec(bd: BlendDeployment, listen_address: str) -> dict:
    spec = {
        "containers": [engine_container(bd, listen_address)],
        "volumes": engine_volumes(bd),
        **POD_HARDENING,
        "securityContext": accel.pod_security(bd.spec.accelerator),
        "terminationGracePeriodSeconds": termination_grace_period_seconds(bd),
    }
    return spec | accel.scheduling(bd.spec.accelerator)


def termination_grace_period_seconds(bd: BlendDeployment) -> int:
    """spec.engine.terminationGracePeriodSeconds, on holeblend-serve pods at least the preStop
    pause plus the server's own stop, with the drain its flags ask for. The kubelet counts the
    pause inside the grace period and leaves SIGTERM only the rest: at 30 s a draining server
    would be killed 15 s into its 30 s drain, cutting off the requests it was finishing."""
    grace = bd.spec.engine.termination_grace_period_seconds
    if not serve.runs_holeblend_serve(bd):
        return grace
    return max(grace, PRE_STOP_SLEEP_SECONDS + serve.stop_seconds(bd))


def rollout_strategy(bd: BlendDeployment) -> dict:
    # Device nodes are usually full: a surge pod would wait for a free NPU/GPU forever, so
    # device pods are replaced one at a time instead.
    if bd.spec.accelerator.type == AcceleratorType.CPU:
        return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}


def progress_deadline_seconds() -> int:
    # A slow model load is not a failed rollout: the deadline covers the startup probe's
    # whole budget plus scheduling and the image pull.
    return probe_budget_seconds(probes()["startupProbe"]) + ROLLOUT_MARGIN_SECONDS


def pod_template_metadata(bd: BlendDeployment) -> dict:
    """The user's pod labels and annotations (scheduler metadata) plus ours; the API models
    refuse user keys under our prefixes, so nothing is overwritten."""
    engine = bd.spec.engine
    annotations = {CONFIG_HASH_ANNOTATION: config_hash(bd)}
    return {
        "labels": dict(sorted(engine.pod_labels.items())) | standard_labels(bd, ENGINE),
        "annotations": dict(sorted(engine.pod_annotations.items())) | annotations,
    }


def engine_deployment(
    bd: BlendDeployment, listen_address: str = DEFAULT_POD_LISTEN_ADDRESS
) -> dict:
    """`listen_address`: where the engine's server listens (the operator's
    --pod-listen-address): vLLM's or holeblend-serve's --host."""
    name = engine_name(bd.metadata.name)
    template_meta = pod_template_metadata(bd)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(bd, name, ENGINE),
        "spec": {
            "replicas": bd.spec.replicas,
            "selector": {"matchLabels": engine_selector(bd)},
            "strategy": rollout_strategy(bd),
            "progressDeadlineSeconds": progress_deadline_seconds(),
            "template": {"metadata": template_meta, "spec": pod_spec(bd, listen_address)},
        },
    }
