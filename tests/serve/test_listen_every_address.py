"""`holeblend-serve --host ::` listens on every address, IPv6 and IPv4 (IPv6-only and
dual-stack clusters); a port already taken is still an error, not a quiet IPv4 fallback."""

import errno
import socket

import aiohttp
import pytest
from aiohttp import web

from holeblend_contract.dual_stack import every_address_socket, listening_site
from holeblend_runtime.serve.app import Server
from holeblend_runtime.serve.cli import serve
from holeblend_runtime.serve.settings import ServeSettings
from tests.serve.conftest import example_settings_json


def connects(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as client:
        client.settimeout(5)
        return client.connect_ex((host, port)) == 0


def settings_of(tmp_path, host: str, port: int) -> ServeSettings:
    config = tmp_path / "blend.json"
    config.write_text(example_settings_json(mode="off", qualityProxies=False))
    return ServeSettings(config, host=host, port=port)


async def status_of(url: str) -> int:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status


async def test_the_server_on_every_address_answers_on_ipv6_and_ipv4(tmp_path):
    server = Server(settings_of(tmp_path, "::", 0))
    runner = web.AppRunner(server.app())
    await runner.setup()
    try:
        await listening_site(runner, "::", 0).start()
        port = runner.addresses[0][1]
        assert await status_of(f"http://[::1]:{port}/healthz") == 200
        assert await status_of(f"http://127.0.0.1:{port}/healthz") == 200
    finally:
        await runner.cleanup()
        server.close()


def test_a_socket_on_every_address_takes_ipv6_and_ipv4_connections():
    with every_address_socket(0) as sock:
        sock.listen()
        port = sock.getsockname()[1]
        assert connects("::1", port) and connects("127.0.0.1", port)


def test_a_port_already_taken_is_an_error_rather_than_an_ipv4_fallback():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        with pytest.raises(OSError) as raised:
            every_address_socket(taken.getsockname()[1]).close()
    assert raised.value.errno == errno.EADDRINUSE


async def test_a_port_already_taken_stops_the_server_with_one_line_naming_the_port(
    tmp_path, capsys
):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        settings = settings_of(tmp_path, "127.0.0.1", taken.getsockname()[1])
        assert await serve(Server(settings), settings) == 2
    error = capsys.readouterr().err
    assert error.startswith("holeblend-serve: --port: cannot listen on 127.0.0.1:"), error
    assert "Traceback" not in error


async def test_an_address_of_another_machine_stops_the_server_naming_the_host(tmp_path, capsys):
    settings = settings_of(tmp_path, "192.0.2.1", 0)  # TEST-NET-1: no machine's address
    assert await serve(Server(settings), settings) == 2
    error = capsys.readouterr().err
    assert error.startswith("holeblend-serve: --host: cannot listen on 192.0.2.1:0"), error
