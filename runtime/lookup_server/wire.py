"""The lookup server's wire format, version 1: one msgpack map per HTTP request and reply.

Every operation is `POST /v1` with `Content-Type: application/msgpack` over HTTP/1.1
keep-alive. A request is a map `{"v": 1, "op": OP, ...fields}`; a reply is
`{"v": 1, "ok": true, ...}` or `{"v": 1, "ok": false, "error": {"code", "message"}}`.

Operations (fields of the request -> fields of the reply):
- `lookup`: `keys` (list of str, at most `Limits.max_keys`), optional `model` (str: a
  key indexed for another model counts as a miss) -> `hits`: one item per key, `None`
  for a miss or `[num_tokens, in_shared_tier, [pod, ...]]` for a hit.
- `admit`: `pod` (str), `entries` (list of entry maps, see `Entry`) -> `admitted` (int:
  the entries indexed; one larger than the index's byte capacity alone is not).
- `evict`: `pod` (str), `keys` (list of str), optional `shared` (bool: the shared copy
  is gone too; remembered, so a resync does not advertise it again) -> `evicted` (int:
  keys this pod no longer holds).
- `heartbeat`: `pod` (str) -> `resync` (bool: the server has not had this pod's full
  announcement, a `resync` with `reset`, since it started or dropped the pod, so the pod
  must re-announce everything it holds).
- `resync`: `pod`, `entries`, `reset` (bool: the first chunk of a full resync; what this
  pod held before and no chunk lists again is forgotten at its next message of another
  kind) -> `admitted`.
- `stats` -> `stats` (map of counters and sizes).
- `pairs_add`: `scope` (str), `pod` (str), `pairs` (list of `[ratio, statistic, f1,
  top1]`, at most `Limits.max_entries`: ratio in [0, 1], statistic finite and >= 0, the
  scores in [0, 1]), optional `ids` (list of int, one per pair: the pod's own number of
  each pair) -> `added` (int). The inline quality proxy's calibration pairs, shared by a
  deployment's pods (`calibration.py`).
- `pairs_get`: `scope`, `pod`, `after` (int, 0: from the start) -> `pairs` (the other
  pods' pairs numbered after `after`, oldest first), `ids` (one `[pod, id]` per pair:
  who published it under which of its own numbers, id None when it was sent without),
  `last` (int: the `after` of the next call), `more` (bool: more wait), `epoch` (str:
  changes when the server restarts, and with it the numbering).

A new field may be added within a version; a change of meaning bumps `v`, and a server
answers a version it does not speak with `unsupported_version` naming the ones it does.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

WIRE_VERSION = 1
SUPPORTED_VERSIONS = (WIRE_VERSION,)
RPC_PATH = "/v1"
CONTENT_TYPE = "application/msgpack"
# How error messages quote a value the client sent (`_shown`).
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel = 3
_SHOWN.maxstring = _SHOWN.maxother = 60

OPS = ("lookup", "admit", "evict", "heartbeat", "resync", "stats", "pairs_add", "pairs_get")
# The `code` of every error reply a server sends (`bad_reply` is the client's own).
ERROR_CODES = (
    "bad_request",
    "too_large",
    "too_many_keys",
    "too_many_entries",
    "unsupported_version",
    "unknown_op",
)


class WireError(ValueError):
    """A request the server refuses; `code` is stable, `message` names the field."""

    def __init__(self, code: str, message: str, http_status: int = 400) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.http_status = http_status


@dataclass(frozen=True)
class Limits:
    """What one request may carry; larger requests get an error reply, never a crash."""

    # Bytes of one request body.
    max_body_bytes: int = 4 << 20
    # Keys in one lookup or evict.
    max_keys: int = 1024
    # Entries in one admit or resync chunk.
    max_entries: int = 4096
    # Characters of one key, pod name, model id or context key.
    max_name_chars: int = 256


@dataclass(frozen=True)
class Entry:
    """One cached segment as a pod announces it."""

    # The segment key (`segments.segment_key`).
    key: str
    # Tokens in the segment.
    num_tokens: int
    # Model identity the KV was computed with.
    model: str
    # KV dtype, e.g. "float32".
    dtype: str
    # Key of the context the segment was computed after (system prompt), None: alone.
    context: str | None
    # Bytes of the segment's KV.
    num_bytes: int
    # Whether the segment is (also) stored in the shared tier.
    shared: bool

    def to_wire(self) -> dict:
        return {
            "key": self.key,
            "tokens": self.num_tokens,
            "model": self.model,
            "dtype": self.dtype,
            "context": self.context,
            "bytes": self.num_bytes,
            "shared": self.shared,
        }


def encode(message: Mapping[str, Any]) -> bytes:
    return msgpack.packb({"v": WIRE_VERSION, **message}, use_bin_type=True)


def error_reply(error: WireError) -> bytes:
    return encode({"ok": False, "error": {"code": error.code, "message": error.message}})


def decode_request(body: bytes, limits: Limits) -> tuple[str, dict]:
    """The operation and the request map; WireError for anything malformed."""
    if len(body) > limits.max_body_bytes:
        raise WireError(
            "too_large", f"body of {len(body)} bytes exceeds {limits.max_body_bytes}", 413
        )
    message = _unpack(body, limits)
    if not isinstance(message, dict):
        raise WireError("bad_request", "the body must be a msgpack map")
    version = message.get("v")
    if version not in SUPPORTED_VERSIONS:
        raise WireError(
            "unsupported_version",
            f"v: got {_shown(version)}, this server speaks {list(SUPPORTED_VERSIONS)}",
        )
    op = message.get("op")
    if op not in OPS:
        raise WireError("unknown_op", f"op: got {_shown(op)}, expected one of {', '.join(OPS)}")
    return op, message


def _shown(value: Any) -> str:
    """A client's value as an error message quotes it: ASCII, at most a few dozen
    characters, at any nesting (msgpack nests 1,000 lists deep, past where repr() fails)."""
    return _SHOWN.repr(value).encode("ascii", "backslashreplace").decode("ascii")


def _unpack(body: bytes, limits: Limits) -> Any:
    try:
        return msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            max_str_len=limits.max_body_bytes,
            max_bin_len=0,
            max_array_len=max(limits.max_keys, limits.max_entries),
            max_map_len=64,
            max_ext_len=0,
        )
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        if "max_array_len" in str(e):
            raise WireError(
                "too_many_keys",
                f"a list in the request is too long ({e}): keys at most {limits.max_keys} per "
                f"lookup or evict, entries at most {limits.max_entries} per admit or resync",
                413,
            ) from None
        raise WireError("bad_request", f"body is not one valid msgpack map: {e}") from None


def decode_reply(body: bytes) -> dict:
    """The reply map of a successful call; WireError for an error reply or garbage."""
    try:
        reply = msgpack.unpackb(body, raw=False)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise WireError("bad_reply", f"reply is not msgpack: {e}") from None
    if not isinstance(reply, dict) or reply.get("v") != WIRE_VERSION:
        raise WireError("bad_reply", f"reply is not a version {WIRE_VERSION} map")
    if not reply.get("ok"):
        error = reply.get("error") or {}
        if not isinstance(error, dict):
            raise WireError("bad_reply", "error reply whose error is not a map")
        raise WireError(str(error.get("code", "error")), str(error.get("message", "")))
    return reply


# --- field checks (the server's side) -------------------------------------------------


def name_field(message: Mapping, field: str, limits: Limits, optional: bool = False) -> str | None:
    value = message.get(field)
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value or len(value) > limits.max_name_chars:
        raise WireError(
            "bad_request", f"{field}: expected a string of 1..{limits.max_name_chars} characters"
        )
    if not value.isprintable():
        # Pod names and model ids reach log lines: no newline or other control character.
        raise WireError(
            "bad_request",
            f"{field}: control characters (newline, tab, ...) are not allowed, got {value!a}",
        )
    return value


def keys_field(message: Mapping, limits: Limits) -> Sequence[str]:
    keys = message.get("keys")
    if not isinstance(keys, list):
        raise WireError("bad_request", "keys: expected a list of strings")
    if len(keys) > limits.max_keys:
        raise WireError("too_many_keys", f"keys: {len(keys)} keys, at most {limits.max_keys}", 413)
    for i, key in enumerate(keys):
        if not isinstance(key, str) or not key or len(key) > limits.max_name_chars:
            raise WireError(
                "bad_request",
                f"keys[{i}]: expected a string of 1..{limits.max_name_chars} characters",
            )
    return keys


def entries_field(message: Mapping, limits: Limits) -> list[Entry]:
    entries = message.get("entries")
    if not isinstance(entries, list):
        raise WireError("bad_request", "entries: expected a list of entry maps")
    if len(entries) > limits.max_entries:
        raise WireError(
            "too_many_entries",
            f"entries: {len(entries)} entries, at most {limits.max_entries}",
            413,
        )
    return [_entry(item, f"entries[{i}]", limits) for i, item in enumerate(entries)]


def _entry(item: Any, where: str, limits: Limits) -> Entry:
    if not isinstance(item, dict):
        raise WireError("bad_request", f"{where}: expected a map")
    return Entry(
        key=_name(item, "key", where, limits),
        num_tokens=_count(item, "tokens", where),
        model=_name(item, "model", where, limits),
        dtype=_name(item, "dtype", where, limits),
        context=_optional_name(item, "context", where, limits),
        num_bytes=_count(item, "bytes", where),
        shared=_flag(item, "shared", where),
    )


def _name(item: dict, field: str, where: str, limits: Limits) -> str:
    value = item.get(field)
    if not isinstance(value, str) or not value or len(value) > limits.max_name_chars:
        raise WireError(
            "bad_request",
            f"{where}.{field}: expected a string of 1..{limits.max_name_chars} characters",
        )
    return value


def _optional_name(item: dict, field: str, where: str, limits: Limits) -> str | None:
    value = item.get(field)
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > limits.max_name_chars:
        raise WireError("bad_request", f"{where}.{field}: expected a string or nil")
    return value


def _count(item: dict, field: str, where: str) -> int:
    value = item.get(field)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 48:
        raise WireError(
            "bad_request",
            f"{where}.{field}: expected an integer from 0 to 2**48 - 1, got {_shown(value)}",
        )
    return value


def _flag(item: dict, field: str, where: str) -> bool:
    value = item.get(field, False)
    if not isinstance(value, bool):
        raise WireError("bad_request", f"{where}.{field}: expected true or false")
    return value


def flag_field(message: Mapping, field: str) -> bool:
    return _flag(dict(message), field, "request")


def count_field(message: Mapping, field: str) -> int:
    return _count(dict(message), field, "request")


def pairs_field(message: Mapping, limits: Limits) -> list[tuple[float, float, float, float]]:
    """`pairs`: [ratio, statistic, f1, top1] each, checked (a pair off its range would
    bend every pod's calibration)."""
    pairs = message.get("pairs")
    if not isinstance(pairs, list):
        raise WireError("bad_request", "pairs: expected a list of [ratio, statistic, f1, top1]")
    if len(pairs) > limits.max_entries:
        raise WireError(
            "too_many_entries", f"pairs: {len(pairs)} pairs, at most {limits.max_entries}", 413
        )
    return [check_pair(item, f"pairs[{i}]") for i, item in enumerate(pairs)]


def pair_ids_field(message: Mapping, num_pairs: int) -> list[int] | None:
    """`ids` of a `pairs_add`: one non-negative integer per pair, or None when absent (a
    client that does not number its pairs)."""
    ids = message.get("ids")
    if ids is None:
        return None
    if not isinstance(ids, list) or len(ids) != num_pairs:
        raise WireError(
            "bad_request", f"ids: expected a list of {num_pairs} integers, one per pair"
        )
    return [_count({"id": value}, "id", f"ids[{i}]") for i, value in enumerate(ids)]


def check_pair(item: Any, where: str = "pair") -> tuple[float, float, float, float]:
    """One [ratio, statistic, f1, top1] as floats; WireError naming `where` and the field
    when it is off its range (the server's check, which a pod also runs before sending)."""
    if not isinstance(item, (list, tuple)) or len(item) != 4:
        raise WireError("bad_request", f"{where}: expected [ratio, statistic, f1, top1]")
    if any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in item):
        raise WireError("bad_request", f"{where}: expected four numbers, got {_shown(item)}")
    ratio, statistic, f1, top1 = (float(x) for x in item)
    if not 0 <= ratio <= 1:
        raise WireError("bad_request", f"{where}: ratio must be in [0, 1], got {ratio!r}")
    if not (math.isfinite(statistic) and statistic >= 0):
        raise WireError(
            "bad_request", f"{where}: statistic must be finite and >= 0, got {statistic!r}"
        )
    for name, score in (("f1", f1), ("top1", top1)):
        if not 0 <= score <= 1:
            raise WireError("bad_request", f"{where}: {name} must be in [0, 1], got {score!r}")
    return ratio, statistic, f1, top1
