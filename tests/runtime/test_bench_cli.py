"""Command-line options of holeblend-bench (no model involved)."""

import sys

import pytest
import torch

from holeblend_runtime.bench.cli import QUICK, bench_config, blend_config, parse_args


def test_quick_preset_applies_unless_overridden():
    config = bench_config(parse_args(["--quick", "--documents", "5"]))
    assert config.workload.num_documents == 5
    assert config.workload.num_questions == QUICK["questions"]
    assert config.ratios == (0.15, 1.0)
    assert config.max_new_tokens == QUICK["max_new_tokens"]


def test_defaults_sweep_ratios_on_ten_documents_with_a_middle_hole():
    config = bench_config(parse_args([]))
    assert config.ratios == (0.05, 0.15, 0.3, 0.5, 1.0)
    assert config.workload.num_documents == 10
    assert (config.workload.min_document_tokens, config.workload.max_document_tokens) == (124, 181)
    assert config.workload.holes == "middle"
    assert config.modes == ("prefix", "hole")


def test_holes_seed_and_modes_pass_through():
    args = parse_args(["--holes", "2,5", "--seed", "7", "--modes", "hole", "--inflate", "3"])
    config = bench_config(args)
    assert config.workload.holes == "2,5"
    assert config.workload.seed == 7 and config.workload.num_inflate == 3
    assert config.modes == ("hole",)


@pytest.mark.parametrize(("name", "expected"), [("kdev", "kDeviation"), ("random", "random")])
def test_selection_names_map_to_the_blend_config(name, expected):
    blend = blend_config(parse_args(["--selection", name, "--check-layer", "3"]))
    assert blend.selection == expected and blend.check_layer == 3


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--ratios", "0.1,x"], "ratios"),
        (["--ratios", "1.5"], "ratios"),
        (["--modes", "full"], "modes"),
        (["--modes", ","], "modes"),
        (["--holes", "42"], "holes"),
        (["--max-new-tokens", "0"], "max_new_tokens"),
    ],
)
def test_bad_options_raise_naming_the_field(argv, field):
    with pytest.raises(ValueError, match=field):
        bench_config(parse_args(argv))


def test_store_policies_and_shuffle_pass_through():
    args = parse_args(["--store-policies", "in-context,isolated", "--shuffle-first-pass"])
    config = bench_config(args)
    assert config.store_policies == ("in-context", "isolated")
    assert config.workload.shuffle_first_pass


def test_unknown_store_policy_is_refused():
    with pytest.raises(ValueError, match="store_policies"):
        bench_config(parse_args(["--store-policies", "later"]))


def test_prompt_tokens_adds_distractor_documents_to_reach_the_length():
    short = bench_config(parse_args(["--prompt-tokens", "1000"])).workload
    long = bench_config(parse_args(["--prompt-tokens", "8192"])).workload
    assert short.num_documents == long.num_documents == 10
    assert short.num_inflate == 0
    # About 8,100 document tokens at ~156 tokens per document and separator.
    assert 40 <= long.num_documents_per_prompt <= 60
    with pytest.raises(ValueError, match="prompt_tokens"):
        bench_config(parse_args(["--prompt-tokens", "0"]))


def test_unknown_model_presets_and_dtypes_are_refused(capsys):
    for argv in (["--model", "llama-9b"], ["--dtype", "int8"]):
        with pytest.raises(SystemExit):
            parse_args(argv)
    assert "invalid choice" in capsys.readouterr().err


def test_a_profile_trace_needs_the_profile(capsys, tmp_path):
    with pytest.raises(SystemExit):
        parse_args(["--profile-trace", str(tmp_path)])
    assert (
        "--profile-trace: traces the --profile prefills; add --profile" in capsys.readouterr().err
    )
    assert parse_args(["--profile", "--profile-trace", str(tmp_path)]).profile_trace == tmp_path


def test_busy_share_writes_no_trace_without_a_gpu(tmp_path, monkeypatch):
    """On a machine without CUDA the busy share is None and nothing is profiled."""
    from holeblend_runtime.bench import device_timing

    monkeypatch.setattr(device_timing.torch.cuda, "is_available", lambda: False)
    calls = []
    share = device_timing.busy_share(lambda: calls.append(1), trace=tmp_path / "hole.json")
    assert share["busy_share"] is None and calls == [] and not (tmp_path / "hole.json").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--threads", "0"], "--threads: must be >= 1, got 0"),
        (["--threads", "-3"], "--threads: must be >= 1, got -3"),
        (["--device", "bogus"], "--device: 'bogus' is not a torch device"),
        (["--device", "cuda:x"], "--device: 'cuda:x' is not a torch device"),
    ],
)
def test_bad_threads_and_devices_exit_2_before_anything_loads(argv, message, capsys):
    with pytest.raises(SystemExit) as caught:
        parse_args(["--quick", *argv])
    assert caught.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("device", ["cuda", "npu"])
def test_an_accelerator_that_is_not_here_exits_2(device, monkeypatch, capsys):
    backend = getattr(torch, device, None)
    if backend is not None:
        monkeypatch.setattr(backend, "is_available", lambda: False)
    with pytest.raises(SystemExit) as caught:
        parse_args(["--device", device])
    assert caught.value.code == 2
    # Without torch_npu, torch does not even parse "npu"; either way the flag is named.
    assert f"--device: '{device}'" in capsys.readouterr().err


def test_a_cuda_index_past_the_last_gpu_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit) as caught:
        parse_args(["--device", "cuda:1"])
    assert caught.value.code == 2
    assert "this machine has 1 cuda device(s)" in capsys.readouterr().err
    assert parse_args(["--device", "cuda:0"]).device == "cuda:0"


def test_png_without_matplotlib_exits_2_before_the_sweep(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises
    with pytest.raises(SystemExit) as caught:
        parse_args(["--quality", "--png", str(tmp_path / "frontier.png")])
    assert caught.value.code == 2
    assert "--png: the frontier plot needs matplotlib" in capsys.readouterr().err


def test_a_negative_seed_exits_2_before_anything_loads(capsys):
    """Python seeds `random.Random(-7)` as `random.Random(7)`: a negative seed would rerun
    seed 7's workload under another name (no held-out run), and the quality sweep's
    bootstrap refuses it only after the whole sweep has run."""
    with pytest.raises(SystemExit) as caught:
        parse_args(["--quick", "--seed", "-7"])
    assert caught.value.code == 2
    assert "--seed: must be >= 0, got -7" in capsys.readouterr().err
    assert parse_args(["--seed", "0"]).seed == 0


@pytest.mark.parametrize(
    "argv",
    [
        ["--device", "meta"],
        ["--model", "llama-3-8b"],
        ["--modes", "hole"],
        ["--ratios", "0.3"],
        ["--selection", "random"],
        ["--check-layer", "3"],
        ["--profile"],
    ],
)
def test_the_load_benchmark_refuses_flags_its_servers_never_read(argv, capsys):
    """holeblend-serve runs SmolLM2 on its own settings: a run asked for another device,
    model, mode or ratio would report the servers' figures under the flags' names."""
    with pytest.raises(SystemExit) as caught:
        parse_args(["--load", *argv])
    assert caught.value.code == 2
    error = capsys.readouterr().err
    assert f"{argv[0]}: not read by the load benchmark" in error
    assert "drop it, or run without --load" in error


@pytest.mark.parametrize("argv", [["--clients", "8"], ["--load-ratio", "0.3"], ["--zipf", "0"]])
def test_load_benchmark_flags_without_load_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as caught:
        parse_args(argv)
    assert caught.value.code == 2
    assert f"{argv[0]}: a flag of the load benchmark; add --load" in capsys.readouterr().err


def test_the_load_benchmark_keeps_the_flags_it_reads():
    argv = ["--load", "--quick", "--seed", "3", "--max-new-tokens", "5", "--min-doc-tokens",
            "30", "--load-modes", "full,hole", "--clients", "2", "--json", "x.json"]  # fmt: skip
    args = parse_args(argv)
    assert args.load and args.clients == 2 and args.seed == 3 and args.max_new_tokens == 5
