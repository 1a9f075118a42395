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
   The CRD must also be structural (`structural_errors`): what the schema's value validations
   under anyOf, allOf, oneOf and not may hold.
3. The rules' estimated costs (`cost_errors`), as the API server checks them when a CRD is
   created or updated: see "Static CEL cost" below.

CEL values are typed the way the API server types them (`to_cel`): an integer in a
`type: number` field is a double, and a null in a `nullable` field is not validated at all
(rules run on non-null values only; the schema accepts the null).

Nulls and numbers as the API server reads them:

- A null in a field that is not `nullable` is pruned before defaulting (then defaulted if
  the field has a default): apiextensions-apiserver's
  `pkg/apiserver/schema/defaulting/prunenulls.go` (PruneNonNullableNullsWithoutDefaults) and
  `pkg/apiserver/schema/defaulting/algorithm.go`. A null in a `nullable` field stays, and CEL
  sees it as absent: `has(self.x)` is false ("null valued nullable fields are treated the
  same as absent optional fields", unstructuredMap.Find in
  `pkg/apiserver/schema/cel/values.go`, now `k8s.io/apiserver/pkg/cel/common/values.go`);
  `to_cel` leaves it out of the object.
- Integers are int64: the JSON decoder (`k8s.io/apimachinery/pkg/util/json`, convertNumber)
  reads a larger integer as a float64, which is no JSON integer any more
  (`k8s.io/kube-openapi/pkg/validation/validate/type.go`: `isFloatInt` needs
  `swag.IsFloat64AJSONInteger`, at most 2**53), so `type: integer` refuses it with a message
  instead of this module crashing on it. An integral float such as `2.0` IS an integer there
  (`isFloatInt`). CEL reads it as the integer kubectl sends: sigs.k8s.io/yaml turns YAML
  `2.0` into JSON `2` (a float64, which encoding/json writes without the fraction). (A raw
  JSON `2.0` sent past kubectl reaches CEL as a float64, which values.go refuses in a rule
  that reads the field: "invalid data, expected int, got float64".)
- `pattern` and CEL `matches()` are Go RE2 searches: `$` is the end of the text, never the
  position before a final newline as in Python's `re`.
"""

import copy
import math
import re
from typing import Any

import celpy
import jsonschema

from holeblend_devtools import schemas
from holeblend_operator.api import kube_int64
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


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# The largest integer a float64 holds exactly: kube-openapi's IsFloat64AJSONInteger bound.
JSON_FLOAT_INT_MAX = 2**53


def _is_quantity(text) -> celpy.celtypes.BoolType:
    try:
        quantity_value(str(text))
    except ValueError:
        return celpy.celtypes.BoolType(False)
    return celpy.celtypes.BoolType(True)


def _is_integer(q: _Quantity) -> celpy.celtypes.BoolType:
    # Kubernetes' library: `isInteger()` is true when AsInt64 succeeds, which depends on how
    # the quantity is written, not only on its value ('1.0' and '1000m' are not integers).
    return celpy.celtypes.BoolType(kube_int64(str(q)) is not None)


def _as_integer(q: _Quantity) -> celpy.celtypes.IntType:
    if not _is_integer(q):
        raise ValueError(f"cannot convert quantity {q} to an int64")
    return celpy.celtypes.IntType(kube_int64(str(q)))


def _substring(text, start, end=None) -> celpy.celtypes.StringType:
    # cel-go's ext.Strings (Kubernetes enables it for CRD rules): code points, not bytes.
    end = len(text) if end is None else int(end)
    if not 0 <= int(start) <= end <= len(text):
        raise ValueError(f"substring: index out of range [{start}, {end}) of {len(text)}")
    return celpy.celtypes.StringType(str(text)[int(start) : end])


def _matches(text, pattern) -> celpy.celtypes.BoolType:
    return celpy.celtypes.BoolType(go_search(str(pattern), str(text)))


def go_search(pattern: str, text: str) -> bool:
    r"""RE2's unanchored search, where `$` matches at the very end only (not before a final
    newline as Python's `$` does) and `\s`, `\d`, `\w` are ASCII classes (Python's are
    Unicode: its `\s` takes a no-break space, RE2's does not)."""
    if pattern not in _GO_PATTERNS:
        _GO_PATTERNS[pattern] = re.compile(_end_anchors(pattern))
    return _GO_PATTERNS[pattern].search(text) is not None


_GO_PATTERNS: dict[str, re.Pattern] = {}

# RE2's Perl classes (github.com/google/re2/wiki/Syntax; Go's regexp/syntax): \s is
# [\t\n\f\r ] (no \v), \d [0-9], \w [0-9A-Za-z_]; each as the ranges a Python class holds.
_PERL_CLASSES = {
    "s": r"\t\n\f\r ",
    "S": r"\x00-\x08\x0b\x0e-\x1f\x21-\U0010ffff",
    "d": "0-9",
    "D": r"\x00-\x2f\x3a-\U0010ffff",
    "w": "0-9A-Za-z_",
    "W": r"\x00-\x2f\x3a-\x40\x5b-\x5e\x60\x7b-\U0010ffff",
}


def _end_anchors(pattern: str) -> str:
    # Every `$` outside a character class and not escaped becomes Python's `\Z`; every Perl
    # class becomes RE2's ASCII one.
    out, escaped, in_class = [], False, False
    for char in pattern:
        if escaped and char in _PERL_CLASSES:
            out[-1] = _PERL_CLASSES[char] if in_class else f"[{_PERL_CLASSES[char]}]"
            escaped = False
        elif escaped:
            out.append(char)
            escaped = False
        elif char == "\\":
            out.append(char)
            escaped = True
        elif char == "[":
            in_class = True
            out.append(char)
        elif char == "]":
            in_class = False
            out.append(char)
        else:
            out.append(r"\Z" if char == "$" and not in_class else char)
    return "".join(out)


# The parts of the Kubernetes CEL libraries our rules use (the quantity library, Kubernetes
# 1.29 and later: k8s.io/apiserver/pkg/cel/library/quantity.go; `substring` from ext.Strings).
_KUBERNETES_FUNCTIONS = {
    "quantity": _quantity,
    "isQuantity": _is_quantity,
    "compareTo": _compare_to,
    "isInteger": _is_integer,
    "asInteger": _as_integer,
    "substring": _substring,
    "matches": _matches,
}


def _is_type(validator, types, instance, schema):
    # OpenAPI's `nullable: true` admits null next to the declared type.
    if instance is None and schema.get("nullable"):
        return
    names = [types] if isinstance(types, str) else list(types)
    is_int = isinstance(instance, int) and not isinstance(instance, bool)
    if "integer" in names and is_int and not INT64_MIN <= instance <= INT64_MAX:
        yield jsonschema.ValidationError(
            f"{instance} is not of type 'integer': beyond int64, the API server reads it as "
            "a float that is no JSON integer"
        )
        return
    if "integer" in names and _is_json_float_integer(instance):
        return  # kube-openapi's isFloatInt
    yield from jsonschema.Draft4Validator.VALIDATORS["type"](validator, types, instance, schema)


def _is_json_float_integer(value) -> bool:
    return (
        isinstance(value, float)
        and math.isfinite(value)
        and value.is_integer()
        and abs(value) <= JSON_FLOAT_INT_MAX
    )


def _pattern(validator, pattern, instance, schema):
    if isinstance(instance, str) and not go_search(pattern, instance):
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


_Validator = jsonschema.validators.extend(
    jsonschema.Draft4Validator, {"type": _is_type, "pattern": _pattern}
)


def to_cel(value: Any, schema: dict[str, Any]) -> Any:
    """`value` as the API server hands it to CEL under `schema`."""
    if isinstance(value, dict):
        # A null (kept only in a nullable field) of an object with properties is absent for
        # CEL: has() is false (unstructuredMap.Find in values.go); a map keeps its nulls.
        is_object = "properties" in schema
        return celpy.celtypes.MapType(
            {
                celpy.celtypes.StringType(key): to_cel(item, _property_schema(schema, key))
                for key, item in value.items()
                if item is not None or not is_object
            }
        )
    if isinstance(value, list):
        return celpy.celtypes.ListType([to_cel(item, schema.get("items", {})) for item in value])
    is_plain_int = isinstance(value, int) and not isinstance(value, bool)
    if is_plain_int and schema.get("type") == "number":
        return celpy.celtypes.DoubleType(value)
    if _is_json_float_integer(value) and schema.get("type") == "integer":
        return celpy.celtypes.IntType(int(value))
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
    """`value` without the fields `schema` does not know, and without nulls in fields that
    are not nullable (defaulting then fills in their defaults), as the API server stores it."""
    if isinstance(value, dict) and "properties" in schema:
        props = schema["properties"]
        return {
            k: pruned(v, props[k])
            for k, v in value.items()
            if k in props and (v is not None or props[k].get("nullable"))
        }
    if isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        return {k: pruned(v, schema["additionalProperties"]) for k, v in value.items()}
    if isinstance(value, list) and "items" in schema:
        return [pruned(item, schema["items"]) for item in value]
    return value


def api_server_errors(manifest: dict[str, Any]) -> list[str]:
    """Schema errors, or (when the schema passes) CEL errors, like the API server reports;
    and the name check every custom resource gets."""
    return name_errors(manifest) + object_errors(manifest, open_api_schema())


_DNS_1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def name_errors(manifest: dict[str, Any]) -> list[str]:
    """metadata.name of a custom resource is a DNS-1123 subdomain (apiextensions-apiserver
    pkg/registry/customresource/validator.go: ValidateObjectMetaAccessor with
    NameIsDNSSubdomain)."""
    name = (manifest.get("metadata") or {}).get("name")
    if isinstance(name, str) and (len(name) > 253 or not _DNS_1123_SUBDOMAIN.fullmatch(name)):
        return [f"metadata.name: {name!r} must be a lowercase RFC 1123 subdomain (<= 253)"]
    return []


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


# What apiextensions-apiserver's ValidateStructural (pkg/apiserver/schema/validation.go) forbids
# in a value validation under anyOf, allOf, oneOf or not: everything that says what a value
# is rather than what it must satisfy.
_NESTED_FORBIDDEN = (
    "type",
    "default",
    "description",
    "title",
    "nullable",
    "additionalProperties",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-embedded-resource",
    "x-kubernetes-int-or-string",
    "x-kubernetes-list-map-keys",
    "x-kubernetes-list-type",
    "x-kubernetes-map-type",
    "x-kubernetes-validations",
)
# The one anyOf an x-kubernetes-int-or-string node may carry with types in it (nothing else
# in its branches: the API server compares them with reflect.DeepEqual), alone or as the
# first allOf entry.
INT_OR_STRING_ANY_OF = [{"type": "integer"}, {"type": "string"}]


def structural_errors(schema: dict[str, Any], path: str = "openAPIV3Schema") -> list[str]:
    """What ValidateStructural reports for `schema` and every node below it."""
    errors = []
    is_int_or_string = bool(schema.get("x-kubernetes-int-or-string"))
    skip_any_of = is_int_or_string and schema.get("anyOf") == INT_OR_STRING_ANY_OF
    all_of = schema.get("allOf", [])
    skip_first_all_of = (
        is_int_or_string and all_of[:1] and all_of[0].get("anyOf") == (INT_OR_STRING_ANY_OF)
    )
    for junctor in ("anyOf", "allOf", "oneOf"):
        for index, branch in enumerate(schema.get(junctor, [])):
            if junctor == "anyOf" and skip_any_of:
                continue
            skip = junctor == "allOf" and index == 0 and skip_first_all_of
            errors += _nested_errors(branch, f"{path}.{junctor}[{index}]", skip_any_of=skip)
    if "not" in schema:
        errors += _nested_errors(schema["not"], f"{path}.not")
    for name, sub in schema.get("properties", {}).items():
        errors += structural_errors(sub, f"{path}.properties[{name}]")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            errors += structural_errors(schema[key], f"{path}.{key}")
    return errors


def _nested_errors(branch: dict[str, Any], path: str, skip_any_of: bool = False) -> list[str]:
    errors = [
        f"{path}.{key}: must be empty to be structural"
        for key in _NESTED_FORBIDDEN
        if key in branch
    ]
    for junctor in ("anyOf", "allOf", "oneOf"):
        if junctor == "anyOf" and skip_any_of:
            continue
        for index, sub in enumerate(branch.get(junctor, [])):
            errors += _nested_errors(sub, f"{path}.{junctor}[{index}]")
    for name, sub in branch.get("properties", {}).items():
        errors += _nested_errors(sub, f"{path}.properties[{name}]")
    if isinstance(branch.get("items"), dict):
        errors += _nested_errors(branch["items"], f"{path}.items")
    if "not" in branch:
        errors += _nested_errors(branch["not"], f"{path}.not")
    return errors


# Static CEL cost, as the API server estimates it when a CRD is created or updated.
#
# apiextensions-apiserver (pkg/apiserver/schema/cel/compilation.go and
# pkg/apis/apiextensions/validation/validation.go) refuses a rule whose estimated cost, times
# how often its node can occur in one object, is over StaticEstimatedCostLimit, and the CRD
# when all its rules together are over StaticEstimatedCRDCostLimit. The estimate is cel-go's
# checker/cost.go (v0.17.8 in Kubernetes 1.30, the oldest version the chart supports) with
# Kubernetes' sizes and library costs (k8s.io/apiserver/pkg/cel/common/schemas.go,
# pkg/cel/library/cost.go). What the estimate rests on:
#
# - A value's size is its schema's bound: a string's maxLength times 4 (bytes per code
#   point), the longest enum value, or the whole request (3 MiB) without either; an
#   x-kubernetes-int-or-string value is the whole request even with a maxLength before
#   Kubernetes 1.34 (kubernetes#132837); a list's maxItems, a map's maxProperties. A map key
#   has no bound of its own (size 0).
# - A call costs 1; string traversals (startsWith, substring, string() of a dyn value,
#   quantity(), isQuantity(), ==) cost ceil(size * 0.1); `matches` ceil((size + 1) * 0.1) times
#   ceil(len(regex) * 0.25); `in` a list its size; both sides of && and || always count.
# - A macro (all, exists, exists_one, filter, map) costs its range's size times its step.
STATIC_ESTIMATED_COST_LIMIT = 10_000_000
STATIC_ESTIMATED_CRD_COST_LIMIT = 100_000_000
MAX_REQUEST_SIZE = 3 * 1024 * 1024
_UNKNOWN = 2**64 - 1
_TRAVERSAL = 0.1
_REGEX_LENGTH = 0.25
_MACROS = {"all", "exists", "exists_one", "filter", "map"}
_TRAVERSING_FUNCTIONS = {"quantity", "isQuantity"}


class _Value:
    """What the estimator knows of a subexpression: its cost, its largest size, the schema
    node it was read from (None for computed values) and, for a list literal, "list"."""

    def __init__(
        self, cost: int, size: int | None = None, schema: dict | None = None, kind: str = ""
    ):
        self.cost, self.size, self.schema = cost, size, schema
        self.kind = kind or _kind(schema)


def _kind(schema: dict | None) -> str:
    if schema is None:
        return "computed"
    if schema.get("x-kubernetes-int-or-string"):
        return "dyn"
    if schema.get("type") == "object" and isinstance(schema.get("additionalProperties"), dict):
        return "map"
    return {"array": "list"}.get(schema.get("type"), schema.get("type", "dyn"))


def max_elements(schema: dict) -> int:
    """The size Kubernetes 1.30 gives a value of `schema` (DeclType.MaxElements)."""
    kind = _kind(schema)
    if kind == "dyn":
        return MAX_REQUEST_SIZE - 2
    if kind == "string":
        if "maxLength" in schema:
            return schema["maxLength"] * 4
        if "enum" in schema:
            return max(len(v) for v in schema["enum"])
        return MAX_REQUEST_SIZE - 2
    # Unbounded: as many of the smallest items as fit the request (here strings, `""`, plus a
    # comma; a map's values with their key, quotes and colon).
    if kind == "list":
        return schema.get("maxItems", (MAX_REQUEST_SIZE - 2) // 3)
    if kind == "map":
        return schema.get("maxProperties", (MAX_REQUEST_SIZE - 2) // 8)
    return 0


def _size(value: _Value) -> int:
    if value.size is not None:
        return value.size
    if value.schema is not None:
        return max_elements(value.schema)
    return _UNKNOWN


def _traverse(size: int, factor: float = _TRAVERSAL) -> int:
    return min(_UNKNOWN, math.ceil(size * factor))


class _Coster:
    """Walks a rule's parse tree (celpy's grammar) as cel-go's coster walks its AST: each
    handler returns the subexpression's cost, size and schema node."""

    def __init__(self, schema: dict[str, Any]):
        self.scopes: list[dict[str, _Value]] = [{"self": _Value(0, schema=schema)}]

    def cost(self, tree) -> _Value:
        handler = getattr(self, f"_{tree.data}", None)
        if handler is not None:
            return handler(tree)
        operands = [c for c in tree.children if hasattr(c, "data")]
        if len(operands) == 1 and len(tree.children) == 1:
            return self.cost(operands[0])
        raise ValueError(f"no cost estimate for CEL node {tree.data}")

    def _expr(self, tree) -> _Value:
        if len(tree.children) == 1:
            return self.cost(tree.children[0])
        cond, yes, no = (self.cost(c) for c in tree.children)
        return _Value(cond.cost + max(yes.cost, no.cost))

    def _logical(self, tree) -> _Value:
        if len(tree.children) == 1:
            return self.cost(tree.children[0])
        return _Value(sum(self.cost(c).cost for c in tree.children))

    _conditionalor = _conditionaland = _logical

    def _relation(self, tree) -> _Value:
        if len(tree.children) == 1:
            return self.cost(tree.children[0])
        operator, right_tree = tree.children
        left, right = self.cost(operator.children[0]), self.cost(right_tree)
        args = left.cost + right.cost
        if operator.data == "relation_in":
            return _Value(args + (_size(right) if right.kind == "list" else 1))
        if operator.data in ("relation_eq", "relation_ne"):
            return _Value(args + _traverse(min(_size(left), _size(right))))
        return _Value(args + 1)

    def _arithmetic(self, tree) -> _Value:
        if len(tree.children) == 1:
            return self.cost(tree.children[0])
        operator, right_tree = tree.children
        return _Value(1 + self.cost(operator.children[0]).cost + self.cost(right_tree).cost)

    _addition = _multiplication = _arithmetic

    def _unary(self, tree) -> _Value:
        if len(tree.children) == 1:
            return self.cost(tree.children[0])
        return _Value(1 + self.cost(tree.children[1]).cost)

    def _member_dot(self, tree) -> _Value:
        operand, name = self.cost(tree.children[0]), str(tree.children[1])
        schema = (operand.schema or {}).get("properties", {}).get(name)
        return _Value(operand.cost + 1, schema=schema)

    def _member_index(self, tree) -> _Value:
        operand, index = self.cost(tree.children[0]), self.cost(tree.children[1])
        schema = operand.schema or {}
        item = (
            schema.get("items") if _kind(schema) == "list" else schema.get("additionalProperties")
        )
        return _Value(
            operand.cost + index.cost + 1, schema=item if isinstance(item, dict) else None
        )

    def _ident(self, tree) -> _Value:
        name = str(tree.children[0])
        for scope in reversed(self.scopes):
            if name in scope:
                return _Value(1, scope[name].size, scope[name].schema)
        raise ValueError(f"unknown CEL variable {name}")

    def _literal(self, tree) -> _Value:
        value = _CEL.program(_CEL.compile(str(tree.children[0]))).evaluate({})
        is_text = isinstance(value, str | bytes)
        return _Value(0, len(value) if is_text else 1)

    def _paren_expr(self, tree) -> _Value:
        return self.cost(tree.children[0])

    def _list_lit(self, tree) -> _Value:
        items = self._args(tree.children)
        return _Value(10 + sum(i.cost for i in items), len(items), kind="list")

    def _ident_arg(self, tree) -> _Value:
        name, args = str(tree.children[0]), self._args(tree.children[1:])
        if name == "has":
            return _Value(args[0].cost)  # the presence test (1) instead of the field's select (1)
        cost = sum(a.cost for a in args)
        if name in _TRAVERSING_FUNCTIONS:
            return _Value(cost + _traverse(_size(args[0])))
        if name == "string" and args[0].kind == "dyn":
            # A dyn argument may be bytes: bytes_to_string traverses it.
            return _Value(cost + _traverse(_size(args[0])), _size(args[0]))
        return _Value(cost + 1)

    def _member_dot_arg(self, tree) -> _Value:
        target, name = self.cost(tree.children[0]), str(tree.children[1])
        if name in _MACROS:
            return self._macro(target, name, tree.children[2].children)
        args = self._args(tree.children[2:])
        cost = target.cost + sum(a.cost for a in args)
        if name == "matches":
            regex = _traverse(_size(args[0]), _REGEX_LENGTH)
            return _Value(cost + _traverse(_size(target) + 1) * regex)
        if name == "contains":
            return _Value(cost + _traverse(_size(target)) * _traverse(_size(args[0])))
        if name in ("startsWith", "endsWith"):
            return _Value(cost + _traverse(_size(args[0])))
        if name in ("substring", "lowerAscii", "upperAscii", "trim"):
            return _Value(cost + _traverse(_size(target)), _size(target))
        return _Value(cost + 1)

    def _args(self, children) -> list[_Value]:
        return [self.cost(c) for c in children[0].children] if children and children[0] else []

    def _macro(self, target: _Value, name: str, args) -> _Value:
        variable, body = str(next(args[0].scan_values(lambda token: True))), args[1]
        schema = target.schema
        if schema is None:
            item = None
        elif target.kind == "list":
            item = schema.get("items")
        else:
            item = {"type": "string", "maxLength": 0}  # map keys have no bound of their own
        count = _size(target)
        self.scopes.append({variable: _Value(0, 1 if item is None else None, item)})
        step = self.cost(body).cost
        self.scopes.pop()
        # Each macro's accumulator init, loop condition, step and result as cel-go expands it.
        fixed, per_item = {
            "all": (1, 3),
            "exists": (1, 4),
            "exists_one": (2, 2),
            "filter": (11, 13),
            "map": (11, 12),
        }[name]
        size = count if name in ("filter", "map") else None
        return _Value(target.cost + fixed + min(_UNKNOWN, count * (per_item + step)), size)


def rule_cost(rule: str, schema: dict[str, Any]) -> int:
    """The estimated cost of one rule on `schema` (before its node's cardinality)."""
    return _Coster(schema).cost(_CEL.compile(rule)).cost


def rule_costs(schema: dict[str, Any], path: str = "", cardinality: int = 1):
    """(path, rule, cost times cardinality) for every rule under `schema`."""
    for rule in schema.get("x-kubernetes-validations", []):
        yield path or "<root>", rule["rule"], rule_cost(rule["rule"], schema) * cardinality
    if "items" in schema:
        yield from rule_costs(schema["items"], f"{path}[*]", cardinality * max_elements(schema))
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict):
        yield from rule_costs(extra, f"{path}[*]", cardinality * max_elements(schema))
    for name, sub in schema.get("properties", {}).items():
        yield from rule_costs(sub, f"{path}.{name}", cardinality)


def cost_errors(schema: dict[str, Any]) -> list[str]:
    """What the API server reports for the rules' estimated costs when the CRD is applied."""
    costs = list(rule_costs(schema))
    errors = [
        f"{path}: estimated rule cost {cost:,} exceeds budget {STATIC_ESTIMATED_COST_LIMIT:,}"
        for path, _, cost in costs
        if cost > STATIC_ESTIMATED_COST_LIMIT
    ]
    total = sum(cost for _, _, cost in costs)
    if total > STATIC_ESTIMATED_CRD_COST_LIMIT:
        errors.append(
            f"estimated cost of all rules {total:,} exceeds the CRD's budget "
            f"{STATIC_ESTIMATED_CRD_COST_LIMIT:,}"
        )
    return errors
