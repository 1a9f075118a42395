"""Which threads of a process run torch's CPU kernels in parallel: one.

torch's CPU kernels run their parallel loops on OpenMP (libgomp in torch's wheels). Every
thread that starts a parallel loop becomes the master of its own team of worker threads,
and the team lives as long as that thread does. libgomp counts the threads it manages in
the whole process; while they outnumber the CPUs it lets an idle worker spin only about a
hundred times (instead of about 300,000) before it sleeps, so every parallel loop of every
team then starts by waking its workers from the kernel. A model forward is thousands of
such loops: the engine's own forward slows by up to 40 % as soon as a second thread (a
loader, a background store, the shadow scorer) has run a single parallel loop and is
still alive, and it stays slow as long as that thread lives. Measured on a 2-core machine,
torch using both cores (docs/serving.md, "Threads"): 32 hole-mode prefills of ~980 tokens
took 9.1-10.1 s alone, 14.0-14.1 s beside a live thread that had run one parallel loop,
9.1 s beside one that runs serially (`serial_torch`), and 10.1-10.3 s once the other
thread had exited.

Hence the rule: the thread that computes for the engine (holeblend-serve's engine thread,
the benchmark's main thread, vLLM's model thread) runs torch with `compute_threads`; every
other thread that may touch tensors is made by `serial_thread` or `serial_pool` (it calls
`serial_torch` first), and a thread that computes only for a while (the model load) ends
when it is done.

`torch.set_num_threads` sets the calling thread's OpenMP and MKL thread counts, and also the
process default that every thread takes before its first parallel loop (unless it took it
already). So both helpers take the default first and then set their own count: a compute
thread does not inherit the 1 a serial thread left as the default, and a serial thread
does not inherit a compute thread's count. And the thread that starts a serial thread takes
its own count before it does (`serial_thread`, `serial_pool`): it may compute itself without
having set one (vLLM's model thread creates the KV tier's reader and writer).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch


def serial_torch() -> None:
    """Run torch on this thread without parallel loops (it starts no OpenMP team): first
    thing in every thread but the one that computes for the engine."""
    _pin_threads(1)


def compute_threads(num_threads: int) -> None:
    """Run torch's parallel loops on this thread with `num_threads` threads: first thing in
    the thread that computes for the engine."""
    if num_threads < 1:
        raise ValueError(f"num_threads: must be >= 1, got {num_threads}")
    _pin_threads(num_threads)


def serial_thread(target: Callable[[], object], name: str) -> threading.Thread:
    """A started daemon thread that runs `target` serially."""

    def run() -> None:
        serial_torch()
        target()

    _keep_thread_count()
    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def serial_pool(max_workers: int, thread_name_prefix: str) -> ThreadPoolExecutor:
    """A thread pool whose threads run serially."""
    _keep_thread_count()
    return ThreadPoolExecutor(max_workers, thread_name_prefix, initializer=serial_torch)


def _keep_thread_count() -> None:
    # The calling thread takes the process default as its count now, if it has not yet:
    # the serial thread it is about to start sets the default to 1.
    torch.get_num_threads()


def _pin_threads(num_threads: int) -> None:
    # A thread takes the process default once, lazily, before its first parallel loop, and
    # then keeps its own count; asking for the count takes it now, so that a default
    # another thread sets later (a serial thread's 1, a compute thread's N) never
    # overrides the count set here.
    torch.get_num_threads()
    torch.set_num_threads(num_threads)
