"""A lookup server URL whose host no DNS query can carry costs failed calls, never a request."""

import pytest

from holeblend_runtime.lookup_server.client import ClientConfig, LookupClient


@pytest.mark.parametrize("host", ["lookup..svc", "a" * 64 + ".svc"])
def test_a_host_name_that_cannot_be_resolved_answers_all_miss_and_never_raises(host):
    """Resolving an empty label or one over 63 characters raises UnicodeError, not an
    OSError: it went up through `lookup` into the request (on a vLLM pod, its scheduler),
    on every lookup. It is a failed call, as an unknown name is."""
    config = ClientConfig(timeout_ms=2000, retries=0, breaker_failures=100)
    client = LookupClient(f"http://{host}:8100", config)
    try:
        for _ in range(2):
            assert client.lookup(["a", "b"]) == [None, None]
        assert client.stats.degraded_lookups == 2 and client.stats.failures == 2
    finally:
        client.close()
