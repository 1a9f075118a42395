"""A closed lookup client answers as a failed call and opens no connection."""

import socket

import pytest

from holeblend_runtime.lookup_server.client import ClientConfig, LookupClient


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_a_closed_client_opens_no_connection_once_its_address_is_known(host):
    """A client whose address is an IP, or a name it resolved already, connected again
    after `close` and kept that socket open with nothing left to close it."""
    with socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True) as listener:
        port = listener.getsockname()[1]
        client = LookupClient(f"http://{host}:{port}", ClientConfig(timeout_ms=100, retries=2))
        assert client.lookup(["a"]) == [None]  # connected, never answered: the address is known
        listener.settimeout(5)
        accepted = [listener.accept()[0]]
        listener.setblocking(False)
        while pending := pending_connection(listener):
            accepted.append(pending)
        client.close()
        assert client.lookup(["a", "b"]) == [None, None]
        assert client.call({"op": "stats"}) is None
        assert client.stats.degraded_lookups == 2 and client.stats.failures == 3
        assert pending_connection(listener) is None
        for sock in accepted:
            sock.close()


def pending_connection(listener: socket.socket) -> socket.socket | None:
    """A connection the kernel completed and nobody accepted yet; None when there is none."""
    try:
        return listener.accept()[0]
    except BlockingIOError:
        return None
