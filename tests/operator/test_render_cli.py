"""`holeblend-operator render`: the YAML/JSON stream and its one-line errors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from holeblend_operator.api import BlendDeployment
from holeblend_operator.cli import main
from holeblend_operator.render import render_children

ROOT = Path(__file__).resolve().parents[2]
CPU_EXAMPLE = ROOT / "examples" / "cpu.yaml"
ASCEND_EXAMPLE = ROOT / "examples" / "ascend-910b-qwen3-8b.yaml"
VALID = CPU_EXAMPLE.read_text()


def expected_children(path: Path) -> list[dict]:
    return render_children(BlendDeployment.model_validate(yaml.safe_load(path.read_text())))


def render(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["render", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_render_prints_every_child_as_a_yaml_stream(capsys):
    code, out, err = render(capsys, "-f", str(ASCEND_EXAMPLE))
    assert (code, err) == (0, "")
    assert list(yaml.safe_load_all(out)) == expected_children(ASCEND_EXAMPLE)
    assert out.count("# Source: ") == len(expected_children(ASCEND_EXAMPLE))


def test_render_prints_a_json_list(capsys):
    code, out, _ = render(capsys, "-f", str(CPU_EXAMPLE), "-o", "json")
    assert code == 0
    document = json.loads(out)
    assert document["kind"] == "List"
    assert document["items"] == expected_children(CPU_EXAMPLE)


def test_render_reads_several_blend_deployments_from_one_file(tmp_path, capsys):
    second = VALID.replace("name: smollm2-demo", "name: second")
    manifest = tmp_path / "two.yaml"
    manifest.write_text(f"{VALID}---\n{second}")
    code, out, _ = render(capsys, "-f", str(manifest))
    names = {doc["metadata"]["name"] for doc in yaml.safe_load_all(out)}
    assert code == 0 and {"smollm2-demo-engine", "second-engine"} <= names


def test_render_reads_stdin(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", _StringStdin(VALID))
    code, out, _ = render(capsys, "-f", "-")
    assert code == 0 and list(yaml.safe_load_all(out)) == expected_children(CPU_EXAMPLE)


class _StringStdin:
    def __init__(self, text: str):
        self.text = text

    def read(self) -> str:
        return self.text


BROKEN = {
    "bad-ratio": (
        VALID.replace("recomputeRatio: 0.15", "recomputeRatio: 1.5"),
        "spec.blend.recomputeRatio",
    ),
    "misspelled-field": (VALID.replace("replicas: 1", "replica: 1"), "spec.replica: unknown field"),
    "bad-yaml": ("spec: [unclosed\n", "not valid YAML at line"),
    "wrong-kind": (
        VALID.replace("kind: BlendDeployment", "kind: Deployment"),
        "kind: 'Deployment'",
    ),
    "wrong-api-version": (
        VALID.replace("blend.holeblend.io/v1alpha1", "blend.holeblend.io/v1"),
        "set apiVersion: blend.holeblend.io/v1alpha1",
    ),
    "not-a-mapping": ("- just\n- a list\n", "expected a Kubernetes object"),
    "empty": ("# nothing here\n", "no BlendDeployment found"),
    "metadata-not-a-mapping": (
        "apiVersion: blend.holeblend.io/v1alpha1\nkind: BlendDeployment\nmetadata: rag\nspec: {}\n",
        "BlendDeployment '?'",
    ),
    "second-document-bad": (
        f"{VALID}---\n{VALID.replace('replicas: 1', 'replicas: -1')}",
        "(document 2)",
    ),
    "cpu-with-resource-name": (
        VALID.replace("count: 0", "count: 0\n    resourceName: nvidia.com/gpu"),
        "remove it for type: cpu",
    ),
}


@pytest.mark.parametrize("case", BROKEN, ids=str)
def test_invalid_manifest_exits_1_with_one_line(case, tmp_path, capsys):
    text, expected = BROKEN[case]
    manifest = tmp_path / f"{case}.yaml"
    manifest.write_text(text)
    code, out, err = render(capsys, "-f", str(manifest))
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert expected in err and str(manifest) in err


def test_unreadable_file_exits_1_with_one_line(tmp_path, capsys):
    code, out, err = render(capsys, "-f", str(tmp_path / "missing.yaml"))
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and "cannot read" in err and "missing.yaml" in err


def test_invalid_manifest_never_prints_a_traceback(tmp_path):
    manifest = tmp_path / "bad.yaml"
    manifest.write_text(BROKEN["bad-ratio"][0])
    result = subprocess.run(
        [str(Path(sys.executable).parent / "holeblend-operator"), "render", "-f", str(manifest)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 1 and result.stdout == ""
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1
    assert "spec.blend.recomputeRatio" in result.stderr
