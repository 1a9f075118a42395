"""holeblend-bench --quality and --musique end to end: 2 prompts, 2 selections, the real
model on tiny documents, JSON and a frontier PNG."""

import json

import pytest

from holeblend_runtime.bench.cli import main

pytestmark = pytest.mark.slow

COMMON = [
    "--questions", "2",
    "--selections", "kDeviation,random",
    "--ratios", "0.15",
    "--max-new-tokens", "3",
    "--no-progress",
]  # fmt: skip
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _musique_file(tmp_path):
    towns = ["Avenor", "Belcaster", "Corvale", "Dunmere", "Eskby", "Farrow"]
    items = [
        {
            "question": f"In which town was the founder of guild {g} born?",
            "answers": [towns[g], f"{towns[g]} town"],
            "ctxs": [
                {
                    "title": f"Guild {g} part {p}",
                    "text": f"Guild {g} keeps record {p}. Its founder was born in {towns[g]} "
                    f"and worked there for {10 + p} years before moving on.",
                }
                for p in range(5)
            ],  # fmt: skip
        }
        for g in range(3)
    ]
    path = tmp_path / "mini-musique.json"
    path.write_text(json.dumps(items))
    return path


def _run(argv):
    assert main(argv) == 0


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quality")
    out = {}
    synthetic = [*COMMON, "--quality", "--documents", "4", "--holes", "1,2",
                 "--min-doc-tokens", "30", "--max-doc-tokens", "45"]  # fmt: skip
    musique = [*COMMON, "--musique", str(_musique_file(tmp))]
    for name, argv in (("synthetic", synthetic), ("musique", musique)):
        json_path, png_path = tmp / f"{name}.json", tmp / f"{name}.png"
        _run([*argv, "--json", str(json_path), "--png", str(png_path)])
        out[name] = (json.loads(json_path.read_text()), png_path.read_bytes())
    return out


@pytest.mark.parametrize("name", ["synthetic", "musique"])
def test_one_row_per_selection_with_intervals_and_a_png(runs, name):
    document, png = runs[name]
    assert png.startswith(PNG_MAGIC)
    rows = document["results"]
    assert [(r["mode"], r["selection"], r["pass"]) for r in rows] == [
        ("full", None, 2),
        ("hole", "kDeviation", 2),
        ("hole", "random", 2),
    ]
    for row in rows:
        assert row["workload"].startswith(name) and row["seed"] == 0
        assert row["num_prompts"] == 2 and len(row["per_prompt"]["top1_vs_full"]) == 2
        for key in ("top1_vs_full", "kl_vs_full", "f1_vs_full", "f1_vs_gold"):
            low, high = row[f"{key}_ci"]
            assert low - 1e-9 <= row[key] <= high + 1e-9
        assert row["device"] == "cpu" and row["model"] == "smollm2"
        assert all(s > 0 for s in row["per_prompt"]["request_cpu_s"])
        assert row["speedup_request_cpu_vs_full"] > 0
    full, kdev, random = rows
    assert full["top1_vs_full"] == 1.0 and full["speedup_vs_full"] == 1.0
    for row in (kdev, random):
        # Cached documents were found (in a new order) and the holes were computed.
        assert row["reused_share"] > 0.3 and row["hole_share"] > 0.0
        assert row["baseline_selection"] == "kDeviation"
        assert 0.0 <= row["top1_vs_full"] <= 1.0 and row["kl_vs_full"] >= 0.0
    assert kdev["top1_vs_full_diff"] == 0.0
    assert kdev["reused_share"] == random["reused_share"]
    # The check layer's deviation per prompt, and what each blend left of it: the same
    # deviation for both selections (same prompts, same cache), less left by K deviation's
    # picks than by random ones; nothing for full prefill.
    assert full["per_prompt"]["deviation_mean"] == [None, None]
    assert full["per_prompt"]["residual_deviation"] == [None, None]
    for before, kdev_left, random_left, other in zip(
        kdev["per_prompt"]["deviation_mean"],
        kdev["per_prompt"]["residual_deviation"],
        random["per_prompt"]["residual_deviation"],
        random["per_prompt"]["deviation_mean"],
        strict=True,
    ):
        assert before == pytest.approx(other, rel=1e-4)
        assert 0.0 <= kdev_left < random_left < before
    first = document["config"]["first_pass"]
    assert first["sent_to_engines"] == 1 and first["num_requests"] >= 1


def test_musique_rows_keep_the_gold_answers_and_name_the_file(runs):
    document, _ = runs["musique"]
    assert document["config"]["workload"] == "musique:mini-musique.json"
    assert document["config"]["musique_file"].endswith("mini-musique.json")
    # 2 questions (the file's third is the warm-up) of 5 passages, the middle one a hole:
    # the other 4 of each cached once in pass 1.
    assert document["config"]["first_pass"]["num_documents"] == 2 * 4


def test_a_bad_musique_file_fails_with_the_item_and_field(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([{"question": "q", "answers": [], "ctxs": []}]))
    assert main([*COMMON, "--musique", str(path)]) == 2
    assert "item 0: field 'answers'" in capsys.readouterr().err
