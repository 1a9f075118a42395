"""What `docker build .` sends to the builder: every file the Dockerfile copies, and nothing
git ignores. After `make test` the working tree holds several GB of virtual environments
(.venv, .venv-vllm, .venv-vllm-0.23) beside helm and kubectl (.tools), and .kube/ is where a
local kubeconfig with its credentials goes: none of it may reach a builder, least of all a
remote one. And the images install our own wheel, never a package of its name from an index.

.dockerignore is read here as Docker reads it (moby's patternmatcher): patterns are cleaned
paths without a leading "/", `*` and `?` stay within one path segment, `**` spans any number
of them, `[...]` is a class, a pattern that matches a folder matches everything under it,
`!` re-includes, and the last pattern that matches decides."""

import os
import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COPY = re.compile(r"^COPY\s+(?!--from)(.+)$", flags=re.M)


def pattern_regex(pattern: str) -> re.Pattern:
    regex, i = "", 0
    while i < len(pattern):
        char = pattern[i]
        if pattern.startswith("**", i):
            i += 2
            if pattern.startswith("/", i):
                i += 1
            regex += ".*" if i == len(pattern) else "(.*/)?"
            continue
        if char == "\\" and i + 1 < len(pattern):
            i += 1
            regex += re.escape(pattern[i])
        elif char == "*":
            regex += "[^/]*"
        elif char == "?":
            regex += "[^/]"
        elif char in "[]":
            regex += char
        else:
            regex += re.escape(char)
        i += 1
    return re.compile(regex)


def rules_of(text: str) -> list[tuple[re.Pattern, bool]]:
    """(regex, re-includes) for each pattern of a .dockerignore text, in order."""
    rules = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        include = line.startswith("!")
        pattern = os.path.normpath(line.removeprefix("!").strip())
        rules.append((pattern_regex(pattern.removeprefix("/")), include))
    return rules


def dockerignore() -> list[tuple[re.Pattern, bool]]:
    return rules_of((ROOT / ".dockerignore").read_text())


def is_sent(path: str, rules: list[tuple[re.Pattern, bool]]) -> bool:
    parts = path.split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    sent = True
    for regex, include in rules:
        if any(regex.fullmatch(candidate) for candidate in candidates):
            sent = include
    return sent


def copied_sources() -> list[str]:
    """The build-context paths the Dockerfile's COPY lines name (not those --from a stage)."""
    sources = []
    for arguments in COPY.findall((ROOT / "Dockerfile").read_text()):
        sources += arguments.split()[:-1]
    return sources


def ignored_samples(top_folders: list[str]) -> list[str]:
    """A path for each .gitignore pattern, at the top and, where git ignores it at any depth,
    inside each folder the Dockerfile copies."""
    samples = []
    for line in (ROOT / ".gitignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "!")):
            continue
        name = line.strip("/").replace("*", "x")
        samples.append(name)
        if not line.startswith("/") and "/" not in line.rstrip("/"):
            samples += [f"{folder}/{name}" for folder in top_folders]
    return samples


def test_the_reading_of_dockerignore_follows_docker():
    rules = rules_of("*\n!src\n**/*.pyc\n/docs/**\n!docs/keep.md\nbuild?\nv[0-9]\n# a comment\n")
    assert not is_sent("notes.txt", rules) and not is_sent(".venv-vllm/bin/python", rules)
    assert is_sent("src", rules) and is_sent("src/a/b.py", rules)
    assert not is_sent("src/a/b.pyc", rules)
    assert not is_sent("docs/x/y.md", rules) and is_sent("docs/keep.md", rules)
    assert not is_sent("build1", rules) and is_sent("src/build12", rules)
    assert not is_sent("v1", rules) and is_sent("src/v1", rules)


def test_every_file_the_dockerfile_copies_is_sent():
    sources = copied_sources()
    assert {"pyproject.toml", "operator"} <= set(sources)
    tracked = subprocess.run(
        ["git", "ls-files", "--", *sources], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert tracked
    rules = dockerignore()
    assert [path for path in tracked if not is_sent(path, rules)] == []


def test_nothing_git_ignores_is_sent():
    folders = [s for s in copied_sources() if (ROOT / s).is_dir()]
    samples = ignored_samples(folders)
    assert {".venv-vllm", ".tools", ".kube", "operator/__pycache__"} <= set(samples)
    rules = dockerignore()
    assert [path for path in samples if is_sent(f"{path}/file", rules)] == []


@pytest.mark.parametrize("path", [".git/config", "tests/conftest.py", ".env"])
def test_files_the_images_do_not_copy_are_not_sent(path):
    assert not is_sent(path, dockerignore())


def pip_installs() -> list[list[str]]:
    """The words of each `pip install` in the Dockerfile's RUN instructions."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    installs = []
    for line in text.splitlines():
        if line.startswith("RUN "):
            for command in line.removeprefix("RUN ").split("&&"):
                words = shlex.split(command)
                for i in range(len(words) - 1):
                    if words[i : i + 2] == ["pip", "install"]:
                        installs.append(words[i + 2 :])
    return installs


def test_the_images_install_our_wheel_not_an_indexs_package_of_its_name():
    """With an index in reach, pip takes the index's copy of a name and version over the one
    --find-links offers: whoever published a `holeblend` 0.1.0 would be installed. Each
    install names the wheel's file, or reads no index; and names the project's version."""
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    ours = [(words, word) for words in pip_installs() for word in words if "holeblend" in word]
    assert len(ours) == 5  # the operator, runtime-cpu and the three vLLM images
    for words, word in ours:
        assert "/" in word or "--no-index" in words, word
        pinned = re.search(r"holeblend(?:\[\w+\])?==(\S+)$|holeblend-([^-*]+)-", word)
        if pinned:
            assert version in pinned.groups(), word
