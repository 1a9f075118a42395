"""The shared KV tier on a real redis-server: blob format, key layout, bad blobs, outages,
a full Redis and blobs larger than Redis takes."""

import socket
import threading
import time
from pathlib import Path

import pytest
import redis
import torch

from holeblend_contract.shared_tier import check_shared_url
from holeblend_runtime.kv.shared_tier import (
    BLOB_FORMAT,
    DTYPE_SIZES,
    REDIS_MAX_BULK_BYTES,
    BlobError,
    BlobHeader,
    SharedTier,
    SharedTierConfig,
    blob_pieces,
    decode_blob,
    redis_url,
)
from holeblend_runtime.kv.store import SegmentKV
from holeblend_runtime.kv.tiers import KVLayout, blob_to_kv, kv_to_blob
from holeblend_runtime.lookup_server.processes import RedisProcess, free_port

LAYOUT = KVLayout("model-a", "float32", num_layers=3, num_kv_heads=2, head_dim=8)


def segment(
    key: str = "seg", num_tokens: int = 5, model: str = "model-a", seed: int = 0
) -> SegmentKV:
    generator = torch.Generator().manual_seed(seed)
    shape = (LAYOUT.num_layers, LAYOUT.num_kv_heads, num_tokens, LAYOUT.head_dim)
    k, v = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    return SegmentKV(key, k, v, torch.arange(7, 7 + num_tokens), model)


def tier(url: str, deployment: str = "ns/rag") -> SharedTier:
    return SharedTier(SharedTierConfig(url, deployment, timeout_s=0.5, breaker_open_s=0.2))


def assert_same(a: SegmentKV, b: SegmentKV) -> None:
    assert a.key == b.key and a.model_id == b.model_id
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v) and torch.equal(a.positions, b.positions)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_blob_round_trips_every_kv_dtype(dtype):
    kv = segment()
    kv = SegmentKV(kv.key, kv.k.to(dtype), kv.v.to(dtype), kv.positions, kv.model_id)
    assert_same(blob_to_kv(kv_to_blob(kv)), kv)


def test_flipped_truncated_and_foreign_blobs_are_refused():
    blob = kv_to_blob(segment())
    flipped = bytearray(blob)
    flipped[len(blob) // 2] ^= 0xFF
    expected = LAYOUT.header("seg")
    with pytest.raises(BlobError, match="checksum"):
        decode_blob(bytes(flipped), expected)
    with pytest.raises(BlobError, match="payload"):
        decode_blob(blob[:-1], expected)
    with pytest.raises(BlobError, match="truncated"):
        decode_blob(blob[:5], expected)
    with pytest.raises(BlobError, match="model"):
        decode_blob(kv_to_blob(segment(model="model-b")), expected)
    with pytest.raises(BlobError, match="magic"):
        decode_blob(b"GARBAGE" * 10, expected)
    with pytest.raises(BlobError, match="format"):
        decode_blob(blob[:4] + b"\x09\x00" + blob[6:], expected)


def test_a_blob_in_another_dtype_is_refused_unless_the_reader_holds_that_dtype_too():
    """A reader whose documents are narrowed holds its system prompt in the model's dtype
    (KVLayout.system_dtype): it takes those two dtypes and refuses a third."""
    narrow = KVLayout("model-a", "bfloat16", 3, 2, 8, system_dtype="float32")
    assert narrow.other_dtypes == ("float32",) and LAYOUT.other_dtypes == ()
    kv = segment()
    half = SegmentKV(kv.key, kv.k.half(), kv.v.half(), kv.positions, kv.model_id)
    with pytest.raises(BlobError, match="dtype: blob has 'float32', expected 'bfloat16'"):
        decode_blob(kv_to_blob(kv), narrow.header("seg"))
    assert decode_blob(kv_to_blob(kv), narrow.header("seg"), "", narrow.other_dtypes)
    with pytest.raises(
        BlobError, match="dtype: blob has 'float16', expected 'bfloat16' or 'float32'"
    ):
        decode_blob(kv_to_blob(half), narrow.header("seg"), "", narrow.other_dtypes)


def test_a_blob_carries_its_deployment_in_header_and_checksum():
    blob = kv_to_blob(segment(), "ns/a")
    expected = LAYOUT.header("seg")
    assert decode_blob(blob, expected, "ns/a")[0].num_tokens == 5
    with pytest.raises(BlobError, match="deployment"):
        decode_blob(blob, expected, "ns/b")
    # Rewriting the header's name is not enough: the checksum covers the identity.
    forged = blob.replace(b"ns/a", b"ns/b", 1)
    with pytest.raises(BlobError, match="checksum"):
        decode_blob(forged, expected, "ns/b")


def test_segments_round_trip_through_redis_under_the_deployment_prefix(redis_server):
    shared = tier(redis_server.url)
    kv = segment()
    assert shared.put_blob(kv.key, kv_to_blob(kv, "ns/rag"))
    assert shared.client.exists("holeblend:ns/rag:kv:v2:seg") == 1
    header, _ = shared.get_checked(LAYOUT.header("seg"))
    assert header.num_tokens == 5
    assert_same(blob_to_kv(shared.get_blob("seg"), LAYOUT.header("seg"), "ns/rag"), kv)
    # Another BlendDeployment on the same Redis sees none of it.
    assert tier(redis_server.url, "ns/other").get_blob("seg") is None


def test_a_corrupted_blob_in_redis_is_a_miss(redis_server):
    shared = tier(redis_server.url)
    blob = bytearray(kv_to_blob(segment(), "ns/rag"))
    blob[-3] ^= 0x01
    shared.client.set(shared.redis_key("seg"), bytes(blob))
    assert shared.get_checked(LAYOUT.header("seg")) is None
    assert shared.stats.bad_blobs == 1


def test_redis_down_is_a_miss_and_a_refused_store_never_an_exception(redis_server):
    shared = tier(redis_server.url)
    redis_server.stop()
    kv = segment()
    assert shared.put_blob(kv.key, kv_to_blob(kv)) is False
    assert shared.get_blob(kv.key) is None
    assert shared.stats.errors >= 1


def large_pieces(deployment: str = "ns/rag", num_bytes: int = 1 << 20) -> list:
    """The pieces of a blob of about 6 x `num_bytes` (float16 K and V, int64 positions)."""
    header = BlobHeader("large", "model-a", "float16", (1, 1, num_bytes // 2, 1))
    parts = [b"\3" * header.kv_bytes] * 2 + [b"\0" * (8 * header.num_tokens)]
    return blob_pieces(header, parts, deployment)


def test_a_full_redis_refusing_writes_still_serves_the_blobs_it_holds():
    """A full Redis under `noeviction` answers every SET with an out-of-memory error; it is
    up, so those refusals are counted but do not open the circuit breaker, and the blobs it
    holds are still read (the breaker would skip them, and every pod would compute them)."""
    with RedisProcess(maxmemory="3mb", policy="noeviction") as server:
        shared = tier(server.url)
        kv = segment()
        assert shared.put_blob(kv.key, kv_to_blob(kv, "ns/rag"))
        pieces = large_pieces()
        assert [shared.put_pieces(f"large-{i}", pieces) for i in range(5)] == [False] * 5
        assert shared.stats.errors_by_kind == {"OutOfMemoryError": 5}
        assert shared.breaker.num_opened == 0
        assert shared.get_checked(LAYOUT.header("seg")) is not None
        assert shared.stats.skipped_by_breaker == 0


def test_commands_a_live_redis_refuses_are_misses_that_never_open_the_breaker(redis_server):
    """An error reply (no permission, a key holding another type) fails that command only:
    counted, a miss, and not taken for a gone copy; Redis answered, so the breaker (3
    failures here) stays closed and the next commands still go to Redis."""
    admin = tier(redis_server.url).client
    admin.execute_command("ACL", "SETUSER", "noget", "on", ">pw", "~*", "+@all", "-get")
    kv = segment()
    refused = SharedTier(SharedTierConfig(redis_server.url, "ns/rag", timeout_s=0.5), "pw", "noget")
    assert refused.put_blob(kv.key, kv_to_blob(kv, "ns/rag"))
    assert [refused.load(LAYOUT.header("seg")) for _ in range(5)] == [(None, False)] * 5
    assert refused.contains_many(["seg"]) == [True]
    admin.rpush(refused.redis_key("listed"), b"x")
    shared = tier(redis_server.url)
    assert [shared.load(LAYOUT.header("listed")) for _ in range(5)] == [(None, False)] * 5
    assert shared.get_checked(LAYOUT.header("seg")) is not None
    assert refused.stats.errors_by_kind == {"NoPermissionError": 5}
    assert shared.stats.errors_by_kind == {"ResponseError": 5}
    for each in (refused, shared):
        assert each.breaker.num_opened == 0 and each.stats.skipped_by_breaker == 0


def test_a_blob_larger_than_redis_takes_is_refused_without_sending_it(redis_server):
    """Redis refuses an argument over its `proto-max-bulk-len` and closes the connection
    (a broken pipe, as if it were down). The tier reads the limit once and refuses such a
    blob itself: nothing is sent, no error is counted, the breaker stays closed and the
    blobs Redis holds are still read."""
    shared = tier(redis_server.url)
    shared.client.config_set("proto-max-bulk-len", "1mb")
    kv = segment()
    assert shared.put_blob(kv.key, kv_to_blob(kv, "ns/rag"))
    pieces = large_pieces(num_bytes=1 << 20)
    assert [shared.put_pieces(f"long-{i}", pieces) for i in range(3)] == [False] * 3
    assert shared.get_checked(LAYOUT.header("seg")) is not None
    assert shared.breaker.num_opened == 0
    assert shared.stats.too_large == 3 and shared.stats.errors == 0
    assert shared.client.exists(shared.redis_key("long-0")) == 0


def test_the_largest_blob_is_configured_or_redis_s_default_where_config_is_refused(redis_server):
    """A configured `max_blob_bytes` is used as is; otherwise a user that may not run
    CONFIG gets Redis's default limit, and the refused CONFIG is not counted as an error."""
    kv = segment()
    blob = kv_to_blob(kv, "ns/rag")
    config = SharedTierConfig(redis_server.url, "ns/rag", max_blob_bytes=len(blob) - 1)
    limited = SharedTier(config)
    assert not limited.put_blob(kv.key, blob) and limited.stats.too_large == 1
    tier(redis_server.url).client.execute_command(
        "ACL", "SETUSER", "noconfig", "on", ">pw", "~*", "+@all", "-config"
    )
    shared = SharedTier(SharedTierConfig(redis_server.url, "ns/rag"), "pw", "noconfig")
    assert shared.put_blob(kv.key, blob)
    assert shared.max_blob_bytes == REDIS_MAX_BULK_BYTES
    assert shared.stats.errors == 0 and shared.stats.too_large == 0


def test_a_miss_is_an_answer_whatever_other_threads_calls_come_to():
    """`load` tells whether Redis answered its own GET: a key Redis does not hold is gone
    (so the lookup server is told) even when another thread's store fails while the GET
    is in flight."""
    with RedisProcess(maxmemory="2mb", policy="noeviction") as server:
        shared = tier(server.url)
        pieces = large_pieces()
        real_get = shared.client.get

        def get_while_a_store_fails(key):
            reply = real_get(key)
            writer = threading.Thread(target=shared.put_pieces, args=("large", pieces))
            writer.start()
            writer.join()
            return reply

        shared.client.get = get_while_a_store_fails
        assert shared.load(LAYOUT.header("evicted")) == (None, True)
        assert shared.stats.errors_by_kind == {"OutOfMemoryError": 1}


@pytest.mark.parametrize(
    "url", ["redis://kv:6379/0", "rediss://kv:6380", "valkey://user@kv:6379/2", "valkeys://kv"]
)
def test_supported_urls_are_accepted(url):
    assert check_shared_url(url) == url
    assert redis_url(url).startswith(("redis://", "rediss://"))


def test_a_url_with_a_password_is_refused_naming_the_field_and_the_fix():
    with pytest.raises(ValueError, match=r"spec.blend.kv.sharedUrl.*sharedPasswordSecret"):
        check_shared_url("redis://:hunter2@kv:6379/0")


@pytest.mark.parametrize("url", ["http://kv:6379", "memcached://kv", "redis://"])
def test_unsupported_urls_are_refused(url):
    with pytest.raises(ValueError, match="sharedUrl"):
        check_shared_url(url)


def test_the_documented_blob_format_is_the_one_written():
    """docs/shared-tier.md names the format a blob carries and every dtype its header may
    name (a reader of another implementation goes by that page)."""
    doc = (Path(__file__).parents[2] / "docs/shared-tier.md").read_text()
    assert f"## Blob format (version {BLOB_FORMAT})" in doc
    header_row = next(line for line in doc.splitlines() if line.startswith("| H | header"))
    assert [dtype for dtype in DTYPE_SIZES if f"`{dtype}`" not in header_row] == []


def held_open_tier(url: str) -> SharedTier:
    """A tier whose breaker, once open, stays open through the test (no trial call)."""
    return SharedTier(SharedTierConfig(url, "ns/rag", timeout_s=0.5, breaker_open_s=60))


def test_a_replica_that_lost_its_primary_opens_the_breaker_like_a_redis_that_is_down():
    """A replica cut off from its primary (a failover in progress) answers every read with
    MASTERDOWN (`replica-serve-stale-data no`) and every write with READONLY: Redis cannot
    serve, so these count as failures and the breaker skips it, as it would a down Redis;
    the refused reads are not taken for gone copies."""
    with RedisProcess() as server:
        shared = held_open_tier(server.url)
        admin = shared.client
        admin.config_set("replica-serve-stale-data", "no")
        admin.replicaof("127.0.0.1", str(free_port()))
        assert [shared.load(LAYOUT.header("seg")) for _ in range(3)] == [(None, False)] * 3
        assert shared.breaker.num_opened == 1
        assert shared.get_blob("seg") is None and shared.stats.skipped_by_breaker == 1
        assert shared.stats.errors_by_kind == {"MasterDownError": 3}

        writer = held_open_tier(server.url)
        kv = segment()
        assert [writer.put_blob(kv.key, kv_to_blob(kv, "ns/rag")) for _ in range(3)] == [False] * 3
        assert writer.breaker.num_opened == 1
        assert writer.stats.errors_by_kind == {"ReadOnlyError": 3}


def test_a_redis_busy_running_a_script_opens_the_breaker():
    """A script running past `busy-reply-threshold` makes Redis answer BUSY to every other
    client until it ends: a failure for the breaker, for single commands and pipelines."""
    with RedisProcess() as server:
        admin = tier(server.url).client
        admin.config_set("busy-reply-threshold", "10")
        with socket.create_connection(("127.0.0.1", server.port)) as script:
            script.sendall(b'EVAL "while true do end" 0\r\n')
            wait_until_busy(admin)
            try:
                shared, pipelined = held_open_tier(server.url), held_open_tier(server.url)
                assert [shared.load(LAYOUT.header("seg")) for _ in range(3)] == [(None, False)] * 3
                assert [pipelined.contains_many(["seg"]) for _ in range(3)] == [[False]] * 3
                for each in (shared, pipelined):
                    assert each.breaker.num_opened == 1
                    assert each.stats.errors_by_kind == {"ResponseError": 3}
            finally:
                admin.script_kill()


def wait_until_busy(client) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            client.get("probe")
        except redis.ResponseError as error:
            if str(error).startswith("BUSY "):
                return
        time.sleep(0.01)
    raise AssertionError("the script did not make Redis busy")


def answer_every_command_with(listener: socket.socket, reply: bytes) -> None:
    """A stand-in for a Redis Cluster node that cannot serve (no cluster runs here), for
    one connection: the handshake (HELLO) is answered, every other command with `reply`."""
    connection, _ = listener.accept()
    with connection:
        while chunk := connection.recv(65536):
            for command in chunk.split(b"*")[1:]:  # the tests' keys hold no '*'
                is_hello = b"HELLO" in command
                connection.sendall(b"%1\r\n+proto\r\n:3\r\n" if is_hello else reply)


@pytest.mark.parametrize(
    "reply, kind",
    [
        (b"-TRYAGAIN Multiple keys request during rehashing of slot\r\n", "TryAgainError"),
        (b"-CLUSTERDOWN The cluster is down\r\n", "ClusterDownError"),
    ],
    ids=["TRYAGAIN", "CLUSTERDOWN"],
)
def test_a_cluster_that_cannot_serve_opens_the_breaker(reply, kind):
    """TRYAGAIN (a slot migrating) and CLUSTERDOWN refuse every command for now, whatever
    the key: failures for the breaker, not refusals of one command."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        server = threading.Thread(target=answer_every_command_with, args=(listener, reply))
        server.start()
        shared = held_open_tier(f"redis://127.0.0.1:{listener.getsockname()[1]}/0")
        assert [shared.load(LAYOUT.header("seg")) for _ in range(3)] == [(None, False)] * 3
        assert shared.breaker.num_opened == 1
        assert shared.stats.errors_by_kind == {kind: 3}
        shared.close()
    server.join(5)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("breaker_failures", 0),
        ("breaker_open_s", -1.0),
        ("breaker_open_s", float("nan")),
        ("timeout_s", float("nan")),
    ],
)
def test_a_bad_setting_is_refused_by_the_config_under_its_own_name(field, value):
    """Not later by the circuit breaker or redis-py, under names the user never wrote."""
    with pytest.raises(ValueError, match=f"^{field}: "):
        SharedTierConfig("redis://kv:6379/0", "ns/rag", **{field: value})


def test_a_shared_url_with_port_zero_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"spec.blend.kv.sharedUrl: 'redis://kv:0/0' names port 0"):
        check_shared_url("redis://kv:0/0")


def _with_header_field(blob: bytes, name: str, value: object) -> bytes:
    """`blob` with one header field replaced (payload and checksum left as they are)."""
    import msgpack

    prefix = 10  # magic, format, header length
    meta_len = int.from_bytes(blob[6:10], "little")
    meta = msgpack.unpackb(blob[prefix : prefix + meta_len])
    meta[name] = value
    packed = msgpack.packb(meta)
    return blob[:6] + len(packed).to_bytes(4, "little") + packed + blob[prefix + meta_len :]


@pytest.mark.parametrize("dtype", [["float32"], {"float32": 1}])
def test_a_header_whose_dtype_is_not_a_name_is_a_bad_blob_not_an_exception(redis_server, dtype):
    """A dtype that is a list or a map (a corrupted or forged header) was looked up in
    the dtype table and raised TypeError through the tier's load into the request."""
    blob = _with_header_field(kv_to_blob(segment(), "ns/rag"), "dtype", dtype)
    with pytest.raises(BlobError, match="dtype"):
        decode_blob(blob, LAYOUT.header("seg"), "ns/rag")
    shared = tier(redis_server.url)
    shared.client.set(shared.redis_key("seg"), blob)
    assert shared.load(LAYOUT.header("seg")) == (None, True)
    assert shared.stats.bad_blobs == 1
