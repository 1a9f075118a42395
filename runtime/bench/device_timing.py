"""Device-side figures for the benchmark: a plain SDPA forward as the floor of full
prefill, and how busy the device is while a prefill runs.

Both wait for the device before reading a clock (a GPU runs behind the host: a clock read
right after the launches times the launches).
"""

from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from holeblend_runtime.blend.segments import SegmentedPrompt
from holeblend_runtime.model.devices import synchronize
from holeblend_runtime.model.llama import Llama

# busy_share's launch breakdown: this many kernel names, each cut to this many characters.
TOP_KERNELS, NAME_CHARS = 12, 80


def plain_forward(model: Llama, token_ids: torch.Tensor) -> torch.Tensor:
    """Next-token logits of a prompt by the textbook forward: the same weights and layer
    functions, torch's own causal SDPA, no KV cache written, no attention dispatch."""
    n = token_ids.shape[0]
    rope = model.rope(torch.arange(n, device=model.device))
    h = model.embed(token_ids)
    for layer in range(model.num_layers):
        q, k, v = model.qkv(layer, h, rope)
        attn = F.scaled_dot_product_attention(
            q[None], k[None], v[None], is_causal=True, enable_gqa=True
        )[0]
        h = model.finish_layer(layer, h, attn)
    return model.logits(h[-1:])[0]


def sdpa_reference_s(
    model: Llama,
    prompts: Sequence[SegmentedPrompt],
    warm_up: SegmentedPrompt | None = None,
    build_s: Sequence[float] | None = None,
) -> dict[str, Any]:
    """Seconds of `plain_forward` per prompt: the first call on its shape, and again;
    `build_s[i]`, the seconds building prompt i took, added to both (the bench's TTFT
    includes building the prompt: the reference it is held against must too).

    One untimed call on `warm_up` goes first, as the bench warms its engines up on a
    prompt outside the workload before it times pass 2: on a GPU the process's first
    SDPA call loads kernels, a one-time cost that the prefills this is the floor of do not
    pay either. Given a prompt outside `prompts` (the bench's warm-up prompt), each
    prompt's first call still meets a shape not seen before; without one, the first
    prompt is the warm-up."""
    build_s = [0.0] * len(prompts) if build_s is None else list(build_s)
    if len(build_s) != len(prompts):
        raise ValueError(f"build_s: {len(build_s)} values for {len(prompts)} prompts")
    first, again = [], []
    with torch.inference_mode():
        warm_ids = (prompts[0] if warm_up is None else warm_up).token_ids
        plain_forward(model, torch.tensor(warm_ids, device=model.device))
        synchronize(model.device)
        for prompt, built_s in zip(prompts, build_s, strict=True):
            token_ids = torch.tensor(prompt.token_ids, device=model.device)
            for times in (first, again):
                forward_s = _timed(model.device, lambda ids=token_ids: plain_forward(model, ids))
                times.append(built_s + forward_s)
    return {
        "num_prompts": len(prompts),
        "ttft_mean_s": statistics.fmean(first),
        "ttft_seen_mean_s": statistics.fmean(again),
        # Included in both means above (0 where the caller built nothing).
        "build_mean_s": statistics.fmean(build_s),
    }


def busy_share(
    run: Callable[[], Any], device: torch.device | None = None, trace: Path | None = None
) -> dict[str, Any]:
    """Share of a call's wall time during which the device runs a kernel: the union of
    kernel intervals of one profiled call (torch's profiler) over the median
    synchronized wall time of three unprofiled calls (the profiler's own host overhead
    would stretch the wall time of the profiled one). Called once first, untimed.
    `trace`: where to write the profiled call's trace (Chrome trace format), if anywhere.

    None on a machine without CUDA: the CPU has no separate device to keep busy."""
    if not torch.cuda.is_available():
        return {"busy_share": None, "wall_s": None, "kernel_s": None, "num_kernels": 0,
                "kernels_by_name": {}}  # fmt: skip
    device = device or torch.device("cuda")
    run()
    wall_s = statistics.median(_timed(device, run) for _ in range(3))
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        run()
        synchronize(device)
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(trace))
    kernels = [e for e in profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernel_s = _union_length([(e.time_range.start, e.time_range.end) for e in kernels]) / 1e6
    counts = collections.Counter(e.name[:NAME_CHARS] for e in kernels)
    return {
        "busy_share": kernel_s / wall_s,
        "wall_s": wall_s,
        "kernel_s": kernel_s,
        "num_kernels": len(kernels),
        # Where the launches go: the most frequent kernel names and their counts.
        "kernels_by_name": dict(counts.most_common(TOP_KERNELS)),
    }


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def _timed(device: torch.device, run: Callable[[], Any]) -> float:
    synchronize(device)
    started = time.perf_counter()
    run()
    synchronize(device)
    return time.perf_counter() - started
