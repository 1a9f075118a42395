"""Our command lines take no abbreviated flags: `--por=9000` is not `--port=9000`.

argparse's default (`allow_abbrev=True`) reads any unique prefix of a flag as the flag. On a
CPU engine pod `engine.extraArgs` follow the operator's own holeblend-serve flags, so an
abbreviation would be a way around the reserved-flag check; the other CLIs refuse them too,
so that none of them reads an argument as a flag it does not name.
"""

import pytest


def _serve(argv):
    from holeblend_runtime.serve.settings import parse_settings

    return parse_settings(["--config", "/c.json", *argv], {})


def _operator(argv):
    from holeblend_operator.cli import build_parser

    return build_parser().parse_args(argv)


def _lookup(argv):
    from holeblend_runtime.lookup_server.cli import serve_parser

    return serve_parser().parse_args(argv)


def _bench(argv):
    from holeblend_runtime.bench.cli import parse_args

    return parse_args(argv)


# (CLI, a full flag it takes, the same flag abbreviated)
CASES = [
    ("holeblend-serve", _serve, ["--port=9000"], ["--por=9000"]),
    ("holeblend-serve", _serve, ["--host", "0.0.0.0"], ["--hos", "0.0.0.0"]),
    ("holeblend-serve", _serve, ["--queue-size", "3"], ["--queue", "3"]),
    ("holeblend-lookup", _lookup, ["--port=9000"], ["--por=9000"]),
    ("holeblend-operator", _operator, ["crd", "--docs", "x.md"], ["crd", "--doc", "x.md"]),
    ("holeblend-bench", _bench, ["--quick"], ["--qui"]),
]


@pytest.mark.parametrize(
    "parse, full, abbreviated",
    [case[1:] for case in CASES],
    ids=[f"{case[0]} {' '.join(case[3])}" for case in CASES],
)
def test_abbreviated_flags_exit_2(parse, full, abbreviated):
    parse(full)  # the full flag is read
    with pytest.raises(SystemExit) as exit_:
        parse(abbreviated)
    assert exit_.value.code == 2
