"""The connector's settings: the operator's blend.json plus the connector's own keys.

blend.json is parsed with the shared contract (`holeblend_contract.blend_settings`); its
path comes from `kv_connector_extra_config.holeblend_config` or `$HOLEBLEND_CONFIG`.
`recomputeRatio` is live: `RatioSource` re-reads the file when it changes.
`kv_connector_extra_config` may also name `kv_dir`, the directory of the segment KV tier
shared by vLLM's scheduler and worker processes (default: under /dev/shm), and
`lookup_deadline_ms` (default: unset, lookups inline), to run a request's segment lookup
through a lookup server or shared tier off vLLM's scheduler thread, planned as a full miss
when it takes longer, and `blend_step_tokens`: loads are asynchronous, each blend spread
over vLLM's steps, each step computing at most that many tokens' worth of blends (tokens
times layers over the model's layers) while the request waits; unset: an eighth of vLLM's
`max_num_batched_tokens` (`step_tokens`); 0: each blend runs whole, synchronously, before
its step's forward. When blend.json
names a shared tier (`kv.sharedUrl`) or a lookup server (`lookupServerUrl`), that
directory is the local tier of a `TieredKVStore` over them. Its `model.name` is part of
the model id of segment keys (`model_name`).
Without a settings file the contract's defaults apply.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from holeblend_contract import blend_settings as contract
from holeblend_runtime.blend.config import BlendConfig, check_ratio, from_settings

log = logging.getLogger(__name__)

CONFIG_KEY = "holeblend_config"
KV_DIR_KEY = "kv_dir"
DEFAULT_KV_DIR = "/dev/shm/holeblend-kv"
LOOKUP_DEADLINE_KEY = "lookup_deadline_ms"
BLEND_STEP_TOKENS_KEY = "blend_step_tokens"
# Most prompt tokens a shadow request prefills in a step beside decoding user requests
# (scheduler.py; spec.tuning.shadowChunkTokens).
SHADOW_CHUNK_TOKENS_KEY = contract.SHADOW_CHUNK_TOKENS_KEY
# Every key of kv_connector_extra_config the connector reads.
EXTRA_CONFIG_KEYS = (
    CONFIG_KEY,
    KV_DIR_KEY,
    LOOKUP_DEADLINE_KEY,
    BLEND_STEP_TOKENS_KEY,
    SHADOW_CHUNK_TOKENS_KEY,
)
_MODES = tuple(mode.value for mode in contract.BlendMode)


@dataclass(frozen=True)
class ConnectorSettings:
    """Validated once at start-up; only the ratio changes afterwards (see RatioSource)."""

    # hole | prefix (standard CacheBlend) | off (the connector provides nothing).
    mode: str = "hole"
    blend: BlendConfig = field(default_factory=BlendConfig)
    # blend.json's model.name, part of the model id every segment key names (with the
    # weights vLLM serves; connector.segment_keyer); None without a settings file.
    model_name: str | None = None
    # Directory of the segment KV tier (one file per segment key).
    kv_dir: Path = Path(DEFAULT_KV_DIR)
    # Byte budget of that directory (blend.json's kv.localCpuBytes; its 0, no tier of the
    # pod's own, is 1: no segment fits, the shared tier alone serves).
    kv_bytes: int = contract.DEFAULT_LOCAL_CPU_BYTES
    # Which segments that directory takes in once full (blend.json's kv.admission); only
    # the workers, which read and write it, apply it.
    kv_admission: contract.Admission = contract.Admission.FREQUENCY
    # The settings file, re-read for the live ratio; None: the ratio is fixed.
    config_path: Path | None = None
    # The fleet's shared KV tier (blend.json's kv.sharedUrl); None: this node only.
    shared_url: str | None = None
    # The deployment's lookup server (blend.json's lookupServerUrl); None: none.
    lookup_url: str | None = None
    # Share of blended requests scored by the shadow full prefill (shadow.py).
    shadow_sample_rate: float = contract.DEFAULT_SHADOW_SAMPLE_RATE
    # The quality proxies at all (shadow and inline proxy); blend.json's qualityProxies.
    quality_proxies: bool = True
    # Most shadow prefill tokens, as a share of user prompt tokens (shadowBudget).
    shadow_budget: float = contract.DEFAULT_SHADOW_BUDGET
    # The idle floor (shadowIdleSamples per shadowIdleSeconds; 0: the budget alone).
    shadow_idle_samples: int = 0
    shadow_idle_seconds: float = contract.DEFAULT_SHADOW_IDLE_SECONDS
    # The pod's own API server the shadow requests go to (engineUrl); None: unknown.
    engine_url: str | None = None
    # With a lookup server or shared tier: how long a request's segment lookup may take,
    # run off vLLM's scheduler thread, before the request is planned as a full miss
    # (kv_connector_extra_config `lookup_deadline_ms`). None (the default): the lookup runs
    # inline, bounded by the lookup client's own timeouts.
    lookup_deadline_s: float | None = None
    # Spread each blend over vLLM's steps, at most this many tokens of whole-model compute
    # per step for all blends under way (kv_connector_extra_config `blend_step_tokens`);
    # None (the default): derived from vLLM's step budget (`step_tokens`); 0: a blend runs
    # whole, synchronously, before its step's forward.
    blend_step_tokens: int | None = None

    @property
    def has_remote_tiers(self) -> bool:
        return bool(self.shared_url or self.lookup_url)

    def __post_init__(self) -> None:
        if self.mode not in _MODES:
            raise ValueError(f"mode: expected one of {_MODES}, got {self.mode!r}")
        if self.kv_bytes < 1:
            raise ValueError(f"kv.localCpuBytes: must be >= 1, got {self.kv_bytes}")
        if self.lookup_deadline_s is not None and not 0 < self.lookup_deadline_s <= 60:
            raise ValueError(
                f"{LOOKUP_DEADLINE_KEY}: must be in (0, 60000] ms, "
                f"got {self.lookup_deadline_s * 1000:g}"
            )
        if self.blend_step_tokens is not None and self.blend_step_tokens < 0:
            raise ValueError(
                f"{BLEND_STEP_TOKENS_KEY}: must be a whole number of tokens >= 0 (0: "
                f"synchronous blends; unset: derived from vLLM's max_num_batched_tokens), "
                f"got {self.blend_step_tokens}"
            )


def load_settings(extra_config: Mapping[str, Any]) -> ConnectorSettings:
    """Settings from `kv_connector_extra_config` and the blend.json it (or the env) names.

    A key the connector does not read is named in a warning, not refused: a misspelt key
    would otherwise leave its default in force unseen, and an operator newer than this
    image may render keys it does not know yet."""
    if unknown := sorted(str(key) for key in extra_config if key not in EXTRA_CONFIG_KEYS):
        log.warning(
            "kv_connector_extra_config: ignoring %s, not a key holeblend reads (check the "
            "spelling); its keys: %s",
            ", ".join(unknown),
            ", ".join(EXTRA_CONFIG_KEYS),
        )
    path = _path(extra_config, CONFIG_KEY) or os.environ.get(contract.CONFIG_ENV)
    kv_dir = Path(_path(extra_config, KV_DIR_KEY) or DEFAULT_KV_DIR)
    deadline_s = _deadline_s(extra_config.get(LOOKUP_DEADLINE_KEY))
    step_tokens = _step_tokens(extra_config.get(BLEND_STEP_TOKENS_KEY))
    if not path:
        return ConnectorSettings(
            kv_dir=kv_dir, lookup_deadline_s=deadline_s, blend_step_tokens=step_tokens
        )
    settings = contract.load_blend_settings(path)
    return ConnectorSettings(
        mode=settings.mode.value,
        blend=from_settings(settings),
        model_name=settings.model.name,
        kv_dir=kv_dir,
        kv_bytes=settings.kv.tier_budget_bytes,  # as holeblend-serve reads it
        kv_admission=settings.kv.admission,
        config_path=Path(path),
        shared_url=settings.kv.shared_url,
        lookup_url=settings.lookup_server_url,
        shadow_sample_rate=settings.shadow_sample_rate,
        quality_proxies=settings.quality_proxies,
        shadow_budget=settings.shadow_budget,
        shadow_idle_samples=settings.shadow_idle_samples,
        shadow_idle_seconds=settings.shadow_idle_seconds,
        engine_url=settings.engine_url,
        lookup_deadline_s=deadline_s,
        blend_step_tokens=step_tokens,
    )


# The default share of vLLM's step budget (`max_num_batched_tokens`) the blends under way
# may use per step: 2048 // 8 = 256 tokens on vLLM's CPU server (measured, docs/vllm-connector.md).
DEFAULT_STEP_SHARE = 8


def step_tokens(settings: ConnectorSettings, max_num_batched_tokens: int) -> int | None:
    """Tokens of blend compute per step for asynchronous loads; None: synchronous loads."""
    if settings.blend_step_tokens is None:
        return max(1, max_num_batched_tokens // DEFAULT_STEP_SHARE)
    return settings.blend_step_tokens or None


def shadow_chunk_tokens(extra_config: Mapping[str, Any]) -> int:
    """`shadow_chunk_tokens` of kv_connector_extra_config, checked; the default when unset."""
    value = extra_config.get(SHADOW_CHUNK_TOKENS_KEY)
    if value is None:
        return contract.DEFAULT_SHADOW_CHUNK_TOKENS
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{SHADOW_CHUNK_TOKENS_KEY}: expected a whole number of tokens >= 1 (the most a "
            f"shadow request prefills per step beside user requests), got {value!r}"
        )
    return value


def _path(extra_config: Mapping[str, Any], key: str) -> str | None:
    value = extra_config.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{key}: expected a path (a string), got {value!r}")
    return value or None


def _step_tokens(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(
            f"{BLEND_STEP_TOKENS_KEY}: expected a whole number of tokens, got {value!r}"
        )
    return value


def _deadline_s(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{LOOKUP_DEADLINE_KEY}: expected milliseconds (a number), got {value!r}")
    return float(value) / 1000


class RatioSource:
    """The live keys of blend.json (`LIVE_KEYS`): the recompute ratio and the shadow's idle
    floor, re-read when the file changes.

    A file that cannot be read or parsed keeps the last good values (logged): the kubelet
    swaps the mounted file atomically, but serving never fails on it. A file that does not
    parse is not read again until it changes: the scheduler asks at every step.
    """

    def __init__(self, settings: ConnectorSettings) -> None:
        self._path = settings.config_path
        self._ratio = settings.blend.ratio
        self._floor = (settings.shadow_idle_samples, settings.shadow_idle_seconds)
        self._stamp: tuple[int, int] | None = None

    def ratio(self) -> float:
        self._refresh()
        return self._ratio

    def idle_floor(self) -> tuple[int, float]:
        """(shadowIdleSamples, shadowIdleSeconds) in force."""
        self._refresh()
        return self._floor

    def _refresh(self) -> None:
        if self._path is None:
            return
        try:
            stat = self._path.stat()
            stamp = (stat.st_mtime_ns, stat.st_size)
            if stamp != self._stamp:
                self._stamp = stamp
                settings = contract.load_blend_settings(self._path)
                self._ratio = check_ratio(settings.recompute_ratio)
                self._floor = (settings.shadow_idle_samples, settings.shadow_idle_seconds)
        except (OSError, ValueError) as error:
            log.warning("keeping recompute ratio %s and the idle floor: %s", self._ratio, error)
