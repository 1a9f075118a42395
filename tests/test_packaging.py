"""What a wheel of this project ships: the packages pyproject.toml lists.

The Makefile installs the project editable, which maps whole folders, so a package left out
of `[tool.setuptools] packages` works in every test and is missing from the images' wheel
(the operator image then fails at its first import)."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed_for_the_wheel():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = set()
    for name, folder in setuptools["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            if "__pycache__" not in parts:
                found.add(".".join((name, *parts)))
    assert found - listed == set(), "add these to [tool.setuptools] packages"
    assert listed - found == set(), "these listed packages have no folder"


def test_the_vllm_images_and_the_vllm_test_environment_install_the_connector_extra():
    """vLLM images install our wheel without dependencies (vLLM's pins stay): what the
    connector imports besides vLLM (pyproject's `connector` extra) is installed by name,
    in every vLLM image stage and in the environment `make test-vllm` runs."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["optional-dependencies"]["connector"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    stages = dockerfile.split("\nFROM ")[1:]
    vllm_stages = [s for s in stages if "--no-deps /tmp/holeblend-" in s]
    assert len(vllm_stages) == 3  # CUDA, Ascend A2, Ascend A3
    for stage in vllm_stages:
        assert all(f'"{pin}"' in stage for pin in wanted), stage.splitlines()[0]
    script = (ROOT / "scripts" / "install-vllm-venv.sh").read_text()
    assert all(f'"{pin}"' in script for pin in wanted)
