"""The quality proxies on a vLLM pod: vLLM's OpenAI server with the connector, as the
operator renders it (blend.json, $HOLEBLEND_ENGINE_URL, $HOLEBLEND_METRICS_PORT).

A hole request that blended cached documents is scored by shadow requests the connector
sends back to the server; the scores match the reference engine's own shadow scorer on
the same prompt and answer, and the shadow requests are not counted as traffic."""

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from holeblend_devtools.hf_export import export_smollm2
from holeblend_devtools.vllm_probe import ProbeConfig, blend_settings, build_prompts
from holeblend_runtime.engine import ReferenceEngine
from holeblend_runtime.lookup_server.processes import free_port
from holeblend_runtime.shadow import ShadowRequest, ShadowScorer

MODEL = "smollm2"
ANSWER_TOKENS = 12


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("serve")
    settings = json.loads(blend_settings(0.15))
    (work / "blend.json").write_text(json.dumps(settings | {"shadowSampleRate": 1.0}))
    port, metrics_port = free_port(), free_port()
    transfer = {
        "kv_connector": "HoleBlendConnector",
        "kv_connector_module_path": "holeblend_runtime.vllm_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "holeblend_config": str(work / "blend.json"),
            "kv_dir": str(work / "kv"),
        },
    }
    command = [sys.executable, "-I", "-m", "vllm.entrypoints.openai.api_server"]
    command += ["--model", str(export_smollm2()), "--served-model-name", MODEL]
    command += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32"]
    command += ["--enforce-eager", "--no-enable-prefix-caching"]
    command += ["--disable-hybrid-kv-cache-manager", "--max-model-len", "1536"]
    command += ["--kv-cache-memory-bytes", str(80 << 20)]
    command += ["--kv-transfer-config", json.dumps(transfer)]
    env = os.environ | {
        "HOLEBLEND_ENGINE_URL": f"http://127.0.0.1:{port}",
        "HOLEBLEND_METRICS_PORT": str(metrics_port),
    }
    log = open(work / "server.log", "w")  # noqa: SIM115 - closed below
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(process, f"http://127.0.0.1:{port}/health", work / "server.log")
        yield f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics"
    finally:
        process.terminate()  # vLLM shuts down on SIGTERM
        process.wait(timeout=60)
        log.close()


def wait_healthy(process, url, log_path, timeout_s=300.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"vLLM exited {process.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(1)
    pytest.fail(f"vLLM not healthy after {timeout_s} s:\n{log_path.read_text()[-4000:]}")


def complete(url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    body["return_token_ids"] = True
    call = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(call, timeout=120) as response:
        return json.loads(response.read())


def samples(metrics_url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(metrics_url, timeout=5) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(found: dict, name: str, **labels) -> float:
    return found.get((name, tuple(sorted(labels.items()))), 0.0)


def num_scored(metrics_url: str) -> float:
    return value(samples(metrics_url), "holeblend_shadow_requests_total", outcome="scored")


def test_hole_requests_are_scored_as_the_reference_engine_scores_them(server):
    url, metrics_url = server
    pairs = build_prompts(ProbeConfig(is_connector=True, work_dir=None, num_questions=2))
    answers = []
    for first, second in pairs:
        complete(url, first, 1)  # caches the documents it has
        before = num_scored(metrics_url)
        choice = complete(url, second, ANSWER_TOKENS)["choices"][0]
        answers.append(choice["token_ids"])
        deadline = time.monotonic() + 120
        while num_scored(metrics_url) == before:
            assert time.monotonic() < deadline, "the hole request was never scored"
            time.sleep(0.5)
    found = samples(metrics_url)

    # Every hole request was offered and scored; pass 1 (a full miss) was not offered.
    assert value(found, "holeblend_shadow_requests_total", outcome="scored") == len(pairs)
    assert value(found, "holeblend_f1_proxy_count", ratio="0.15") == len(pairs)
    assert value(found, "holeblend_top1_agreement_count", ratio="0.15") == len(pairs)
    # The shadow requests went through the connector unplanned and uncounted.
    requests = sum(v for (name, _), v in found.items() if name == "holeblend_requests_total")
    assert requests == 2 * len(pairs)
    prompt_tokens = sum(len(first) + len(second) for first, second in pairs)
    assert value(found, "holeblend_prompt_tokens_total") == prompt_tokens

    # The same proxies as holeblend-serve's scorer on the same prompts and answers (our
    # model is vLLM's within 2e-4, tests/vllm/test_model_oracle.py).
    loaded = ReferenceEngine.load(num_threads=2)
    scorer = ShadowScorer(loaded.model, loaded.tokenizer, 1.0)
    splitter = loaded.prompt_builder.splitter
    eos = loaded.model.config.eos_token_id
    expected = [
        scorer.score(
            ShadowRequest(splitter.split(second), tuple(t for t in answer if t != eos), 0.15)
        )
        for (_, second), answer in zip(pairs, answers, strict=True)
    ]
    scorer.close()
    f1_sum = value(found, "holeblend_f1_proxy_sum", ratio="0.15")
    top1_sum = value(found, "holeblend_top1_agreement_sum", ratio="0.15")
    assert f1_sum == pytest.approx(sum(s.f1 for s in expected), abs=1e-6)
    assert top1_sum == pytest.approx(sum(s.top1 for s in expected), abs=1e-6)
    assert 0 < top1_sum < len(pairs) + 1e-9
