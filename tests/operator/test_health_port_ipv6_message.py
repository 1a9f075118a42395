"""A taken --health-port is named with the address in brackets when it is IPv6 (the
default, "::"): "[::]:8080", never ":::8080", where the port cannot be told from the
address."""

import socket

import pytest

from holeblend_operator import run_command, settings


async def test_a_taken_port_on_the_default_address_names_it_in_brackets():
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = settings.OperatorSettings(health_port=port)
        assert ":" in config.health_host
        with pytest.raises(run_command.StartError) as caught:
            await run_command.serve(config)
    assert f"cannot listen on [{config.health_host}]:{port} (" in str(caught.value)
