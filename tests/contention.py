"""Running code on many threads at once, switching between them as often as the interpreter
allows: an unlocked read-modify-write (`+=` on a shared counter) then loses updates."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable


def run_contended(work: Callable[[], object], threads: int, rounds: int) -> None:
    """`work` `rounds` times on each of `threads` threads, all at once."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        workers = [
            threading.Thread(target=lambda: [work() for _ in range(rounds)]) for _ in range(threads)
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    finally:
        sys.setswitchinterval(interval)
