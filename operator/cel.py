"""Cross-field rules written once: as CEL for the CRD and as a Python check for pydantic.

Each rule lives next to the model it guards. The CRD generator emits `rule` and `message`
as `x-kubernetes-validations`; the model's validator runs `check`, so `holeblend-operator
render` and the operator reject exactly what the API server rejects.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import model_validator


@dataclass(frozen=True)
class CelRule:
    # CEL expression evaluated by the API server with `self` bound to the object.
    rule: str
    # What is wrong and how to fix it; shown to the user verbatim by both validators.
    message: str
    # The same rule in Python, over the pydantic model instance.
    check: Callable[[Any], bool]
    # Field path (relative to the object) the message is reported against, if any.
    field_path: str | None = None

    def to_schema(self) -> dict[str, str]:
        entry = {"rule": self.rule, "message": self.message}
        if self.field_path:
            entry["fieldPath"] = self.field_path
        return entry


def cel_schema_extra(*rules: CelRule) -> dict[str, list[dict[str, str]]]:
    """The `json_schema_extra` that carries the rules into the generated schema."""
    return {"x-kubernetes-validations": [rule.to_schema() for rule in rules]}


def cel_validator(*rules: CelRule):
    """A pydantic `model_validator(mode="after")` that enforces the rules in Python."""

    def validate(model):
        for rule in rules:
            if not rule.check(model):
                raise ValueError(rule.message)
        return model

    return model_validator(mode="after")(validate)
