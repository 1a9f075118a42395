"""The `vllm.general_plugins` entry point: hands the loaded model to the KV connector.

vLLM runs `register()` in every process it starts (possibly more than once). It wraps
`load_model` of the model runners (the GPU runner, the CPU runner, which overrides it,
and the newer runner where present) so that, after vLLM has loaded the weights, the
model is recorded for the worker-side connector of this process. vLLM's files are not
changed; the wrapper calls the original and only reads `runner.model`.
"""

from __future__ import annotations

import functools
import importlib
import logging
from typing import Any

log = logging.getLogger(__name__)

# (module, class) of the model runners whose load_model is wrapped.
MODEL_RUNNERS = (
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
    ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner"),
)
_WRAPPED = "_holeblend_wrapped"

# One model per worker process: vLLM gives each worker its own process and runner.
_loaded: dict[str, Any] = {}


def register() -> None:
    found, reasons = False, []
    for module_name, class_name in MODEL_RUNNERS:
        try:
            runner_class = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError) as error:
            # Not in this vLLM build (e.g. no CPU runner in a CUDA image), or a runner that
            # fails to import (a missing library): said below if no runner is left.
            reasons.append(f"{module_name}.{class_name}: {error}")
            continue
        _wrap_load_model(runner_class)
        found = True
    if not found:
        # Else the connector's worker would only say, at its first load, that the model
        # was not handed over, as if holeblend were not installed.
        log.warning(
            "holeblend: none of the model runners the plugin wraps imports in this vLLM "
            "(%s); it cannot hand the model to the KV connector: use a vLLM version "
            "holeblend supports, installed with its dependencies",
            "; ".join(reasons),
        )


def _wrap_load_model(runner_class: type) -> None:
    original = runner_class.__dict__.get("load_model")
    if original is None or getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        _loaded["model"] = self.model
        _loaded["vllm_config"] = self.vllm_config
        return result

    setattr(load_model, _WRAPPED, True)
    runner_class.load_model = load_model


def loaded_model() -> Any | None:
    """The model this process's runner loaded, or None before loading (or when the plugin
    did not run: holeblend not installed in vLLM's environment, or left out of
    `VLLM_PLUGINS`; the connector then stops the engine at start-up saying which)."""
    return _loaded.get("model")
