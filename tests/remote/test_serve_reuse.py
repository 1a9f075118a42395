"""Two `holeblend-serve` processes share one lookup server and one redis-server.

Process A answers RAG requests that together contain every document (it computes and stores
each one: its local tier, the shared tier, then the lookup server). Process B, started with
an empty local tier, answers requests over the same documents in other orders and subsets:
nearly every prompt token is reused from what A computed, and at recompute ratio 1.0 B's
answers are A's answers to the same prompts, which were full prefills (nothing was cached).
"""

import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from holeblend_runtime.blend.config import BlendConfig
from holeblend_runtime.blend.keys import keyed_model_id
from holeblend_runtime.lookup_server.client import LookupClient
from holeblend_runtime.lookup_server.processes import free_port
from holeblend_runtime.model.gguf import find_smollm2_gguf
from holeblend_runtime.quality.inline_proxy import MIN_PAIRS
from holeblend_runtime.quality.shared_calibration import calibration_scope

# Six documents of about 80 tokens; A's two requests contain every one of them.
PEOPLE = [
    ("Alice Moreau", "Lyon", "chemistry", "Grenoble", "battery cells"),
    ("Bob Lindqvist", "Oslo", "naval design", "Bergen", "sailing boats"),
    ("Carol Zhang", "Chengdu", "physics", "Shanghai", "solar panels"),
    ("Dmitri Volkov", "Kazan", "mathematics", "Moscow", "railway timetables"),
    ("Elena Rossi", "Turin", "architecture", "Milan", "concert halls"),
    ("Farid Haddad", "Beirut", "medicine", "Paris", "heart valves"),
]
DOCUMENTS = [
    f" {name} was born in {city} and studied {subject} at the university of {school}."
    f" After graduating, {name.split()[0]} spent ten years designing {product} for a"
    f" small company, wrote two books about the work, and now teaches evening classes"
    f" about {product} to apprentices who come from all over the region. On weekends"
    f" {name.split()[0]} walks in the hills above {city} with an old dog called Pepper."
    for name, city, subject, school, product in PEOPLE
]
QUESTION = " Who designs sailing boats?"
COMPUTE_SETS = [[0, 1, 2], [3, 4, 5]]
SERVE = str(Path(sys.executable).parent / "holeblend-serve")
REUSE_SETS = [[0, 1, 2], [3, 4, 5], [5, 3, 1, 0], [2, 4, 0, 1, 3, 5], [1, 2, 4]]


class ServeProcess:
    def __init__(self, config: Path) -> None:
        self.port = free_port()
        command = [SERVE, "--config", str(config), "--host", "127.0.0.1", "--port", str(self.port)]
        self.process = subprocess.Popen(
            [*command, "--torch-threads", "1", "--log-level", "WARNING"]
        )

    def wait_ready(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, "holeblend-serve exited"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/ready", timeout=1):
                    return
            except OSError:
                time.sleep(0.2)
        raise AssertionError("holeblend-serve not ready")

    def complete(self, documents: list[str]) -> dict:
        body = {
            "model": "smollm2",
            "prompt": QUESTION,
            "documents": documents,
            "max_tokens": 8,
        }
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=300) as reply:
            return json.load(reply)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics") as reply:
            return reply.read().decode()

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(60)


def blend_json(path: Path, lookup_url: str, redis_url: str) -> Path:
    settings = {
        "formatVersion": 1,
        "model": {"name": "smollm2"},
        "recomputeRatio": 1.0,
        "kv": {"localCpuBytes": 1 << 30, "sharedUrl": redis_url},
        "lookupServerUrl": lookup_url,
    }
    path.write_text(json.dumps(settings))
    return path


def publish_pairs(lookup_url: str) -> None:
    """`MIN_PAIRS` calibration pairs at ratio 1.0 under the scope of these pods (SmolLM2,
    float32, one rank, the default selection) from a pod that is neither A nor B."""
    gguf = find_smollm2_gguf()
    # The pods' model id: blend.json's model.name with the GGUF's name and size.
    model_id = keyed_model_id("smollm2", f"{gguf.stem}:{gguf.stat().st_size}")
    scope = calibration_scope(model_id, "float32", 1, BlendConfig())
    pairs = [[1.0, 0.01 * i, 1.0 - 0.01 * i, 1.0] for i in range(MIN_PAIRS)]
    reply = LookupClient(lookup_url).call(
        {"op": "pairs_add", "scope": scope, "pod": "earlier-pod", "pairs": pairs}
    )
    assert reply == {"v": 1, "ok": True, "added": MIN_PAIRS}


def metric_value(text: str, series: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return None


def wait_for_metric(server: ServeProcess, series: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not metric_value(server.metrics(), series):
        assert time.monotonic() < deadline, f"{series} never appeared"
        time.sleep(0.1)


def index_entries(lookup_url: str) -> int:
    with urllib.request.urlopen(f"{lookup_url}/stats") as reply:
        return json.load(reply)["entries"]


@pytest.mark.slow
def test_process_b_reuses_what_process_a_computed(lookup_server, redis_server, tmp_path):
    config = blend_json(tmp_path / "blend.json", lookup_server.url, redis_server.url)
    a, b = ServeProcess(config), ServeProcess(config)
    try:
        a.wait_ready()
        answers_a = [a.complete([DOCUMENTS[i] for i in docs]) for docs in COMPUTE_SETS]
        assert answers_a[0]["usage"]["holeblend"]["lookup_mode"] == "full-miss"
        deadline = time.monotonic() + 30
        while index_entries(lookup_server.url) < len(DOCUMENTS) + 1:  # documents + system
            assert time.monotonic() < deadline, "A's segments never reached the lookup server"
            time.sleep(0.1)
        # The deployment's calibration pairs (as A's shadows would have scored them at the
        # ratio in force): B, which scores none before its first requests, starts with them.
        publish_pairs(lookup_server.url)
        b.wait_ready()
        wait_for_metric(b, 'holeblend_inline_proxy_shared_pairs_total{direction="received"}')
        answers_b = [b.complete([DOCUMENTS[i] for i in docs]) for docs in REUSE_SETS]
        metrics = b.metrics()
        # Both remote services gone: B still answers, from its local tier.
        lookup_server.kill()
        redis_server.stop()
        alone = b.complete([DOCUMENTS[i] for i in REUSE_SETS[2]])
    finally:
        a.stop()
        b.stop()
    shares = [
        a["usage"]["prompt_tokens_details"]["cached_tokens"] / a["usage"]["prompt_tokens"]
        for a in answers_b
    ]
    print("reused shares of B's requests:", [round(share, 3) for share in shares])
    for answer in answers_b:
        usage = answer["usage"]
        assert usage["holeblend"]["hole_tokens"] == 0
        assert usage["prompt_tokens_details"]["cached_tokens"] / usage["prompt_tokens"] > 0.9
    shared_hits = re.search(r'holeblend_kv_tier_hits_total\{tier="shared"\} (\S+)', metrics)
    assert float(shared_hits.group(1)) >= len(DOCUMENTS)  # each loaded once, then local
    assert (
        alone["usage"]["prompt_tokens_details"]["cached_tokens"]
        == (answers_b[2]["usage"]["prompt_tokens_details"]["cached_tokens"])
    )
    # Every blended request of B got an inline estimate from the shared calibration.
    received = metric_value(
        metrics, 'holeblend_inline_proxy_shared_pairs_total{direction="received"}'
    )
    assert received == MIN_PAIRS
    assert metric_value(metrics, 'holeblend_inline_f1_proxy_count{ratio="1.0"}') == len(REUSE_SETS)
    # Ratio 1.0 recomputes every reused token: B's answers are A's full-prefill answers.
    for answer_a, answer_b in zip(answers_a, answers_b, strict=False):
        assert answer_b["choices"][0]["text"] == answer_a["choices"][0]["text"]
