"""Two engine processes share one lookup server and one redis-server: B reuses what A computed.

Each process runs the real SmolLM2 reference engine with a `TieredKVStore` (local tier,
shared tier on redis, lookup server). A computes every document and exits; B, a fresh
process with an empty local tier, serves prompts over those documents in other orders.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("engine_worker.py")


def run_worker(role: str, lookup_url: str, redis_url: str, out: Path) -> dict:
    subprocess.run(
        [sys.executable, "-I", str(WORKER), role, lookup_url, redis_url, str(out)],
        check=True,
        timeout=600,
    )
    return json.loads(out.read_text())


@pytest.mark.slow
def test_a_second_process_reuses_every_document_the_first_computed(
    lookup_server, redis_server, tmp_path
):
    computed = run_worker("compute", lookup_server.url, redis_server.url, tmp_path / "a.json")
    assert computed["stored"] >= 7  # the system prompt and six documents
    reused = run_worker("reuse", lookup_server.url, redis_server.url, tmp_path / "b.json")
    requests = reused["requests"]
    assert reused["load_failures"] == 0
    for request in requests:
        assert request["hole_tokens"] == 0
        assert request["reused_tokens"] / request["cacheable_tokens"] == 1.0
        assert request["reused_tokens"] / request["prompt_tokens"] > 0.9
        # Ratio 1.0 recomputes every reused token: the answer is full prefill's.
        assert request["answer_at_ratio_1"] == request["answer_full"]
        assert request["max_logit_diff"] < 1e-3
