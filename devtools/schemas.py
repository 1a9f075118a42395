"""Defaulting from a CRD's structural OpenAPI schema, as the API server does on every write."""

import copy
from typing import Any


def with_defaults(obj: Any, schema: dict[str, Any]) -> Any:
    """A copy of `obj` with every absent field that has a schema `default` filled in."""
    if not schema:
        return obj
    return _default(copy.deepcopy(obj), schema)


def _default(value: Any, schema: dict[str, Any]) -> Any:
    if isinstance(value, dict) and "properties" in schema:
        for name, sub in schema["properties"].items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = _default(value[name], sub)
    elif isinstance(value, list) and "items" in schema:
        return [_default(item, schema["items"]) for item in value]
    return value
