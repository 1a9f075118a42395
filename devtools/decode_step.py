"""One batched greedy decode step on the CPU: the weights' layout and the step's attention
against the forms they replaced, side by side in one run.

`python -m holeblend_devtools.decode_step --json out/decode-step.json`. A model of the
preset's shape with random weights (a step's time depends on shapes, not values), B
sequences with `--keys` tokens of KV each (a little apart, as a batch's requests are),
one token each per step (`runtime/model/batch_decode.py`). Four arms, interleaved round
by round so that the machine's drift falls on all alike:

- `layout`: `cpu` is the projections as `Llama` stores them on the CPU ([in, out]
  contiguous), `checkpoint` the same values in the checkpoint's [out, in] storage (what
  the model used before).
- `attention`: `pooled` is the step as it runs (the sequences' KV rows of one pool, one
  attention call per layer for all of them); `grouped` one call per sequence, each
  `attend_one_query` (the query heads of a KV head read as its queries: what the step did
  before the pool); `gqa` one call per sequence on SDPA's own GQA path (`enable_gqa`, what
  it did before that).

Each row gives the median step time over `--steps` steps per round and its ratio to the
`checkpoint` + `gqa` arm of the same batch size.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from holeblend_runtime.model import batch_decode
from holeblend_runtime.model.batch_decode import DecodeSequence
from holeblend_runtime.model.llama import Llama
from holeblend_runtime.model.presets import PRESETS, preset_config, random_weights

LAYOUTS = ("checkpoint", "cpu")
ATTENTIONS = ("gqa", "grouped", "pooled")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", choices=sorted(PRESETS), default="smollm2-135m")
    parser.add_argument("--keys", type=int, default=1500, help="KV tokens per sequence")
    parser.add_argument("--batch", default="1,4,8", help="sequences per step, comma-separated")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per arm and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        batches = [int(n) for n in args.batch.split(",")]
    except ValueError:
        parser.error(f"--batch: expected comma-separated integers, got {args.batch!r}")
    if min(batches) < 1 or args.keys < 1 or args.steps < 1 or args.rounds < 1:
        parser.error("--batch, --keys, --steps and --rounds must be >= 1")
    torch.set_num_threads(args.threads)
    config = dataclasses.replace(
        preset_config(args.model), context_length=args.keys + 64 * max(batches) + args.steps
    )
    model = Llama(config, random_weights(config))
    layouts = {"cpu": (model.layers, model.output), "checkpoint": _checkpoint_layout(model)}
    rows = []
    with torch.inference_mode():
        for batch in batches:
            times: dict[tuple[str, str], list[float]] = {}
            # One pool per sequence (a call each) and one pool for all, the same KV.
            alone = _sequences(model, batch, args.keys, args.steps, shared=False)
            pooled = _sequences(model, batch, args.keys, args.steps, shared=True)
            for _ in range(args.rounds):
                for layout in LAYOUTS:
                    model.layers, model.output = layouts[layout]
                    for attention in ATTENTIONS:
                        sequences = pooled if attention == "pooled" else alone
                        with _attention(attention):
                            step = _time_steps(model, sequences, args.steps)
                        times.setdefault((layout, attention), []).extend(step)
            base = statistics.median(times[("checkpoint", "gqa")])
            for (layout, attention), samples in times.items():
                median = statistics.median(samples)
                row = {"batch": batch, "keys": args.keys, "layout": layout,
                       "attention": attention, "step_ms": round(median * 1e3, 2),
                       "x_before": round(median / base, 3)}  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
    meta = {"model": args.model, "torch": torch.__version__, "threads": args.threads,
            "steps": args.steps, "rounds": args.rounds}  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"config": meta, "rows": rows}, indent=1) + "\n")
    return 0


def _checkpoint_layout(model: Llama) -> tuple[list, torch.Tensor]:
    """The model's projections with the same values in [out, in] storage."""
    names = ("qkv", "out", "gate_up", "down")
    layers = [
        dataclasses.replace(w, **{n: getattr(w, n).contiguous() for n in names})
        for w in model.layers
    ]
    return layers, model.output.contiguous()


def _sequences(
    model: Llama, batch: int, keys: int, steps: int, shared: bool
) -> list[DecodeSequence]:
    """B sequences of random KV, `keys + 64 * row` tokens each (the same values whether
    `shared` puts them in one pool or each in its own)."""
    generator = torch.Generator().manual_seed(0)
    pool = batch_decode.KVPool(model)
    sequences = []
    for row in range(batch):
        k, v = model.new_kv(keys + 64 * row)
        k.normal_(generator=generator), v.normal_(generator=generator)
        logits = torch.zeros(model.config.vocab_size)
        own = pool if shared else batch_decode.KVPool(model)
        sequences.append(batch_decode.start_sequence(own, k, v, logits, steps + 2))
    return sequences


def _time_steps(model: Llama, sequences: list[DecodeSequence], steps: int) -> list[float]:
    tokens = [7 + row for row in range(len(sequences))]
    batch_decode.decode_step(model, sequences, tokens)  # warm
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        batch_decode.decode_step(model, sequences, tokens)
        times.append(time.perf_counter() - start)
    for sequence in sequences:  # the next arm writes the same slots again
        sequence.position -= steps + 1
    return times


@contextlib.contextmanager
def _attention(name: str) -> Iterator[None]:
    if name != "gqa":
        yield
        return
    grouped = batch_decode.attend_one_query
    batch_decode.attend_one_query = _sdpa_gqa
    try:
        yield
    finally:
        batch_decode.attend_one_query = grouped


def _sdpa_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q[None], k[None], v[None], enable_gqa=True)[0]


if __name__ == "__main__":
    raise SystemExit(main())
