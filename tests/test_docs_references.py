"""The README and docs/ name only things the code has.

What the pages cite is checked against the tree, not read by a person:

1. every `make TARGET` is a target of the Makefile;
2. every repository path cited in a code span or a link exists (a `path:line` citation:
   the file has that line; a `page.md#anchor` link: the page has that heading), except the
   files runs write under out/;
3. every flag given to one of our commands (pyproject's [project.scripts]) is an option of
   that command's argparse parser, built here from its module;
4. every HOLEBLEND_* variable a page names is read by the code, and every one the code reads
   is named in a page;
5. every holeblend_* Prometheus series in the pages, the chart's dashboards and its rules is
   one the code exports (a counter also as `_total`, a histogram as `_bucket`/`_sum`/`_count`).
"""

import argparse
import contextlib
import dataclasses
import importlib.util
import itertools
import re
from collections import defaultdict
from functools import cache
from pathlib import Path
from unittest import mock

import pytest

from holeblend_contract import serve_settings as serve_contract
from holeblend_operator import cli as operator_cli
from holeblend_operator import settings as operator_settings
from holeblend_runtime.bench import cli as bench_cli
from holeblend_runtime.kv.tiers import TierMetrics
from holeblend_runtime.lookup_server import bench as lookup_bench
from holeblend_runtime.lookup_server import cli as lookup_cli
from holeblend_runtime.lookup_server.metrics import ServerMetrics
from holeblend_runtime.serve import settings as serve_settings
from holeblend_runtime.serve.metrics import ServeMetrics

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PAGES += sorted((ROOT / "docs" / "bench").rglob("*.md"))
CODE_DIRS = ("operator", "runtime", "kernels", "contract", "devtools")
TOP_LEVEL = {path.name for path in ROOT.iterdir() if not path.name.startswith(".")}
# Where a page cites a path relative to a package or the chart (`blend/selection.py`,
# `templates/rbac.yaml`) rather than to the repository root.
PATH_BASES = ("runtime", "operator", "devtools", "kernels", "contract", "charts/holeblend")
# Files a run writes, cited as what a command produces.
PRODUCED = ("out/",)
PATH_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".json", ".jsonl", ".toml", ".sh", ".png", ".txt")

# Words in code spans that look like repository paths and are not.
NOT_PATHS = {
    "runtime/default",  # the seccomp and AppArmor profile named in the CRD's rules
}

# Flags that a page owned by one command names in code spans but that belong to another
# program, each with the reason.
FOREIGN_FLAGS = {
    # `vllm bench serve --backend openai` drives holeblend-serve in the vLLM tests.
    ("docs/serving.md", "--backend"),
}


def page_name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


@cache
def page_lines(page: Path, fenced: bool = False) -> list[str]:
    """The lines of the page's prose, or those of its fenced code blocks."""
    lines, in_fence = [], False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        elif in_fence == fenced:
            lines.append(line)
    return lines


@cache
def page_parts(page: Path) -> tuple[list[str], list[str]]:
    """The page's inline code spans and the lines of its fenced code blocks."""
    text = "\n".join(page_lines(page))
    spans = [match.group(2) for match in re.finditer(r"(`+)(.+?)\1", text, re.S)]
    return spans, page_lines(page, fenced=True)


def links(page: Path) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", page.read_text())


def commands(page: Path) -> list[str]:
    """Code spans, and the fenced lines joined where a line ends in a backslash."""
    spans, fenced = page_parts(page)
    joined = "\n".join(fenced).replace("\\\n", " ")
    return spans + joined.splitlines()


# 1. make targets


@cache
def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z0-9_.-]+):(?!=)", text, re.M))


def cited_make_targets() -> list[tuple[str, str]]:
    cited = []
    for page in PAGES:
        for command in commands(page):
            cited += [(page_name(page), t) for t in re.findall(r"\bmake ([a-z][\w-]*)", command)]
    return cited


def test_every_make_target_in_the_docs_is_in_the_makefile():
    cited = cited_make_targets()
    assert cited, "no `make` command found in the pages: the pattern is wrong"
    missing = [(page, target) for page, target in cited if target not in make_targets()]
    assert not missing


# 2. paths


def expand_braces(path: str) -> list[str]:
    """`a-{x,y}-s{0,1}.json` as the four names it stands for."""
    parts = re.split(r"\{([^{}]*)\}", path)
    choices = [[part] if i % 2 == 0 else part.split(",") for i, part in enumerate(parts)]
    return ["".join(combination) for combination in itertools.product(*choices)]


@cache
def file_names() -> set[str]:
    """Names of the files in the code and the tests, for a module cited by its name alone."""
    folders = [ROOT / directory for directory in (*CODE_DIRS, "tests", "scripts")]
    return {path.name for folder in folders for path in folder.rglob("*") if path.is_file()}


def exists(path: str, page: Path) -> bool:
    if "/" not in path and path in file_names():
        return True
    bases = [ROOT, page.parent, *(ROOT / base for base in PATH_BASES)]
    for name in expand_braces(path):
        if not any(
            any(base.glob(name)) if "*" in name else (base / name).exists() for base in bases
        ):
            return False
    return True


def locate(path: str, page: Path) -> Path | None:
    """The file a citation with a line, an anchor or a test names: from the root or the page."""
    return next((base / path for base in (ROOT, page.parent) if (base / path).is_file()), None)


def headings(page: Path) -> set[str]:
    """GitHub's anchors of the page's headings."""
    anchors, seen = set(), defaultdict(int)
    for line in page_lines(page):
        match = re.match(r"#{1,6} (.+)", line)
        if match:
            slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
            anchors.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
            seen[slug] += 1
    return anchors


def is_repository_path(token: str) -> bool:
    if (
        token in NOT_PATHS
        or token.startswith(PRODUCED)
        or "://" in token
        or token.startswith(("/", "~", "$", "."))
    ):
        return False
    first, _, rest = token.partition("/")
    if first.isupper():
        return False  # a placeholder: DIR/MODE.json
    if rest or token.endswith("/"):
        return first in TOP_LEVEL or token.split(":")[0].endswith(PATH_SUFFIXES)
    return re.split(r"[:#]", token)[0].endswith((".py", ".md")) or first in TOP_LEVEL


def cited_paths(page: Path) -> list[str]:
    """Paths in code spans and links; in fenced blocks, files named from the root (not
    `kubectl ... deploy/NAME`)."""
    spans, fenced = page_parts(page)
    tokens = [token.split("=")[-1].strip("(),;'\"") for span in spans for token in span.split()]
    cited = [token for token in tokens if is_repository_path(token)]
    tokens = [token.split("=")[-1].strip("(),;'\"") for line in fenced for token in line.split()]
    cited += [
        token
        for token in tokens
        if token.split("/")[0] in TOP_LEVEL
        and token.endswith(PATH_SUFFIXES)
        and is_repository_path(token)
    ]
    return cited + [link for link in links(page) if not re.match(r"\w+:|/", link)]


def broken_reference(citation: str, page: Path) -> str | None:
    """What is wrong with one citation, or None."""
    path, _, node = citation.partition("::")
    path, _, anchor = path.partition("#")
    path, _, line = path.partition(":")
    if not path:
        return None if anchor in headings(page) else f"no heading #{anchor}"
    if not exists(path, page):
        return "no such path"
    if line.isdigit() or anchor or node:
        target = locate(path, page)
        if target is None:
            return "a line, anchor or test of a file not named from the root or the page"
        if line.isdigit() and int(line) > len(target.read_text().splitlines()):
            return f"{path} has no line {line}"
        if anchor and anchor not in headings(target):
            return f"{path} has no heading #{anchor}"
        if node and f"def {node}(" not in target.read_text():
            return f"{path} has no test {node}"
    return None


def test_every_path_cited_in_the_docs_exists():
    broken = []
    for page in PAGES:
        for citation in cited_paths(page):
            reason = broken_reference(citation, page)
            if reason:
                broken.append((page_name(page), citation, reason))
    assert not broken


def test_the_path_check_reads_lines_anchors_and_tests():
    page = ROOT / "docs" / "serving.md"
    assert broken_reference("runtime/serve/app.py:1", page) is None
    assert broken_reference("runtime/serve/app.py:999999", page)
    assert broken_reference("runtime/serve/no_such_module.py", page)
    assert broken_reference("serving.md#no-such-heading", page)
    assert broken_reference("tests/test_docs_references.py::test_no_such_test", page)
    assert "docs/serving.md" in cited_paths(ROOT / "README.md")


def module_exists(dotted: str) -> bool:
    """A module, or a name defined at the top of one (`holeblend_runtime.engine.BlendEngine`)."""
    with contextlib.suppress(ModuleNotFoundError):
        if importlib.util.find_spec(dotted):
            return True
    parent, _, name = dotted.rpartition(".")
    with contextlib.suppress(ModuleNotFoundError):
        spec = importlib.util.find_spec(parent) if parent else None
        if spec and spec.origin:
            pattern = rf"^(?:class |def |async def )?{re.escape(name)}\b"
            return bool(re.search(pattern, Path(spec.origin).read_text(), re.M))
    return False


def cited_modules(page: Path) -> list[str]:
    """Our modules run with `python -m` or named in a code span."""
    spans, _ = page_parts(page)
    packages = r"holeblend_(?:runtime|operator|kernels|devtools|contract)"
    cited = [m for c in commands(page) for m in re.findall(r"python -m ([\w.]+)", c)]
    cited += [span for span in spans if re.fullmatch(rf"{packages}(\.\w+)*", span)]
    return [name for name in cited if re.match(packages, name)]


def test_every_module_cited_in_the_docs_exists():
    cited = [(page_name(page), name) for page in PAGES for name in cited_modules(page)]
    assert cited, "no module found in the pages: the pattern is wrong"
    assert not [(page, name) for page, name in cited if not module_exists(name)]


# 3. flags of our commands


class _Built(Exception):
    pass


def parser_built_by(parse, *args) -> argparse.ArgumentParser:
    """The parser a module builds inside the function that parses the command line."""
    built = []

    def keep(parser, *_args, **_kwargs):
        built.append(parser)
        raise _Built

    with (
        mock.patch.object(argparse.ArgumentParser, "parse_args", keep),
        contextlib.suppress(_Built),
    ):
        parse(*args)
    return built[0]


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


@cache
def command_options() -> dict[str, set[str]]:
    """Option strings of each command, by the words that start it in a shell."""
    parsers = {
        "holeblend-serve": parser_built_by(serve_settings.parse_settings, [], {}),
        "holeblend-bench": parser_built_by(bench_cli.parse_args, []),
        "holeblend-lookup": lookup_cli.serve_parser(),
        "holeblend-lookup bench": parser_built_by(lookup_bench.parse_args, []),
    }
    operator = operator_cli.build_parser()
    (subcommands,) = [a for a in operator._actions if isinstance(a, argparse._SubParsersAction)]
    for name, parser in subcommands.choices.items():
        parsers[f"holeblend-operator {name}"] = parser
    found = {name: options(parser) for name, parser in parsers.items()}
    found["python -m holeblend_runtime.lookup_server"] = found["holeblend-lookup"]
    return found


def flags_given(command: str) -> list[tuple[str, str]]:
    """(command, flag) for each of our commands in one shell line or code span, with the
    flags written after it up to the end of that command."""
    given = []
    names = sorted(command_options(), key=len, reverse=True)
    pattern = "|".join(re.escape(name) for name in names)
    for match in re.finditer(rf"(?<![\w./-])({pattern})(?![\w-])", command):
        rest = re.split(r"\s(?:\||&&|;|#)|\)|`", command[match.end() :])[0]
        rest = re.split(rf"(?<![\w./-])(?:{pattern})(?![\w-])", rest)[0]
        given += [
            (match.group(1), flag) for flag in re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", rest)
        ]
    return given


# Pages that describe one command: their flag spans are that command's.
PAGE_COMMANDS = {
    "docs/serving.md": ("holeblend-serve",),
    "docs/lookup-server.md": ("holeblend-lookup", "holeblend-lookup bench"),
    "docs/bench.md": ("holeblend-bench",),
}


def unknown_flags() -> list[tuple[str, str, str]]:
    known = command_options()
    unknown = []
    for page in PAGES:
        name = page_name(page)
        for command in commands(page):
            for program, flag in flags_given(command):
                if flag not in known[program]:
                    unknown.append((name, program, flag))
        spans, _ = page_parts(page)
        for span in spans if name in PAGE_COMMANDS else ():
            flag = re.match(r"(--[a-z][\w-]*)(?:[ =]|$)", span)
            owners = PAGE_COMMANDS[name]
            if (
                flag
                and (name, flag.group(1)) not in FOREIGN_FLAGS
                and not any(flag.group(1) in known[owner] for owner in owners)
            ):
                unknown.append((name, owners[0], flag.group(1)))
    return unknown


def test_every_flag_of_our_commands_in_the_docs_is_one_of_theirs():
    assert not unknown_flags()


def test_flags_are_read_up_to_the_end_of_their_command():
    assert flags_given("holeblend-bench --quick --json out/x.json | tee log --fake") == [
        ("holeblend-bench", "--quick"),
        ("holeblend-bench", "--json"),
    ]
    assert flags_given("holeblend-operator run --namespace a") == [
        ("holeblend-operator run", "--namespace")
    ]


# 4. HOLEBLEND_* environment variables


# Variables read one per flag, `PREFIX<FLAG>`, which a page may name as a family.
PER_FLAG_PREFIXES = (
    serve_contract.ENV_PREFIX,
    operator_settings.ENV_PREFIX,
    lookup_cli.ENV_PREFIX,
)


@cache
def variables_read() -> set[str]:
    """Every variable the code reads: those it names, and one per flag of holeblend-serve,
    `holeblend-operator run` and holeblend-lookup."""
    read = set()
    for directory in CODE_DIRS:
        for source in (ROOT / directory).rglob("*.py"):
            text = source.read_text()
            read |= set(re.findall(r"[\"'](HOLEBLEND_[A-Z0-9_]*[A-Z0-9])[\"']", text))
    for field in dataclasses.fields(serve_settings.ServeSettings):
        read.add(serve_contract.env_name(field.name))
    for field in dataclasses.fields(operator_settings.OperatorSettings):
        read.add(operator_settings.ENV_PREFIX + field.name.upper())
    for flag in options(lookup_cli.serve_parser()) - {"-h", "--help"}:
        read.add(lookup_cli._env_name(flag.removeprefix("--")))
    return read


def variables_named() -> dict[str, set[str]]:
    """Variables the pages name, with the pages; a family as `PREFIX_<FLAG>` or `PREFIX_*`."""
    named = defaultdict(set)
    for page in PAGES:
        for name in re.findall(r"HOLEBLEND_[A-Z0-9_]*(?:<[A-Z]+>|\*)?", page.read_text()):
            named[name].add(page_name(page))
    return named


def family(name: str) -> str | None:
    """The prefix a family's name stands for, or None for one variable."""
    match = re.fullmatch(r"(.*)(?:<[A-Z]+>|\*)", name)
    return match.group(1) if match else None


def test_every_variable_in_the_docs_is_read_by_the_code():
    unread = []
    for name, pages in variables_named().items():
        if family(name) == "HOLEBLEND_":
            continue  # "every HOLEBLEND_* variable" (engine.env's rule): all of them
        if family(name) not in PER_FLAG_PREFIXES and name not in variables_read():
            unread.append((name, sorted(pages)))
    assert not unread


def test_every_variable_the_code_reads_is_in_the_docs():
    named = variables_named()
    families = tuple({family(name) for name in named} & set(PER_FLAG_PREFIXES))
    undocumented = [
        name
        for name in sorted(variables_read())
        if name not in named and not name.startswith(families)
    ]
    assert not undocumented


# 5. holeblend_* metrics


@cache
def exported_series() -> set[str]:
    """Names of the series the code exports: literal names, and those of the collectors
    that build their names (the server's token counters, the KV tiers', the lookup
    server's index figures)."""
    names = set()
    for directory in ("operator", "runtime"):
        for source in (ROOT / directory).rglob("*.py"):
            names |= set(
                re.findall(r"[\"'](holeblend_[a-z0-9_]*[a-z0-9])[\"']", source.read_text())
            )
    collectors = [
        ServeMetrics().registry,
        TierMetrics(),
        ServerMetrics(lambda: defaultdict(int)).registry,
    ]
    for collector in collectors:
        names |= {family.name for family in collector.collect()}
    return names


def exported(name: str) -> bool:
    base = re.sub(r"_(total|bucket|sum|count|created)$", "", name)
    return name in exported_series() or base in exported_series()


def monitoring_files() -> list[Path]:
    chart = ROOT / "charts" / "holeblend"
    return [*PAGES, *sorted(chart.glob("dashboards/*.json")), *sorted(chart.glob("rules/*.yaml"))]


def test_every_metric_in_the_docs_and_the_chart_is_exported_by_the_code():
    packages = ("holeblend_runtime", "holeblend_operator", "holeblend_kernels")
    packages += ("holeblend_devtools", "holeblend_contract")
    missing = []
    for path in monitoring_files():
        for name in sorted(set(re.findall(r"\bholeblend_[a-z0-9_]*[a-z0-9]", path.read_text()))):
            if not name.startswith(packages) and not exported(name):
                missing.append((page_name(path), name))
    assert not missing


@pytest.mark.parametrize("name", ["holeblend_lookup_hits_total", "holeblend_ttft_seconds_bucket"])
def test_built_series_names_count_as_exported(name):
    assert exported(name)
