"""The CPU attention for every position after a prefix: causal attention behind zero query
rows against the masked chunks it replaced, side by side in one run.

`python -m holeblend_devtools.cpu_attention --json out/cpu-attention.json`. For each
(keys, prefix) case, one layer's attention of the preset's heads (random values) for the
queries at positions prefix..keys-1, as `attend` runs it with a plan from `plan_attention`:

- `padded`: the plan the CPU now makes when the prefix is at most a quarter of the keys
  (`padded_rows`: SDPA's causal attention over zero rows for the prefix, then the queries).
- `chunks`: the same queries in chunks of 64 with a mask each (the plan before, and still
  the plan for a longer prefix).

The arms alternate round by round; each row gives the median milliseconds per layer, the
ratio to `chunks`, and the largest difference between the arms' outputs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from holeblend_runtime.model.attention import (
    CHUNKED,
    DEFAULT_CHUNK_SIZE,
    MAX_PADDED_PREFIX_SHARE,
    AttentionPlan,
    _chunks,
    attend,
    plan_attention,
)
from holeblend_runtime.model.presets import PRESETS, preset_config

ARMS = ("chunks", "padded")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", choices=sorted(PRESETS), default="smollm2-135m")
    parser.add_argument(
        "--cases", default="1300:60,1650:400,6000:60,6000:1500", help="KEYS:PREFIX, comma-separated"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        cases = [tuple(int(n) for n in case.split(":")) for case in args.cases.split(",")]
        if any(len(case) != 2 for case in cases):
            raise ValueError
    except ValueError:
        parser.error(f"--cases: expected KEYS:PREFIX pairs, got {args.cases!r}")
    if args.rounds < 1 or any(
        not 0 < prefix <= MAX_PADDED_PREFIX_SHARE * keys for keys, prefix in cases
    ):
        parser.error(
            f"--rounds must be >= 1 and each PREFIX within 1..KEYS x {MAX_PADDED_PREFIX_SHARE}"
        )
    torch.set_num_threads(args.threads)
    config = preset_config(args.model)
    rows = []
    for keys, prefix in cases:
        generator = torch.Generator().manual_seed(keys + prefix)
        q = torch.randn(config.num_heads, keys - prefix, config.head_dim, generator=generator)
        k, v = torch.randn(2, config.num_kv_heads, keys, config.head_dim, generator=generator)
        padded = plan_attention(torch.arange(prefix, keys), keys, backend=CHUNKED)
        assert padded.padded_rows == prefix
        plans = {"padded": padded, "chunks": _chunked(padded, keys, prefix)}
        outputs = {arm: attend(q, k, v, plan) for arm, plan in plans.items()}
        difference = float((outputs["padded"] - outputs["chunks"]).abs().max())
        times: dict[str, list[float]] = {arm: [] for arm in ARMS}
        for _ in range(args.rounds):
            for arm in ARMS:
                start = time.perf_counter()
                attend(q, k, v, plans[arm])
                times[arm].append(time.perf_counter() - start)
        base = statistics.median(times["chunks"])
        for arm in ARMS:
            median = statistics.median(times[arm])
            row = {"keys": keys, "prefix": prefix, "arm": arm, "ms_per_layer": round(median * 1e3, 2),
                   "x_chunks": round(median / base, 3), "max_difference": difference}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    meta = {"model": args.model, "torch": torch.__version__, "threads": args.threads,
            "rounds": args.rounds}  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"config": meta, "rows": rows}, indent=1) + "\n")
    return 0


def _chunked(padded: AttentionPlan, keys: int, prefix: int) -> AttentionPlan:
    """The same queries in masked chunks (what `plan_attention` makes for a longer prefix)."""
    chunks = _chunks(torch.arange(prefix, keys), DEFAULT_CHUNK_SIZE, torch.float32)
    return dataclasses.replace(padded, padded_rows=0, chunks=chunks)


if __name__ == "__main__":
    raise SystemExit(main())
