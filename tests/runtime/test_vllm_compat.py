"""The connector's version seams (vllm_connector/compat.py) over stand-ins of both vLLM
versions' shapes; tests/vllm runs them against the installed vLLM (0.32 and 0.23)."""

from __future__ import annotations

import pytest
import torch

from holeblend_runtime.vllm_connector import compat


class _Impl:
    """A 0.32-style backend: the cache update apart from the attention call."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def do_kv_cache_update(self, layer, key, value, cache, slots) -> None:
        self.calls.append("update")
        cache[slots] = key


class _Layer:
    def __init__(self, impl=None, inside: bool = False) -> None:
        self.impl = impl if impl is not None else _Impl()
        self.attn_backend = type("B", (), {"forward_includes_kv_cache_update": inside})()


def test_the_cache_update_is_the_backends_own_and_none_without_one():
    layer = _Layer()
    assert compat.cache_update(layer) == layer.impl.do_kv_cache_update
    assert compat.cache_update(object()) is None
    assert compat.cache_update(_Layer(impl=object())) is None  # no op, not vLLM's CPU impl


def test_a_tap_sees_each_write_after_it_lands_and_keeps_the_write():
    layer, seen = _Layer(), []
    cache = torch.zeros(8)
    compat.tap_cache_writes(layer, lambda k, v, s: seen.append((cache.clone(), k, s)))
    key, slots = torch.tensor([1.0, 2.0]), torch.tensor([3, 5])
    layer.impl.do_kv_cache_update(layer, key, key, cache, slots)
    assert layer.impl.calls == ["update"]
    ((after, k, s),) = seen
    assert after[3] == 1.0 and after[5] == 2.0  # the backend wrote before the tap ran
    assert torch.equal(k, key) and torch.equal(s, slots)


def test_a_backend_writing_inside_another_attention_call_cannot_be_tapped():
    inside = _Layer(inside=True)
    assert not compat.can_tap(inside)
    assert not compat.can_tap(object())
    assert not compat.can_tap(_Layer(impl=object()))
    assert compat.can_tap(_Layer())
    with pytest.raises(ValueError, match="cannot be tapped"):
        compat.tap_cache_writes(inside, lambda *_: None)
    assert inside.impl.do_kv_cache_update.__func__ is _Impl.do_kv_cache_update  # unchanged


def test_the_isa_is_the_layers_own_where_it_has_one():
    layer = _Layer()
    layer.isa = "amx"
    assert compat.cpu_isa(layer, torch.float32, 16, 64) == "amx"


@pytest.mark.parametrize(
    "window, off",
    [
        (-1, True),
        (None, True),
        ((-1, -1), True),
        (4095, False),
        ((4095, 0), False),
        ((-1, 0), False),
    ],
)
def test_a_window_is_off_in_either_versions_form(window, off):
    assert compat.window_off(window) is off


def test_the_kernels_no_window_value_follows_its_signature():
    def kernel_032(query, sliding_window: int) -> None: ...

    def kernel_023(query, sliding_window: tuple[int, int]) -> None: ...

    assert compat.no_window(kernel_032) == -1
    assert compat.no_window(kernel_023) == (-1, -1)


class _Scheduler032:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def _preempt_request(self, request, timestamp, drop_stale_output: bool = False) -> None:
        self.calls.append((request, timestamp, drop_stale_output))


class _Scheduler023:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def _preempt_request(self, request, timestamp) -> None:
        self.calls.append((request, timestamp))


@pytest.mark.parametrize("delivery", [True, False])
def test_preemption_passes_drop_stale_output_only_where_vllm_takes_it(delivery):
    new, old = _Scheduler032(), _Scheduler023()
    new.requires_kv_delivery = old.requires_kv_delivery = delivery
    compat.preempt(new, "r", 1.0)
    compat.preempt(old, "r", 1.0)
    assert new.calls == [("r", 1.0, delivery)]
    assert old.calls == [("r", 1.0)]


def test_preemption_keeps_output_where_the_scheduler_has_no_delivery_flag():
    new = _Scheduler032()
    compat.preempt(new, "r", 2.0)
    assert new.calls == [("r", 2.0, False)]


def test_requests_holding_kv_come_from_their_own_queue_or_none():
    new, old = _Scheduler032(), _Scheduler023()
    new.kv_holding_waiting = ("a", "b")
    assert compat.waiting_holding_kv(new) == ["a", "b"]
    assert compat.waiting_holding_kv(old) == []
