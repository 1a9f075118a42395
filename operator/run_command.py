"""`holeblend-operator run`: the operator process (kopf, /healthz, /metrics, JSON logs).

Standalone by default; `--peering NAME` lets several replicas share a kopf peering object so
that one is active at a time (HA). SIGTERM and SIGINT stop it gracefully: kopf finishes the
handlers in flight, then the health server closes.
"""

import argparse
import asyncio
import logging
import sys

import kopf

from holeblend_operator import handlers, settings
from holeblend_operator.health import HealthServer


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("run", help="run the operator against the current cluster")
    settings.add_arguments(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        config = settings.from_sources(args)
    except ValueError as exc:
        print(f"holeblend-operator run: {exc}", file=sys.stderr)
        return 2
    kopf.configure(
        debug=config.log_level == "debug",
        verbose=config.log_level in ("debug", "info"),
        quiet=config.log_level == "warning",
        log_format=kopf.LogFormat.JSON if config.log_format == "json" else kopf.LogFormat.FULL,
    )
    asyncio.run(serve(config))
    return 0


async def serve(config: settings.OperatorSettings, stop: asyncio.Event | None = None) -> None:
    """Run until SIGTERM/SIGINT (or `stop`, for embedding in tests and tools)."""
    registry = kopf.OperatorRegistry()
    handlers.register(config, registry)
    ready = asyncio.Event()
    task = asyncio.create_task(
        kopf.operator(
            registry=registry,
            standalone=config.peering is None,
            peering_name=config.peering,
            clusterwide=not config.namespaces,
            namespaces=config.namespaces,
            ready_flag=ready,
            stop_flag=stop,
        )
    )
    health = HealthServer(task, ready)
    await health.start(config.health_host, config.health_port)
    logging.getLogger(__name__).info("health and metrics on port %s", health.port)
    try:
        await task
    finally:
        await health.stop()
