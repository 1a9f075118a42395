"""blend.json at run time: loaded once at start, its live keys re-read while serving.

The kubelet updates a ConfigMap volume by writing a new timestamped directory and swapping
the `..data` symlink, so the file's own inode never changes and a watch on the file misses
updates. The watcher therefore polls the path through the directory every
`reload_interval` seconds and compares the bytes it reads (the file is a few hundred bytes).

On a change:
1. parse it with the contract's parser; on any error (garbage, half-written, unknown key,
   newer formatVersion) keep the last good settings, log the error and count it;
2. apply the live keys (`LIVE_KEYS`: `recomputeRatio`, the shadow's idle floor);
3. log, once per distinct file, that other keys changed and need a restart (the operator
   rolls the pods for those; until then this process keeps its start-up values).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
from collections.abc import Callable
from pathlib import Path

from holeblend_contract.blend_settings import (
    BlendSettings,
    BlendSettingsError,
    load_blend_settings,
)

log = logging.getLogger(__name__)


class LiveConfig:
    """The settings in force; the live keys follow the file, the rest is fixed."""

    def __init__(
        self,
        path: Path,
        on_error: Callable[[], None] = lambda: None,
        on_reload: Callable[[], None] = lambda: None,
    ) -> None:
        self.path = path
        # Taken before the settings are read: a file swapped in between then differs from
        # it, and the first check applies it.
        self._digest = _digest(path)
        self.startup = load_blend_settings(path)
        self._current = self.startup
        self._on_error = on_error
        self._on_reload = on_reload
        self._lock = threading.Lock()
        self.num_errors = 0

    @property
    def current(self) -> BlendSettings:
        with self._lock:
            return self._current

    @property
    def recompute_ratio(self) -> float:
        return self.current.recompute_ratio

    def check(self) -> bool:
        """Re-read the file if its bytes changed; True when new settings were applied."""
        digest = _digest(self.path)
        if digest == self._digest:
            return False
        self._digest = digest
        try:
            settings = load_blend_settings(self.path)
        except BlendSettingsError as error:
            self._count_error()
            log.error("keeping the last good blend settings: %s", error)
            return False
        return self._apply(settings)

    def _count_error(self) -> None:
        self.num_errors += 1
        try:
            self._on_error()
        except Exception:
            log.exception("the reload error callback failed")

    def _apply(self, settings: BlendSettings) -> bool:
        if settings.restart_settings() != self.startup.restart_settings():
            log.warning("%s: keys other than the live ones changed; they apply after a restart",
                        self.path)  # fmt: skip
        live = self.startup.model_copy(
            update={
                "recompute_ratio": settings.recompute_ratio,
                "shadow_idle_samples": settings.shadow_idle_samples,
                "shadow_idle_seconds": settings.shadow_idle_seconds,
            }
        )
        with self._lock:
            self._current = live
        self._on_reload()
        log.info("blend settings reloaded: recomputeRatio=%s", live.recompute_ratio)
        return True

    async def watch(self, interval: float) -> None:
        """Poll until cancelled. Nothing ends it but cancellation: an unexpected error in a
        round is logged and counted as a reload error, the last good settings stay in force
        and polling goes on."""
        while True:
            await asyncio.sleep(interval)
            try:
                self.check()
            except OSError as error:  # a read racing the symlink swap: retried next round
                log.warning("cannot read %s: %s", self.path, error)
            except Exception:
                self._count_error()
                log.exception("reloading %s failed; keeping the last good blend settings",
                              self.path)  # fmt: skip


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None
