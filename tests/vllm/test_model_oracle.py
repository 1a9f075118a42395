"""The reference model and tokenizer against transformers, which reads the same GGUF file
its own way (dequantization, q/k permutation, RoPE, grouped-query attention, BPE): an
independent oracle. transformers (and accelerate, which its GGUF loading needs) are not
dependencies of holeblend; vLLM brings transformers, so the oracle runs in the vLLM
environment (`make test-vllm`)."""

import pytest
import torch
import transformers

from holeblend_runtime.engine import BlendEngine
from holeblend_runtime.model.gguf import find_smollm2_gguf

PROMPT = (
    "<|im_start|>system\nAnswer from the documents in a few words.<|im_end|>\n"
    "<|im_start|>user\nThe Brakenvas Observatory was founded in 1874 by Talia Mirvok in "
    "Oskpel. Who founded the Brakenvas Observatory?<|im_end|>\n<|im_start|>assistant\n"
)
TEXTS = [
    PROMPT,
    "Prices rose 12.5% in 2024: 1234567 units.",
    "Zürich, Ελλάδα, 日本語 — naïve café 🚀",
    "  two  spaces\n\n\ttab",
    "def f(x):\n    return x**2  # square\n",
]


@pytest.fixture(scope="module")
def ours() -> BlendEngine:
    return BlendEngine.load(num_threads=2)


@pytest.fixture(scope="module")
def theirs():
    path = find_smollm2_gguf()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model.eval(), tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_the_tokenizer_gives_transformers_ids(ours, theirs, text):
    assert ours.tokenizer.encode(text) == theirs[1](text, add_special_tokens=False)["input_ids"]


def test_every_positions_logits_match_transformers(ours, theirs):
    ids = ours.tokenizer.encode(PROMPT)
    with torch.inference_mode():
        expected = theirs[0](torch.tensor([ids])).logits[0]
        k, v = ours.model.new_kv(len(ids))
        actual = ours.model.logits(ours.model.forward(torch.tensor(ids), k, v, start=0))
    assert len(ids) > 50
    torch.testing.assert_close(actual, expected, atol=2e-4, rtol=1e-4)


def test_a_continuation_on_the_kv_cache_matches_one_forward_in_transformers(ours, theirs):
    ids = ours.tokenizer.encode(PROMPT)
    split = len(ids) // 2
    with torch.inference_mode():
        expected = theirs[0](torch.tensor([ids])).logits[0, split:]
        k, v = ours.model.new_kv(len(ids))
        ours.model.forward(torch.tensor(ids[:split]), k, v, start=0)
        h = ours.model.forward(torch.tensor(ids[split:]), k, v, start=split)
        actual = ours.model.logits(h)
    torch.testing.assert_close(actual, expected, atol=2e-4, rtol=1e-4)
