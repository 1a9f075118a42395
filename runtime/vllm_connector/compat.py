"""What differs between the vLLM versions the connector supports (0.23 and 0.32), in one place.

| what | vLLM 0.32 | vLLM 0.23 |
|---|---|---|
| cache update | every backend has `impl.do_kv_cache_update` | the CPU backend writes the cache inside `impl.forward` |
| CPU kernel ISA | on the attention layer (`layer.isa`) | on the step's metadata only; derived here as vLLM does |
| CPU kernel window | `sliding_window: int`, -1 off | `sliding_window: tuple[int, int]`, (-1, -1) off |
| `Scheduler._preempt_request` | takes `drop_stale_output=`, set from `requires_kv_delivery` | `(request, timestamp)` only |
| requests waiting with KV blocks (remote loads) | their own queue, `kv_holding_waiting` | in `waiting` |
| limits on running requests | the model runner's `max_num_running_reqs`, admission's `max_num_active_reqs` | `max_num_running_reqs` |
| `vllm serve`'s argument parser | `vllm.entrypoints.launchers.cli_args` | `vllm.entrypoints.openai.cli_args` |
| a step that runs no forward | calls `wait_for_save` | does not; the connector runs the step's stores at `get_finished`, before vLLM takes the step's stats |
| the revision a config kept in another repo (`hf_config_path`) is read at | its own, `ModelConfig._hf_config_revision` | the model's `revision` |

Every function takes what it inspects as an argument and imports vLLM only when it needs one
of vLLM's own ops, so the worker stays testable without vLLM (the fakes in the tests have a
`do_kv_cache_update`, as 0.32's backends do).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

# `update(module, key, value, cache, slots)`: writes K/V rows `[tokens, kv_heads, head_dim]`
# (K already rotated) at `slots` of one layer's paged cache.
CacheUpdate = Callable[[Any, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
# `on_write(key, value, slots)`: what one layer's forward wrote, rows in the order of `slots`.
OnWrite = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


def writes_inside_forward(module: Any) -> bool:
    """Whether the layer's backend writes the cache inside its attention call."""
    backend = getattr(module, "attn_backend", None)
    return bool(getattr(backend, "forward_includes_kv_cache_update", False))


def cache_update(module: Any) -> CacheUpdate | None:
    """The layer's own cache-update op: the backend's `do_kv_cache_update`, or for vLLM
    0.23's CPU backend (which has none) the same op it runs inside its forward; None when
    the backend offers neither (the caller writes the NHD layout itself)."""
    impl = getattr(module, "impl", None)
    update = getattr(impl, "do_kv_cache_update", None)
    if update is not None:
        return update
    if _is_cpu_impl(impl):
        return _cpu_cache_update
    return None


def can_tap(module: Any) -> bool:
    """Whether `tap_cache_writes` can see what the layer's forward writes: a separate
    `do_kv_cache_update`, or vLLM 0.23's CPU backend (whose forward writes the step's
    `slot_mapping` rows); not a backend that writes inside any other attention call."""
    impl = getattr(module, "impl", None)
    if impl is None:
        return False
    if writes_inside_forward(module):
        return _is_cpu_impl(impl)
    return hasattr(impl, "do_kv_cache_update")


def tap_cache_writes(module: Any, on_write: OnWrite) -> None:
    """Calls `on_write` with every K/V the layer's forward writes to its cache, after the
    write; the layer must pass `can_tap`."""
    if not can_tap(module):
        raise ValueError(f"{type(module).__name__}: its cache writes cannot be tapped")
    impl = module.impl
    if not writes_inside_forward(module):
        update = impl.do_kv_cache_update

        def do_kv_cache_update(layer: Any, key: Any, value: Any, cache: Any, slots: Any) -> None:
            update(layer, key, value, cache, slots)
            on_write(key, value, slots)

        impl.do_kv_cache_update = do_kv_cache_update
        return
    forward = impl.forward

    def forward_and_tap(layer: Any, query: Any, key: Any, value: Any, *args: Any, **kw: Any):
        out = forward(layer, query, key, value, *args, **kw)
        metadata = args[1] if len(args) > 1 else kw.get("attn_metadata")
        slots = getattr(metadata, "slot_mapping", None)
        written = key is not None and value is not None and slots is not None
        if written and getattr(impl, "kv_sharing_target_layer_name", None) is None:
            on_write(key[: len(slots)], value[: len(slots)], slots)
        return out

    impl.forward = forward_and_tap


def cpu_isa(module: Any, dtype: torch.dtype, block_size: int, head_dim: int) -> str | None:
    """The ISA vLLM's CPU kernels run with for this layer: the layer's own (0.32), else
    derived as 0.23's metadata builder derives it; None where vLLM cannot say."""
    isa = getattr(module, "isa", None)
    if isa is not None:
        return isa
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:
        return None
    kv_cache_dtype = getattr(getattr(module, "impl", None), "kv_cache_dtype", "auto")
    return _isa(_get_attn_isa, dtype, block_size, head_dim, kv_cache_dtype)


def window_off(value: Any) -> bool:
    """Whether a CPU impl's `sliding_window` (int, tuple or None) means no window."""
    if value is None:
        return True
    if isinstance(value, tuple):
        return all(v == -1 for v in value)
    return value == -1


def no_window(kernel: Callable[..., Any]) -> Any:
    """The "no sliding window" value of `kernel`'s `sliding_window` argument."""
    annotation = inspect.signature(kernel).parameters["sliding_window"].annotation
    return (-1, -1) if "tuple" in str(annotation).lower() else -1


def preempt(scheduler: Any, request: Any, timestamp: float) -> None:
    """`scheduler._preempt_request` as vLLM's own preemption calls it: where it takes
    `drop_stale_output`, that is set when a connector has a KV hand-off pending
    (`requires_kv_delivery`), which drops the request's in-flight output."""
    method = scheduler._preempt_request
    if _takes(type(scheduler)._preempt_request, "drop_stale_output"):
        drop = bool(getattr(scheduler, "requires_kv_delivery", False))
        method(request, timestamp, drop_stale_output=drop)
    else:
        method(request, timestamp)


def waiting_holding_kv(scheduler: Any) -> list[Any]:
    """The requests that wait holding KV blocks in a queue of their own (vLLM 0.32's
    `kv_holding_waiting`); empty where vLLM keeps them in `waiting` (0.23)."""
    return list(getattr(scheduler, "kv_holding_waiting", ()))


def waiting_queues(scheduler: Any) -> list[Any]:
    """The scheduler's queues of waiting requests: `waiting` and, in vLLM 0.32, the queue
    of those holding KV blocks (`kv_holding_waiting`)."""
    holding = getattr(scheduler, "kv_holding_waiting", None)
    return [scheduler.waiting] if holding is None else [scheduler.waiting, holding]


def seat_limits(scheduler: Any) -> tuple[str, ...]:
    """The scheduler's attributes that limit its running requests: the model runner's
    seats (`max_num_running_reqs`) and, in vLLM 0.32, the admission cap under them
    (`max_num_active_reqs`)."""
    names = ("max_num_running_reqs", "max_num_active_reqs")
    return tuple(name for name in names if hasattr(scheduler, name))


def serve_arg_parser() -> Any:
    """`vllm serve`'s own argument parser, from wherever the installed vLLM defines it."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ImportError:  # vLLM 0.23
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    return make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))


def hf_config_revision(model_config: Any) -> str | None:
    """The revision vLLM read the model's config at (the checkpoint's config is read again
    there, without overrides, to tell the RoPE they set)."""
    return getattr(model_config, "_hf_config_revision", None) or model_config.revision


@functools.cache
def _takes(function: Callable[..., Any], name: str) -> bool:
    return name in inspect.signature(function).parameters


def _is_cpu_impl(impl: Any) -> bool:
    if impl is None:
        return False
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    except ImportError:
        return False
    return isinstance(impl, CPUAttentionBackendImpl)


@functools.cache
def _isa(derive: Callable[..., str], dtype: torch.dtype, block: int, head: int, kv: str) -> str:
    return derive(dtype, block, head, kv)


def _cpu_cache_update(
    module: Any, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """vLLM 0.23's CPU cache write, as its forward runs it: the cache is
    `[blocks, kv_heads, block_size, 2 * head_dim]`, K then V along the block's rows."""
    from vllm import _custom_ops as ops

    blocks, heads, block_size, _ = cache.shape
    key_cache, value_cache = cache.view(blocks, heads, 2 * block_size, -1).chunk(2, dim=2)
    isa = cpu_isa(module, key.dtype, block_size, key.shape[-1])
    ops.cpu_attn_reshape_and_cache(
        key, value, key_cache, value_cache, slots, isa,
        k_scale=getattr(module, "_k_scale_float", 1.0),
        v_scale=getattr(module, "_v_scale_float", 1.0),
        kv_cache_dtype=module.impl.kv_cache_dtype,
    )  # fmt: skip
