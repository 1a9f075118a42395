"""`holeblend-operator run`: the operator process (kopf, /healthz, /metrics, JSON logs).

Standalone by default; `--peering NAME` lets several replicas share a kopf peering object so
that one is active at a time (HA). SIGTERM and SIGINT stop it gracefully: kopf finishes the
handlers in flight, then the health server closes.
"""

import argparse
import asyncio
import contextlib
import ctypes
import ctypes.util
import errno
import gc
import logging
import sys

import kopf

from holeblend_contract.dual_stack import EVERY_ADDRESS, host_port
from holeblend_operator import handlers, settings
from holeblend_operator.health import HealthServer

GC_THRESHOLD = 2_000  # allocations between gen-0 collections (CPython's default: 700)
TRIM_INTERVAL_S = 10.0  # how often freed heap memory is handed back to the OS


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
    configure_logging(config)
    tune_garbage_collector()  # here, not in serve(): tests embed serve() in their own process
    try:
        asyncio.run(serve(config))
    except StartError as exc:
        print(f"holeblend-operator run: {exc}", file=sys.stderr)
        return 1
    return 0


class StartError(Exception):
    """The operator cannot start (a setting the machine cannot honour): said in one line."""


def configure_logging(config: settings.OperatorSettings) -> None:
    """kopf's handler on the root logger (JSON lines by default) at the chosen level."""
    kopf.configure(
        debug=config.log_level == "debug",  # kopf's `verbose` also means DEBUG: not used
        quiet=config.log_level == "warning",
        log_format=kopf.LogFormat.JSON if config.log_format == "json" else kopf.LogFormat.FULL,
    )
    logging.getLogger("kopf.objects").addFilter(_quiet_event_handlers)
    logging.getLogger("kopf._core.reactor.observation").addFilter(_quiet_optional_resources)


def _quiet_event_handlers(record: logging.LogRecord) -> bool:
    # kopf logs every successful handler call at INFO: with event handlers only, that is a
    # line per watch event. The reconciles log their own outcome.
    message = record.getMessage()
    return not (
        record.levelno == logging.INFO
        and message.startswith("Handler '")
        and "succeeded" in message
    )


def _quiet_optional_resources(record: logging.LogRecord) -> bool:
    # kopf warns at start-up about watched resources the cluster does not serve. ServiceMonitors
    # are optional (prometheus-operator): a BlendDeployment that asks for one without the CRD
    # says so in its status and events; a cluster without it needs no warning.
    message = record.getMessage()
    unresolved = message.partition("Unresolved resources cannot be served")[2]
    return not (unresolved and unresolved.count("Selector(") == unresolved.count("servicemonitors"))


def tune_garbage_collector() -> None:
    # kopf allocates many short-lived containers per watch event, so the default gen-0
    # threshold (700) runs a collection every few events, and each older-generation pass
    # walks every object imported at startup. Freeze the startup heap (never garbage)
    # and collect less often. Not too seldom: cyclic garbage (exceptions and their frames,
    # finished tasks) left among a burst's objects keeps the interpreter's memory arenas
    # from being freed after it. bench-operator at 200 BlendDeployments, MB of RSS per
    # object: 0.089-0.090 with 2,000 (0.060 at 1,000), 0.094-0.100 with 5,000, about 0.1
    # with 20,000; CPU per object the same within the noise.
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_THRESHOLD, 20, 20)


async def serve(config: settings.OperatorSettings, stop: asyncio.Event | None = None) -> None:
    """Run until SIGTERM/SIGINT (or `stop`, for embedding in tests and tools)."""
    registry = kopf.OperatorRegistry()
    operator = handlers.register(config, registry)
    ready = asyncio.Event()
    # Started before kopf, which takes every task it finds running at its start for someone
    # else's; one started after, it would take for its own leftover and wait 5 s on at exit.
    trimming = asyncio.create_task(trim_heap_periodically(TRIM_INTERVAL_S))
    task = asyncio.create_task(
        kopf.operator(
            registry=registry,
            standalone=config.peering is None,
            peering_name=config.peering,
            clusterwide=not config.namespaces,
            namespaces=config.namespaces,
            ready_flag=ready,
            stop_flag=stop,
            identity=operator.identity,  # the tuner finds this replica in the peering object
            memories=handlers.EventMemories(),  # none kept per object: see there
        )
    )
    health = HealthServer(task, ready)
    try:
        await health.start(config.health_host, config.health_port)
    except OSError as exc:  # the port is taken: stop kopf before it does anything
        task.cancel()
        trimming.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        with contextlib.suppress(asyncio.CancelledError):
            await trimming
        reason = exc.strerror or exc
        if config.health_host != EVERY_ADDRESS and exc.errno != errno.EADDRINUSE:
            raise StartError(
                f"--health-host: cannot listen on {config.health_host!r} ({reason}); give an "
                f"address of this pod, or {EVERY_ADDRESS} (the default) for every address"
            ) from None
        where = host_port(config.health_host, config.health_port)
        raise StartError(
            f"--health-port: cannot listen on {where} ({reason}); "
            "stop what holds it or pick another port"
        ) from None
    logging.getLogger(__name__).info("health and metrics on port %s", health.port)
    try:
        await task
    finally:
        trimming.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await trimming
        await health.stop()


async def trim_heap_periodically(interval_s: float) -> None:
    """Hand the heap's free pages back to the OS every `interval_s` (glibc only).

    A burst (thousands of objects created at once, or a relist after a restart) allocates
    far more than the operator keeps afterwards; glibc's malloc keeps what was freed in the
    middle of its heap, so without this RSS stays at the burst's peak for good
    (docs/operator.md, "Memory and scale"). A trim takes about a millisecond."""
    trim = _malloc_trim()
    if trim is None:
        return
    while True:
        await asyncio.sleep(interval_s)
        trim(0)


def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
