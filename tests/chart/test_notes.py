"""The notes `helm install` prints name an example that runs anywhere, where it is served."""

import os
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from holeblend_operator.api import BlendDeployment

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "holeblend"
HELM = ROOT / ".tools" / "bin" / "helm"


@pytest.fixture(autouse=True)
def _needs_helm():
    if not HELM.exists():
        pytest.fail("helm is missing: run `make tools` (make test does it)")


def notes(tmp_path: Path, *args: str) -> str:
    env = {**os.environ}
    for name in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
        env[name] = str(tmp_path / name.lower())
    result = subprocess.run(
        [str(HELM), "install", "hb", str(CHART), "-n", "holeblend-system"]
        + ["--dry-run=client", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.partition("NOTES:")[2]


def kubectl_commands(text: str, verb: str) -> list[list[str]]:
    lines = [line.strip() for line in text.splitlines()]
    commands = [shlex.split(line) for line in lines if line.startswith("kubectl ")]
    return [c for c in commands if c[:2] == ["kubectl", verb]]


def option(command: list[str], *names: str) -> str | None:
    for index, word in enumerate(command[:-1]):
        if word in names:
            return command[index + 1]
    return None


@pytest.mark.parametrize(
    "watch", [[], ["team-a", "team-b"]], ids=["every-namespace", "some-namespaces"]
)
def test_the_notes_apply_an_example_that_needs_no_accelerator_where_it_is_served(watch, tmp_path):
    text = notes(tmp_path, "--set-json", f"watchNamespaces={watch!r}".replace("'", '"'))
    (apply,) = kubectl_commands(text, "apply")
    # A path in this repository, or a URL of one of its files on its main branch.
    example = ROOT / option(apply, "-f", "--filename").rpartition("/raw/main/")[2]
    assert example.is_file(), f"{example} does not exist"
    manifest = yaml.safe_load(example.read_text())
    bd = BlendDeployment.model_validate(manifest)
    # The first thing a user applies must run on any cluster: no device, no volume.
    assert bd.spec.accelerator.type == "cpu"
    assert bd.spec.model.source is None or bd.spec.model.source.pvc is None
    namespace = option(apply, "-n", "--namespace") or manifest["metadata"].get("namespace")
    if watch:
        assert namespace in watch, f"{apply} applies outside the watched namespaces"
        (get,) = kubectl_commands(text, "get")
        assert option(get, "-n", "--namespace") == namespace
