"""The lookup client's requests carry a valid Host header: an IPv6 address in brackets,
and the port of the URL (RFC 7230), whatever the server in front does with it."""

import socket
import threading

from holeblend_runtime.lookup_server import wire
from holeblend_runtime.lookup_server.client import ClientConfig, LookupClient


def answer_one_lookup(listener: socket.socket, heads: list[bytes]) -> None:
    """Accept one client, keep its request head, and answer its lookup: all miss."""
    sock, _ = listener.accept()
    with sock:
        received = b""
        while b"\r\n\r\n" not in received:
            chunk = sock.recv(65536)
            if not chunk:
                return
            received += chunk
        heads.append(received.split(b"\r\n\r\n", 1)[0])
        body = wire.encode({"ok": True, "hits": [None]})
        sock.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n"
            % (wire.CONTENT_TYPE.encode(), len(body))
            + body
        )


def host_header_sent(
    family: socket.AddressFamily, address: str, url_host: str
) -> tuple[bytes, int]:
    """The Host header line of a lookup sent to http://URL_HOST:PORT, as a listener on
    `address` received it, and that PORT."""
    listener = socket.create_server((address, 0), family=family)
    heads: list[bytes] = []
    with listener:
        port = listener.getsockname()[1]
        thread = threading.Thread(target=answer_one_lookup, args=(listener, heads), daemon=True)
        thread.start()
        config = ClientConfig(timeout_ms=5000, retries=0)
        client = LookupClient(f"http://{url_host}:{port}", config)
        try:
            assert client.lookup(["k"]) == [None] and client.stats.degraded_lookups == 0
        finally:
            client.close()
        thread.join(5)
    (head,) = heads
    (line,) = [line for line in head.split(b"\r\n") if line.lower().startswith(b"host:")]
    return line, port


def test_an_ipv6_server_address_is_sent_in_brackets_in_the_host_header():
    """`Host: ::1` was sent: not valid HTTP (the colons read as a port), which a proxy or
    a stricter server in front of the lookup server may refuse with 400."""
    line, port = host_header_sent(socket.AF_INET6, "::1", "[::1]")
    assert line == b"Host: [::1]:%d" % port


def test_an_ipv4_server_address_is_sent_with_its_port_in_the_host_header():
    line, port = host_header_sent(socket.AF_INET, "127.0.0.1", "127.0.0.1")
    assert line == b"Host: 127.0.0.1:%d" % port
