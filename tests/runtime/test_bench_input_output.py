"""holeblend-bench's flags refused before anything runs; its JSON file strict and whole."""

import json
import math
import subprocess
import sys

import pytest

from holeblend_runtime.bench.cli import parse_args
from holeblend_runtime.bench.load_workload import LoadWorkloadConfig, generate_load_workload
from holeblend_runtime.bench.report import RequestMeasure, summarize, write_json


def _measure(**changes) -> RequestMeasure:
    values = dict(
        num_prompt_tokens=100,
        num_reused_tokens=60,
        num_hole_tokens=20,
        num_recomputed_tokens=40,
        ttft_s=1.0,
        request_s=1.5,
        f1_vs_full=1.0,
        top1_vs_full=1.0,
        kl_vs_full=0.0,
        gold_loss=2.0,
        f1_vs_gold=0.0,
    )
    return RequestMeasure(**(values | changes))


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def test_json_results_hold_null_where_a_measure_is_nan_or_infinite(tmp_path):
    """Overflowing half-precision logits give NaN KL and infinite losses; Python's json
    would write them as NaN and Infinity, which strict readers (jq, JavaScript) refuse."""
    measures = [_measure(kl_vs_full=math.nan, gold_loss=math.inf)]
    row = summarize("hole", 0.15, 2, measures, full_ttft_mean_s=2.0, full_request_mean_s=3.0)
    path = tmp_path / "bench.json"
    write_json(path, "model-x", {"interval": [0.5, -math.inf]}, [row])
    document = json.loads(path.read_text(), parse_constant=_refuse_constant)
    assert document["results"][0]["kl_vs_full"] is None
    assert document["results"][0]["gold_loss"] is None
    assert document["results"][0]["speedup_vs_full"] == pytest.approx(2.0)
    assert document["config"] == {"interval": [0.5, None]}


# Writes the document under a file-size limit smaller than it, as a full disk would stop it.
_WRITE_PAST_THE_LIMIT = """
import resource, signal, sys
from pathlib import Path
from holeblend_runtime.bench.report import write_json

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    write_json(Path(sys.argv[1]), "model-x", {}, [{"answer": "y" * 100}] * 1000)
except OSError:
    sys.exit(3)
"""


def test_a_json_write_that_fails_leaves_the_previous_file_whole(tmp_path):
    path = tmp_path / "bench.json"
    write_json(path, "model-x", {"seed": 1}, [])
    before = path.read_text()
    done = subprocess.run(
        [sys.executable, "-I", "-c", _WRITE_PAST_THE_LIMIT, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 3, done.stderr
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["bench.json"]


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-1"])
def test_a_store_size_that_is_not_a_positive_number_exits_2_before_anything_loads(value, capsys):
    """`int(inf GiB)` raised OverflowError (a traceback) once the model had loaded."""
    with pytest.raises(SystemExit) as caught:
        parse_args(["--quick", "--store-gib", value])
    assert caught.value.code == 2
    assert "--store-gib: must be a positive number of GiB" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--json", "--png"])
def test_an_output_path_that_cannot_be_written_exits_2_before_the_run(flag, tmp_path, capsys):
    """Found only when the results were written, after the whole run: all of it lost."""
    extra = ["--quality"] if flag == "--png" else []
    with pytest.raises(SystemExit) as caught:
        parse_args([*extra, flag, str(tmp_path)])
    assert caught.value.code == 2
    assert f"{flag}: {tmp_path} is a directory" in capsys.readouterr().err
    regular = tmp_path / "notes.txt"
    regular.write_text("")
    with pytest.raises(SystemExit) as caught:
        parse_args([*extra, flag, str(regular / "out" / "results")])
    assert caught.value.code == 2
    assert f"{flag}: {regular} is not a directory" in capsys.readouterr().err


def test_an_output_path_in_a_directory_still_to_make_is_accepted(tmp_path):
    args = parse_args(["--json", str(tmp_path / "new" / "bench.json")])
    assert args.json == tmp_path / "new" / "bench.json"


@pytest.mark.parametrize("zipf_s", [math.inf, math.nan, 400.0])
def test_a_zipf_exponent_without_float_weights_is_refused_naming_the_field(zipf_s):
    """inf and NaN reached random.choices ('Total of weights must be ...', no field named);
    400 over 40 documents raised OverflowError (a traceback) computing the weights."""
    with pytest.raises(ValueError, match="zipf_s: "):
        LoadWorkloadConfig(zipf_s=zipf_s, num_corpus_documents=40)


def test_a_steep_zipf_exponent_within_float_range_draws_the_top_ranks():
    config = LoadWorkloadConfig(zipf_s=150.0, num_warmup=0, num_requests=3)
    for request in generate_load_workload(config):
        assert sorted(request.document_ranks) == list(range(config.documents_per_request))
