"""The decode-step benchmark: every arm timed per batch size against the arm it replaced,
the arms compute the same step, and the step's attention is restored afterwards."""

import dataclasses
import json

import pytest
import torch

from holeblend_devtools import decode_step
from holeblend_runtime.model import batch_decode
from holeblend_runtime.model.attention import attend_one_query
from holeblend_runtime.model.llama import Llama
from holeblend_runtime.model.presets import preset_config, random_weights


def test_rows_per_batch_and_arm_against_the_replaced_arm(tmp_path):
    out = tmp_path / "decode.json"
    argv = ["--keys", "24", "--batch", "1,3", "--steps", "2", "--rounds", "1", "--json", str(out)]
    assert decode_step.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    arms = {(r["layout"], r["attention"]) for r in rows}
    assert arms == {(layout, a) for layout in decode_step.LAYOUTS for a in decode_step.ATTENTIONS}
    assert sorted({r["batch"] for r in rows}) == [1, 3]
    assert len(rows) == 2 * len(decode_step.LAYOUTS) * len(decode_step.ATTENTIONS)
    for row in rows:
        if (row["layout"], row["attention"]) == ("checkpoint", "gqa"):
            assert row["x_before"] == 1.0
        assert row["step_ms"] > 0
    assert batch_decode.attend_one_query is attend_one_query


def test_the_replaced_attention_computes_what_the_grouped_one_does():
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(*s, generator=generator) for s in ((9, 1, 64), (3, 50, 64), (3, 50, 64)))
    torch.testing.assert_close(decode_step._sdpa_gqa(q, k, v), attend_one_query(q, k, v))


@pytest.mark.parametrize(
    "argv, message",
    [(["--batch", "1,x"], "--batch: expected"), (["--steps", "0"], "must be >= 1")],
)
def test_bad_arguments_are_named(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        decode_step.main([*argv, "--json", str(tmp_path / "out.json")])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_the_pooled_arm_shares_one_pool_and_the_others_do_not():
    config = preset_config("smollm2-135m")
    config = dataclasses.replace(config, num_layers=2, context_length=256)
    model = Llama(config, random_weights(config))
    with torch.inference_mode():
        pooled = decode_step._sequences(model, 3, 20, 2, shared=True)
        alone = decode_step._sequences(model, 3, 20, 2, shared=False)
    assert len({id(s.pool) for s in pooled}) == 1 and [s.row for s in pooled] == [0, 1, 2]
    assert len({id(s.pool) for s in alone}) == 3 and {s.row for s in alone} == {0}
    for p, a in zip(pooled, alone, strict=True):  # the same KV either way
        torch.testing.assert_close(p.k, a.k, atol=0, rtol=0)
