"""`holeblend-serve --config FILE --host H --port P` (flags also from HOLEBLEND_SERVE_*).

Exit status: 0 after a graceful shutdown (SIGTERM/SIGINT), 2 for bad flags (an address or
port it cannot listen on included) or an unusable blend.json at start (the message names the
key), 1 when the model cannot be loaded.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from holeblend_contract.blend_settings import BlendSettingsError
from holeblend_contract.dual_stack import host_port, listening_site
from holeblend_runtime.kv.tiers import TieredKVStore
from holeblend_runtime.serve.app import Server
from holeblend_runtime.serve.settings import ServeSettings, parse_settings

log = logging.getLogger("holeblend_runtime.serve")


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_settings(argv)
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        server = Server(settings)
    except (BlendSettingsError, ValueError) as error:
        print(f"holeblend-serve: {error}", file=sys.stderr)
        return 2
    return asyncio.run(serve(server, settings))


async def serve(server: Server, settings: ServeSettings) -> int:
    """Listen, load, serve until SIGTERM/SIGINT, drain, close."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    runner = web.AppRunner(
        server.app(),
        handler_cancellation=True,
        access_log=None,
        # A connection gets this long to send a request head (and may idle this long).
        keepalive_timeout=settings.idle_timeout,
        shutdown_timeout=settings.shutdown_timeout,
        # aiohttp's default keeps reading an unread body for 10 s after the answer.
        lingering_time=min(settings.body_timeout, 2.0),
    )
    await runner.setup()
    try:
        await listening_site(runner, settings.host, settings.port).start()
    except OSError as error:
        await runner.cleanup()
        server.close()
        print(f"holeblend-serve: {listen_error(error, settings)}", file=sys.stderr)
        return 2
    # The bound addresses (port 0 asks the system for a free one).
    bound = [address[:2] for address in runner.addresses]
    where = ", ".join(host_port(host, port) for host, port in bound)
    log.info("listening on %s; loading the model", where)
    watcher = asyncio.create_task(server.live.watch(settings.reload_interval))
    watcher.add_done_callback(_log_watcher_end)
    status = await _load(server, stop)
    await stop.wait()
    log.info("draining")
    await server.drain()
    watcher.cancel()
    await runner.cleanup()
    server.close()
    _stop_threads(server)
    log.info("stopped")
    return status


def listen_error(error: OSError, settings: ServeSettings) -> str:
    """Why the server cannot listen, naming the flag to change."""
    reason = error.strerror or error
    where = host_port(settings.host, settings.port)
    if error.errno in (errno.EADDRINUSE, errno.EACCES):  # taken, or below 1024 without root
        return f"--port: cannot listen on {where} ({reason}); stop what holds it or pick another"
    return (
        f"--host: cannot listen on {where} ({reason}); give an address of this machine, or "
        ":: or 0.0.0.0 for every address"
    )


def _log_watcher_end(watcher: asyncio.Task) -> None:
    """The blend.json watcher ends only when cancelled; anything else is logged."""
    if not watcher.cancelled() and (error := watcher.exception()) is not None:
        log.error("the blend.json watcher stopped; live reload is off until a restart",
                  exc_info=error)  # fmt: skip


def _stop_threads(server: Server) -> None:
    """Join every thread that may run torch or the network before the interpreter exits:
    a thread still inside torch at interpreter shutdown aborts the process."""
    if server.worker is not None:
        server.worker.stop()
    if server.shadow is not None:
        server.shadow.close()
    if server.shared_calibration is not None:
        server.shared_calibration.stop()  # its last pairs go out
    if server.engine is not None:
        server.engine.close()  # the background store worker
        if isinstance(server.engine.store, TieredKVStore):
            server.engine.store.close()  # the announcer thread


async def _load(server: Server, stop: asyncio.Event) -> int:
    # On a thread of its own that ends with the load: the load computes (warm-up) with
    # torch's threads, and a thread that did so and lives on (asyncio's default executor)
    # would slow every forward of the engine's thread (model/threads.py).
    loader = ThreadPoolExecutor(1, thread_name_prefix="holeblend-load")
    try:
        await asyncio.get_running_loop().run_in_executor(loader, server.load)
    except Exception:
        log.exception("cannot load the model")
        stop.set()
        return 1
    finally:
        loader.shutdown(wait=False)  # its thread ends once the load returned
    server.is_ready = True
    log.info("ready: model %s", server.model_name)
    return 0
