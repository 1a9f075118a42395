"""Host time against device time of one blended (sparse) layer on CUDA: whether a short
prompt's blend waits for the GPU or the GPU waits for the host.

`python -m holeblend_devtools.layer_host_cost --json out/layer-host-cost.json` on a machine
with CUDA (the main environment's torch is CPU-only: run it where torch has CUDA, with the
repository's packages on PYTHONPATH). A model of the preset's shape with `--layers` random
layers; for each recompute-set size, the layer as `Blender._sparse_layer` runs it (the
packed QKV projection, RoPE and the cache writes, the sparse attention over `--keys` cached
keys, the output projection and MLP), called `--calls` times back to back: `host_us` is
the time the host took to launch one layer (no wait for the device), `total_us` the time
per layer once the device finished (the larger of the host's and the device's pace).
`total_us` about `host_us` means the host sets the pace: the device idles between
kernels, whatever the kernels cost.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from holeblend_runtime.model.attention import plan_attention
from holeblend_runtime.model.llama import Llama
from holeblend_runtime.model.presets import PRESETS, preset_config, random_weights


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", choices=sorted(PRESETS), default="llama-3-8b")
    parser.add_argument("--layers", type=int, default=2, help="random layers built (>= 1)")
    parser.add_argument("--keys", type=int, default=2048, help="cached keys attended to")
    parser.add_argument("--queries", default="64,256,512,1024", help="recompute-set sizes")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        sizes = [int(n) for n in args.queries.split(",")]
    except ValueError:
        parser.error(f"--queries: expected comma-separated integers, got {args.queries!r}")
    if args.layers < 1 or args.calls < 1 or not all(0 < n <= args.keys for n in sizes):
        parser.error("--layers and --calls >= 1; each of --queries within 1..--keys")
    if not torch.cuda.is_available():
        parser.error("needs CUDA: the host/device split only exists on an accelerator")
    device, dtype = torch.device("cuda"), torch.bfloat16
    config = dataclasses.replace(preset_config(args.model), num_layers=args.layers)
    model = Llama(config, random_weights(config, device, dtype, seed=0), device=device, dtype=dtype)
    rows = []
    for num in sizes:
        row = _time_layer(model, args.keys, num, args.calls)
        rows.append(row)
        print(json.dumps(row), flush=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "model": args.model, "dtype": "bfloat16", "calls": args.calls}  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"config": meta, "rows": rows}, indent=1) + "\n")
    return 0


def _time_layer(model: Llama, num_keys: int, num_queries: int, calls: int) -> dict:
    """One sparse layer of `num_queries` recomputed tokens among `num_keys`, `calls` times."""
    config, device, dtype = model.config, model.device, model.dtype
    k, v = model.new_kv(num_keys)
    positions = torch.sort(torch.randperm(num_keys, device=device)[:num_queries]).values
    plan = plan_attention(
        positions, num_keys, dtype, head_dim=config.head_dim, ends_at_last_key=False
    )
    rope = model.rope(positions)
    h = torch.randn(num_queries, config.hidden_size, device=device, dtype=dtype) * 0.01

    def layer() -> None:
        q = model.qkv_into(0, h, rope, k[0], v[0], positions)
        model.attend_and_mlp(0, h, q, k[0], v[0], plan)

    for _ in range(10):
        layer()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(calls):
        layer()
    host = time.perf_counter() - started
    torch.cuda.synchronize()
    total = time.perf_counter() - started
    return {"queries": num_queries, "keys": num_keys, "backend": plan.backend,
            "host_us": host / calls * 1e6, "total_us": total / calls * 1e6}  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
