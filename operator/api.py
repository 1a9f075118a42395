"""The BlendDeployment API (`blend.holeblend.io/v1alpha1`): the single source of truth.

The CRD (`holeblend-operator crd`), the chart's CRD and docs/api.md are generated from these
models. Field names are camelCase on the wire (aliases) and snake_case in Python.
"""

import math
import re
from enum import StrEnum
from typing import Annotated, Any, Literal, NamedTuple, get_args, get_origin
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from holeblend_contract import blend_settings as contract
from holeblend_contract.blend_settings import (
    Admission,
    BlendMode,
    Dtype,
    KVStoreDtype,
    SegmentContext,
    Selection,
    StorePolicy,
)
from holeblend_contract.shared_tier import CREDENTIAL_QUERY_PATTERN, check_shared_url
from holeblend_operator import host_paths, reserved
from holeblend_operator.cel import CelRule, cel_schema_extra, cel_validator
from holeblend_operator.quantity import quantity_bytes, quantity_value

GROUP = "blend.holeblend.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "BlendDeployment"
PLURAL = "blenddeployments"
SINGULAR = "blenddeployment"
SHORT_NAMES = ("bd",)

DEFAULT_RESOURCE_NAMES = {"ascend": "huawei.com/Ascend910", "nvidia": "nvidia.com/gpu"}


# Anchored pattern -> what it describes, for messages about map keys in the CRD.
PATTERN_MEANINGS: dict[str, str] = {}


class StringRule(NamedTuple):
    """A rule a regular expression cannot say, on one string: CEL over `self` for the CRD
    (on map keys the generator rewrites it over each key), the same check in Python."""

    cel: str
    check: Any  # Callable[[str], bool]
    message: str


def _matching(
    pattern: str, what: str, max_length: int | None = None, rules: tuple[StringRule, ...] = ()
):
    """A string type checked against `pattern` (and `rules`), with a message that says what
    is expected."""
    regex = re.compile(pattern)
    PATTERN_MEANINGS[f"^{pattern}$"] = what

    def check(value: str) -> str:
        if max_length is not None and len(value) > max_length:
            raise ValueError(f"{value!r} is longer than {max_length} characters; shorten it")
        if not regex.fullmatch(value):
            raise ValueError(f"{value!r} is not {what}")
        for rule in rules:
            if not rule.check(value):
                raise ValueError(f"{value!r}: {rule.message}")
        return value

    # Anchored: the API server's `pattern` is a search, pydantic's check a full match.
    schema = {"pattern": f"^{pattern}$"} | ({"maxLength": max_length} if max_length else {})
    if rules:
        schema["x-kubernetes-validations"] = [{"rule": r.cel, "message": r.message} for r in rules]
    return Annotated[str, AfterValidator(check), Field(json_schema_extra=schema)]


# What str.isspace() calls whitespace, which the runtime refuses as a whole separator. Spelled
# out: the API server's `pattern` is RE2, whose `\s` is ASCII only ([\t\n\f\r ]) and would
# let a no-break space or a vertical tab through to an operator that then refuses it.
_UNICODE_SPACE = (
    "\t\n\v\f\r\x1c\x1d\x1e\x1f \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
)
# Some character that is not whitespace, up to 64 in all.
Separator = _matching(
    rf"[\s\S]*[^{_UNICODE_SPACE}][\s\S]*",
    "a separator with a visible character (whitespace alone is refused by the runtime), "
    "like ' # #'",
    max_length=64,
)
DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS_SUBDOMAIN = rf"{DNS_LABEL}(\.{DNS_LABEL})*"
# At most 63 characters: the name part of label keys, annotation keys and resource names.
LABEL_NAME = r"([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]"
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
# Annotation keys are qualified names once lower-cased (ValidateAnnotations in
# k8s.io/apimachinery/pkg/api/validation/objectmeta.go): their prefix may have upper case.
DNS_LABEL_ANY_CASE = r"[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?"
DNS_SUBDOMAIN_ANY_CASE = rf"{DNS_LABEL_ANY_CASE}(\.{DNS_LABEL_ANY_CASE})*"

# IsQualifiedName (k8s.io/apimachinery/pkg/api/validate/content/kube.go, IsLabelKey): the
# prefix is a DNS-1123 subdomain, so at most 253 characters; a pattern cannot count it.
_PREFIX_AT_MOST_253 = StringRule(
    cel="!self.contains('/') || self.matches('^[^/]{1,253}/')",
    check=lambda key: "/" not in key or len(key.split("/", 1)[0]) <= 253,
    message="the prefix before '/' must be at most 253 characters (a DNS subdomain)",
)
# hasChDirPrefix in k8s.io/apimachinery/pkg/util/validation/validation.go, applied by
# IsEnvVarName (env names) and IsConfigMapKey (Secret and ConfigMap keys).
_NOT_DOT_OR_DOT_DOT = StringRule(
    cel="self != '.' && !self.startsWith('..')",
    check=lambda name: name != "." and not name.startswith(".."),
    message="must not be '.' or '..' or start with '..'",
)

# A '..' component is refused whatever the operator's host-path prefixes
# (host_paths.check_host_path, as ValidateHostPathVolumeSource's validatePathNoBacksteps in
# pkg/apis/core/validation/validation.go): the CRD refuses it too, so such a spec never
# reaches the operator to turn Degraded. The models' validators say it with the path.
# CEL: the path has no '..' component.
_NO_DOT_DOT_COMPONENT_CEL = r"!self.matches('(^|/)\\.\\.(/|$)')"
_NO_DOT_DOT_COMPONENT = StringRule(
    cel=_NO_DOT_DOT_COMPONENT_CEL,
    check=lambda path: True,  # checked with the path in its message by host_paths
    message="the path contains '..'; write the directory without it",
)
AbsolutePath = _matching(
    r"/.*",
    "an absolute path like /data/models",
    max_length=4096,
    rules=(_NO_DOT_DOT_COMPONENT,),
)
StoreUrl = _matching(
    r"[a-z][a-z0-9+.-]*://.+", "a URL like redis://kv-cache:6379/0", max_length=2048
)
HttpUrl = _matching(r"https?://.+", "an http(s) URL like http://prometheus:9090", max_length=2048)
# IsExtendedResourceName (pkg/apis/core/helper/helpers.go) wants "requests." + the name to
# be a qualified name: the prefix of an extended resource is at most 253 - 9 characters.
_EXTENDED_PREFIX_AT_MOST_244 = StringRule(
    cel="!self.contains('/') || self.matches('^[^/]{1,244}/')",
    check=lambda name: "/" not in name or len(name.split("/", 1)[0]) <= 244,
    message="the prefix before '/' must be at most 244 characters (an extended resource name)",
)
ResourceName = _matching(
    rf"{DNS_SUBDOMAIN}/{LABEL_NAME}",
    "an extended resource name like 'huawei.com/Ascend910' or 'nvidia.com/gpu'",
    max_length=253,
    rules=(_EXTENDED_PREFIX_AT_MOST_244,),
)
LabelKey = _matching(
    rf"({DNS_SUBDOMAIN}/)?{LABEL_NAME}",
    "a label key ('name' or 'prefix.example.com/name', letters, digits, '-', '_', '.')",
    max_length=317,
    rules=(_PREFIX_AT_MOST_253,),
)
AnnotationKey = _matching(
    rf"({DNS_SUBDOMAIN_ANY_CASE}/)?{LABEL_NAME}",
    "an annotation key ('name' or 'prefix.example.com/name', letters, digits, '-', '_', '.')",
    max_length=317,
    rules=(_PREFIX_AT_MOST_253,),
)
# A toleration's key may be empty (with operator Exists: every taint), ValidateTolerations in
# pkg/apis/core/validation/validation.go; otherwise a qualified name.
TolerationKey = _matching(
    rf"(({DNS_SUBDOMAIN}/)?{LABEL_NAME})?",
    "a taint key ('name' or 'prefix.example.com/name'), or '' with operator Exists",
    max_length=317,
    rules=(_PREFIX_AT_MOST_253,),
)
LabelValue = _matching(
    rf"({LABEL_NAME})?",
    "a label value (at most 63 letters, digits, '-', '_', '.'; starting and ending alphanumeric)",
    max_length=63,
)
# IsEnvVarName (k8s.io/apimachinery/pkg/util/validation/validation.go), as the API server
# applies it without the RelaxedEnvironmentVariableValidation gate: the names every
# supported version accepts.
EnvName = _matching(
    r"[-._a-zA-Z][-._a-zA-Z0-9]*",
    "an environment variable name like 'HF_HOME'",
    max_length=128,
    rules=(_NOT_DOT_OR_DOT_DOT,),
)
# IsConfigMapKey (same file): the key of a Secret or ConfigMap a pod references.
ConfigMapKey = _matching(
    r"[-._a-zA-Z0-9]+",
    "a Secret key (letters, digits, '-', '_', '.')",
    max_length=253,
    rules=(_NOT_DOT_OR_DOT_DOT,),
)
# What Go's strings.TrimSpace trims (unicode.IsSpace): the API server refuses an image with
# any of it at either end (validateContainerCommon in pkg/apis/core/validation/validation.go:
# "must not have leading or trailing whitespace").
_GO_SPACE = "\t\n\v\f\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
Image = _matching(
    rf"[^{_GO_SPACE}]([\s\S]*[^{_GO_SPACE}])?",
    "a container image like 'registry.example.com/vllm:0.9' without leading or trailing whitespace",
    max_length=512,
)
AnnotationValue = Annotated[str, Field(max_length=4096)]
NetworkInterface = _matching(
    r"[A-Za-z0-9][-A-Za-z0-9_.:]{0,14}", "a network interface name like 'eth0'", max_length=15
)
DnsName = _matching(
    DNS_SUBDOMAIN, "a DNS-1123 name (lowercase letters, digits, '-', '.')", max_length=253
)
# Kubernetes' own quantity pattern admits negative values and fractional exponents
# ('1e0.5'), which its parser then rejects; this one admits only what parses and is >= 0.
QUANTITY_PATTERN = (
    r"\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?[0-9]{1,2}))?"
)
QUANTITY_MAX_LENGTH = 64


def _wire_quantity(value: Any) -> Any:
    # A JSON integer within int64, or an integral float (`2.0`, an integer to the API server:
    # kube-openapi pkg/validation/validate/type.go, isFloatInt): a larger integer is read as a
    # float that is no integer, so no int-or-string (see tests/operator/crd_validation.py).
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= INT64_MAX:
        return str(value)
    if _is_json_float_integer(value) and value >= 0:
        return str(int(value))
    if isinstance(value, float) and math.isfinite(value) and value >= 0:
        # `cpu: 0.5` is fine in a pod, whose quantities parse numbers; here it is no integer.
        raise ValueError(
            "the API server takes a quantity as an integer or a string, not the number "
            f"{value!r}; quote it: '{value!r}'"
        )
    return value


# Kubernetes accepts `cpu: 2` as well as `cpu: "2"`: keep quantities as strings inside,
# accept both on the wire.
Quantity = Annotated[
    _matching(
        QUANTITY_PATTERN,
        "a non-negative Kubernetes quantity like '500m', '2', '16Gi'",
        max_length=QUANTITY_MAX_LENGTH,
    ),
    BeforeValidator(lambda v: _wire_quantity(v)),
    # The API server takes exactly this anyOf under int-or-string (anything more in it, such
    # as a minimum, makes the CRD non-structural and refused); beside it, `minimum` applies to
    # integers only, as `pattern` and `maxLength` apply to strings only.
    WithJsonSchema(
        {
            "x-kubernetes-int-or-string": True,
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "minimum": 0,
            "pattern": f"^{QUANTITY_PATTERN}$",
            "maxLength": QUANTITY_MAX_LENGTH,
        }
    ),
]
ResourceKey = _matching(
    rf"(cpu|memory|ephemeral-storage|hugepages-[-A-Za-z0-9]+|{DNS_SUBDOMAIN}/{LABEL_NAME})",
    "a resource name: cpu, memory, ephemeral-storage or an extended resource like nvidia.com/gpu",
    max_length=253,
    rules=(_EXTENDED_PREFIX_AT_MOST_244,),
)
# The API server estimates each CEL rule's cost when the CRD is applied and refuses the CRD
# when one rule is over 10,000,000 or all are over 100,000,000. Before Kubernetes 1.34 it sizes
# an x-kubernetes-int-or-string value as the whole request (3 MiB) whatever its maxLength, so
# reading one quantity (`quantity(string(v))`) is estimated at 629,146 per key: a rule that
# compares requests with limits reads two per key, and the rules of both containers' resources
# read 20 per key in all. 6 keys keep every rule under its budget and the CRD under its own.
RESOURCE_LIST_MAX_ITEMS = 6
ResourceList = Annotated[dict[ResourceKey, Quantity], Field(max_length=RESOURCE_LIST_MAX_ITEMS)]


# A byte budget the runtime reads as a whole number of bytes: also checked by the parser the
# renderer uses, so a quantity the pattern admits but the parser cannot read (a fractional
# exponent) is an invalid spec, not a render error.
def _readable_bytes(value: str) -> str:
    quantity_bytes(value)  # ValueError if the runtime's byte budget could not be read from it
    return value


ByteCount = Annotated[Quantity, AfterValidator(_readable_bytes)]


class ApiModel(BaseModel):
    """Base of every API object: camelCase on the wire, unknown fields rejected, immutable."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        use_attribute_docstrings=True,
        # As typed as the CRD: "3" is not an integer and "yes" not a boolean, here as there.
        # Enum fields opt out (`strict=False`) so they take their string values.
        strict=True,
    )

    @model_validator(mode="before")
    @classmethod
    def _as_the_api_server_reads_it(cls, data: Any) -> Any:
        """Nulls and integral floats as the API server takes them, before strict typing.

        A null in a field that is not nullable (not `X | None`) is pruned and the field
        defaulted (apiextensions-apiserver pkg/apiserver/schema/defaulting/prunenulls.go);
        `2.0` in an integer field or list of integers is the integer 2 (kube-openapi
        pkg/validation/validate/type.go, isFloatInt: integral and at most 2**53).
        """
        if not isinstance(data, dict):
            return data
        fields = _wire_fields(cls)
        out = {}
        for key, value in data.items():
            annotation = fields.get(key)
            if annotation is not None and value is None and not _admits_none(annotation):
                continue
            if annotation is not None and _is_json_float_integer(value) and _is_int(annotation):
                value = int(value)
            if isinstance(value, list) and _is_int_list(annotation):
                value = [int(item) if _is_json_float_integer(item) else item for item in value]
            out[key] = value
        return out


def _wire_fields(model: type[BaseModel]) -> dict[str, Any]:
    if model not in _WIRE_FIELDS:
        fields = {}
        for name, info in model.model_fields.items():
            fields[name] = fields[info.alias or name] = info.annotation
        _WIRE_FIELDS[model] = fields
    return _WIRE_FIELDS[model]


_WIRE_FIELDS: dict[type, dict[str, Any]] = {}


def _admits_none(annotation: Any) -> bool:
    return annotation is None or type(None) in get_args(annotation)


def _is_int(annotation: Any) -> bool:
    return annotation is int or (int in get_args(annotation) and bool not in get_args(annotation))


def _is_int_list(annotation: Any) -> bool:
    return get_origin(annotation) is list and _is_int(get_args(annotation)[0])


def _is_json_float_integer(value: Any) -> bool:
    return (
        isinstance(value, float)
        and math.isfinite(value)
        and value.is_integer()
        and abs(value) <= 2**53
    )


def _is_extended(name: str) -> bool:
    # Extended resources (device plugins, HAMi's -memory/-core) and hugepages cannot be
    # overcommitted: the API server wants them in limits, with requests equal to limits.
    return "/" in name or name.startswith("hugepages-")


def _requests_within_limits(r) -> bool:
    return all(
        quantity_value(value) <= quantity_value(r.limits[name])
        for name, value in r.requests.items()
        if name in r.limits
    )


def _extended_in_limits(r) -> bool:
    return all(
        name in r.limits and quantity_value(value) == quantity_value(r.limits[name])
        for name, value in r.requests.items()
        if _is_extended(name)
    )


# `quantity()` is Kubernetes' CEL quantity library (Kubernetes 1.29 and later).
_QUANTITY_CEL = "quantity(string({}))"
_REQUESTS_WITHIN_LIMITS = CelRule(
    rule="!has(self.requests) || !has(self.limits) || self.requests.all(k, !(k in self.limits) || "
    + _QUANTITY_CEL.format("self.requests[k]")
    + ".compareTo("
    + _QUANTITY_CEL.format("self.limits[k]")
    + ") <= 0)",
    message="every request must be at most its limit; lower the request or raise the limit",
    check=_requests_within_limits,
    field_path=".requests",
)
_EXTENDED_IN_LIMITS = CelRule(
    rule="!has(self.requests) || self.requests.all(k, !(k.contains('/') || k.startsWith('hugepages-')) || "
    "(has(self.limits) && k in self.limits && "
    + _QUANTITY_CEL.format("self.requests[k]")
    + ".compareTo("
    + _QUANTITY_CEL.format("self.limits[k]")
    + ") == 0))",
    message="extended resources and hugepages must be in limits too, equal to the request; "
    "add them to limits",
    check=_extended_in_limits,
    field_path=".limits",
)


# What ValidateResourceRequirements (pkg/apis/core/validation/validation.go) checks beyond
# the above, for both requests and limits:
# - extended resources (a '/' in the name, not under kubernetes.io/: IsExtendedResourceName
#   in pkg/apis/core/helper/helpers.go) are whole numbers (ValidateResourceQuantityValue,
#   "must be an integer"); CEL's `isInteger()` also wants them written as one (`kube_int64`);
# - hugepages-<size> quantities are whole multiples of the page size, which must be a
#   positive whole quantity (validateResourceQuantityHugePageValue and
#   IsHugePageResourceValueDivisible in pkg/apis/core/helper/helpers.go);
# - hugepages need cpu or memory in requests or limits ("HugePages require cpu or memory").
def _is_extended_name(name: str) -> bool:
    return "/" in name and "kubernetes.io/" not in name


# Quantity suffixes as ParseQuantity reads them: a power of ten, or of two for the binary ones.
_DECIMAL_EXPONENTS = {
    "n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18,
}  # fmt: skip
_BINARY_EXPONENTS = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}


def kube_int64(quantity: str) -> int | None:
    """`quantity` as Kubernetes' Quantity.AsInt64 gives it (CEL's `isInteger()` and
    `asInteger()`), None where that fails.

    AsInt64 reads the form ParseQuantity stored, not the value: it fails for a whole value
    written with decimals or a smaller unit ('1.0', '1000m': a negative scale), for a
    fraction with a binary suffix ('0.5Gi'), and for more digits than the int64 form takes
    (over 18; 1Pi and up), all kept as a big decimal. ParseQuantity in
    k8s.io/apimachinery/pkg/api/resource/quantity.go, int64Amount.AsInt64 in amount.go.
    """
    try:
        quantity_value(quantity)
    except ValueError:
        return None
    sign, num, denom, suffix = re.fullmatch(
        r"([+-]?)0*([0-9]*)(?:\.([0-9]*))?(.*)", quantity
    ).groups()
    num, denom = num or "0", denom or ""
    if suffix in _BINARY_EXPONENTS:
        exponent = _BINARY_EXPONENTS[suffix]
        if denom or 15 - len(num) - exponent * 3 // 10 - 1 < 0:
            return None
        value, scale = int(num) << exponent, 0
    else:
        exponent = _DECIMAL_EXPONENTS.get(suffix)
        scale = (int(suffix[1:]) if exponent is None else exponent) - len(denom)
        if len(num) + len(denom) > 18 or scale < 0:
            return None
        value = int(num + denom) * 10**scale
    if value > INT64_MAX:
        return None
    return -value if sign == "-" else value


def _is_whole(quantity: str) -> bool:
    return kube_int64(quantity) is not None


def _hugepage_multiple(name: str, quantity: str) -> bool:
    page, value = kube_int64(name.removeprefix("hugepages-")), kube_int64(quantity)
    if page is None or page <= 0 or value is None:
        return False
    return value % page == 0


def _all_sections(r, check) -> bool:
    return all(
        check(name, value) for section in (r.requests, r.limits) for name, value in section.items()
    )


_WHOLE_CEL = _QUANTITY_CEL + ".isInteger()"
_PAGE_CEL = "quantity(k.substring(10))"
_EXTENDED_WHOLE = CelRule(
    rule=" && ".join(
        f"(!has(self.{section}) || self.{section}.all(k, !k.contains('/') || "
        f"k.contains('kubernetes.io/') || {_WHOLE_CEL.format(f'self.{section}[k]')}))"
        for section in ("requests", "limits")
    ),
    message="extended resources (like nvidia.com/gpu) are whole numbers, written as one (the API "
    "server's integer check refuses '1.0' and '1000m'); use e.g. '1', not '0.5'",
    check=lambda r: _all_sections(
        r, lambda name, value: not _is_extended_name(name) or _is_whole(value)
    ),
    field_path=".limits",
)


def _hugepages_whole_pages(section: str) -> CelRule:
    # One rule per section: together they read each quantity of both sections twice, over the
    # API server's cost budget for one rule (see RESOURCE_LIST_MAX_ITEMS).
    return CelRule(
        rule=f"!has(self.{section}) || self.{section}.all(k, !k.startsWith('hugepages-') || "
        f"(isQuantity(k.substring(10)) && {_PAGE_CEL}.isInteger() && "
        f"{_PAGE_CEL}.asInteger() > 0 && {_WHOLE_CEL.format(f'self.{section}[k]')} && "
        f"{_QUANTITY_CEL.format(f'self.{section}[k]')}.asInteger() % {_PAGE_CEL}.asInteger() == 0))",
        message="hugepages-<size> must be a whole multiple of its page size (e.g. hugepages-2Mi: "
        "4Mi, not 3Mi), with a page size like 2Mi or 1Gi, both written without a fraction "
        "(512Mi, not 0.5Gi)",
        check=lambda r: all(
            not name.startswith("hugepages-") or _hugepage_multiple(name, value)
            for name, value in getattr(r, section).items()
        ),
        field_path=f".{section}",
    )


_HUGEPAGES_NEED_CPU_OR_MEMORY = CelRule(
    rule="!((has(self.requests) && self.requests.exists(k, k.startsWith('hugepages-'))) || "
    "(has(self.limits) && self.limits.exists(k, k.startsWith('hugepages-')))) || "
    "(has(self.requests) && ('cpu' in self.requests || 'memory' in self.requests)) || "
    "(has(self.limits) && ('cpu' in self.limits || 'memory' in self.limits))",
    message="hugepages need a cpu or memory request or limit too; add e.g. memory to limits",
    check=lambda r: (
        not any(n.startswith("hugepages-") for n in [*r.requests, *r.limits])
        or any(n in ("cpu", "memory") for n in [*r.requests, *r.limits])
    ),
)
_RESOURCE_RULES = (
    _REQUESTS_WITHIN_LIMITS,
    _EXTENDED_IN_LIMITS,
    _EXTENDED_WHOLE,
    _hugepages_whole_pages("requests"),
    _hugepages_whole_pages("limits"),
    _HUGEPAGES_NEED_CPU_OR_MEMORY,
)


class Resources(ApiModel):
    """CPU, memory and device requests and limits of a container."""

    model_config = ConfigDict(json_schema_extra=cel_schema_extra(*_RESOURCE_RULES))
    check_rules = cel_validator(*_RESOURCE_RULES)

    requests: ResourceList = Field(default_factory=dict)
    """Minimum resources the scheduler reserves, e.g. {cpu: '4', memory: 32Gi}."""
    limits: ResourceList = Field(default_factory=dict)
    """Maximum resources; accelerator counts are added from `accelerator` automatically."""


# A hub id must not read as a local path or a flag to `vllm serve`: no leading '/', '.' or '-'.
HubId = _matching(
    r"[A-Za-z0-9][-A-Za-z0-9_.]{0,95}(/[A-Za-z0-9][-A-Za-z0-9_.]{0,95})?",
    "a hub repository id like 'Qwen/Qwen3-8B' (no '..', no leading '/')",
    max_length=193,
)
HubRevision = _matching(
    r"[A-Za-z0-9][-A-Za-z0-9_./]{0,254}", "a branch, tag or commit like 'main'", max_length=255
)


class PvcSource(ApiModel):
    """Model files on a PersistentVolumeClaim."""

    claim_name: DnsName
    """Name of the PersistentVolumeClaim in the BlendDeployment's namespace."""
    path: str = Field(
        default="/",
        min_length=1,
        max_length=4096,
        json_schema_extra=cel_schema_extra(
            CelRule(
                rule=_NO_DOT_DOT_COMPONENT_CEL,
                message="the path contains '..'; the model must stay inside its volume",
                check=lambda path: True,  # checked with a better message by the validator
            )
        ),
    )
    """Directory of the model inside the volume; '/' is the volume's root, '..' is refused."""

    @field_validator("path")
    @classmethod
    def _inside_the_volume(cls, path: str) -> str:
        if host_paths.has_dot_dot(path):
            raise ValueError(f"{path!r} contains '..'; the model must stay inside its volume")
        return path


class HostPathSource(ApiModel):
    """Model files in a directory on every node."""

    path: AbsolutePath
    """Absolute directory on the node, e.g. /data/models/Qwen3-8B; must lie under one of the
    operator's allowed host-path prefixes (by default /data/models and /usr/local/Ascend)."""

    @field_validator("path")
    @classmethod
    def _allowed(cls, path: str, info: ValidationInfo) -> str:
        return host_paths.check_host_path(path, host_paths.prefixes_of(info.context))


class HubSource(ApiModel):
    """Model downloaded from a model hub at start (clusters that can reach one)."""

    id: HubId
    """Repository id on the hub, e.g. Qwen/Qwen3-8B."""
    revision: HubRevision | None = None
    """Branch, tag or commit; the hub's default branch when unset."""


_ONE_SOURCE = CelRule(
    rule="[has(self.pvc), has(self.hostPath), has(self.hub)].filter(x, x).size() == 1",
    message="set exactly one of model.source.pvc, model.source.hostPath or model.source.hub",
    check=lambda s: sum(x is not None for x in (s.pvc, s.host_path, s.hub)) == 1,
)


class ModelSource(ApiModel):
    """Where the model's weights come from: exactly one of pvc, hostPath or hub."""

    model_config = ConfigDict(json_schema_extra=cel_schema_extra(_ONE_SOURCE))
    check_rules = cel_validator(_ONE_SOURCE)

    pvc: PvcSource | None = None
    """Weights on a PersistentVolumeClaim (recommended for production)."""
    host_path: HostPathSource | None = None
    """Weights pre-staged on every node."""
    hub: HubSource | None = None
    """Weights from a hub; needs network access from the pods."""


class ModelSpec(ApiModel):
    """The served model."""

    name: str = Field(min_length=1, max_length=253)
    """Model identity, e.g. Qwen/Qwen3-8B; part of every KV cache key, with the weights'
    path: new weights at the same path need a new name, or they reuse the old ones' KV."""
    served_name: str | None = Field(default=None, min_length=1, max_length=253)
    """Name clients use in the OpenAI API; defaults to `name`."""
    source: ModelSource
    """Where the weights come from."""
    dtype: Dtype = Field(default=Dtype.AUTO, strict=False)
    """Weight and activation dtype; `auto` takes the checkpoint's."""
    max_model_len: int | None = Field(default=None, ge=128, le=1048576)
    """Longest prompt plus answer in tokens; the model's own limit when unset (vLLM pods:
    --max-model-len; holeblend-serve: the same limit, from blend.json). Above the model's
    context the engine refuses to start, naming it."""


class EnvVar(ApiModel):
    """A plain environment variable."""

    name: EnvName
    """Variable name."""
    value: str = Field(default="", max_length=4096)
    """Variable value."""


_NO_OPERATOR_KEYS = {
    "x-kubernetes-validations": [
        {
            "rule": "self.all(k, "
            + " && ".join(f"!k.startsWith('{p}')" for p in reserved.RESERVED_METADATA_PREFIXES)
            + ")",
            "message": "keys under "
            + " and ".join(reserved.RESERVED_METADATA_PREFIXES)
            + " are set by the operator; use a key of your own",
        }
    ]
}
_NO_OPERATOR_OR_SECURITY_KEYS = {
    "x-kubernetes-validations": [
        *_NO_OPERATOR_KEYS["x-kubernetes-validations"],
        {"rule": reserved.DENIED_ANNOTATIONS_RULE, "message": reserved.DENIED_ANNOTATIONS_MESSAGE},
    ]
}


_PORTS_DIFFER = CelRule(
    rule="self.port != self.metricsPort",
    message="engine.metricsPort must differ from engine.port; pick another port for either",
    check=lambda e: e.port != e.metrics_port,
    field_path=".metricsPort",
)


# Well-known annotations the API server checks on a pod template
# (ValidatePodSpecificAnnotations in pkg/apis/core/validation/validation.go) and on the pods
# the Deployment creates (ValidatePodCreate, validateSeccompAnnotationsAndFields).
MIRROR_POD_ANNOTATION = "kubernetes.io/config.mirror"
TOLERATIONS_ANNOTATION = "scheduler.alpha.kubernetes.io/tolerations"
DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
SECCOMP_POD_ANNOTATION = "seccomp.security.alpha.kubernetes.io/pod"
SECCOMP_CONTAINER_PREFIX = "container.seccomp.security.alpha.kubernetes.io/"
APPARMOR_CONTAINER_PREFIX = "container.apparmor.security.beta.kubernetes.io/"
# The engine pod's only container (render/engine.py names it).
ENGINE_CONTAINER = "engine"


def _annotation(key: str, cel: str) -> str:
    """CEL: `cel` (over VALUE, the annotation's value) holds when podAnnotations has `key`."""
    value = f"self.podAnnotations['{key}']"
    return f"!has(self.podAnnotations) || !('{key}' in self.podAnnotations) || ({cel.replace('VALUE', value)})"


def is_deletion_cost(value: str) -> bool:
    """GetDeletionCostFromPodAnnotations (pkg/apis/core/helper/helpers.go): no '+', no
    leading zero (but '-0..' is read), then strconv.ParseInt(value, 10, 32)."""
    if not re.fullmatch(r"0|[1-9][0-9]*|-[0-9]+", value):
        return False
    return -(2**31) <= int(value) <= INT32_MAX


def is_seccomp_profile(value: str) -> bool:
    """ValidateSeccompProfile (pkg/apis/core/validation/validation.go): runtime/default,
    docker/default, unconfined or localhost/<relative path without '..' elements>."""
    if value in ("runtime/default", "docker/default", "unconfined"):
        return True
    path = value.removeprefix("localhost/")
    return value != path and not path.startswith("/") and ".." not in path.split("/")


def is_apparmor_profile(value: str) -> bool:
    """ValidateProfileFormat (pkg/apis/core/validation/validation.go)."""
    return value in ("", "runtime/default", "unconfined") or value.startswith("localhost/")


_CEL_DELETION_COST = "VALUE.matches('^(0|[1-9][0-9]{0,9}|-0*[0-9]{1,10})$') && int(VALUE) >= -2147483648 && int(VALUE) <= 2147483647"
_CEL_SECCOMP = (
    "VALUE == 'runtime/default' || VALUE == 'docker/default' || VALUE == 'unconfined' || "
    "(VALUE.startsWith('localhost/') && !VALUE.startsWith('localhost//') && "
    "!VALUE.matches('(^|/)[.][.](/|$)'))"
)
_WELL_KNOWN_ANNOTATION_RULES = (
    CelRule(
        rule=f"!has(self.podAnnotations) || !('{MIRROR_POD_ANNOTATION}' in self.podAnnotations)",
        message=f"engine.podAnnotations: {MIRROR_POD_ANNOTATION} marks static pods and needs "
        "spec.nodeName, which Deployment pods never have; remove it",
        check=lambda e: MIRROR_POD_ANNOTATION not in e.pod_annotations,
        field_path=".podAnnotations",
    ),
    CelRule(
        rule=_annotation(TOLERATIONS_ANNOTATION, "VALUE == ''"),
        message=f"engine.podAnnotations: {TOLERATIONS_ANNOTATION} is the old form of "
        "tolerations; set accelerator.tolerations instead",
        check=lambda e: not e.pod_annotations.get(TOLERATIONS_ANNOTATION),
        field_path=".podAnnotations",
    ),
    CelRule(
        rule=_annotation(DELETION_COST_ANNOTATION, _CEL_DELETION_COST),
        message=f"engine.podAnnotations: {DELETION_COST_ANNOTATION} must be a 32-bit integer "
        "like '100' or '-5' (no '+', no leading zeros)",
        check=lambda e: (
            DELETION_COST_ANNOTATION not in e.pod_annotations
            or is_deletion_cost(e.pod_annotations[DELETION_COST_ANNOTATION])
        ),
        field_path=".podAnnotations",
    ),
    CelRule(
        rule=_annotation(
            SECCOMP_POD_ANNOTATION, "VALUE == 'runtime/default' || VALUE == 'docker/default'"
        ),
        message=f"engine.podAnnotations: the engine pod's seccompProfile is RuntimeDefault and "
        f"{SECCOMP_POD_ANNOTATION} must match it; use runtime/default or remove it",
        check=lambda e: (
            e.pod_annotations.get(SECCOMP_POD_ANNOTATION, "runtime/default")
            in ("runtime/default", "docker/default")
        ),
        field_path=".podAnnotations",
    ),
    CelRule(
        rule=f"!has(self.podAnnotations) || self.podAnnotations.all(k, "
        f"!k.startsWith('{SECCOMP_CONTAINER_PREFIX}') || "
        f"({_CEL_SECCOMP.replace('VALUE', 'self.podAnnotations[k]')}))",
        message=f"engine.podAnnotations: {SECCOMP_CONTAINER_PREFIX}* must be runtime/default, "
        "unconfined or localhost/<relative path without '..'>",
        check=lambda e: all(
            is_seccomp_profile(v)
            for k, v in e.pod_annotations.items()
            if k.startswith(SECCOMP_CONTAINER_PREFIX)
        ),
        field_path=".podAnnotations",
    ),
    CelRule(
        rule=f"!has(self.podAnnotations) || self.podAnnotations.all(k, "
        f"!k.startsWith('{APPARMOR_CONTAINER_PREFIX}') || "
        f"(k == '{APPARMOR_CONTAINER_PREFIX}{ENGINE_CONTAINER}' && "
        "(self.podAnnotations[k] in ['', 'runtime/default', 'unconfined'] || "
        "self.podAnnotations[k].startsWith('localhost/'))))",
        message=f"engine.podAnnotations: the engine pod's container is '{ENGINE_CONTAINER}', so "
        f"the only AppArmor annotation is {APPARMOR_CONTAINER_PREFIX}{ENGINE_CONTAINER}, with "
        "runtime/default, unconfined or localhost/<profile>",
        check=lambda e: all(
            k == APPARMOR_CONTAINER_PREFIX + ENGINE_CONTAINER and is_apparmor_profile(v)
            for k, v in e.pod_annotations.items()
            if k.startswith(APPARMOR_CONTAINER_PREFIX)
        ),
        field_path=".podAnnotations",
    ),
)


class EngineSpec(ApiModel):
    """The vLLM engine pods that run the hole-mode blending runtime."""

    model_config = ConfigDict(
        json_schema_extra=cel_schema_extra(_PORTS_DIFFER, *_WELL_KNOWN_ANNOTATION_RULES)
    )
    check_rules = cel_validator(_PORTS_DIFFER, *_WELL_KNOWN_ANNOTATION_RULES)

    image: Image | None = None
    """Container image; a holeblend runtime image for the accelerator type when unset."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """When the kubelet pulls the image."""
    tensor_parallel_size: int = Field(default=1, ge=1, le=64)
    """Devices one engine shards the model over; at most `accelerator.count`."""
    extra_args: list[Annotated[str, Field(max_length=1024)]] = Field(
        default_factory=list,
        max_length=64,
        json_schema_extra=cel_schema_extra(
            CelRule(
                rule=reserved.RESERVED_FLAGS_RULE,
                message=reserved.RESERVED_FLAGS_MESSAGE,
                check=lambda args: reserved.reserved_flag_problem(args) is None,
            )
        ),
    )
    """Extra `vllm serve` arguments (holeblend-serve flags on `accelerator.type: cpu`), e.g.
    ['--max-num-seqs', '8', '--gpu-memory-utilization=0.85']. Flags the operator sets or the
    blend needs (--port, --tensor-parallel-size, --enforce-eager, --enable-prefix-caching, ...)
    are refused in every spelling vLLM reads: abbreviated (--por), with '_', with '=',
    negated (--no-...) or as a dotted key (--kv-transfer-config.kv_role); the list is under
    "Reserved flags" in docs/api.md."""
    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=64,
        json_schema_extra=cel_schema_extra(
            CelRule(
                rule=reserved.RESERVED_ENV_RULE,
                message=reserved.RESERVED_ENV_MESSAGE,
                check=lambda env: True,
            ),
            CelRule(
                rule=reserved.UNIQUE_ENV_RULE,
                message="env names must be unique",
                check=lambda env: True,
            ),
        ),
    )
    """Extra environment variables of the engine container; names must be unique. Those the
    operator sets (*_VISIBLE_DEVICES, HOME, ...) and every HOLEBLEND_* variable except
    HOLEBLEND_ENGINE_URL (deprecated: tuning.qualityProxies replaces it), HOLEBLEND_ATTENTION,
    HOLEBLEND_CACHE_DIR and HOLEBLEND_SERVE_* are refused."""
    resources: Resources = Field(default_factory=Resources)
    """CPU and memory; accelerator devices are added from `accelerator`."""
    port: int = Field(default=8000, ge=1, le=65535)
    """Port of the OpenAI-compatible API and /metrics."""
    metrics_port: int = Field(default=9464, ge=1, le=65535)
    """Port of the KV connector's holeblend_* metrics on vLLM pods (vLLM's own stay on
    `port`); CPU pods (holeblend-serve) export everything on `port`."""
    shm_size: ByteCount = "8Gi"
    """Size of the in-memory /dev/shm volume (tensor-parallel workers share memory); vLLM
    pods keep their KV tier on a volume of its own, sized by blend.kv.localCpuBytes."""
    pod_labels: dict[LabelKey, LabelValue] = Field(
        default_factory=dict, max_length=32, json_schema_extra=_NO_OPERATOR_KEYS
    )
    """Extra labels of the engine pods, e.g. {volcano.sh/queue-name: inference} (scheduler
    metadata); the app.kubernetes.io/* labels are the operator's."""
    pod_annotations: dict[AnnotationKey, AnnotationValue] = Field(
        default_factory=dict, max_length=32, json_schema_extra=_NO_OPERATOR_OR_SECURITY_KEYS
    )
    """Extra annotations of the engine pods, e.g. HAMi's {hami.io/vnpu-mode: hami-core} or
    MindCluster's; keys under blend.holeblend.io/ are the operator's, and security profiles
    (AppArmor, seccomp) and container-runtime settings (CRI-O, Kata, gVisor) are refused."""
    termination_grace_period_seconds: int = Field(default=120, ge=30, le=3600)
    """How long a stopping engine pod may take: a preStop pause lets the Service stop
    routing to it, then in-flight requests finish before the pod is killed. On
    holeblend-serve pods (accelerator.type cpu) at least 53 s are rendered: the 15 s pause
    counts inside the grace period, and the server's drain (30 s), close (3 s) and stop
    follow it; a longer --drain-timeout or --shutdown-timeout in extraArgs (or its
    HOLEBLEND_SERVE_* variable in env) lengthens it to match."""
    blend_step_tokens: int | None = Field(default=None, ge=0, le=1048576)
    """vLLM pods: tokens' worth of blend compute per engine step. A request's load is
    asynchronous: its blend is spread over vLLM's steps, one model layer at a time, so
    requests decoding meanwhile wait for at most this much blend work per step. Unset: an
    eighth of vLLM's --max-num-batched-tokens (256 on vLLM's CPU server); lower trades
    time to first token for steadier inter-token latency of the others; 0: each blend runs
    whole, before its step's forward (every request of that step waits for it). Not read
    by holeblend-serve (CPU pods). Changing it restarts the pods."""

    lookup_deadline_ms: int | None = Field(default=None, ge=1, le=60000)
    """vLLM pods with a lookup server or shared KV tier: how long a request's segment lookup
    may take, run off vLLM's scheduler thread, before the request is planned as if those
    segments were missing (full prefill, counted in holeblend_lookup_late_total). Unset: the
    lookup runs on vLLM's scheduler thread, bounded by the lookup client's own timeouts.
    Not read by holeblend-serve (CPU pods). Changing it restarts the pods."""

    @field_validator("extra_args")
    @classmethod
    def _no_reserved_flags(cls, args: list[str]) -> list[str]:
        problem = reserved.reserved_flag_problem(args)
        if problem:
            raise ValueError(problem)
        return args

    @field_validator("env")
    @classmethod
    def _no_reserved_env(cls, env: list["EnvVar"]) -> list["EnvVar"]:
        problem = reserved.reserved_env_problem([var.name for var in env])
        if problem:
            raise ValueError(problem)
        return env

    @field_validator("pod_labels", "pod_annotations")
    @classmethod
    def _no_operator_keys(cls, meta: dict[str, str]) -> dict[str, str]:
        for key in meta:
            if key.startswith(reserved.RESERVED_METADATA_PREFIXES):
                raise ValueError(f"{key!r} is set by the operator; use a key of your own")
        return meta

    @field_validator("pod_annotations")
    @classmethod
    def _no_security_keys(cls, annotations: dict[str, str]) -> dict[str, str]:
        problem = reserved.denied_annotation_problem(annotations)
        if problem:
            raise ValueError(problem)
        return annotations


class AcceleratorType(StrEnum):
    ASCEND = "ascend"
    NVIDIA = "nvidia"
    CPU = "cpu"


# ValidateTolerations (pkg/apis/core/validation/validation.go): an empty key needs operator
# Exists; with Exists the value must be empty ('' or unset).
_EQUAL_NEEDS_KEY = CelRule(
    rule="self.operator == 'Exists' || (has(self.key) && self.key != '')",
    message="a toleration with operator Equal needs a key; set key, or use operator: Exists",
    check=lambda t: t.operator == "Exists" or bool(t.key),
)
_EXISTS_HAS_NO_VALUE = CelRule(
    rule="self.operator != 'Exists' || !has(self.value) || self.value == ''",
    message="a toleration with operator Exists matches any value; remove value",
    check=lambda t: t.operator != "Exists" or not t.value,
)


_SECONDS_NEED_NO_EXECUTE = CelRule(
    rule="!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
    message="tolerationSeconds applies to effect NoExecute only; set effect: NoExecute or remove it",
    check=lambda t: t.toleration_seconds is None or t.effect == "NoExecute",
    field_path=".tolerationSeconds",
)


class Toleration(ApiModel):
    """A pod toleration, as in core/v1."""

    model_config = ConfigDict(
        json_schema_extra=cel_schema_extra(
            _EQUAL_NEEDS_KEY, _EXISTS_HAS_NO_VALUE, _SECONDS_NEED_NO_EXECUTE
        )
    )
    check_rules = cel_validator(_EQUAL_NEEDS_KEY, _EXISTS_HAS_NO_VALUE, _SECONDS_NEED_NO_EXECUTE)

    key: TolerationKey | None = None
    """Taint key; empty with operator Exists tolerates every taint."""
    operator: Literal["Exists", "Equal"] = "Equal"
    """Exists matches any value; Equal matches `value`."""
    value: LabelValue | None = None
    """Taint value for operator Equal."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect to tolerate; all effects when unset."""
    toleration_seconds: int | None = Field(default=None, ge=0, le=INT32_MAX)
    """How long a NoExecute taint is tolerated; needs effect: NoExecute."""


_DEVICES_NEED_COUNT = CelRule(
    rule="self.type == 'cpu' || self.count >= 1",
    message="accelerator.count must be at least 1 for ascend and nvidia; use type: cpu for none",
    check=lambda a: a.type == AcceleratorType.CPU or a.count >= 1,
    field_path=".count",
)
_CPU_HAS_NO_RESOURCE = CelRule(
    rule="self.type != 'cpu' || !has(self.resourceName)",
    message="accelerator.resourceName applies to ascend and nvidia only; remove it for type: cpu",
    check=lambda a: a.type != AcceleratorType.CPU or a.resource_name is None,
    field_path=".resourceName",
)


class AcceleratorSpec(ApiModel):
    """Which devices the engine pods get and how they are scheduled."""

    model_config = ConfigDict(
        json_schema_extra=cel_schema_extra(_DEVICES_NEED_COUNT, _CPU_HAS_NO_RESOURCE)
    )
    check_rules = cel_validator(_DEVICES_NEED_COUNT, _CPU_HAS_NO_RESOURCE)

    type: AcceleratorType = Field(default=AcceleratorType.ASCEND, strict=False)
    """ascend (Huawei Ascend NPUs), nvidia (GPUs) or cpu."""
    count: int = Field(default=1, ge=0, le=64)
    """Devices per engine pod."""
    resource_name: ResourceName | None = None
    """Device plugin resource; huawei.com/Ascend910 (MindCluster) or nvidia.com/gpu by default.
    Set e.g. huawei.com/ascend-1980 for other Ascend device plugins."""
    node_selector: dict[LabelKey, LabelValue] = Field(default_factory=dict, max_length=32)
    """Node labels the engine pods require, e.g. {accelerator: huawei-Ascend910}."""
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32)
    """Taints of accelerator nodes the engine pods tolerate."""
    scheduler_name: DnsName | None = None
    """Scheduler of the engine pods, e.g. volcano; the default scheduler when unset."""
    driver_host_path: AbsolutePath = "/usr/local/Ascend/driver"
    """Ascend only: the node's driver directory, mounted read-only where CANN looks for it
    (/usr/local/Ascend/driver in the container) whatever its path on the node."""
    hccn_conf_host_path: AbsolutePath | None = "/etc/hccn.conf"
    """Ascend only: the node's NPU network settings, mounted read-only at /etc/hccn.conf when
    engine.tensorParallelSize > 1 (HCCL reads it); null for nodes without one."""
    network_interface: NetworkInterface | None = None
    """Network interface for collective communication between the engine's device workers
    (HCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME, TP_SOCKET_IFNAME; NCCL_SOCKET_IFNAME on nvidia),
    e.g. eth0; the libraries pick one when unset."""

    @field_validator("driver_host_path", "hccn_conf_host_path")
    @classmethod
    def _allowed(cls, path: str | None, info: ValidationInfo) -> str | None:
        if path is None:
            return None
        return host_paths.check_host_path(path, host_paths.prefixes_of(info.context))

    @property
    def effective_resource_name(self) -> str | None:
        return self.resource_name or DEFAULT_RESOURCE_NAMES.get(self.type)


class SecretKeyRef(ApiModel):
    """One key of a Secret in the BlendDeployment's namespace."""

    name: DnsName
    """Secret name."""
    key: ConfigMapKey
    """Key within the Secret."""


# The shared tier's URL sits in a ConfigMap: a password in it is refused (CEL and pydantic),
# with the fix named; the password comes from sharedPasswordSecret instead.
SharedStoreUrl = Annotated[
    _matching(
        r"(redis|rediss|valkey|valkeys)://.+",
        "a redis://, rediss://, valkey:// or valkeys:// URL like redis://kv-cache:6379/0",
        max_length=2048,
    ),
    AfterValidator(lambda url: check_shared_url(url, "spec.blend.kv.sharedUrl")),
]


def _no_credentials(url: str) -> bool:
    try:
        check_shared_url(url)
    except ValueError:
        return False
    return True


_SHARED_URL_NO_CREDENTIALS = CelRule(
    rule="!has(self.sharedUrl) || !(self.sharedUrl.matches('^[a-z]+://[^/@]*:[^/@]*@') || "
    f"self.sharedUrl.contains('#') || self.sharedUrl.matches('{CREDENTIAL_QUERY_PATTERN}'))",
    message="kv.sharedUrl must not carry credentials (it is stored in a ConfigMap): no password "
    "in user:password@, no query parameter named like password, username or token, no "
    "#fragment; remove them and reference a Secret key in kv.sharedPasswordSecret",
    check=lambda kv: kv.shared_url is None or _no_credentials(kv.shared_url),
    field_path=".sharedUrl",
)
_SECRET_NEEDS_URL = CelRule(
    rule="!has(self.sharedPasswordSecret) || has(self.sharedUrl)",
    message="kv.sharedPasswordSecret needs kv.sharedUrl; set the URL of the shared tier or remove the secret",
    check=lambda kv: kv.shared_password_secret is None or kv.shared_url is not None,
    field_path=".sharedPasswordSecret",
)


class SharedIdentity(StrEnum):
    # The deployment's own ACL user, limited to its keys (docs/shared-tier.md).
    DEPLOYMENT = "deployment"
    # The URL's user (or none) and the password, shared with whoever else holds them.
    SHARED = "shared"


def _is_shared_identity(kv: "KVTiers") -> bool:
    return kv.shared_identity == SharedIdentity.SHARED


_IDENTITY_NEEDS_SECRET = CelRule(
    rule=(
        "!has(self.sharedUrl) || has(self.sharedPasswordSecret) || "
        "(has(self.sharedIdentity) && self.sharedIdentity == 'shared')"
    ),
    message="kv.sharedIdentity deployment (the default) needs kv.sharedPasswordSecret, the password of the deployment's own ACL user (`holeblend-operator shared-tier-acl NAMESPACE/NAME` prints the command that creates it); or set kv.sharedIdentity: shared",
    check=lambda kv: (
        kv.shared_url is None or kv.shared_password_secret is not None or _is_shared_identity(kv)
    ),
    field_path=".sharedPasswordSecret",
)
_IDENTITY_URL_WITHOUT_USER = CelRule(
    rule=(
        "!has(self.sharedUrl) || !self.sharedUrl.matches('^[a-z]+://[^/@]*@') || "
        "(has(self.sharedIdentity) && self.sharedIdentity == 'shared')"
    ),
    message="kv.sharedUrl names a user, which would replace the deployment's own ACL user (kv.sharedIdentity: deployment); remove the user from the URL, or set kv.sharedIdentity: shared",
    check=lambda kv: (
        kv.shared_url is None or urlsplit(kv.shared_url).username is None or _is_shared_identity(kv)
    ),
    field_path=".sharedUrl",
)
_KV_RULES = (
    _SHARED_URL_NO_CREDENTIALS, _SECRET_NEEDS_URL, _IDENTITY_NEEDS_SECRET, _IDENTITY_URL_WITHOUT_USER,
)  # fmt: skip


class KVTiers(ApiModel):
    """Where segment KV caches live."""

    model_config = ConfigDict(json_schema_extra=cel_schema_extra(*_KV_RULES))
    check_rules = cel_validator(*_KV_RULES)

    local_cpu_bytes: ByteCount = f"{contract.DEFAULT_LOCAL_CPU_BYTES >> 30}Gi"
    """Byte budget of each engine pod's own tier, in memory (holeblend-serve: in-process;
    vLLM pods: a memory-backed volume of its own, this size plus 256Mi of headroom);
    counts against engine.resources.limits.memory, so it must be below that limit. Least
    recently used segments are evicted. 0: no tier of the pod's own (only the shared tier,
    if any)."""
    admission: Admission = Field(default=Admission.FREQUENCY, strict=False)
    """Which segments that tier keeps once full. frequency: new segments enter a window of
    the most recently used bytes; what leaves the window stays only if it was asked for
    more often, recently, than what it would evict, so rarely used documents do not push
    popular ones out (a Zipf RAG stream on vLLM: a quarter fewer holes for the same bytes;
    docs/vllm-connector.md); the window's size adapts to the traffic. always: plain LRU."""
    store_dtype: KVStoreDtype = Field(default=KVStoreDtype.AUTO, strict=False)
    """The dtype every tier (the pod's own, the shared tier) holds documents' KV in. auto:
    the model's KV dtype, lossless. bfloat16 or float16 under a float32 model: half the
    bytes per document, so each tier holds twice the documents, for a rounding of the
    reused KV; float8_e4m3fn: a quarter of float32's bytes, half a 16-bit model's, for a
    coarser rounding (3 mantissa bits; a segment with a value beyond +-448 is computed
    afresh instead of reused); measured in docs/shared-tier.md. The engines convert on
    store and on load. The system prompt's KV stays in the model's dtype (the exact prefix
    of every prompt); rounded documents are always blended, never taken as exact, so ratio
    1.0 still gives full prefill's answers. A dtype not narrower than the model's is
    refused: by the API server when model.dtype names float16 or bfloat16, else
    (model.dtype auto) by the engine at start-up. Documents' keys name this dtype:
    changing it starts every tier afresh (a restart, like every setting but the ratio)."""
    shared_url: SharedStoreUrl | None = None
    """Shared tier on Redis or Valkey, e.g. redis://kv-cache:6379/0; none when unset. No
    credentials: a password (user:password@ or ?password=), a credential query parameter or a
    #fragment is refused; see sharedPasswordSecret. Configure the store with
    `maxmemory-policy allkeys-lfu` (docs/shared-tier.md)."""
    shared_password_secret: SecretKeyRef | None = None
    """Secret key holding the shared tier's password, given to the engine pods as the env
    var HOLEBLEND_SHARED_TIER_PASSWORD: the password of the deployment's own ACL user
    (sharedIdentity deployment: required), or of the store (sharedIdentity shared; none
    when the store needs no password)."""
    shared_identity: SharedIdentity = Field(default=SharedIdentity.DEPLOYMENT, strict=False)
    """Who the engine pods are to the shared tier. deployment: the ACL user
    holeblend:NAMESPACE/NAME, limited to this deployment's keys, so no other tenant of the
    store can read or overwrite its KV (create it with `holeblend-operator shared-tier-acl`;
    docs/shared-tier.md). shared: the URL's user (or none) and the password, shared with
    whoever else holds them."""


# The grammar of spec.blend.selection (holeblend_contract.blend_settings.parse_selection):
# a strategy name, or up to MAX_MIX_STRATEGIES joined by '+', each with an optional share of
# the recompute budget in (0, 1]. The pattern lets the API server refuse what is not the
# grammar; the rest (a name twice, shares over 1) is parse_selection's, with its message.
_STRATEGY = "(" + "|".join(s.value for s in Selection) + ")"
_SHARE = r"(0?\.[0-9]*[1-9][0-9]*|1(\.0+)?)"
_MIX_PART = rf"{_STRATEGY}(:{_SHARE})?"
SELECTION_PATTERN = rf"{_MIX_PART}(\+{_MIX_PART}){{0,{contract.MAX_MIX_STRATEGIES - 1}}}"
SELECTION_MAX_LENGTH = 128


def _parsed_selection(text: str) -> str:
    contract.parse_selection(text)  # ValueError saying what to write
    return text


SelectionText = Annotated[
    _matching(
        SELECTION_PATTERN,
        "a selection strategy ("
        + ", ".join(s.value for s in Selection)
        + ") or a mix of them with shares of the budget like 'sinks:0.25+kDeviation'",
        max_length=SELECTION_MAX_LENGTH,
    ),
    AfterValidator(_parsed_selection),
]
MAX_FILTER_LAYERS = 4


def _filter_layers_ordered(blend: "BlendSpec") -> bool:
    try:
        contract.check_filter_layers(blend.check_layer, blend.filter_layers)
    except ValueError:
        return False
    return True


_FILTER_LAYERS_ORDERED = CelRule(
    rule="!has(self.filterLayers) || ("
    + " && ".join(
        f"(self.filterLayers.size() <= {i} || self.filterLayers[{i}] > "
        + ("self.checkLayer" if i == 0 else f"self.filterLayers[{i - 1}]")
        + ")"
        for i in range(MAX_FILTER_LAYERS)
    )
    + ")",
    message="blend.filterLayers must be strictly increasing and above blend.checkLayer "
    "(e.g. checkLayer 1, filterLayers [8, 16]); sort them, drop repeats, or lower checkLayer",
    check=_filter_layers_ordered,
    field_path=".filterLayers",
)


class BlendSpec(ApiModel):
    """How prompts are split into segments and their cached KV blended."""

    model_config = ConfigDict(json_schema_extra=cel_schema_extra(_FILTER_LAYERS_ORDERED))
    check_rules = cel_validator(_FILTER_LAYERS_ORDERED)

    mode: BlendMode = Field(default=BlendMode.HOLE, strict=False)
    """hole: reuse every cached segment; prefix: stop at the first miss (CacheBlend); off."""
    separator: Separator = contract.DEFAULT_SEPARATOR
    """String between the system prompt, the documents and the question; it must contain a
    visible character (the runtime refuses whitespace alone)."""
    check_layer: int = Field(default=contract.DEFAULT_CHECK_LAYER, ge=1, le=255)
    """Layer at which the tokens whose K and V deviate most are selected for recompute
    (>= 1: K at layer 0 depends only on the token and its position). The layers up to it
    run over every token. The default, 2, selected better than 1 on reordered documents
    for one more full layer (docs/blending.md)."""
    recompute_ratio: float = Field(default=contract.DEFAULT_RECOMPUTE_RATIO, gt=0, le=1)
    """Initial share of cached tokens recomputed, in (0, 1]; the tuner adjusts it."""
    selection: SelectionText = contract.DEFAULT_SELECTION
    """How the cached tokens to recompute are chosen at the check layer: one strategy, or a
    mix that gives each strategy a share of the recompute budget. Strategies: kDeviation
    (CacheBlend: the tokens whose K deviates most from a fresh computation), vDeviation (V
    instead of K), kvDeviation (K and V together), sinks (the first tokens of every reused
    segment), query (the cached tokens the question attends to most), random (a
    baseline). The default, kvDeviation, had the lowest KL divergence from full prefill
    at the default ratio in the quality bench's runs (docs/blending.md). A mix joins up to 6 names with '+', each with an optional share in (0, 1]
    after ':'; at most one leaves its share out and takes what the others leave, e.g.
    'sinks:0.25+kDeviation' (a quarter of the budget on sinks, the rest on K deviation);
    given shares must not exceed 1 (all given: sum to 1). Changing it restarts the pods."""
    filter_layers: list[Annotated[int, Field(ge=2, le=255)]] = Field(
        default_factory=list, max_length=MAX_FILTER_LAYERS
    )
    """Gradual filtering: later layers at which the recompute set is narrowed, strictly
    increasing and above checkLayer, e.g. [8, 16]. The check layer picks (1 + n) times the
    budget, each filter layer keeps fewer by its own deviation, the last keeps the budget.
    At most 4 layers, each 2..255. Empty: one check layer, as CacheBlend. Changing it
    restarts the pods."""
    min_segment_tokens: int = Field(default=contract.DEFAULT_MIN_SEGMENT_TOKENS, ge=1, le=65536)
    """Documents shorter than this are recomputed, never cached (the system prompt is
    cached whatever its length)."""
    segment_context: SegmentContext = Field(default=SegmentContext.AFTER_SYSTEM, strict=False)
    """afterSystem: cache a document's KV as computed right after the system prompt
    (about half the blending error at low ratios); alone: from position 0."""
    store_policy: StorePolicy = Field(default=StorePolicy.IN_CONTEXT, strict=False)
    """How a document the request computed gets cached: in-context keeps the KV the request
    computed (free); isolated recomputes it after the system prompt in a low-priority
    background worker (see docs/blending.md for the measured trade-off)."""
    kv: KVTiers = Field(default_factory=KVTiers)
    """Cache tiers."""


class LookupServerSpec(ApiModel):
    """The shared index of cached segments, one per BlendDeployment; it also keeps the
    calibration pairs the pods share for their inline quality proxies."""

    enabled: bool = True
    """Run the lookup server; without it each pod only knows its own cache and calibrates its
    inline quality proxy on its own shadows only (no pairs shared by the deployment)."""
    replicas: int = Field(default=1, ge=1, le=16)
    """Lookup server pods. Each holds its own index, so more than one gives pods fewer
    hits (never a wrong one); see docs/lookup-server.md."""
    image: Image | None = None
    """Container image; the holeblend runtime CPU image when unset."""
    port: int = Field(default=8100, ge=1, le=65535)
    """Port of the lookup API, /metrics and /healthz."""
    resources: Resources = Field(
        default_factory=lambda: Resources(
            requests={"cpu": "250m", "memory": "256Mi"}, limits={"memory": "1Gi"}
        )
    )
    """CPU and memory of a lookup server pod. The default fits the default index capacity
    (1,000,000 segments took about 0.5 GiB when measured; one process uses one core)."""


_BOUNDS_ORDERED = CelRule(
    rule="self.minRatio <= self.maxRatio",
    message="tuning.minRatio must not exceed tuning.maxRatio",
    check=lambda t: t.min_ratio <= t.max_ratio,
    field_path=".minRatio",
)


class TuningSpec(ApiModel):
    """Closed-loop tuning of the recompute ratio from the F1 proxy."""

    model_config = ConfigDict(json_schema_extra=cel_schema_extra(_BOUNDS_ORDERED))
    check_rules = cel_validator(_BOUNDS_ORDERED)

    enabled: bool = True
    """Let the operator adjust blend.recomputeRatio within [minRatio, maxRatio]."""
    target_f1_proxy: float = Field(default=0.9, gt=0, le=1)
    """F1 of blended vs full-prefill answers the tuner keeps the ratio at."""
    band: float = Field(default=0.03, ge=0, le=0.5)
    """Dead band around the target inside which nothing changes."""
    min_ratio: float = Field(default=0.05, gt=0, le=1)
    """Lowest ratio the tuner may set."""
    max_ratio: float = Field(default=0.6, gt=0, le=1)
    """Highest ratio the tuner may set."""
    step_up_factor: float = Field(default=1.5, gt=1, le=4)
    """Multiplier applied when quality is below target."""
    step_down: float = Field(default=0.02, gt=0, le=0.5)
    """Amount subtracted when quality stays above target for the cooldown."""
    interval_seconds: int = Field(default=60, ge=5, le=86400)
    """How often the tuner evaluates."""
    cooldown_seconds: int = Field(default=300, ge=0, le=86400)
    """How long quality must stay above target before lowering the ratio."""
    min_samples: int = Field(default=20, ge=1, le=100000)
    """Fewest F1-proxy samples in the window to act on. Also the shadow's idle floor: while
    tuning, a pod scores up to this many requests per intervalSeconds past shadowBudget, of
    those that end with no other user request in flight (docs/tuning.md)."""
    quality_proxies: bool = True
    """Score the quality proxies the tuner reads: a full-prefill shadow of a share
    shadowSampleRate of the requests (within shadowBudget), and the inline proxy, which
    costs nothing and stands in when too few shadows ran. On vLLM pods the shadow requests
    go through the pod's own API server at the lowest priority: the operator adds
    `--scheduling-policy priority` (requests without a priority keep their arrival order).
    false: no proxies, and the tuner holds the ratio (NoQualityProxies). Replaces the
    HOLEBLEND_ENGINE_URL variable in engine.env: still honoured (its value is the URL the
    shadow requests go to), with a warning to remove it."""
    shadow_budget: float = Field(default=contract.DEFAULT_SHADOW_BUDGET, ge=0, le=1)
    """Most prefill tokens the shadow requests may use, as a share of the prefill tokens of
    user requests (0.05: 5 %); 0: no shadow requests, the inline proxy only."""
    shadow_chunk_tokens: int = Field(
        default=contract.DEFAULT_SHADOW_CHUNK_TOKENS, ge=16, le=1048576
    )
    """vLLM pods while qualityProxies is on: most prompt tokens the shadow requests prefill in
    one vLLM step, beside user requests that are decoding or alone. The operator sets the
    scheduler class under which a shadow sits out every step in which a user request waits
    or prefills, so a user prompt waits for a shadow at most one such chunk (also one the
    idle floor started on an idle pod), and is never chunked on its account. Smaller: less
    wait for users, slower shadows."""
    shadow_sample_rate: float = Field(default=contract.DEFAULT_SHADOW_SAMPLE_RATE, ge=0, le=1)
    """Share of requests also run with full prefill to score the F1 proxy (within
    shadowBudget)."""
    prometheus_url: HttpUrl | None = None
    """Prometheus to query; the operator scrapes the pods directly when unset."""


class ServiceMonitorSpec(ApiModel):
    """A prometheus-operator ServiceMonitor for the engine and lookup server metrics."""

    enabled: bool = False
    """Create the ServiceMonitor (needs the monitoring.coreos.com CRDs)."""
    interval_seconds: int = Field(default=15, ge=1, le=3600)
    """Scrape interval."""
    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict, max_length=32)
    """Extra labels, e.g. {release: prometheus} to match a Prometheus's selector."""


class MonitoringSpec(ApiModel):
    """Metrics collection."""

    service_monitor: ServiceMonitorSpec = Field(default_factory=ServiceMonitorSpec)
    """ServiceMonitor settings."""


class DisruptionBudgetSpec(ApiModel):
    """A PodDisruptionBudget for the engine pods."""

    enabled: bool = True
    """Create the PodDisruptionBudget."""
    max_unavailable: int = Field(default=1, ge=1, le=INT32_MAX)
    """Engine pods a voluntary disruption (drain) may take down at once."""


_TP_FITS = CelRule(
    rule="self.accelerator.type == 'cpu' || self.engine.tensorParallelSize <= self.accelerator.count",
    message="engine.tensorParallelSize must not exceed accelerator.count; raise the count or lower the size",
    check=lambda s: (
        s.accelerator.type == AcceleratorType.CPU
        or s.engine.tensor_parallel_size <= s.accelerator.count
    ),
    field_path=".engine.tensorParallelSize",
)
_RATIO_IN_BOUNDS = CelRule(
    rule="!self.tuning.enabled || (self.tuning.minRatio <= self.blend.recomputeRatio && self.blend.recomputeRatio <= self.tuning.maxRatio)",
    message="blend.recomputeRatio must lie within [tuning.minRatio, tuning.maxRatio] when tuning is enabled; move it or widen the bounds",
    check=lambda s: (
        not s.tuning.enabled or s.tuning.min_ratio <= s.blend.recompute_ratio <= s.tuning.max_ratio
    ),
    field_path=".blend.recomputeRatio",
)


_STORE_DTYPE_NARROWER = CelRule(
    rule="!(self.model.dtype in ['float16', 'bfloat16']) || self.blend.kv.storeDtype in ['auto', 'float8_e4m3fn', self.model.dtype]",
    message="blend.kv.storeDtype must be auto, model.dtype or float8_e4m3fn for a float16 or bfloat16 model: another 16- or 32-bit dtype holds no more documents and loses precision or range; set it to auto",
    check=lambda s: (
        s.model.dtype not in (Dtype.FLOAT16, Dtype.BFLOAT16)
        or s.blend.kv.store_dtype in (KVStoreDtype.AUTO, KVStoreDtype.FLOAT8_E4M3FN)
        or s.blend.kv.store_dtype == s.model.dtype
    ),
    field_path=".blend.kv.storeDtype",
)


_NO_IDLE_DEVICES = CelRule(
    rule="self.accelerator.type == 'cpu' || self.accelerator.count <= self.engine.tensorParallelSize",
    message="accelerator.count exceeds engine.tensorParallelSize, so devices would sit idle; "
    "set the count to the tensor-parallel size or raise the size",
    check=lambda s: (
        s.accelerator.type == AcceleratorType.CPU
        or s.accelerator.count <= s.engine.tensor_parallel_size
    ),
    field_path=".accelerator.count",
)


_CPU_COMPUTES_IN_FLOAT32 = CelRule(
    rule="self.accelerator.type != 'cpu' || self.model.dtype in ['auto', 'float32']",
    message="model.dtype must be auto or float32 for accelerator.type cpu: holeblend-serve "
    "computes in float32 and refuses another dtype at start; set it to auto",
    check=lambda s: (
        s.accelerator.type != AcceleratorType.CPU or s.model.dtype in (Dtype.AUTO, Dtype.FLOAT32)
    ),
    field_path=".model.dtype",
)


def _kv_tier_below_memory_limit(spec) -> bool:
    memory = spec.engine.resources.limits.get("memory")
    return memory is None or quantity_value(spec.blend.kv.local_cpu_bytes) < quantity_value(memory)


# The pod's own KV tier is memory (holeblend-serve's process; vLLM pods' memory-backed
# volume), charged to the engine container's memory limit: a budget at or above the limit
# gets the pod OOM-killed as the cache fills, long after it started.
_KV_TIER_BELOW_MEMORY_LIMIT = CelRule(
    rule="!has(self.engine.resources.limits) || !('memory' in self.engine.resources.limits) || "
    + _QUANTITY_CEL.format("self.blend.kv.localCpuBytes")
    + ".compareTo("
    + _QUANTITY_CEL.format("self.engine.resources.limits['memory']")
    + ") < 0",
    message="blend.kv.localCpuBytes must be below engine.resources.limits.memory: the pod's "
    "KV tier is held in memory and counts against that limit; lower localCpuBytes or raise "
    "the limit, leaving room for the engine itself",
    check=_kv_tier_below_memory_limit,
    field_path=".blend.kv.localCpuBytes",
)


class BlendDeploymentSpec(ApiModel):
    """Desired state of a BlendDeployment."""

    model_config = ConfigDict(
        json_schema_extra=cel_schema_extra(
            _TP_FITS,
            _RATIO_IN_BOUNDS,
            _STORE_DTYPE_NARROWER,
            _NO_IDLE_DEVICES,
            _CPU_COMPUTES_IN_FLOAT32,
            _KV_TIER_BELOW_MEMORY_LIMIT,
        )
    )
    check_rules = cel_validator(
        _TP_FITS, _RATIO_IN_BOUNDS, _STORE_DTYPE_NARROWER, _NO_IDLE_DEVICES,
        _CPU_COMPUTES_IN_FLOAT32, _KV_TIER_BELOW_MEMORY_LIMIT,
    )  # fmt: skip

    model: ModelSpec
    """The served model."""
    replicas: int = Field(default=1, ge=0, le=1024)
    """Engine pods; also set by `kubectl scale` and autoscalers."""
    engine: EngineSpec = Field(default_factory=EngineSpec)
    """Engine container settings."""
    accelerator: AcceleratorSpec = Field(default_factory=AcceleratorSpec)
    """Devices and scheduling."""
    blend: BlendSpec = Field(default_factory=BlendSpec)
    """KV blending. (`chunkSize` is gone: nothing read it. The API server drops it from
    stored objects once this CRD is applied and refuses it in new manifests under strict
    field validation; the rendered blend.json no longer carries it, so engine pods roll once
    after the upgrade.)"""
    lookup_server: LookupServerSpec = Field(default_factory=LookupServerSpec)
    """Shared lookup server."""
    tuning: TuningSpec = Field(default_factory=TuningSpec)
    """Recompute-ratio tuner."""
    monitoring: MonitoringSpec = Field(default_factory=MonitoringSpec)
    """Metrics collection."""
    disruption_budget: DisruptionBudgetSpec = Field(default_factory=DisruptionBudgetSpec)
    """Voluntary disruption limits."""


class ConditionType(StrEnum):
    READY = "Ready"
    PROGRESSING = "Progressing"
    DEGRADED = "Degraded"
    LOOKUP_SERVER_READY = "LookupServerReady"
    TUNED = "Tuned"


# The longest condition message the status schema accepts (characters): the API server
# refuses a status patch with a longer one.
CONDITION_MESSAGE_MAX_LENGTH = 32768


class Condition(ApiModel):
    """A standard Kubernetes condition."""

    type: str = Field(min_length=1, max_length=316)
    """Ready, Progressing, Degraded, LookupServerReady or Tuned."""
    status: Literal["True", "False", "Unknown"]
    """Whether the condition holds."""
    reason: str = Field(default="", max_length=1024)
    """CamelCase reason code."""
    message: str = Field(default="", max_length=CONDITION_MESSAGE_MAX_LENGTH)
    """What happened and what to do, for a person."""
    last_transition_time: str | None = Field(default=None, max_length=64)
    """When status last changed (RFC 3339)."""
    observed_generation: int | None = Field(default=None, ge=0)
    """The spec generation the condition was computed from."""


class Phase(StrEnum):
    PENDING = "Pending"
    PROGRESSING = "Progressing"
    READY = "Ready"
    DEGRADED = "Degraded"


# status.tuning.history[].reason and a condition's reason: the most characters they hold.
REASON_MAX_LENGTH = 1024


class TuningDecision(ApiModel):
    """One decision of the tuner."""

    time: str = Field(max_length=64)
    """When it was taken (RFC 3339)."""
    direction: Literal["up", "down", "hold"]
    """What the tuner did to the ratio."""
    from_ratio: float = Field(gt=0, le=1)
    """Ratio before."""
    to_ratio: float = Field(gt=0, le=1)
    """Ratio after."""
    reason: str = Field(max_length=REASON_MAX_LENGTH)
    """Why, with the numbers it saw; starts with a reason code (e.g. `BelowTarget:`)."""
    inputs: "ObservedMetrics | None" = None
    """The windowed metrics the decision was taken on."""


class TuningStatus(ApiModel):
    """The tuner's recent decisions."""

    base_ratio: float | None = Field(default=None, gt=0, le=1)
    """spec.blend.recomputeRatio the tuned ratio started from; when the spec's ratio
    changes, the pods take the new value and tuning starts over from it."""

    history: list[TuningDecision] = Field(default_factory=list, max_length=20)
    """The latest decisions, newest last."""
    above_target_since: str | None = None
    """Since when the F1 proxy has stayed above target + band (RFC 3339); the ratio is
    lowered once this is a cooldown ago."""
    below_target_ratio: float | None = Field(default=None, gt=0, le=1)
    """The highest ratio measured below target - band: the tuner does not lower the ratio
    to it or below while it is remembered (20 cooldowns after `belowTargetAt`)."""
    below_target_at: str | None = None
    """When `belowTargetRatio` was measured (RFC 3339)."""
    meets_target_ratio: float | None = Field(default=None, gt=0, le=1)
    """The lowest ratio measured meeting the target: a raise from below goes straight back
    to it while it is remembered (20 cooldowns after `meetsTargetAt`)."""
    meets_target_at: str | None = None
    """When `meetsTargetRatio` was measured (RFC 3339)."""
    meets_target_above_ratio: float | None = Field(default=None, gt=0, le=1)
    """The ratio that was `meetsTargetRatio` before a lower one met the target: if the lower
    one then falls below target, a raise goes back to this one instead of a whole step up."""
    meets_target_above_at: str | None = None
    """When `meetsTargetAboveRatio` was measured (RFC 3339)."""
    learned_target_f1_proxy: float | None = Field(default=None, gt=0, le=1)
    """spec.tuning.targetF1Proxy when the ratios above were learned: when the target or
    the band changes, what they no longer tell of the new one is forgotten (a floor when
    target - band falls, the known-good ratios when it rises)."""
    learned_band: float | None = Field(default=None, ge=0, le=0.5)
    """spec.tuning.band when the ratios above were learned."""


class ObservedMetrics(ApiModel):
    """Windowed metrics the operator last read."""

    hit_percent: float | None = Field(default=None, ge=0, le=100)
    """Share of prompt tokens served from cached KV, in percent."""
    f1_proxy: float | None = Field(default=None, ge=0, le=1)
    """Mean F1 of blended vs full-prefill answers over the window."""
    top1_agreement: float | None = Field(default=None, ge=0, le=1)
    """Mean next-token agreement of blended vs full prefill over the window."""
    ttft_seconds: float | None = Field(default=None, ge=0)
    """Mean time to first token."""
    num_samples: int | None = Field(default=None, ge=0)
    """F1-proxy samples in the window."""
    proxy_signal: Literal["shadow", "inline"] | None = None
    """Which quality proxy f1Proxy, top1Agreement and numSamples are: shadow (full-prefill
    shadow requests scored against the blended answers) or inline (the engine's own
    estimate on every blended request, which the tuner reads when the window holds fewer
    than tuning.minSamples shadow samples)."""
    observed_at: str | None = Field(default=None, max_length=64)
    """When they were read (RFC 3339)."""


class BlendDeploymentStatus(ApiModel):
    """Observed state, written by the operator."""

    observed_generation: int | None = None
    """The spec generation last reconciled."""
    replicas: int = 0
    """Engine pods that exist."""
    ready_replicas: int = 0
    """Engine pods that are ready."""
    selector: str | None = Field(default=None, max_length=1024)
    """Label selector of the engine pods (for the scale subresource and autoscalers)."""
    phase: Phase = Field(default=Phase.PENDING, strict=False)
    """Pending, Progressing, Ready or Degraded."""
    conditions: list[Condition] = Field(default_factory=list, max_length=16)
    """Ready, Progressing, Degraded, LookupServerReady, Tuned."""
    recompute_ratio: float | None = Field(default=None, gt=0, le=1)
    """The ratio the pods run with now."""
    tuning: TuningStatus = Field(default_factory=TuningStatus)
    """Tuner decisions."""
    metrics: ObservedMetrics = Field(default_factory=ObservedMetrics)
    """Last observed metrics."""


class ObjectMeta(BaseModel):
    """The part of metadata the operator reads; everything else passes through."""

    model_config = ConfigDict(extra="allow", frozen=True)

    name: DnsName
    namespace: str = "default"
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    uid: str | None = None
    generation: int | None = None


class BlendDeployment(ApiModel):
    """A served RAG model with hole-mode KV blending, lookup server and tuner."""

    model_config = ConfigDict(extra="ignore")

    api_version: Literal["blend.holeblend.io/v1alpha1"] = API_VERSION
    kind: Literal["BlendDeployment"] = KIND
    metadata: ObjectMeta
    spec: BlendDeploymentSpec
    status: BlendDeploymentStatus = Field(default_factory=BlendDeploymentStatus)


# The old opt-in to the vLLM pods' quality proxies, before spec.tuning.qualityProxies: the
# pod's own API server's URL in engine.env. Still accepted and honoured (its value is the URL
# the pods' shadow requests go to); the operator asks for its removal (`spec_notices`).
LEGACY_ENGINE_URL_ENV = "HOLEBLEND_ENGINE_URL"


def legacy_engine_url(spec: BlendDeploymentSpec) -> str | None:
    """The value of HOLEBLEND_ENGINE_URL in engine.env, None when it is not set."""
    return next((var.value for var in spec.engine.env if var.name == LEGACY_ENGINE_URL_ENV), None)


def spec_notices(spec: Any) -> list[str]:
    """What a valid spec (the wire dict) still carries from earlier versions, each with what
    to change; the operator posts them as Warning events, `render` prints them."""
    if not isinstance(spec, dict):
        return []
    engine = spec.get("engine") if isinstance(spec.get("engine"), dict) else {}
    env = engine.get("env") if isinstance(engine.get("env"), list) else []
    if not any(isinstance(v, dict) and v.get("name") == LEGACY_ENGINE_URL_ENV for v in env):
        return []
    tuning = spec.get("tuning") if isinstance(spec.get("tuning"), dict) else {}
    prefix = (
        f"engine.env sets {LEGACY_ENGINE_URL_ENV}, the old opt-in to the quality proxies; "
        "spec.tuning.qualityProxies replaces it"
    )
    if tuning.get("qualityProxies", True) is False:
        return [
            f"{prefix}, and it is false, so the variable is ignored: remove "
            f"{LEGACY_ENGINE_URL_ENV} from engine.env"
        ]
    return [
        f"{prefix} (on by default; the operator gives the pods their API server's URL): "
        f"remove {LEGACY_ENGINE_URL_ENV} from engine.env (until then its value is the URL the "
        "shadow requests go to)"
    ]


# The most characters of a refused value a message quotes: enough to find it in the
# manifest, while a long one (a 40,000-character annotation) would not fit in the status.
QUOTED_INPUT_MAX_LENGTH = 100


def format_validation_error(exc) -> str:
    """One line per problem, `field.path: what is wrong`, joined with '; '."""
    problems = []
    for error in exc.errors():
        path = ".".join(str(part) for part in error["loc"] if not _is_type_tag(part))
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "unknown field; check its spelling against `kubectl explain bd.spec`"
        value = error.get("input")
        if isinstance(value, str) and len(value) > QUOTED_INPUT_MAX_LENGTH:
            message = message.replace(repr(value), _quoted(value))  # validators quote it too
        shown = isinstance(value, str) and _quoted(value) in message  # the validator's quote
        if error["type"] not in ("extra_forbidden", "missing") and _is_scalar(value) and not shown:
            message += f" (got {_quoted(value)})"
        problems.append(f"{path}: {message}" if path else message)
    return "; ".join(problems)


def _quoted(value) -> str:
    """`value` as a message quotes it: a long string by its start and its length."""
    if isinstance(value, str) and len(value) > QUOTED_INPUT_MAX_LENGTH:
        return f"{value[:QUOTED_INPUT_MAX_LENGTH]!r}... ({len(value)} characters)"
    return repr(value)


def _is_scalar(value) -> bool:
    return isinstance(value, str | int | float | bool) and "got " not in str(value)


def _is_type_tag(part) -> bool:
    # pydantic adds the branch of a union or a function-validator name to `loc`.
    return isinstance(part, str) and ("[" in part or part.startswith("function-"))
