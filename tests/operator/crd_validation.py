"""Validate a manifest the way the API server would: defaults, OpenAPI schema, CEL rules.

The schema part runs `jsonschema` (Draft 4 semantics match OpenAPI v3's boolean
`exclusiveMinimum`); the CEL part evaluates the CRD's own `x-kubernetes-validations`
with a real CEL interpreter, after applying the schema's defaults as the API server does.
"""

from typing import Any

import celpy
import jsonschema

from holeblend_devtools import schemas
from holeblend_operator.crd import open_api_schema

_CEL = celpy.Environment()


def cel_errors(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """Messages of every CEL rule that fails, as `path: message`."""
    errors = [
        f"{path or '<root>'}: {rule['message']}"
        for rule in schema.get("x-kubernetes-validations", [])
        if not _evaluate(rule["rule"], value)
    ]
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                errors += cel_errors(sub, value[name], f"{path}.{name}")
    if isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            errors += cel_errors(schema["items"], item, f"{path}[{index}]")
    return errors


def _evaluate(rule: str, value: Any) -> bool:
    program = _CEL.program(_CEL.compile(rule))
    return bool(program.evaluate({"self": celpy.json_to_cel(value)}))


def api_server_errors(manifest: dict[str, Any]) -> list[str]:
    """Schema errors, or (when the schema passes) CEL errors, like the API server reports."""
    schema = open_api_schema()
    obj = schemas.with_defaults(manifest, schema)  # as the API server defaults
    validator = jsonschema.Draft4Validator(schema)
    schema_errors = [
        f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}"
        for e in validator.iter_errors(obj)
    ]
    return schema_errors or cel_errors(schema, obj)
