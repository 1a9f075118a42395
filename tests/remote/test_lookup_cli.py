"""`holeblend-lookup`: bad flags and HOLEBLEND_LOOKUP_* values exit 2 naming them, never a traceback."""

import re

import pytest

from holeblend_runtime.lookup_server.cli import config_from_args, serve_parser


def parse(argv, monkeypatch, environ=None):
    for name, value in (environ or {}).items():
        monkeypatch.setenv(name, value)
    return serve_parser().parse_args(argv)


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        (["--port", "70000"], {}, "--port: '70000': expected an integer port in 1..65535"),
        (["--port", "-5"], {}, "--port: '-5': expected an integer port"),
        (["--port", "0"], {}, "--port: '0': expected an integer port"),
        (["--log-level", "verbose"], {}, "--log-level: 'verbose': expected one of DEBUG"),
        (["--max-keys", "-1"], {}, "--max-keys: '-1': expected an integer >= 1"),
        (["--max-entries", "0"], {}, "--max-entries: '0': expected an integer >= 1"),
        (["--max-connections", "0"], {}, "--max-connections: '0': expected an integer >= 1"),
        (["--pod-timeout", "0"], {}, "--pod-timeout: '0': expected a number of seconds > 0"),
        (["--drain-seconds", "nan"], {}, "--drain-seconds: 'nan': expected"),
        ([], {"HOLEBLEND_LOOKUP_PORT": "abc"}, "--port: HOLEBLEND_LOOKUP_PORT='abc': expected"),
        (
            [],
            {"HOLEBLEND_LOOKUP_LOG_LEVEL": "loud"},
            "--log-level: HOLEBLEND_LOOKUP_LOG_LEVEL='loud': expected one of",
        ),
        ([], {"HOLEBLEND_LOOKUP_MAX_KEYS": "-1"}, "--max-keys: HOLEBLEND_LOOKUP_MAX_KEYS='-1'"),
    ],
)
def test_bad_flags_and_variables_exit_2_naming_them(argv, environ, message, monkeypatch, capsys):
    with pytest.raises(SystemExit) as caught:
        parse(argv, monkeypatch, environ)
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_help_works_with_a_bad_variable(monkeypatch, capsys):
    with pytest.raises(SystemExit) as caught:
        parse(["--help"], monkeypatch, {"HOLEBLEND_LOOKUP_PORT": "abc"})
    assert caught.value.code == 0
    assert "HOLEBLEND_LOOKUP_PORT" in capsys.readouterr().out


def test_a_flag_wins_over_a_bad_variable(monkeypatch):
    assert parse(["--port", "8100"], monkeypatch, {"HOLEBLEND_LOOKUP_PORT": "abc"}).port == 8100


def test_variables_are_read_and_converted_like_flags(monkeypatch):
    environ = {
        "HOLEBLEND_LOOKUP_PORT": "9100",
        "HOLEBLEND_LOOKUP_LOG_LEVEL": "debug",
        "HOLEBLEND_LOOKUP_DRAIN_SECONDS": "0",
    }
    args = parse([], monkeypatch, environ)
    assert (args.port, args.log_level, args.drain_seconds) == (9100, "DEBUG", 0.0)


def test_defaults_are_used_without_flags_or_variables(monkeypatch):
    for name in ("HOLEBLEND_LOOKUP_PORT", "HOLEBLEND_LOOKUP_LOG_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    args = parse([], monkeypatch)
    assert (args.port, args.log_level) == (8100, "INFO")


def test_the_connection_limit_reaches_the_server_config(monkeypatch):
    args = parse([], monkeypatch, {"HOLEBLEND_LOOKUP_MAX_CONNECTIONS": "32"})
    assert config_from_args(args).max_connections == 32
    monkeypatch.delenv("HOLEBLEND_LOOKUP_MAX_CONNECTIONS")
    assert config_from_args(parse([], monkeypatch)).max_connections == 4096


def test_a_body_limit_the_buffer_cannot_hold_names_both_flags_and_a_buffer_that_fits(monkeypatch):
    """The error named the configuration's fields (`max_buffer_bytes`), which a person who
    set HOLEBLEND_LOOKUP_MAX_BODY_BYTES never wrote, and no value that would do."""
    args = parse([], monkeypatch, {"HOLEBLEND_LOOKUP_MAX_BODY_BYTES": "100000000"})
    with pytest.raises(SystemExit) as caught:
        config_from_args(args)
    message = str(caught.value)
    assert "--max-body-bytes (env HOLEBLEND_LOOKUP_MAX_BODY_BYTES)" in message
    assert "--max-buffer-bytes (env HOLEBLEND_LOOKUP_MAX_BUFFER_BYTES)" in message
    assert "max_buffer_bytes" not in message and "max_body_bytes" not in message
    needed = re.search(r"needs (\d+)", message).group(1)
    monkeypatch.setenv("HOLEBLEND_LOOKUP_MAX_BUFFER_BYTES", needed)
    assert config_from_args(serve_parser().parse_args([])).max_buffer_bytes == int(needed)
