"""The GPU layer-cost benchmark's arguments: bad ones are named before the device is
checked, and a machine without CUDA is told why it cannot run it."""

import pytest
import torch

from holeblend_devtools import layer_host_cost


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--queries", "64,x"], "--queries: expected comma-separated integers"),
        (["--queries", "4096", "--keys", "2048"], "each of --queries within 1..--keys"),
        (["--calls", "0"], "--layers and --calls >= 1"),
    ],
)
def test_bad_arguments_are_named(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        layer_host_cost.main([*argv, "--json", str(tmp_path / "out.json")])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_says_it_needs_an_accelerator(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        layer_host_cost.main(["--json", str(tmp_path / "out.json")])
    assert exit_.value.code == 2
    assert "needs CUDA" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()
