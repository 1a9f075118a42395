"""`holeblend-lookup`: serve one BlendDeployment's segment index, or benchmark it.

    holeblend-lookup --host :: --port 8100 [--max-entries N] [--max-bytes N] ...
    holeblend-lookup bench --json out/lookup-bench.json

Every serve flag can also be set as `HOLEBLEND_LOOKUP_<FLAG>` (e.g. HOLEBLEND_LOOKUP_PORT).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from collections.abc import Sequence

from holeblend_runtime.lookup_server.index import IndexLimits
from holeblend_runtime.lookup_server.server import ServerConfig, run
from holeblend_runtime.lookup_server.wire import Limits

ENV_PREFIX = "HOLEBLEND_LOOKUP_"


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# The configuration fields whose errors a flag can cause, and that flag.
FLAG_OF_FIELD = {
    "max_entries": "max-entries",
    "max_bytes": "max-bytes",
    "pod_timeout_s": "pod-timeout",
    "max_keys": "max-keys",
    "max_body_bytes": "max-body-bytes",
    "drain_s": "drain-seconds",
    "header_timeout_s": "header-timeout",
    "body_timeout_s": "body-timeout",
    "idle_timeout_s": "idle-timeout",
    "write_timeout_s": "write-timeout",
    "max_buffer_bytes": "max-buffer-bytes",
    "max_connections": "max-connections",
}
_FIELD_NAMES = re.compile(r"\b(" + "|".join(FLAG_OF_FIELD) + r")\b")


class _FromEnv(str):
    """A default read from `HOLEBLEND_LOOKUP_<FLAG>`: argparse converts it with the flag's
    type (only when the flag is not given), and an error names the variable."""

    variable: str


def _env_name(flag: str) -> str:
    return ENV_PREFIX + flag.upper().replace("-", "_")


def _env_default(flag: str, default: object) -> object:
    value = os.environ.get(_env_name(flag))
    if value is None:
        return default
    text = _FromEnv(value)
    text.variable = _env_name(flag)
    return text


def _checked(convert, check, expected: str):
    """An argparse type: `convert`, then `check`; else an error that names what was
    expected, and the environment variable when the value came from one."""

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not check(value):
            where = f"{text.variable}={text!r}" if isinstance(text, _FromEnv) else repr(text)
            raise argparse.ArgumentTypeError(f"{where}: expected {expected}")
        return value

    return parse


_PORT = _checked(int, lambda v: 1 <= v <= 65535, "an integer port in 1..65535")
_POSITIVE_INT = _checked(int, lambda v: v >= 1, "an integer >= 1")
_POSITIVE_FLOAT = _checked(float, lambda v: 0 < v < float("inf"), "a number of seconds > 0")
_NON_NEGATIVE_FLOAT = _checked(float, lambda v: 0 <= v < float("inf"), "a number of seconds >= 0")
_LOG_LEVEL = _checked(str.upper, lambda v: v in LOG_LEVELS, "one of " + ", ".join(LOG_LEVELS))


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="holeblend-lookup",
        allow_abbrev=False,
        description="Serve the segment index of one BlendDeployment (subcommand `bench`: benchmark it).",
    )
    defaults_index, defaults_limits, defaults = IndexLimits(), Limits(), ServerConfig()
    for flag, kind, default, help_text in (
        ("host", str, "127.0.0.1", "address to listen on (:: every address, IPv6 and IPv4)"),
        ("port", _PORT, 8100, "port of the API, /metrics, /healthz and /ready"),
        (
            "max-entries",
            _POSITIVE_INT,
            defaults_index.max_entries,
            "segments the index holds at most (LRU)",
        ),
        (
            "max-bytes",
            _POSITIVE_INT,
            defaults_index.max_bytes,
            "KV bytes the index tracks at most (LRU)",
        ),
        (
            "pod-timeout",
            _POSITIVE_FLOAT,
            defaults_index.pod_timeout_s,
            "seconds without a heartbeat before a pod is dropped",
        ),
        (
            "max-keys",
            _POSITIVE_INT,
            defaults_limits.max_keys,
            "keys in one lookup or evict request at most",
        ),
        (
            "max-body-bytes",
            _POSITIVE_INT,
            defaults_limits.max_body_bytes,
            "bytes of one request body at most",
        ),
        (
            "drain-seconds",
            _NON_NEGATIVE_FLOAT,
            defaults.drain_s,
            "seconds between SIGTERM (failing /ready) and exit",
        ),
        (
            "header-timeout",
            _POSITIVE_FLOAT,
            defaults.header_timeout_s,
            "seconds from a request's first byte until its head must be complete (else 408, close)",
        ),
        (
            "body-timeout",
            _POSITIVE_FLOAT,
            defaults.body_timeout_s,
            "seconds from the end of a request's head until its body must be complete (else 408)",
        ),
        (
            "idle-timeout",
            _POSITIVE_FLOAT,
            defaults.idle_timeout_s,
            "seconds a kept-alive connection with no request in progress stays open",
        ),
        (
            "write-timeout",
            _POSITIVE_FLOAT,
            defaults.write_timeout_s,
            "seconds a client may leave its replies unread before it is disconnected",
        ),
        (
            "max-buffer-bytes",
            _POSITIVE_INT,
            defaults.max_buffer_bytes,
            "request bytes buffered across all connections at most (else 503)",
        ),
        (
            "max-connections",
            _POSITIVE_INT,
            defaults.max_connections,
            "client connections open at once at most (one more: 503, closed)",
        ),
        ("log-level", _LOG_LEVEL, "INFO", "logging level: " + ", ".join(LOG_LEVELS)),
    ):
        parser.add_argument(
            f"--{flag}",
            type=kind,
            default=_env_default(flag, default),
            help=f"{help_text} (env {_env_name(flag)})",
        )
    return parser


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    try:
        index = IndexLimits(args.max_entries, args.max_bytes, args.pod_timeout)
        limits = Limits(max_body_bytes=args.max_body_bytes, max_keys=args.max_keys)
        return ServerConfig(
            args.host,
            args.port,
            index,
            limits,
            drain_s=args.drain_seconds,
            header_timeout_s=args.header_timeout,
            body_timeout_s=args.body_timeout,
            idle_timeout_s=args.idle_timeout,
            write_timeout_s=args.write_timeout,
            max_buffer_bytes=args.max_buffer_bytes,
            max_connections=args.max_connections,
        )
    except ValueError as error:
        raise SystemExit(f"holeblend-lookup: {_as_flags(str(error))}") from None


def _as_flags(message: str) -> str:
    """`message` with the configuration fields it names written as the flags that set
    them, each variable named at its first mention: what the person reading it set."""
    named: set[str] = set()

    def flag(match: re.Match) -> str:
        name = FLAG_OF_FIELD[match.group(1)]
        if name in named:
            return f"--{name}"
        named.add(name)
        return f"--{name} (env {_env_name(name)})"

    return _FIELD_NAMES.sub(flag, message)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        from holeblend_runtime.lookup_server.bench import main as bench_main

        bench_main(argv[1:])
        return
    args = serve_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    run(config_from_args(args))
