"""`holeblend-lookup`: serve one BlendDeployment's segment index, or benchmark it.

    holeblend-lookup --host 0.0.0.0 --port 8100 [--max-entries N] [--max-bytes N] ...
    holeblend-lookup bench --json out/lookup-bench.json

Every serve flag can also be set as `HOLEBLEND_LOOKUP_<FLAG>` (e.g. HOLEBLEND_LOOKUP_PORT).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from holeblend_runtime.lookup_server.index import IndexLimits
from holeblend_runtime.lookup_server.server import ServerConfig, run
from holeblend_runtime.lookup_server.wire import Limits

ENV_PREFIX = "HOLEBLEND_LOOKUP_"


def _env_default(flag: str, default: object) -> object:
    return os.environ.get(ENV_PREFIX + flag.upper().replace("-", "_"), default)


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="holeblend-lookup",
        allow_abbrev=False,
        description="Serve the segment index of one BlendDeployment (subcommand `bench`: benchmark it).",
    )
    defaults_index, defaults_limits, defaults = IndexLimits(), Limits(), ServerConfig()
    for flag, kind, default, help_text in (
        ("host", str, "127.0.0.1", "address to listen on"),
        ("port", int, 8100, "port of the API, /metrics, /healthz and /ready"),
        ("max-entries", int, defaults_index.max_entries, "segments the index holds at most (LRU)"),
        ("max-bytes", int, defaults_index.max_bytes, "KV bytes the index tracks at most (LRU)"),
        (
            "pod-timeout",
            float,
            defaults_index.pod_timeout_s,
            "seconds without a heartbeat before a pod is dropped",
        ),
        ("max-keys", int, defaults_limits.max_keys, "keys in one lookup or evict request at most"),
        (
            "max-body-bytes",
            int,
            defaults_limits.max_body_bytes,
            "bytes of one request body at most",
        ),
        (
            "drain-seconds",
            float,
            defaults.drain_s,
            "seconds between SIGTERM (failing /ready) and exit",
        ),
        (
            "header-timeout",
            float,
            defaults.header_timeout_s,
            "seconds from a request's first byte until its head must be complete (else 408, close)",
        ),
        (
            "body-timeout",
            float,
            defaults.body_timeout_s,
            "seconds from the end of a request's head until its body must be complete (else 408)",
        ),
        (
            "idle-timeout",
            float,
            defaults.idle_timeout_s,
            "seconds a kept-alive connection with no request in progress stays open",
        ),
        (
            "write-timeout",
            float,
            defaults.write_timeout_s,
            "seconds a client may leave its replies unread before it is disconnected",
        ),
        (
            "max-buffer-bytes",
            int,
            defaults.max_buffer_bytes,
            "request bytes buffered across all connections at most (else 503)",
        ),
        ("log-level", str, "INFO", "logging level"),
    ):
        parser.add_argument(
            f"--{flag}", type=kind, default=kind(_env_default(flag, default)), help=help_text
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
        )
    except ValueError as error:
        raise SystemExit(f"holeblend-lookup: {error}") from None


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
