"""A lookup server URL whose host no DNS query can carry is refused when the client is
built, never left to fail inside every lookup."""

import pytest

from holeblend_runtime.lookup_server.client import LookupClient


@pytest.mark.parametrize("host", ["lookup..svc", "a" * 64 + ".svc"])
def test_a_host_name_that_cannot_be_resolved_is_refused_naming_the_setting(host):
    """Resolving an empty label or one over 63 characters raises UnicodeError, not an
    OSError: it went up through `lookup` into the request (on a vLLM pod, its scheduler),
    on every lookup. The URL is refused up front instead, naming lookupServerUrl."""
    with pytest.raises(ValueError, match="lookupServerUrl: host .* is not a DNS name"):
        LookupClient(f"http://{host}:8100")
