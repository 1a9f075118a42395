"""A circuit breaker for calls to remote services (the lookup server, the shared tier).

After `max_failures` consecutive failures the breaker opens: callers skip the remote
call (and take the miss path) for `open_s` seconds; then one call is let through, and
its success closes the breaker again. Not locked: callers hold their own lock or accept
a racy count (it only shifts when the breaker opens by a call).
"""

from __future__ import annotations

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
        self._num_failures = 0
        self._open_until = 0.0
        self.num_opened = 0

    @property
    def is_open(self) -> bool:
        """Whether calls are skipped now."""
        return self._clock() < self._open_until

    def succeeded(self) -> None:
        self._num_failures = 0

    def failed(self) -> bool:
        """Count a failure; True when it opened the breaker."""
        self._num_failures += 1
        if self._num_failures < self.max_failures:
            return False
        self._num_failures = 0
        self._open_until = self._clock() + self.open_s
        self.num_opened += 1
        return True
