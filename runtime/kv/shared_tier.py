"""The shared KV tier on Redis or Valkey: one versioned, checksummed blob per segment.

Blob layout (format `BLOB_FORMAT`), all integers little-endian:

    b"HBKV" | u16 format | u32 header length | header (msgpack map) | payload

The header names the segment `key`, the `model` identity, the `dtype`, the K/V `shape`
[layers, kv_heads, tokens, head_dim], the token count `tokens`, the `deployment` that wrote
it ("namespace/name"), the payload length `payload_bytes` and the `xxh3_64` checksum
(xxHash3, ~10 GB/s: it must not slow a load much next to Redis itself) of the deployment's
name, a NUL byte and the payload: a blob carries its deployment's identity, so a blob
written by (or copied from) another deployment fails the check even where the store's
ACLs would let it through. The payload is K, then V (each `shape` of `dtype`),
then the int64 RoPE positions. A reader checks every field against what it expects;
a blob that is corrupted, truncated, of another format, model, dtype or key is a miss,
and the tier no longer reports it held (`contains_many`) until it stores the key again.

Keys follow `holeblend_contract.shared_tier` (per-BlendDeployment prefix). Every Redis
error, timeout or reply that cannot be read (a server that does not speak Redis) is a
miss (reads) or a refused store (writes), counted in `stats`. A circuit breaker skips
Redis for a while after repeated failures to reach it (connection errors, timeouts, and
the error replies of a server that cannot serve any command now: see `is_unavailable`);
an error reply to one command (`ResponseError`: out of memory under `noeviction`, no
permission, a key of another type) shows Redis is up and does not feed it. A blob larger
than Redis takes in one argument (`proto-max-bulk-len`) is refused without being sent.
This module imports no torch (the tiered store converts tensors), so the lookup
benchmark can use it.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import msgpack
import redis
import xxhash

from holeblend_contract.shared_tier import PASSWORD_ENV, USER_ENV, check_shared_url, key_prefix
from holeblend_runtime.kv.circuit_breaker import CircuitBreaker

log = logging.getLogger(__name__)

# 2: the deployment's identity in the header and the checksum.
BLOB_FORMAT = 2
MAGIC = b"HBKV"
_PREFIX = struct.Struct("<4sHI")
MAX_HEADER_BYTES = 4096
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}
POSITION_BYTES = 8  # int64
# Redis's default `proto-max-bulk-len`: the largest argument (a SET's value) it takes.
REDIS_MAX_BULK_BYTES = 512 * 1024 * 1024
# Keys whose blob a tier refused that it remembers at most (oldest forgotten first).
MAX_REFUSED_KEYS = 4096


@dataclass(frozen=True)
class BlobHeader:
    """What a blob says about itself; compared with what the reader expects."""

    # The segment key.
    key: str
    # Model identity the KV was computed with.
    model: str
    # KV dtype name, one of DTYPE_SIZES.
    dtype: str
    # K and V shape: [layers, kv_heads, tokens, head_dim].
    shape: tuple[int, int, int, int]

    @property
    def num_tokens(self) -> int:
        return self.shape[2]

    @property
    def kv_bytes(self) -> int:
        """Bytes of K (= bytes of V)."""
        layers, heads, tokens, head_dim = self.shape
        return layers * heads * tokens * head_dim * DTYPE_SIZES[self.dtype]

    @property
    def payload_bytes(self) -> int:
        return 2 * self.kv_bytes + self.num_tokens * POSITION_BYTES


class BlobError(ValueError):
    """Why a blob cannot be used; the reader treats it as a miss."""


def encode_blob(
    header: BlobHeader, parts: Sequence[bytes | memoryview], deployment: str = ""
) -> bytes:
    """The blob of K, V and positions (`parts`, raw bytes in that order), in one piece."""
    return b"".join(blob_pieces(header, parts, deployment))


def _digest(deployment: str) -> xxhash.xxh3_64:
    """The checksum's state after the deployment's identity, before the payload."""
    digest = xxhash.xxh3_64()
    digest.update(deployment.encode() + b"\0")
    return digest


def blob_pieces(
    header: BlobHeader, parts: Sequence[bytes | memoryview], deployment: str = ""
) -> list:
    """The blob as [prefix and header, *parts], to be sent without joining (no copy);
    `deployment` ("namespace/name") is the writer's identity."""
    payload_bytes = sum(memoryview(part).nbytes for part in parts)
    if payload_bytes != header.payload_bytes:
        raise ValueError(
            f"parts: {payload_bytes} bytes, the header promises {header.payload_bytes}"
        )
    digest = _digest(deployment)
    for part in parts:
        digest.update(part)
    meta = msgpack.packb(
        {
            "key": header.key,
            "model": header.model,
            "dtype": header.dtype,
            "shape": list(header.shape),
            "tokens": header.num_tokens,
            "deployment": deployment,
            "payload_bytes": payload_bytes,
            "xxh3_64": digest.intdigest(),
        }
    )
    return [_PREFIX.pack(MAGIC, BLOB_FORMAT, len(meta)) + meta, *parts]


def decode_blob(
    blob: bytes,
    expected: BlobHeader | None = None,
    deployment: str = "",
    also_dtypes: Collection[str] = (),
) -> tuple[BlobHeader, memoryview]:
    """The header and payload of a checked blob written by `deployment`; BlobError for
    anything wrong. With `expected`, the blob's dtype is `expected.dtype` or one of
    `also_dtypes` (a reader whose segments come in two dtypes checks which is whose)."""
    if not isinstance(blob, bytes | bytearray | memoryview):  # a server not speaking Redis
        raise BlobError(f"not a blob: a {type(blob).__name__} reply")
    if len(blob) < _PREFIX.size:
        raise BlobError(f"truncated: {len(blob)} bytes")
    magic, version, meta_len = _PREFIX.unpack_from(blob)
    if magic != MAGIC:
        raise BlobError("not a holeblend KV blob (bad magic)")
    if version != BLOB_FORMAT:
        raise BlobError(f"blob format {version}, this reader speaks {BLOB_FORMAT}")
    if meta_len > MAX_HEADER_BYTES or _PREFIX.size + meta_len > len(blob):
        raise BlobError("truncated or oversized header")
    meta = _unpack_meta(blob[_PREFIX.size : _PREFIX.size + meta_len])
    header = _header(meta)
    payload = memoryview(blob)[_PREFIX.size + meta_len :]
    if payload.nbytes != header.payload_bytes or meta.get("payload_bytes") != payload.nbytes:
        raise BlobError(f"payload of {payload.nbytes} bytes, expected {header.payload_bytes}")
    if meta.get("deployment") != deployment:
        raise BlobError(
            f"deployment: blob written by {meta.get('deployment')!r}, expected {deployment!r}"
        )
    digest = _digest(deployment)
    digest.update(payload)
    if digest.intdigest() != meta.get("xxh3_64"):
        raise BlobError("checksum mismatch")
    if expected is not None:
        _check_expected(header, expected, also_dtypes)
    return header, payload


def _unpack_meta(raw: bytes) -> dict:
    try:
        meta = msgpack.unpackb(raw, raw=False)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise BlobError(f"unreadable header: {e}") from None
    if not isinstance(meta, dict):
        raise BlobError("header is not a map")
    return meta


def _header(meta: dict) -> BlobHeader:
    shape = meta.get("shape")
    if not (isinstance(shape, list) and len(shape) == 4 and all(_is_count(n) for n in shape)):
        raise BlobError(f"shape: expected 4 non-negative integers, got {shape!r}")
    if shape[2] == 0:  # no segment is empty: its tensors could not even be built
        raise BlobError(f"shape: {shape} holds no tokens")
    # A name first: a list or map (a corrupted or forged header) cannot be looked up.
    if not isinstance(meta.get("dtype"), str) or meta["dtype"] not in DTYPE_SIZES:
        raise BlobError(f"dtype: {meta.get('dtype')!r} is not one of {sorted(DTYPE_SIZES)}")
    for name in ("key", "model"):
        if not isinstance(meta.get(name), str):
            raise BlobError(f"{name}: missing")
    if meta.get("tokens") != shape[2]:
        raise BlobError(f"tokens: {meta.get('tokens')!r} disagrees with shape {shape}")
    return BlobHeader(meta["key"], meta["model"], meta["dtype"], tuple(shape))


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 31


def _check_expected(
    header: BlobHeader, expected: BlobHeader, also_dtypes: Collection[str] = ()
) -> None:
    for name in ("key", "model"):
        if getattr(header, name) != getattr(expected, name):
            raise BlobError(
                f"{name}: blob has {getattr(header, name)!r}, expected {getattr(expected, name)!r}"
            )
    if header.dtype != expected.dtype and header.dtype not in also_dtypes:
        wanted = " or ".join(repr(d) for d in (expected.dtype, *also_dtypes))
        raise BlobError(f"dtype: blob has {header.dtype!r}, expected {wanted}")
    layers, heads, _, head_dim = expected.shape
    if (header.shape[0], header.shape[1], header.shape[3]) != (layers, heads, head_dim):
        raise BlobError(
            f"shape: blob has {list(header.shape)}, expected [{layers}, {heads}, *, {head_dim}]"
        )


# --- the Redis/Valkey store -----------------------------------------------------------------


@dataclass(frozen=True)
class SharedTierConfig:
    # redis://, rediss://, valkey:// or valkeys:// URL without a password.
    url: str
    # "namespace/name" of the BlendDeployment: the key prefix.
    deployment: str
    # Seconds one Redis command may take (a 32 MB blob needs well over a few ms).
    timeout_s: float = 2.0
    # Consecutive failures that open the breaker, and how long it stays open.
    breaker_failures: int = 3
    breaker_open_s: float = 2.0
    # The largest blob stored (Redis's `proto-max-bulk-len`); None: read once from Redis
    # (CONFIG GET) before the first store, REDIS_MAX_BULK_BYTES where that is refused.
    max_blob_bytes: int | None = None

    def __post_init__(self) -> None:
        check_shared_url(self.url, "kv.sharedUrl")
        key_prefix(self.deployment, BLOB_FORMAT)
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0, got {self.timeout_s}")
        if self.breaker_failures < 1:
            raise ValueError(f"breaker_failures: must be >= 1, got {self.breaker_failures}")
        if not self.breaker_open_s >= 0:
            raise ValueError(f"breaker_open_s: must be >= 0, got {self.breaker_open_s}")
        if self.max_blob_bytes is not None and self.max_blob_bytes < 1:
            raise ValueError(f"max_blob_bytes: must be >= 1, got {self.max_blob_bytes}")


@dataclass
class SharedTierStats:
    gets: int = 0
    hits: int = 0
    puts: int = 0
    errors: int = 0
    skipped_by_breaker: int = 0
    # Blobs refused by `decode_blob` (corrupted, truncated, foreign).
    bad_blobs: int = 0
    # Stores refused without sending: the blob is larger than `max_blob_bytes`.
    too_large: int = 0
    errors_by_kind: dict = field(default_factory=dict)


# Error replies that refuse every command for now, not this one: a replica whose link to
# its primary is down (MASTERDOWN), a replica or a primary demoted by a failover
# (READONLY), a cluster resharding or down (TRYAGAIN, CLUSTERDOWN). LOADING is a
# `redis.ConnectionError` already; BUSY (a script running past `busy-reply-threshold`)
# has no class of its own.
_UNAVAILABLE_REPLIES = (
    redis.exceptions.ReadOnlyError,
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,
)


def is_unavailable(error: redis.ResponseError) -> bool:
    """Whether the error reply says the server cannot serve now (a failure for the
    breaker) rather than refusing this one command."""
    if isinstance(error, _UNAVAILABLE_REPLIES):
        return True
    # A pipeline prefixes its command to the reply: "Command # 1 (...) caused error: BUSY ..."
    text = str(error)
    return text.startswith("BUSY ") or "caused error: BUSY " in text


# What one call to Redis came to (`SharedTier._call_with_breaker`): it ran; Redis answered
# with an error (it is up); it failed to reach Redis or was skipped by the open breaker.
ANSWERED, REFUSED, UNREACHED = "answered", "refused", "unreached"


def redis_url(url: str) -> str:
    """The URL redis-py understands: valkey(s):// is spoken as redis(s)://."""
    if url.startswith("valkeys://"):
        return "rediss://" + url.removeprefix("valkeys://")
    if url.startswith("valkey://"):
        return "redis://" + url.removeprefix("valkey://")
    return url


class SharedTier:
    """Blobs in Redis under the deployment's prefix; thread-safe (redis-py's pool).

    Connects as `username` (default: $HOLEBLEND_SHARED_TIER_USER, the deployment's ACL
    user the operator names; a user in the URL wins) with `password` (default:
    $HOLEBLEND_SHARED_TIER_PASSWORD)."""

    def __init__(
        self, config: SharedTierConfig, password: str | None = None, username: str | None = None
    ) -> None:
        self.config = config
        # The writer identity every blob of this tier carries (`blob_pieces`).
        self.deployment = config.deployment
        self.prefix = key_prefix(config.deployment, BLOB_FORMAT)
        self.client = redis.Redis.from_url(
            redis_url(config.url),
            username=username if username is not None else os.environ.get(USER_ENV) or None,
            password=password if password is not None else os.environ.get(PASSWORD_ENV) or None,
            socket_timeout=config.timeout_s,
            socket_connect_timeout=config.timeout_s,
            retry_on_timeout=False,
        )
        self.breaker = CircuitBreaker(config.breaker_failures, config.breaker_open_s)
        self.stats = SharedTierStats()
        # The tier is used from several threads (a store's reads and writes): every
        # change of `stats` is made under this lock.
        self._stats_lock = threading.Lock()
        # The largest blob stored: `config.max_blob_bytes`, else None until read from Redis.
        self.max_blob_bytes = config.max_blob_bytes
        # Keys whose blob `load` refused, until this tier stores them again: Redis still
        # holds that blob, and a caller told it is held (`contains_many`) would never
        # store a usable one over it. Under this lock.
        self._refused: OrderedDict[str, None] = OrderedDict()
        self._refused_lock = threading.Lock()

    def redis_key(self, segment_key: str) -> str:
        return self.prefix + segment_key

    def put_blob(self, segment_key: str, blob: bytes) -> bool:
        """Store `blob`; False when Redis refused or failed, or the blob is too large
        (never raises)."""
        return self.put_pieces(segment_key, [blob])

    def put_pieces(self, segment_key: str, pieces: Sequence[bytes | memoryview]) -> bool:
        """Store the blob made of `pieces` (see `blob_pieces`) without joining them first.

        A 32 MB join cost more than the SET itself on a loaded machine (page faults of a
        fresh buffer), so the SET is framed here and the pieces go to the socket as they are.
        """
        self._count("puts")
        total = sum(memoryview(piece).nbytes for piece in pieces)
        limit = self._blob_limit()
        if limit is None:  # Redis not reached: the SET would not be either
            return False
        if total > limit:  # Redis would refuse it and close the connection
            with self._stats_lock:
                self.stats.too_large += 1
                is_first = self.stats.too_large == 1
            (log.warning if is_first else log.debug)(
                "shared tier: not storing segment %s: %d bytes, Redis takes at most %d",
                segment_key, total, limit,
            )  # fmt: skip
            return False
        status, reply = self._call_with_breaker(
            self._set_pieces, self.redis_key(segment_key), pieces, total
        )
        is_stored = status == ANSWERED and reply is True
        if is_stored:
            self._mark_refused(segment_key, is_refused=False)
        return is_stored

    def _blob_limit(self) -> int | None:
        """`max_blob_bytes`, read from Redis the first time when not configured (Redis's
        default where CONFIG is refused); None while Redis is not reached."""
        if self.max_blob_bytes is None:
            status, reply = self._call_with_breaker(
                self.client.config_get, "proto-max-bulk-len", counts_refusal=False
            )
            if status == UNREACHED:
                return None
            self.max_blob_bytes = _bulk_len(reply) if status == ANSWERED else REDIS_MAX_BULK_BYTES
        return self.max_blob_bytes

    def _set_pieces(self, key: str, pieces: Sequence[bytes | memoryview], total: int) -> bool:
        encoded_key = key.encode()
        head = b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(encoded_key), encoded_key, total)
        connection = self.client.connection_pool.get_connection()
        try:
            connection.send_packed_command([head, *pieces, b"\r\n"])
            reply = connection.read_response()
        except redis.ResponseError:
            raise  # an error reply read in full: the connection is still in step
        except BaseException:
            connection.disconnect()
            raise
        finally:
            self.client.connection_pool.release(connection)
        if isinstance(reply, redis.ResponseError):
            raise reply
        return reply in (b"OK", "OK")

    def get_blob(self, segment_key: str) -> bytes | None:
        """The stored blob, or None on a miss or failure (never raises)."""
        return self._get(segment_key)[1]

    def _get(self, segment_key: str) -> tuple[bool, bytes | None]:
        """(whether Redis answered the GET, the blob or None)."""
        status, blob = self._call_with_breaker(self.client.get, self.redis_key(segment_key))
        self._count("gets")
        if blob is not None:
            self._count("hits")
        return status == ANSWERED, blob

    def contains_many(self, segment_keys: Sequence[str]) -> list[bool]:
        """Whether Redis holds a usable blob under each key (one pipelined round trip of
        EXISTS, no blob read; False for a key whose blob `load` refused, until it is stored
        again); all False when Redis refused, failed or was skipped (never raises): a key
        not known to be there is computed, never counted on."""
        if not segment_keys:
            return []
        status, reply = self._call_with_breaker(
            self._exists_many, [self.redis_key(key) for key in segment_keys]
        )
        if status != ANSWERED:
            return [False] * len(segment_keys)
        with self._refused_lock:
            return [
                bool(count) and key not in self._refused
                for key, count in zip(segment_keys, reply, strict=True)
            ]

    def _exists_many(self, redis_keys: Sequence[str]) -> list:
        pipe = self.client.pipeline(transaction=False)
        for key in redis_keys:
            pipe.exists(key)
        return pipe.execute()

    def get_checked(self, expected: BlobHeader) -> tuple[BlobHeader, memoryview] | None:
        """The blob of `expected.key` if it matches `expected`; None for a miss or a bad blob."""
        return self.load(expected)[0]

    def load(
        self, expected: BlobHeader, also_dtypes: Collection[str] = ()
    ) -> tuple[tuple[BlobHeader, memoryview] | None, bool]:
        """(`get_checked`'s answer, whether Redis answered): a None with False is a failed or
        skipped call, so the blob may still be there; with True it is gone or unusable.
        `also_dtypes`: as `decode_blob`'s."""
        is_answer, blob = self._get(expected.key)
        if blob is None:
            return None, is_answer
        try:
            checked = decode_blob(blob, expected, self.deployment, also_dtypes)
        except BlobError as error:
            self._count("bad_blobs")
            log.warning("shared tier: refusing blob of segment %s: %s", expected.key, error)
            self._mark_refused(expected.key, is_refused=True)
            return None, True
        self._mark_refused(expected.key, is_refused=False)
        return checked, True

    def _mark_refused(self, segment_key: str, is_refused: bool) -> None:
        """Remember that the key's blob was refused, or forget it once a usable blob is
        there (loaded, or stored by this tier)."""
        with self._refused_lock:
            if not is_refused:
                self._refused.pop(segment_key, None)
                return
            self._refused[segment_key] = None
            self._refused.move_to_end(segment_key)
            if len(self._refused) > MAX_REFUSED_KEYS:
                self._refused.popitem(last=False)

    def delete(self, segment_key: str) -> None:
        self._call_with_breaker(self.client.delete, self.redis_key(segment_key))

    def _call_with_breaker(
        self, function, *args: object, counts_refusal: bool = True
    ) -> tuple[str, object]:
        """(what the call came to, `function(*args)` or None): ANSWERED with its result;
        REFUSED when Redis answered with an error (counted in `errors` unless not
        `counts_refusal`; Redis is up, so it closes the breaker like a success);
        UNREACHED when the breaker is open, Redis was not reached, answered that it
        cannot serve now or answered what cannot be read (a failure for the breaker).
        Each call's own outcome, whatever other threads' calls come to."""
        if self.breaker.is_open:
            self._count("skipped_by_breaker")
            return UNREACHED, None
        try:
            result = function(*args)
        except redis.ResponseError as error:
            if is_unavailable(error):
                self._failed(_name(function), error)
                return UNREACHED, None
            self.breaker.succeeded()
            if counts_refusal:
                self._count_error(error)
                log.debug("shared tier: %s refused: %s", _name(function), error)
            return REFUSED, None
        except (redis.RedisError, OSError) as error:
            self._failed(_name(function), error)
            return UNREACHED, None
        except Exception as error:
            # A reply redis-py cannot make sense of (a server not speaking Redis: its
            # handshake reads HELLO's answer as a map). The connection it left half opened
            # in the pool would read the next command's reply out of step: closed.
            self._failed(_name(function), error)
            self.client.connection_pool.disconnect(inuse_connections=False)
            return UNREACHED, None
        self.breaker.succeeded()
        return ANSWERED, result

    def _count(self, name: str) -> None:
        with self._stats_lock:
            setattr(self.stats, name, getattr(self.stats, name) + 1)

    def _count_error(self, error: Exception) -> None:
        kind = type(error).__name__
        with self._stats_lock:
            self.stats.errors += 1
            self.stats.errors_by_kind[kind] = self.stats.errors_by_kind.get(kind, 0) + 1

    def _failed(self, command: str, error: Exception) -> None:
        self._count_error(error)
        if self.breaker.failed():
            log.warning(
                "shared tier unreachable (%s: %s); serving from the local tier", command, error
            )

    def close(self) -> None:
        self.client.close()


def _name(function) -> str:
    return getattr(function, "__name__", "call")


def _bulk_len(reply: object) -> int:
    """`proto-max-bulk-len` from CONFIG GET's reply ({name: value}, bytes or str),
    REDIS_MAX_BULK_BYTES where it is missing or unreadable."""
    if isinstance(reply, dict):
        for name, value in reply.items():
            name = name.decode() if isinstance(name, bytes) else name
            if name == "proto-max-bulk-len":
                try:
                    return int(value)
                except (TypeError, ValueError):
                    break
    return REDIS_MAX_BULK_BYTES
