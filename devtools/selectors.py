"""Kubernetes label selectors (`?labelSelector=`), parsed once and matched against labels."""

import dataclasses
import re

# `key in (a,b)`, `key notin (a,b)`: the set-based forms.
_SET_TERM = re.compile(r"^\s*(!?[\w./-]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


@dataclasses.dataclass(frozen=True)
class Requirement:
    key: str
    operator: str  # one of: =, !=, in, notin, exists, !exists
    values: frozenset[str]  # empty for exists / !exists

    def matches(self, labels: dict[str, str]) -> bool:
        value = labels.get(self.key)
        if self.operator in ("=", "in"):
            return value in self.values
        if self.operator in ("!=", "notin"):
            return value not in self.values
        if self.operator == "exists":
            return self.key in labels
        return self.key not in labels


def parse(selector: str | None) -> tuple[Requirement, ...]:
    """Parse a selector string; ValueError names the term that does not parse."""
    return tuple(_parse_term(term) for term in _split_terms(selector or ""))


def matches(requirements: tuple[Requirement, ...], labels: dict[str, str] | None) -> bool:
    return all(req.matches(labels or {}) for req in requirements)


def _split_terms(selector: str) -> list[str]:
    # Commas inside `(...)` belong to a set term, not to the list of terms.
    terms, depth, current = [], 0, ""
    for char in selector:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += char
    terms.append(current)
    return [term.strip() for term in terms if term.strip()]


def _parse_term(term: str) -> Requirement:
    if match := _SET_TERM.match(term):
        values = frozenset(v.strip() for v in match.group(3).split(",") if v.strip())
        return Requirement(match.group(1), match.group(2), values)
    for operator in ("!=", "==", "="):
        if operator in term:
            key, value = (part.strip() for part in term.split(operator, 1))
            return Requirement(key, "!=" if operator == "!=" else "=", frozenset({value}))
    if term.startswith("!"):
        return Requirement(term[1:].strip(), "!exists", frozenset())
    if re.fullmatch(r"[\w./-]+", term):
        return Requirement(term, "exists", frozenset())
    raise ValueError(f"labelSelector: cannot parse term {term!r}")
