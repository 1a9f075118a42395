"""Validate like kube-apiserver: a manifest (defaults, schema, CEL) and the CRD's own defaults.

No API server runs here, so this module reproduces the parts of it the CRD depends on:

1. Objects (`api_server_errors`): prune unknown fields, fill in schema defaults, validate the
   OpenAPI schema (jsonschema, Draft 4 semantics match OpenAPI v3's boolean
   `exclusiveMinimum`), then evaluate every `x-kubernetes-validations` rule with a real CEL
   interpreter.
2. The CRD itself (`default_errors`), as `ValidateDefaults` in apiextensions-apiserver's
   `pkg/apiserver/schema/defaulting/validation.go` does when a CRD is created: every
   `default` must be pruned (no unknown fields), must pass its own node's schema, and its
   node's CEL rules (and those below it) must pass on the default as written: nested
   defaults are NOT filled in first.

CEL values are typed the way the API server types them (`to_cel`): an integer in a
`type: number` field is a double, and a null in a `nullable` field is not validated at all
(rules run on non-null values only; the schema accepts the null).
"""

import copy
from typing import Any

import celpy
import jsonschema

from holeblend_devtools import schemas
from holeblend_operator.crd import open_api_schema
from holeblend_operator.quantity import quantity_value

_CEL = celpy.Environment()
_PROGRAMS: dict[str, Any] = {}


class _Quantity(celpy.celtypes.StringType):
    """A value of Kubernetes' CEL quantity library (`quantity('2Gi')`)."""


def _quantity(text) -> _Quantity:
    quantity_value(str(text))  # the library refuses what does not parse
    return _Quantity(str(text))


def _compare_to(a: _Quantity, b: _Quantity) -> celpy.celtypes.IntType:
    x, y = quantity_value(str(a)), quantity_value(str(b))
    return celpy.celtypes.IntType((x > y) - (x < y))


# The parts of the Kubernetes CEL libraries our rules use.
_KUBERNETES_FUNCTIONS = {"quantity": _quantity, "compareTo": _compare_to}


def _is_type(validator, types, instance, schema):
    # OpenAPI's `nullable: true` admits null next to the declared type.
    if instance is None and schema.get("nullable"):
        return
    yield from jsonschema.Draft4Validator.VALIDATORS["type"](validator, types, instance, schema)


_Validator = jsonschema.validators.extend(jsonschema.Draft4Validator, {"type": _is_type})


def to_cel(value: Any, schema: dict[str, Any]) -> Any:
    """`value` as the API server hands it to CEL under `schema`."""
    if isinstance(value, dict):
        return celpy.celtypes.MapType(
            {
                celpy.celtypes.StringType(key): to_cel(item, _property_schema(schema, key))
                for key, item in value.items()
            }
        )
    if isinstance(value, list):
        return celpy.celtypes.ListType([to_cel(item, schema.get("items", {})) for item in value])
    is_plain_int = isinstance(value, int) and not isinstance(value, bool)
    if is_plain_int and schema.get("type") == "number":
        return celpy.celtypes.DoubleType(value)
    return celpy.json_to_cel(value)


def _property_schema(schema: dict[str, Any], key: str) -> dict[str, Any]:
    if key in schema.get("properties", {}):
        return schema["properties"][key]
    extra = schema.get("additionalProperties")
    return extra if isinstance(extra, dict) else {}


def cel_errors(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """Messages of every CEL rule that fails or cannot be evaluated, as `path: message`."""
    if value is None:
        return []  # the API server runs rules on non-null values only
    errors = [
        f"{path or '<root>'}: {problem}"
        for rule in schema.get("x-kubernetes-validations", [])
        if (problem := _rule_problem(rule, value, schema)) is not None
    ]
    if isinstance(value, dict):
        for name, item in value.items():
            errors += cel_errors(_property_schema(schema, name), item, f"{path}.{name}")
    if isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            errors += cel_errors(schema["items"], item, f"{path}[{index}]")
    return errors


def _rule_problem(rule: dict[str, str], value: Any, schema: dict[str, Any]) -> str | None:
    expression = rule["rule"]
    if expression not in _PROGRAMS:
        ast = _CEL.compile(expression)
        _PROGRAMS[expression] = _CEL.program(ast, functions=_KUBERNETES_FUNCTIONS)
    try:
        result = _PROGRAMS[expression].evaluate({"self": to_cel(value, schema)})
    except celpy.CELEvalError as exc:
        return f"rule `{expression}` cannot be evaluated: {exc.args[0]}"
    return None if bool(result) else rule["message"]


def schema_errors(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """OpenAPI schema errors of `value`, as `path: message`."""
    prefix = f"{path}." if path else ""
    return [
        f"{prefix}{'.'.join(str(p) for p in e.absolute_path)}: {e.message}"
        for e in _Validator(schema).iter_errors(value)
    ]


def pruned(value: Any, schema: dict[str, Any]) -> Any:
    """`value` without the fields `schema` does not know, as the API server stores it."""
    if isinstance(value, dict) and "properties" in schema:
        props = schema["properties"]
        return {k: pruned(v, props[k]) for k, v in value.items() if k in props}
    if isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        return {k: pruned(v, schema["additionalProperties"]) for k, v in value.items()}
    if isinstance(value, list) and "items" in schema:
        return [pruned(item, schema["items"]) for item in value]
    return value


def api_server_errors(manifest: dict[str, Any]) -> list[str]:
    """Schema errors, or (when the schema passes) CEL errors, like the API server reports."""
    return object_errors(manifest, open_api_schema())


def object_errors(manifest: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    obj = schemas.with_defaults(pruned(manifest, schema), schema)  # as the API server defaults
    return schema_errors(schema, obj) or cel_errors(schema, obj)


def default_errors(schema: dict[str, Any], path: str = "openAPIV3Schema") -> list[str]:
    """What the API server's ValidateDefaults reports for every default under `schema`."""
    errors = []
    if "default" in schema:
        default = schema["default"]
        where = f"{path}.default"
        if pruned(copy.deepcopy(default), schema) != default:
            errors.append(f"{where}: must not have unknown fields")
        errors += schema_errors(schema, default, where) or cel_errors(schema, default, where)
    # Like the API server: follow items and properties, not additionalProperties (defaults
    # are forbidden there).
    if "items" in schema:
        errors += default_errors(schema["items"], f"{path}.items")
    for name, sub in schema.get("properties", {}).items():
        errors += default_errors(sub, f"{path}.properties[{name}]")
    return errors
