"""`holeblend-operator render -f FILE`: print every child of the BlendDeployments in FILE.

Like `helm template`: a multi-document YAML stream (or a JSON `List`) that users can review
or commit for GitOps. Bad input ends with exit code 1 and one line on stderr that names the
file, the field path and the fix; never a traceback.
"""

import argparse
import json
import sys
from pathlib import Path

import yaml
from pydantic import ValidationError

from holeblend_operator import settings
from holeblend_operator.api import (
    API_VERSION,
    KIND,
    BlendDeployment,
    format_validation_error,
    spec_notices,
)
from holeblend_operator.render import render_children


class ManifestError(ValueError):
    """A manifest that cannot be rendered; the message is the one line shown to the user."""


class _BlockDumper(yaml.SafeDumper):
    """Writes multi-line strings (the ConfigMap's JSON) as readable literal blocks."""

    def ignore_aliases(self, data) -> bool:
        # Anchors and aliases are legal YAML but hard to review; write every value out.
        return True


def _represent_str(dumper: yaml.SafeDumper, value: str):
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_BlockDumper.add_representer(str, _represent_str)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "render", help="print the objects a BlendDeployment creates, like `helm template`"
    )
    parser.add_argument(
        "-f", "--filename", required=True, help="BlendDeployment manifest ('-' for stdin)"
    )
    parser.add_argument("-o", "--output", choices=("yaml", "json"), default="yaml")
    parser.add_argument(
        "--pod-listen-address",
        choices=settings.POD_LISTEN_ADDRESSES,
        default=settings.DEFAULT_POD_LISTEN_ADDRESS,
        help="where the pods listen, as the operator's own flag of that name",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        children = [
            child
            for bd in load_manifests(args.filename)
            for child in render_children(bd, args.pod_listen_address)
        ]
    except ManifestError as exc:
        print(f"holeblend-operator render: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(json_list(children) if args.output == "json" else yaml_stream(children))
    return 0


def load_manifests(filename: str) -> list[BlendDeployment]:
    """Every BlendDeployment in the file, validated; ManifestError on the first problem."""
    documents = [doc for doc in _parse_yaml(filename, _read(filename)) if doc is not None]
    if not documents:
        raise ManifestError(f"{filename}: no BlendDeployment found; the file is empty")
    where = [
        f"{filename}" if len(documents) == 1 else f"{filename} (document {i + 1})"
        for i in range(len(documents))
    ]
    return [_blend_deployment(at, doc) for at, doc in zip(where, documents, strict=True)]


def _read(filename: str) -> str:
    try:
        return sys.stdin.read() if filename == "-" else Path(filename).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise ManifestError(f"cannot read {filename}: {reason}") from exc


def _parse_yaml(filename: str, text: str) -> list:
    try:
        return list(yaml.safe_load_all(text))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "cannot be parsed"
        raise ManifestError(f"{filename}: not valid YAML{at}: {problem}") from exc


def _blend_deployment(where: str, document) -> BlendDeployment:
    _check_kind(where, document)
    metadata = document.get("metadata")
    name = metadata.get("name", "?") if isinstance(metadata, dict) else "?"
    try:
        bd = BlendDeployment.model_validate(document)
    except ValidationError as exc:
        problems = _one_line(format_validation_error(exc))
        raise ManifestError(f"{where}: BlendDeployment {name!r}: {problems}") from exc
    for notice in spec_notices(document.get("spec")):  # valid, but to change: say so
        print(f"holeblend-operator render: warning: {where}: {name!r}: {notice}", file=sys.stderr)
    return bd


def _check_kind(where: str, document) -> None:
    if not isinstance(document, dict):
        raise ManifestError(
            f"{where}: expected a Kubernetes object with kind: {KIND}, "
            f"got a YAML {type(document).__name__}"
        )
    if document.get("kind") != KIND:
        raise ManifestError(
            f"{where}: kind: {document.get('kind')!r} is not supported; "
            f"render takes kind: {KIND} (apiVersion: {API_VERSION})"
        )
    if document.get("apiVersion") != API_VERSION:
        raise ManifestError(
            f"{where}: apiVersion: {document.get('apiVersion')!r} is not supported; "
            f"set apiVersion: {API_VERSION}"
        )


def _one_line(text: str) -> str:
    return " ".join(text.split())


def object_yaml(obj: dict) -> str:
    """One object as block YAML, keys in the order the render functions wrote them."""
    return yaml.dump(obj, Dumper=_BlockDumper, sort_keys=False, width=100)


def source_comment(obj: dict) -> str:
    return f"# Source: {obj['kind'].lower()}-{obj['metadata']['name']}.yaml\n"


def yaml_stream(children: list[dict]) -> str:
    return "".join(f"---\n{source_comment(obj)}{object_yaml(obj)}" for obj in children)


def json_list(children: list[dict]) -> str:
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": children}, indent=2) + "\n"
