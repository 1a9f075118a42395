"""Command line of the operator: `holeblend-operator {crd,render,run}`."""

import sys


def main(argv: list[str] | None = None) -> int:
    print("holeblend-operator: no commands yet", file=sys.stderr)
    return 1
