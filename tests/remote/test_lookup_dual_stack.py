"""`--host ::` listens on every address, IPv6 and IPv4, so an IPv6-only cluster reaches the
lookup server (on 0.0.0.0 it answered IPv4 alone, and asyncio binds "::" for IPv6 only)."""

import contextlib
import errno
import socket
import subprocess
import sys

import pytest

from holeblend_runtime.lookup_server import processes
from holeblend_runtime.lookup_server import server as server_module
from holeblend_runtime.lookup_server.client import ClientConfig, LookupClient

from .test_lookup_hostile import read_until_closed, server_on_a_thread, status_of


@contextlib.contextmanager
def every_address_server():
    with server_on_a_thread(host="::") as (server, _):
        yield server


@pytest.mark.parametrize("address", ["::1", "127.0.0.1"])
def test_every_address_takes_ipv6_and_ipv4_clients(address):
    with every_address_server() as server:
        with socket.create_connection((address, server.port), timeout=5) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n")
            reply, _ = read_until_closed(sock)
        assert status_of(reply) == 200
        host = f"[{address}]" if ":" in address else address
        config = ClientConfig(timeout_ms=5000, retries=0)
        client = LookupClient(f"http://{host}:{server.port}", config)
        try:
            assert client.lookup(["k"]) == [None] and client.stats.degraded_lookups == 0
        finally:
            client.close()


def test_the_command_line_host_of_every_address_serves_both():
    # The process is ready once /ready answers on 127.0.0.1; the lookup goes over ::1.
    with processes.LookupProcess("--host", "::") as server:
        client = LookupClient(f"http://[::1]:{server.port}", ClientConfig(timeout_ms=5000))
        try:
            assert client.lookup(["k"]) == [None] and client.stats.degraded_lookups == 0
        finally:
            client.close()


def test_a_port_taken_is_an_error_not_a_fall_back_to_ipv4():
    with socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(OSError) as refused:
            server_module.every_address_socket(port)
    assert refused.value.errno == errno.EADDRINUSE and f"('::', {port})" in str(refused.value)


@pytest.mark.parametrize("host", ["::", "127.0.0.1"])
def test_a_port_taken_is_refused_naming_the_flags_without_a_traceback(host):
    with socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True) as taken:
        port = str(taken.getsockname()[1])
        command = [sys.executable, "-I", "-m", "holeblend_runtime.lookup_server"]
        done = subprocess.run(
            [*command, "--host", host, "--port", port], capture_output=True, timeout=30
        )
    error = done.stderr.decode()
    assert done.returncode == 1 and "Traceback" not in error, error
    assert f"cannot listen on --host {host} --port {port}" in error and "choose a free" in error


def test_a_kernel_without_ipv6_gets_every_ipv4_address(monkeypatch):
    """No kernel here lacks IPv6: creating an IPv6 socket fails as it does on one."""
    real_socket = socket.socket

    def socket_without_ipv6(family=socket.AF_INET, *args, **kwargs):
        if family == socket.AF_INET6:
            raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
        return real_socket(family, *args, **kwargs)

    monkeypatch.setattr(socket, "socket", socket_without_ipv6)
    sock = server_module.every_address_socket(0)
    monkeypatch.undo()
    with sock:
        assert sock.family == socket.AF_INET and sock.getsockname()[0] == "0.0.0.0"
