"""`blend.json`: the blend settings file the operator writes and every engine pod reads.

Defined here once. The operator renders it (`holeblend_operator.render.runtime_config`) from
a BlendDeployment, taking its defaults from the constants below; the runtime parses it with
`parse_blend_settings` (`holeblend-serve`, the vLLM connector) and builds its own typed
config from the result. Contract:

1. JSON, camelCase keys, written with sorted keys (`to_json`), so equal settings give
   byte-equal files.
2. `formatVersion` is bumped whenever a key changes meaning. A reader refuses a file newer
   than `FORMAT_VERSION` with an error that says to upgrade the runtime; it reads older ones.
3. Unknown keys are an error (a misspelt key is never silently ignored); missing keys take
   the defaults below.
4. Only `LIVE_KEYS` may change while a pod runs (the kubelet swaps the mounted file; the
   runtime re-reads it). A change to any other key rolls the pods (the operator's config
   hash) and a running reader ignores it until restarted.

Names that differed between the two sides before this contract, and what they are now:
- `selection`: one strategy name (`kDeviation`, `vDeviation`, `kvDeviation` (default), `sinks`,
  `query`, `random`: the runtime's names) or a mix giving each a share of the recompute
  budget, `"sinks:0.25+kDeviation"` (`parse_selection`; a name without a share takes what
  the others leave).
- `filterLayers`: later layers at which the recompute set is narrowed (gradual filtering);
  empty: one check layer, as CacheBlend.
- `checkLayer`: one layer (the blender selects at a single layer, as CacheBlend does). At
  least 1: K at layer 0 depends only on the token and its position, so a deviation there
  says nothing about context. Default 2: on 40 prompts of documents reused in new orders
  it lowered KL against full prefill by 16 % at ratio 0.15 (29 % at 0.2) for 2-7 % more
  time per request, a better trade than raising the ratio (0.15 -> 0.2: 16 % more time for
  6 % lower KL; docs/blending.md).
- `segmentContext`: `afterSystem` | `alone` (the runtime's `cache_after_system` flag).
- `minSegmentTokens`: 8, the value the runtime's benchmarks were measured with.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from enum import StrEnum
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

FORMAT_VERSION = 1
# The ConfigMap key, the directory it is mounted at and the variable that names the file.
CONFIG_KEY = "blend.json"
CONFIG_DIR = "/etc/holeblend"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_KEY}"
CONFIG_ENV = "HOLEBLEND_CONFIG"
# Keys a running engine re-reads without a restart; every other key rolls the pods.
# The idle floor follows the tuner's minSamples and intervalSeconds, which change without
# touching the engine.
LIVE_KEYS = frozenset({"recomputeRatio", "shadowIdleSamples", "shadowIdleSeconds"})

DEFAULT_SEPARATOR = " # #"
DEFAULT_CHECK_LAYER = 2
DEFAULT_RECOMPUTE_RATIO = 0.15
DEFAULT_MIN_SEGMENT_TOKENS = 8
# Keys older operators wrote that no reader uses any more: read and dropped (contract 2:
# older files stay readable). `chunkSize` (tokens per KV storage chunk) was never read.
RETIRED_KEYS = ("chunkSize",)
DEFAULT_LOCAL_CPU_BYTES = 4 << 30
DEFAULT_SHADOW_SAMPLE_RATE = 0.02
# Most of the prefill tokens the shadow quality proxies may spend, as a share of the
# prefill tokens of user requests (0: no shadow; the inline proxy still scores).
DEFAULT_SHADOW_BUDGET = 0.05
# The idle floor's window when blend.json names none (the tuner's default interval).
DEFAULT_SHADOW_IDLE_SECONDS = 60.0
# vLLM pods that score the proxies: the scheduler class (vLLM's --scheduler-cls) whose
# shadow requests yield to user requests, and the most prompt tokens a shadow prefills in
# a step beside decoding user requests (kv_connector_extra_config key).
SHADOW_SCHEDULER_CLS = "holeblend_runtime.vllm_connector.scheduler.ShadowYieldingScheduler"
SHADOW_CHUNK_TOKENS_KEY = "shadow_chunk_tokens"
DEFAULT_SHADOW_CHUNK_TOKENS = 128


class BlendMode(StrEnum):
    HOLE = "hole"
    PREFIX = "prefix"
    OFF = "off"


class SegmentContext(StrEnum):
    AFTER_SYSTEM = "afterSystem"
    ALONE = "alone"


class Selection(StrEnum):
    """The selection strategies' names (see the runtime's blend/selection.py)."""

    K_DEVIATION = "kDeviation"
    V_DEVIATION = "vDeviation"
    KV_DEVIATION = "kvDeviation"
    SINKS = "sinks"
    QUERY = "query"
    RANDOM = "random"


DEFAULT_SELECTION = Selection.KV_DEVIATION.value
# Most strategies one mix may name.
MAX_MIX_STRATEGIES = 6


def parse_selection(text: str) -> tuple[tuple[str, float], ...]:
    """`"sinks:0.25+kDeviation"` -> `(("sinks", 0.25), ("kDeviation", 0.75))`.

    Each part is a strategy name with an optional share of the recompute budget in (0, 1];
    at most one part may leave its share out and takes what the others leave; given shares
    must not exceed 1 (all given: they must sum to 1). A name appears once. ValueError,
    saying what to write, otherwise."""
    names = [s.value for s in Selection]
    parts = [part.strip() for part in text.split("+")]
    if not text.strip() or any(not part for part in parts):
        raise ValueError(
            f"expected a strategy name or a mix like 'sinks:0.25+kDeviation', got {text!r}"
        )
    if len(parts) > MAX_MIX_STRATEGIES:
        raise ValueError(f"at most {MAX_MIX_STRATEGIES} strategies in a mix, got {len(parts)}")
    mix: list[tuple[str, float | None]] = []
    for part in parts:
        name, has_share, share_text = part.partition(":")
        name = name.strip()
        if name not in names:
            raise ValueError(f"unknown strategy {name!r} in {text!r}; expected one of {names}")
        if any(name == seen for seen, _ in mix):
            raise ValueError(f"strategy {name!r} appears twice in {text!r}")
        share = None
        if has_share:
            try:
                share = float(share_text)
            except ValueError:
                raise ValueError(
                    f"share of {name!r}: expected a number, got {share_text!r}"
                ) from None
            if not 0 < share <= 1:
                raise ValueError(f"share of {name!r}: must be in (0, 1], got {share}")
        mix.append((name, share))
    open_parts = [name for name, share in mix if share is None]
    given = sum(share for _, share in mix if share is not None)
    if len(open_parts) > 1:
        raise ValueError(f"only one strategy may leave out its share, got {open_parts} in {text!r}")
    if given > 1 + 1e-9:
        raise ValueError(f"shares sum to {given:g} in {text!r}; they must not exceed 1")
    if not open_parts and abs(given - 1) > 1e-6:
        raise ValueError(
            f"shares sum to {given:g} in {text!r}; make them sum to 1 or leave one out"
        )
    rest = max(0.0, 1 - given)
    return tuple((name, rest if share is None else share) for name, share in mix)


def check_filter_layers(check_layer: int, layers: Sequence[int]) -> tuple[int, ...]:
    """Filter layers strictly increasing and above the check layer; ValueError otherwise."""
    previous = check_layer
    for layer in layers:
        if layer <= previous:
            raise ValueError(
                f"must be strictly increasing and above checkLayer {check_layer}, "
                f"got {list(layers)}"
            )
        previous = layer
    return tuple(layers)


class StorePolicy(StrEnum):
    # Keep the KV slices the request computed for a missing document, at their positions.
    IN_CONTEXT = "in-context"
    # Recompute the document after the system prompt in a low-priority background worker.
    ISOLATED = "isolated"


class Admission(StrEnum):
    # New segments enter a window of the most recently used bytes; what leaves the window
    # stays only if it was used more often, recently, than what it would evict (W-TinyLFU,
    # the window's size adapting); least recently used entries are evicted.
    FREQUENCY = "frequency"
    # Every segment is admitted, evicting the least recently used (plain LRU).
    ALWAYS = "always"


class Dtype(StrEnum):
    AUTO = "auto"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"


class KVStoreDtype(StrEnum):
    """What `kv.storeDtype` may name: the model dtypes, and float8_e4m3fn (1 byte per value:
    a quarter of float32, half of a 16-bit model's; 3 mantissa bits, finite up to 448)."""

    AUTO = "auto"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"
    FLOAT8_E4M3FN = "float8_e4m3fn"


class BlendSettingsError(ValueError):
    """The file cannot be used; the message names the key and what to do."""


class _Settings(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


class ModelSettings(_Settings):
    # Model identity; part of every KV cache key, with the engine's identity of the weights
    # it loaded (vLLM: path@revision; holeblend-serve: GGUF stem:size), as
    # `holeblend_runtime.blend.keys.keyed_model_id` joins them.
    name: str = Field(min_length=1)
    # Name clients use in the OpenAI API (None: `name`).
    served_name: str | None = None
    dtype: Dtype = Dtype.AUTO
    # Longest prompt plus answer in tokens (None: the model's own context); vLLM takes it
    # as --max-model-len, holeblend-serve from here. Above the model's context: refused.
    max_model_len: int | None = Field(default=None, ge=1)

    @property
    def api_name(self) -> str:
        return self.served_name or self.name


# RFC 1035 2.3.4: a label is 1-63 octets, a name 255 on the wire: 253 as written.
MAX_DNS_LABEL_LENGTH = 63
MAX_DNS_NAME_LENGTH = 253


def parse_lookup_url(url: str) -> tuple[str, int]:
    """(host, port) of an http://HOST:PORT lookup server URL (`lookupServerUrl`);
    ValueError naming it for anything else, a port outside 1-65535 included (urllib's own
    errors name no setting, and its port 0 would read as 80), and a host name no DNS query
    can carry (every lookup would fail once the pod runs). A user, password, query or
    fragment is refused too: the client opens a plain connection to HOST:PORT and sends
    none of them, so a URL that carries credentials would look protected and not be.
    Checked when the file loads, so a vLLM pod refuses it at start with this message, and
    by the lookup client."""
    refusal = f"lookupServerUrl: expected http://HOST:PORT with a port in 1-65535, got {url!r}"
    extras = [
        name
        for name, mark in (("user or password", "@"), ("query", "?"), ("fragment", "#"))
        if mark in url
    ]
    if extras:  # checked first, and the URL not quoted: a password would reach the logs
        raise ValueError(
            f"lookupServerUrl: has a {' and a '.join(extras)}, which the lookup client never "
            "sends (it connects to HOST:PORT alone); write http://HOST:PORT"
        )
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise ValueError(refusal) from None
    if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/") or port == 0:
        raise ValueError(refusal)
    if ":" not in parts.hostname and not _is_dns_name(parts.hostname):
        raise ValueError(
            f"lookupServerUrl: host {parts.hostname!r} is not a DNS name (dot-separated labels "
            f"of 1-{MAX_DNS_LABEL_LENGTH} characters, at most {MAX_DNS_NAME_LENGTH} in all); "
            "write the lookup Service's name, like http://NAME.NAMESPACE.svc:PORT, "
            "or an IP address"
        )
    return parts.hostname, port or 80


def _is_dns_name(host: str) -> bool:
    """Whether a DNS query can carry `host` (an IPv4 address is one too), its labels
    counted as the resolver sends them (IDNA: a non-ASCII label takes its xn-- form)."""
    try:
        name = host.encode("idna").decode("ascii").removesuffix(".")
    except UnicodeError:  # the codec's own refusal: an empty label or one too long
        return False
    labels = name.split(".")
    return len(name) <= MAX_DNS_NAME_LENGTH and all(
        0 < len(label) <= MAX_DNS_LABEL_LENGTH for label in labels
    )


class KVSettings(_Settings):
    # Byte budget of the pod's own tier (holeblend-serve: in-process; vLLM pods: the node
    # directory), least recently used entries evicted.
    local_cpu_bytes: int = Field(default=DEFAULT_LOCAL_CPU_BYTES, ge=0)
    # Which segments that tier takes in once full.
    admission: Admission = Admission.FREQUENCY
    # The dtype every tier holds documents' KV in (auto: the model's KV dtype, lossless;
    # the system prompt's stays in the model's); the engines convert on store and on load,
    # and documents' keys name it.
    store_dtype: KVStoreDtype = KVStoreDtype.AUTO
    # Shared tier URL (redis://...), None: no shared tier.
    shared_url: str | None = None

    @property
    def tier_budget_bytes(self) -> int:
        """The budget a store of the pod's own tier takes: at least 1, as a store needs one;
        `local_cpu_bytes` 0 (no tier of the pod's own) then holds nothing."""
        return max(self.local_cpu_bytes, 1)


class BlendSettings(_Settings):
    """The whole file, typed; see the module docstring for the contract."""

    format_version: int = Field(default=FORMAT_VERSION, ge=1)
    model: ModelSettings
    mode: BlendMode = BlendMode.HOLE
    separator: str = Field(default=DEFAULT_SEPARATOR, min_length=1)
    check_layer: int = Field(default=DEFAULT_CHECK_LAYER, ge=1)
    recompute_ratio: float = Field(default=DEFAULT_RECOMPUTE_RATIO, ge=0, le=1)
    selection: str = DEFAULT_SELECTION
    filter_layers: tuple[int, ...] = ()
    min_segment_tokens: int = Field(default=DEFAULT_MIN_SEGMENT_TOKENS, ge=1)
    segment_context: SegmentContext = SegmentContext.AFTER_SYSTEM
    store_policy: StorePolicy = StorePolicy.IN_CONTEXT
    kv: KVSettings = Field(default_factory=KVSettings)
    lookup_server_url: str | None = None
    shadow_sample_rate: float = Field(default=DEFAULT_SHADOW_SAMPLE_RATE, ge=0, le=1)
    # The quality proxies (shadow full prefill within `shadow_budget`, and the inline
    # proxy): on unless the BlendDeployment turned them off.
    quality_proxies: bool = True
    shadow_budget: float = Field(default=DEFAULT_SHADOW_BUDGET, ge=0, le=1)
    # The idle floor: while no user request is in flight, a blended request is scored
    # beyond `shadow_budget` (and its sample rate) as long as fewer than
    # `shadow_idle_samples` shadows were admitted in the last `shadow_idle_seconds`. The
    # operator renders the tuner's minSamples per intervalSeconds; 0: the budget alone.
    shadow_idle_samples: int = Field(default=0, ge=0)
    shadow_idle_seconds: float = Field(default=DEFAULT_SHADOW_IDLE_SECONDS, gt=0)
    # The pod's own OpenAI-compatible API server (vLLM pods' shadow requests go through
    # it), e.g. http://127.0.0.1:8000; None: not known (no shadow on vLLM pods).
    engine_url: str | None = None

    @field_validator("separator")
    @classmethod
    def _check_separator(cls, value: str) -> str:
        if value.isspace():  # the runtime splits prompts on it: it must be visible
            raise ValueError("must contain a visible character, like ' # #'")
        return value

    @field_validator("lookup_server_url")
    @classmethod
    def _check_lookup_server_url(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                parse_lookup_url(value)
            except ValueError as error:  # the file's error names the key already
                raise ValueError(str(error).removeprefix("lookupServerUrl: ")) from None
        return value

    @field_validator("selection")
    @classmethod
    def _check_selection(cls, value: str) -> str:
        parse_selection(value)
        return value

    @field_validator("filter_layers")
    @classmethod
    def _check_filter_layers(cls, value: tuple[int, ...], info: ValidationInfo) -> tuple[int, ...]:
        if "check_layer" not in info.data:  # refused, with its own error: nothing to compare
            return value
        return check_filter_layers(info.data["check_layer"], value)

    @model_validator(mode="before")
    @classmethod
    def _refuse_newer_format(cls, data: Any) -> Any:
        version = _as_version(data.get("formatVersion")) if isinstance(data, dict) else None
        if version is not None and version > FORMAT_VERSION:
            raise ValueError(
                f"formatVersion: {version} is newer than this runtime reads "
                f"({FORMAT_VERSION}); upgrade the runtime image to match the operator"
            )
        if isinstance(data, dict) and any(key in data for key in RETIRED_KEYS):
            # Written by older operators and read by nothing: an old file still loads.
            data = {key: value for key, value in data.items() if key not in RETIRED_KEYS}
        return data

    def to_wire(self) -> dict:
        """The file's content as a JSON-ready dict (camelCase, every key present)."""
        return self.model_dump(mode="json", by_alias=True)

    def to_json(self) -> str:
        return json.dumps(self.to_wire(), sort_keys=True, indent=2) + "\n"

    def restart_settings(self) -> dict:
        """Everything but `LIVE_KEYS`: what must not change without a restart."""
        return {k: v for k, v in self.to_wire().items() if k not in LIVE_KEYS}


def _as_version(value: Any) -> int | None:
    """`value` as the int field reads it (2, 2.0 and "2" alike: a newer file is refused as
    newer however its writer spelt the number); None for what the field refuses."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    if isinstance(value, int):
        return value
    try:
        number = float(value)
    except ValueError:
        return None
    return int(number) if number.is_integer() else None


def parse_blend_settings(text: str | bytes, source: str = CONFIG_KEY) -> BlendSettings:
    """Parse and validate one file's text; `BlendSettingsError` naming the key otherwise."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as error:
        # ValueError: not JSON, not UTF-8, or an integer over Python's digit limit;
        # RecursionError: nested deeper than the parser's recursion limit.
        reason = "nested too deeply" if isinstance(error, RecursionError) else str(error)
        raise BlendSettingsError(f"{source}: not JSON ({reason})") from None
    if not isinstance(data, dict):
        raise BlendSettingsError(f"{source}: expected a JSON object, got {type(data).__name__}")
    try:
        return BlendSettings.model_validate(data)
    except ValidationError as error:
        raise BlendSettingsError(f"{source}: {_describe(error)}") from None


def load_blend_settings(path: str | Path) -> BlendSettings:
    """Read and parse the file at `path`."""
    try:
        text = Path(path).read_bytes()
    except OSError as error:
        raise BlendSettingsError(f"{path}: cannot read ({error.strerror})") from None
    return parse_blend_settings(text, source=str(path))


def _describe(error: ValidationError) -> str:
    problems = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "(file)"
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown key; remove it or check its spelling"
        problems.append(f"{where}: {message}")
    return "; ".join(problems)
