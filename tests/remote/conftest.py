"""Real servers for the cross-pod reuse tests: redis-server and the lookup server process."""

import pytest

from holeblend_runtime.lookup_server.processes import LookupProcess, RedisProcess


@pytest.fixture
def redis_server():
    with RedisProcess(maxmemory="256mb") as server:
        yield server


@pytest.fixture
def lookup_server():
    # A short pod timeout so the silent-pod tests run in about a second.
    with LookupProcess("--pod-timeout", "1.0") as server:
        yield server
