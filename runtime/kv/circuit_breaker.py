"""A circuit breaker for calls to remote services (the lookup server, the shared tier).

After `max_failures` consecutive failures the breaker opens: callers skip the remote
call (and take the miss path) for `open_s` seconds. Then it is half-open: the first
caller to ask `is_open` is let through as the trial call, and the others are skipped
while it runs. The trial's success closes the breaker; its failure opens it again at
once for another `open_s` seconds. A trial that reports neither within `open_s` (its
caller raised) is given up and the next caller becomes the trial; one whose call never
reached the remote (its caller's deadline was spent first) says so (`not_tried`), and the
next caller becomes the trial at once. Thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class CircuitBreaker:
    def __init__(
        self, max_failures: int, open_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if max_failures < 1:
            raise ValueError(f"max_failures: must be >= 1, got {max_failures}")
        if open_s < 0:
            raise ValueError(f"open_s: must be >= 0, got {open_s}")
        self.max_failures = max_failures
        self.open_s = open_s
        self._clock = clock
        self._lock = threading.Lock()
        self._num_failures = 0
        self._open_until = 0.0
        # Opened and not closed by a success since: open, then half-open.
        self._is_tripped = False
        # When the half-open breaker let its trial call through (None: no trial running).
        self._trial_since: float | None = None
        self.num_opened = 0

    @property
    def is_open(self) -> bool:
        """Whether this call is skipped. Asked while half-open, False for the one caller
        it lets through as the trial."""
        with self._lock:
            now = self._clock()
            if not self._is_tripped:
                return False
            if now < self._open_until:
                return True
            if self._trial_since is not None and now - self._trial_since < self.open_s:
                return True  # a trial is running
            self._trial_since = now
            return False

    def succeeded(self) -> None:
        with self._lock:
            self._num_failures = 0
            if self._is_tripped and self._clock() >= self._open_until:
                self._is_tripped = False
                self._trial_since = None

    def not_tried(self) -> None:
        """The call let through did not reach the remote: neither a success nor a
        failure. A half-open breaker lets the next caller through as its trial."""
        with self._lock:
            self._trial_since = None

    def failed(self) -> bool:
        """Count a failure; True when it opened the breaker (a failed trial reopens it)."""
        with self._lock:
            now = self._clock()
            if self._is_tripped:
                if now < self._open_until:
                    return False  # a call that started before the breaker opened
                return self._open(now)
            self._num_failures += 1
            if self._num_failures < self.max_failures:
                return False
            return self._open(now)

    def _open(self, now: float) -> bool:
        self._num_failures = 0
        self._is_tripped = True
        self._trial_since = None
        self._open_until = now + self.open_s
        self.num_opened += 1
        return True
