"""The reserved-flag table against the installed vLLM's own `vllm serve` parser."""

from holeblend_operator import reserved
from holeblend_runtime.vllm_connector import compat


def _options_by_dest() -> dict[str, list[str]]:
    parser = compat.serve_arg_parser()
    options: dict[str, list[str]] = {}
    for action in parser._actions:
        options.setdefault(action.dest, []).extend(action.option_strings)
    return options


def test_no_free_vllm_flag_is_refused():
    # Refusing every prefix of a reserved flag is exact only while no other flag is one.
    options = _options_by_dest()
    reserved_dests = {d for d, opts in options.items() if set(opts) & set(reserved.RESERVED_FLAGS)}
    for dest, opts in options.items():
        if dest not in reserved_dests:
            assert [o for o in opts if reserved.reserved_flag(o)] == [], dest


def test_every_spelling_of_a_reserved_vllm_option_is_reserved():
    # E.g. -tp next to --tensor-parallel-size, --no-enforce-eager next to --enforce-eager.
    for dest, opts in _options_by_dest().items():
        if set(opts) & set(reserved.RESERVED_FLAGS):
            assert set(opts) <= set(reserved.RESERVED_FLAGS), dest
