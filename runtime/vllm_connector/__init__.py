"""holeblend's KV connector for vLLM (hole-mode reuse), the only code that imports vLLM.

vLLM loads `HoleBlendConnector` from this module by name (`kv_connector_module_path`).
The class is imported lazily, so the pure parts of this package (accounting, planning,
settings) import and test without vLLM installed.

| module | side | holds |
|---|---|---|
| accounting.py | scheduler | load specs re-derived from `num_computed_tokens` (no vLLM) |
| planning.py | scheduler | hole-aware reuse plan of a prompt's segments (no vLLM) |
| settings.py | both | blend.json and the connector's own keys (no vLLM) |
| metadata.py | both | what the scheduler sends the worker each step (no vLLM) |
| store.py | both | the KV tiers; one entry per rank under tensor parallelism (no vLLM) |
| compat.py | both | what differs between the supported vLLM versions (0.32, 0.23) |
| model_adapter.py | worker | the blender's model interface over vLLM's modules |
| worker.py | worker | load + blend into the paged cache, store missing segments |
| plugin.py | worker | the `vllm.general_plugins` entry point that hands over the model |
| connector.py | both | `HoleBlendConnector`, the thin facade vLLM calls |
"""

from typing import Any

__all__ = ["HoleBlendConnector"]


def __getattr__(name: str) -> Any:
    if name == "HoleBlendConnector":
        try:
            from holeblend_runtime.vllm_connector.connector import HoleBlendConnector
        except ModuleNotFoundError as error:
            if error.name != "vllm" and not (error.name or "").startswith("vllm."):
                raise
            raise ModuleNotFoundError(
                "HoleBlendConnector needs vLLM: install holeblend with the vllm extra "
                "(pip install 'holeblend[vllm]'), or a supported vLLM (0.32 or 0.23)",
                name=error.name,
            ) from error
        return HoleBlendConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
