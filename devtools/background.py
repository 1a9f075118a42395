"""Run the API emulator on its own thread and event loop.

Tests, the demo and the benchmark drive an operator (kopf's KopfRunner thread, or a
subprocess) that must keep talking to the emulator while the caller blocks or sleeps, so the
emulator never shares the caller's event loop.
"""

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from holeblend_devtools.emulator import ClusterEmulator


class EmulatorThread:
    """`with EmulatorThread(kubeconfig_path, crds=[...]) as cluster:` serves until exit."""

    def __init__(
        self, kubeconfig: str, crds: tuple[str, ...] = (), port: int | None = None, **options: Any
    ):
        self.kubeconfig = kubeconfig
        self._crds = crds
        self._port = port
        self._options = options
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="emulator", daemon=True)
        self._stopped: asyncio.Event | None = None
        self._serving: asyncio.Future | None = None
        self.api: ClusterEmulator | None = None
        self.url: str | None = None

    def __enter__(self) -> "EmulatorThread":
        self._thread.start()
        self.call(self._start())
        return self

    def __exit__(self, *_: Any) -> None:
        self.call(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def call(self, coro: Coroutine, timeout: float = 60) -> Any:
        """Run a coroutine on the emulator's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def run(self, fn: Callable[[], Any]) -> Any:
        """Call a plain function on the emulator's loop (its state is not thread-safe)."""
        return self.call(_async(fn))

    def get(self, resource: str, namespace: str | None, name: str) -> dict | None:
        return self.run(lambda: self.api.get_object(resource, namespace, name))

    def list(self, resource: str, namespace: str | None = None) -> list[dict]:
        return self.run(lambda: self.api.list_objects(resource, namespace))

    def wait_for(
        self, predicate: Callable[[], Any], timeout: float = 10, interval: float = 0.05
    ) -> Any:
        """Poll until `predicate()` is truthy; TimeoutError says what never came true."""
        deadline = time.monotonic() + timeout
        while True:
            result = predicate()
            if result:
                return result
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"not true after {timeout} s: {getattr(predicate, '__name__', predicate)}"
                )
            time.sleep(interval)

    async def _start(self) -> None:
        self._stopped = asyncio.Event()
        started: asyncio.Future = self._loop.create_future()
        self._serving = self._loop.create_task(self._serve(started))
        await started

    async def _serve(self, started: asyncio.Future) -> None:
        try:
            await self._serve_until_stopped(started)
        except Exception as exc:  # a bad CRD path or a taken port: fail the caller, not hang
            if not started.done():
                started.set_exception(exc)
            raise

    async def _serve_until_stopped(self, started: asyncio.Future) -> None:
        # Here, not at the top: `stop_process` serves venvs without the emulator (kmock).
        import kmock

        from holeblend_devtools.emulator import ClusterEmulator, write_kubeconfig

        async with (
            ClusterEmulator(**self._options) as api,
            kmock.Server(api, host="127.0.0.1", port=self._port) as server,
        ):
            for path in self._crds:
                with open(path) as file:
                    api.install_crd(yaml.safe_load(file))
            self.api, self.url = api, str(server.url)
            write_kubeconfig(self.kubeconfig, self.url)
            started.set_result(None)
            await self._stopped.wait()

    async def _stop(self) -> None:
        self._stopped.set()
        try:
            await asyncio.wait_for(self._serving, timeout=5)
        except TimeoutError:
            self._serving.cancel()


async def _async(fn: Callable[[], Any]) -> Any:
    return fn()


def environment_for(kubeconfig: str) -> dict[str, str]:
    """os.environ pointed at the emulator (for kubectl and operator subprocesses)."""
    return dict(os.environ, KUBECONFIG=kubeconfig)


def operator_command(*flags: str) -> list[str]:
    """`holeblend-operator run FLAGS` as a subprocess command of this interpreter."""
    # -I: never the repository root on sys.path, where operator/ would shadow the stdlib module.
    return [sys.executable, "-I", "-m", "holeblend_operator.cli", "run", *flags]


def stop_process(process: subprocess.Popen, timeout: float = 20) -> None:
    """SIGTERM (the operator's graceful stop), then SIGKILL if it does not exit in time."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
