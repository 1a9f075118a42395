"""The `vllm.general_plugins` entry point: it hands the model a runner loads to the
connector, and says so when this vLLM has none of the runners it knows. Runners here are
small classes in modules made for the test (no vLLM needed)."""

from __future__ import annotations

import importlib.util
import logging
import sys
import types

import pytest

from holeblend_runtime.vllm_connector import plugin


@pytest.fixture
def runner_module(monkeypatch):
    """A module `fake_runner` holding a `Runner` whose load_model sets `self.model`."""

    class Runner:
        vllm_config = "config"

        def load_model(self) -> str:
            self.model = "weights"
            return "loaded"

    module = types.ModuleType("fake_runner")
    module.Runner = Runner
    monkeypatch.setitem(sys.modules, "fake_runner", module)
    monkeypatch.setattr(plugin, "_loaded", {})
    return module


def test_the_model_a_runner_loads_is_handed_to_the_connector(runner_module, monkeypatch):
    monkeypatch.setattr(plugin, "MODEL_RUNNERS", (("fake_runner", "Runner"),))
    assert plugin.loaded_model() is None
    plugin.register()
    plugin.register()  # vLLM may run it more than once: wrapped once
    assert runner_module.Runner().load_model() == "loaded"
    assert plugin.loaded_model() == "weights"


def test_a_vllm_without_any_known_runner_is_named_at_registration(monkeypatch, caplog):
    monkeypatch.setattr(plugin, "MODEL_RUNNERS", (("no_such_runner_module", "Runner"),))
    with caplog.at_level(logging.WARNING, logger=plugin.__name__):
        plugin.register()
    assert "no_such_runner_module.Runner" in caplog.text
    assert "cannot hand the model" in caplog.text


def test_a_runner_that_fails_to_import_is_named_with_its_error(monkeypatch, tmp_path, caplog):
    (tmp_path / "broken_runner.py").write_text(
        'raise ImportError("libcudart.so.12: cannot open shared object file")\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "broken_runner", raising=False)
    monkeypatch.setattr(plugin, "MODEL_RUNNERS", (("broken_runner", "Runner"),))
    with caplog.at_level(logging.WARNING, logger=plugin.__name__):
        plugin.register()
    assert "broken_runner.Runner: libcudart.so.12: cannot open shared object file" in caplog.text


def test_the_connector_without_vllm_says_what_to_install():
    """vLLM loads the class by name; where vLLM is missing (an engine image built without
    the extra) the error says what to install, not a bare "No module named 'vllm'"."""
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: tests/vllm covers the connector")
    with pytest.raises(ModuleNotFoundError, match=r"holeblend\[vllm\]"):
        from holeblend_runtime.vllm_connector import HoleBlendConnector  # noqa: F401
