"""Command line of the operator: `holeblend-operator {crd,render,run,rbac,shared-tier-acl}`.

Each subcommand lives in its own module with `add_parser(subparsers)` and a `run(args)`
returning the exit code; this module only wires them together.
"""

import argparse
import sys

from holeblend_operator import (
    crd_command,
    rbac_command,
    render_command,
    run_command,
    shared_acl_command,
)

COMMANDS = [crd_command, render_command, run_command, rbac_command, shared_acl_command]


def _no_abbreviations(**kwargs) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(**{"allow_abbrev": False, **kwargs})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="holeblend-operator",
        allow_abbrev=False,
        description="Kubernetes operator for hole-mode KV blending (BlendDeployment).",
    )
    # Subcommands do not inherit allow_abbrev: their parsers get it here.
    subparsers = parser.add_subparsers(
        dest="command", required=True, parser_class=_no_abbreviations
    )
    for command in COMMANDS:
        command.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
