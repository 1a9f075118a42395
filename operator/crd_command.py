"""`holeblend-operator crd`: print or write the generated CRD (and the API reference)."""

import argparse
import sys
from pathlib import Path

from holeblend_operator.api_docs import api_reference_markdown
from holeblend_operator.crd import crd_yaml


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "crd", help="print the BlendDeployment CRD generated from the API"
    )
    parser.add_argument("-o", "--output", type=Path, help="write the CRD here instead of stdout")
    parser.add_argument("--docs", type=Path, help="also write the API reference (Markdown) here")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    text = crd_yaml()
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text)
    if args.docs is not None:
        args.docs.parent.mkdir(parents=True, exist_ok=True)
        args.docs.write_text(api_reference_markdown())
    return 0
