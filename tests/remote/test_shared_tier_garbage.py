"""A shared-tier URL that reaches something answering other than Redis does: every read is
a miss and every store refused, never an exception in the request."""

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from holeblend_runtime.kv.shared_tier import BlobHeader, SharedTier, SharedTierConfig, blob_pieces
from holeblend_runtime.kv.store import LocalKVStore, SegmentKV
from holeblend_runtime.kv.tiers import KVLayout, TieredKVStore, kv_blob_pieces
from holeblend_runtime.lookup_server.processes import RedisProcess

LAYOUT = KVLayout("model-a", "float32", num_layers=3, num_kv_heads=2, head_dim=8)
# The handshake's answer of a RESP3 server: {"proto": 3}.
HELLO_REPLY = b"%1\r\n+proto\r\n:3\r\n"


def segment(key: str = "seg", num_tokens: int = 5) -> SegmentKV:
    shape = (LAYOUT.num_layers, LAYOUT.num_kv_heads, num_tokens, LAYOUT.head_dim)
    k, v = torch.ones(shape), torch.ones(shape)
    return SegmentKV(key, k, v, torch.arange(num_tokens), LAYOUT.model_id)


@contextmanager
def answering(hello: bytes, reply: bytes) -> Iterator[str]:
    """The URL of a server that answers HELLO with `hello` and every other command with
    `reply`, on as many connections as the client opens."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve(connection: socket.socket) -> None:
        with connection:
            try:
                while chunk := connection.recv(65536):
                    for command in chunk.split(b"*")[1:]:  # the tests' keys hold no '*'
                        connection.sendall(hello if b"HELLO" in command else reply)
            except OSError:
                pass

    def accept() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=serve, args=(connection,), daemon=True).start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
    finally:
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        acceptor.join(5)


def held_open_tier(url: str) -> SharedTier:
    config = SharedTierConfig(
        url, "ns/rag", timeout_s=0.5, breaker_open_s=60, max_blob_bytes=1 << 20
    )
    return SharedTier(config)


def test_a_reply_of_the_wrong_type_to_a_read_is_a_bad_blob_and_a_miss():
    """An integer where GET's bulk string belongs was handed to the blob decoder, whose
    TypeError went through `load` into the request."""
    with answering(HELLO_REPLY, b":5\r\n") as url:
        shared = held_open_tier(url)
        assert shared.load(LAYOUT.header("seg")) == (None, True)
        assert shared.stats.bad_blobs == 1
        store = TieredKVStore(LocalKVStore(1 << 20), LAYOUT, shared)
        assert store.get("seg") is None
        assert store.stats.misses == 1
        store.close()


def test_a_handshake_answered_with_garbage_is_a_failure_for_the_breaker_not_an_exception():
    """redis-py reads HELLO's reply as a map; a plain string there raised AttributeError
    through every read and store, and left the half-opened connection in the pool, where
    the next command read the garbage as a blob."""
    with answering(b"+OK\r\n", b"+OK\r\n") as url:
        shared = held_open_tier(url)
        assert [shared.load(LAYOUT.header("seg")) for _ in range(3)] == [(None, False)] * 3
        assert shared.stats.errors == 3 and shared.stats.bad_blobs == 0
        assert shared.breaker.num_opened == 1
        shared.close()

        store = TieredKVStore(LocalKVStore(1 << 20), LAYOUT, held_open_tier(url))
        kv = segment()
        assert store.shared.put_pieces(kv.key, kv_blob_pieces(kv, "ns/rag")) is False
        assert store.put(kv) is True  # the local tier holds it
        assert store.stats.shared_stores == 0
        assert store.get_many(["seg", "other"])[1] is None
        store.close()


def test_a_blob_of_no_tokens_is_a_bad_blob_not_an_exception():
    """A blob whose header and checksum hold together but whose shape has no tokens (no
    segment has none: a forged or miswritten blob) passed every check, and building its
    tensors raised ValueError through the tiered store's load into the request."""
    with RedisProcess() as server:
        shared = SharedTier(SharedTierConfig(server.url, "ns/rag", timeout_s=0.5))
        header = BlobHeader("seg", LAYOUT.model_id, LAYOUT.dtype, (3, 2, 0, 8))
        shared.put_pieces("seg", blob_pieces(header, [b"", b"", b""], "ns/rag"))
        store = TieredKVStore(LocalKVStore(1 << 20), LAYOUT, shared)
        assert store.get("seg") is None
        assert shared.stats.bad_blobs == 1 and store.stats.misses == 1
        assert shared.contains_many(["seg"]) == [False]
        store.close()
