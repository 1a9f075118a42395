"""The lookup server keeps its index out of the cyclic collector without keeping garbage."""

import asyncio
import gc
import weakref

import pytest

from holeblend_runtime.lookup_server.server import (
    FULL_COLLECTION_GROWTH,
    LookupServer,
    ServerConfig,
)


class _Cycle:
    def __init__(self) -> None:
        self.itself = self


@pytest.fixture
def collector():
    """Only explicit collections run (an automatic one would free the test's garbage
    early), and nothing is frozen before or after the test."""
    gc.unfreeze()
    gc.disable()
    yield
    gc.unfreeze()
    gc.enable()


def test_cyclic_garbage_left_at_a_sweep_is_freed_not_frozen(collector):
    server = LookupServer(ServerConfig(port=0))
    garbage = _Cycle()
    freed = weakref.ref(garbage)
    del garbage
    server.sweep_silent_pods()
    gc.collect()
    assert freed() is None


def test_a_connection_closed_after_a_sweep_is_freed_without_uvloop(collector):
    """asyncio's transports hold a reference cycle: one frozen while its connection was
    open is garbage once it closes, and is freed once enough was frozen after it."""

    async def serve_one_connection() -> weakref.ref:
        server = LookupServer(ServerConfig(port=0))
        await server.start()
        server.sweep_silent_pods()
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /healthz HTTP/1.1\r\n\r\n")
        assert (await reader.readuntil(b"ok\n")).startswith(b"HTTP/1.1 200")
        (connection,) = server.connections
        transport = weakref.ref(connection.transport)
        server.sweep_silent_pods()  # the connection is open: its transport is frozen
        writer.close()
        await writer.wait_closed()
        while server.connections:
            await asyncio.sleep(0.01)
        growth = 2 * FULL_COLLECTION_GROWTH  # more than calls for a full collection
        held = [[] for _ in range(int(gc.get_freeze_count() * growth))]
        server.sweep_silent_pods()  # freezes them: the next sweep collects everything
        del held
        server.sweep_silent_pods()
        server.stop()
        await server.serve_forever()
        return transport

    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:  # not uvloop
        transport = runner.run(serve_one_connection())
    gc.collect()
    assert transport() is None
