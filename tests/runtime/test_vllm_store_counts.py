"""The connector worker's count of the segments it stores (`BlendWorker.take_stored`, which
the connector's stats carry to `holeblend_stored_segments_total`): a segment is counted as
often as it is stored. The worker runs over the reference model, with plain tensors in vLLM's
paged layout as the KV cache and a stand-in attention layer whose cache writes are tapped, as
vLLM's backends' are; nothing of vLLM is needed.
"""

import torch

from holeblend_kernels.paged import scatter_kv_nhd
from holeblend_runtime.vllm_connector.metadata import StoreRequest
from holeblend_runtime.vllm_connector.worker import BlendWorker, ForwardKVCapture, PagedKVWriter

BLOCK = 16


class _Impl:
    """A backend that writes the cache apart from attention (`do_kv_cache_update`)."""

    def do_kv_cache_update(self, layer, key, value, cache, slots):
        scatter_kv_nhd(cache, slots, key, value)


class _Backend:
    forward_includes_kv_cache_update = False


class _AttentionLayer:
    def __init__(self):
        self.impl, self.attn_backend = _Impl(), _Backend()


def test_a_segment_two_requests_of_one_step_computed_is_stored_and_counted_once(
    new_engine, rag_texts, monkeypatch
):
    """Two requests with the same missing document are prefilled in one step, each at its
    own blocks: the document is written to the tier once, from the first request's rows,
    and counted once."""
    engine = new_engine()
    prompt = engine.build_prompt(*rag_texts)
    keys = engine.segment_keys(prompt)
    last = max(i for i, key in enumerate(keys) if key is not None)
    full = engine.prefill(prompt, "full", 1.0)
    engine.store.remove(keys[last])  # full prefill stored it: start from a miss
    per_request = -(-prompt.num_tokens // BLOCK)
    c = engine.config
    caches = [
        torch.zeros(2, 2 * per_request, BLOCK, c.num_kv_heads, c.head_dim)
        for _ in range(c.num_layers)
    ]
    modules = [_AttentionLayer() for _ in caches]
    writer = PagedKVWriter(modules, caches, BLOCK)
    worker = BlendWorker(engine, writer, capture=ForwardKVCapture(modules))
    blocks_a, blocks_b = tuple(range(per_request)), tuple(range(per_request, 2 * per_request))
    requests = [
        StoreRequest("a", prompt, (last,), blocks_a),
        StoreRequest("b", prompt, (last,), blocks_b),
    ]
    worker.arm_capture(requests)
    slots = torch.cat([writer.slots(b, 0, prompt.num_tokens) for b in (blocks_a, blocks_b)])
    for layer, module in enumerate(modules):
        k = full.k[layer].transpose(0, 1).repeat(2, 1, 1)
        v = full.v[layer].transpose(0, 1).repeat(2, 1, 1)
        module.impl.do_kv_cache_update(module, k, v, caches[layer], slots)
    written = []
    real_put = engine.store.put
    monkeypatch.setattr(engine.store, "put", lambda kv: written.append(kv.key) or real_put(kv))
    assert worker.store_many(requests) == (1, 0)
    assert written == [keys[last]]
    assert worker.take_stored() == {"forward": 1}
    assert worker.take_stored() == {}
