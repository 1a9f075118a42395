"""The end of `make demo`: holeblend-serve on the CPU example's blend.json, three RAG
requests, the usage each reports and a few of the server's metrics.

1. Render examples/cpu.yaml's ConfigMap with the operator and write its blend.json.
2. Start `holeblend-serve --config <that file>` and wait for /ready.
3. Send three /v1/completions requests with the `documents` extension: all documents new
   (full miss), then the same documents with a new one in the middle (a hole), then the
   first request again (pure hit). Print each reply's usage.
4. Print a few series from /metrics, then stop the server with SIGTERM.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import yaml

from holeblend_contract.blend_settings import CONFIG_KEY
from holeblend_devtools.demo import exit_on_signals
from holeblend_devtools.serve_process import ServeProcess, get, post_json
from holeblend_operator.api import BlendDeployment
from holeblend_operator.render import runtime_configmap

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "cpu.yaml"
SYSTEM = "You answer questions from the documents."
DOCS = [
    "The Aral Sea in Central Asia was once the fourth largest lake in the world. Rivers "
    "that fed it were diverted for cotton farming, and it shrank to a tenth of its size.",
    "Lichens are partnerships between a fungus and algae or bacteria. They grow slowly on "
    "bare rock and tree bark, and some survive in deserts and on Antarctic cliffs.",
    "The abacus is a counting frame with beads that slide on rods. Merchants in China, "
    "Rome and Mesopotamia used versions of it for arithmetic for many centuries.",
]
HOLE_DOC = (
    "Basalt is a dark volcanic rock that forms when lava rich in iron and magnesium cools "
    "quickly at the surface; most of the ocean floor is made of it."
)
QUESTION = "Why did the Aral Sea shrink?"
METRICS = (
    "holeblend_requests_total", "holeblend_prompt_tokens_total", "holeblend_reused_tokens_total",
    "holeblend_hole_tokens_total", "holeblend_recomputed_tokens_total",
    "holeblend_recompute_ratio", "holeblend_kv_store_entries", "holeblend_kv_store_bytes",
    "holeblend_ttft_seconds_sum", "holeblend_ttft_seconds_count",
)  # fmt: skip


def write_config(folder: Path) -> Path:
    bd = BlendDeployment.model_validate(yaml.safe_load(EXAMPLE.read_text()))
    path = folder / CONFIG_KEY
    path.write_text(runtime_configmap(bd)["data"][CONFIG_KEY])
    return path


def ask(server: ServeProcess, label: str, documents: list[str]) -> None:
    body = {
        "model": "smollm2", "system": SYSTEM, "documents": documents, "prompt": QUESTION,
        "max_tokens": 24,
    }  # fmt: skip
    status, reply, _ = post_json(server.url + "/v1/completions", body)
    if status != 200:
        raise RuntimeError(f"{label}: HTTP {status}: {reply}")
    usage = reply["usage"]
    print(f"\n== {label}")
    print(f"answer: {reply['choices'][0]['text'].strip()!r}")
    print(
        f"usage.prompt_tokens_details.cached_tokens: {usage['prompt_tokens_details']['cached_tokens']}"
    )
    print(f"usage.holeblend: {json.dumps(usage['holeblend'])}")


def print_metrics(server: ServeProcess) -> None:
    print("\n== /metrics (a few series)")
    for line in get(server.url + "/metrics")[1].splitlines():
        if line.startswith(METRICS):
            print(line)


def main() -> int:
    exit_on_signals()  # a kill of this process stops the server too
    with tempfile.TemporaryDirectory(prefix="holeblend-serve-demo-") as folder:
        config = write_config(Path(folder))
        print(f"== holeblend-serve --config {config} (rendered from {EXAMPLE.name})")
        print(config.read_text())
        server = ServeProcess(config, Path(folder) / "serve.log")
        try:
            server.wait_ready()
            ask(server, "1. all documents new (full miss)", DOCS)
            ask(server, "2. a new document in the middle (hole)", [DOCS[0], HOLE_DOC, *DOCS[1:]])
            ask(server, "3. the first request again (pure hit)", DOCS)
            print_metrics(server)
        finally:
            status = server.stop()
        print(f"\nholeblend-serve stopped on SIGTERM, exit status {status}")
        return status


if __name__ == "__main__":
    sys.exit(main())
