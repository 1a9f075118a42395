"""Every spec the API server would accept renders children the API server accepts.

Hypothesis draws BlendDeployments from the generated CRD schema, biased to the edges (bounds
and one past them, the longest strings, odd quantities, extended resources). Each draw goes
through the CRD emulation (tests/operator/crd_validation.py: pruning, defaults, schema, CEL)
and the API models, which must agree. Every accepted spec is rendered, and each child must
pass kubernetes-validate (strict) plus the API server's checks that schema cannot express:
DNS-1035 Service names, label and annotation syntax and lengths, quantities that parse and
are >= 0, requests <= limits, extended resources in limits, int32 ranges, objects under
1 MiB and annotations under 256 KiB (the operator's last-applied copy included), and every
rule of tests/operator/kube_rules.py (qualified names, env names, Secret keys, whole extended
resources, hugepages, images, tolerations, well-known annotations).

Draws also carry what the API server reads in its own way: explicit nulls, integral floats,
integers beyond int64; and the edges the rules are about: long and upper-case key prefixes,
toleration variants, env names like '.' and '..x', fractional extended resources, hugepages
quantities, images with whitespace, and reserved vLLM flags in several spellings. A refused
spec is refused with a message that names the field; an accepted one never passes a reserved
flag to vLLM (operator/reserved.py decides what is reserved).
"""

import json
import re

import kubernetes_validate
import pydantic
import pytest
from hypothesis import HealthCheck, Phase, assume, event, given, settings
from hypothesis import strategies as st

from holeblend_operator import reconcile, reserved
from holeblend_operator.api import BlendDeployment, format_validation_error
from holeblend_operator.crd import open_api_schema
from holeblend_operator.quantity import quantity_value
from holeblend_operator.render import render_children
from tests.operator.crd_validation import api_server_errors
from tests.operator.kube_rules import child_rule_problems

pytestmark = pytest.mark.slow

SCHEMA = open_api_schema()
KUBERNETES_VERSION = "1.30"
INT32_MAX = 2**31 - 1
DNS_1035 = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")
DNS_1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
LABEL_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]")
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?")
ODD_QUANTITIES = ["0", "1", "+1", ".5", "100m", "1e3", "1E-2", "16Gi", "1Ei", "999E", "1e0.5", "-1"]
RESOURCE_KEYS = [
    "cpu",
    "memory",
    "ephemeral-storage",
    "hugepages-2Mi",
    "nvidia.com/gpu",
    "huawei.com/Ascend910",
    "huawei.com/ascend-1980",
    "huawei.com/ascend-1980-memory",
    "huawei.com/ascend-1980-core",
]
HOST_PATHS = ["/", "/etc/kubernetes", "/data/models/qwen", "/usr/local/Ascend/driver"]
# How many specs one run draws: enough to find the edges, within about a minute on 2 cores.
MAX_EXAMPLES = 100
INT64_EDGES = [2**63 - 1, 2**63, -(2**63) - 1, 2**64, 10**30]
LONG_PREFIX = "a" * 250 + ".io"  # 253 characters
KEYS = [
    "team",
    "example.com/team",
    "Example.COM/team",
    f"{LONG_PREFIX}/x",
    f"a{LONG_PREFIX}/x",
    "example.com/",
    "-x",
    "a/b/c",
]
WELL_KNOWN_ANNOTATIONS = [
    ("kubernetes.io/config.mirror", "x"),
    ("scheduler.alpha.kubernetes.io/tolerations", ""),
    ("scheduler.alpha.kubernetes.io/tolerations", "[]"),
    ("controller.kubernetes.io/pod-deletion-cost", "-5"),
    ("controller.kubernetes.io/pod-deletion-cost", "01"),
    ("controller.kubernetes.io/pod-deletion-cost", "2147483648"),
    ("seccomp.security.alpha.kubernetes.io/pod", "unconfined"),
    ("seccomp.security.alpha.kubernetes.io/pod", "runtime/default"),
    ("container.seccomp.security.alpha.kubernetes.io/engine", "localhost/../x"),
    ("container.apparmor.security.beta.kubernetes.io/engine", "runtime/default"),
    ("container.apparmor.security.beta.kubernetes.io/sidecar", "runtime/default"),
]
TOLERATIONS = [
    {"key": "", "operator": "Exists"},
    {"key": "", "operator": "Equal"},
    {"operator": "Exists", "value": ""},
    {"operator": "Exists", "value": "x"},
    {"key": "example.com/npu", "value": ""},
    {"key": "Example.com/npu", "operator": "Exists"},
    {"key": f"a{LONG_PREFIX}/npu", "operator": "Exists"},
    {"key": "npu", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 2**63},
    {"key": None, "operator": "Exists", "value": None, "effect": None},
]
ENV_NAMES = [".", "..", "..x", ".x", "x..", "A_B", "1A", "x=y", ""]
SECRET_KEYS = [".", "..", "..pw", ".pw", "pass.word", "a/b"]
IMAGES = [
    " vllm:1",
    "vllm:1 ",
    "vllm:1\n",
    "\tvllm:1",
    "vllm:1\xa0",
    "vllm\u3000",
    "vl lm:1",
    "vllm:1",
]
RESOURCE_VARIANTS = [
    {"example.com/foo": "500m"},
    {"example.com/foo": "0.5"},
    {"example.com/foo": "1000m"},
    {"example.com/foo": 2},
    {"hugepages-2Mi": "3Mi", "memory": "1Gi"},
    {"hugepages-2Mi": "4Mi", "memory": "1Gi"},
    {"hugepages-2Mi": "4Mi"},
    {"hugepages-1Gi": "1", "cpu": "1"},
    {"hugepages-foo": "2", "memory": "1Gi"},
    {"a" * 242 + ".io/x": "1"},
    {"memory": 2.0**31},
]
# Reserved flags in the spellings vLLM reads (operator/reserved.py decides which it refuses).
EXTRA_ARGS = [
    "--port=1",
    "--port",
    "1",
    "--kv-transfer-config.kv_connector=x",
    "--kv_transfer_config={}",
    "--tensor-parallel",
    "2",
    "--tensor_parallel_size=2",
    "-tp",
    "--served-model-name=x",
    "--enable-lora",
    "--max-num-seqs",
    "8",
]


def _key_pattern(node: dict) -> str | None:
    for rule in node.get("x-kubernetes-validations", []):
        found = re.search(r"k\.matches\(r'(.*)'\)\)$", rule["rule"])
        if found:
            return found.group(1)
    return None


def _string(node: dict) -> st.SearchStrategy:
    if "enum" in node:
        return st.sampled_from(node["enum"])
    limit = node.get("maxLength", 300)
    if "pattern" in node:
        matching = st.from_regex(node["pattern"], fullmatch=True)
        return st.one_of(matching, matching.map(lambda s: s * (limit // max(len(s), 1) + 1)))
    plain = st.text(alphabet="ab-_/. ", max_size=8)
    return st.one_of(plain, st.just("x" * limit), st.just("x" * (limit + 1)))


def _number(node: dict, is_integer: bool) -> st.SearchStrategy:
    low, high = node.get("minimum", -(2**40)), node.get("maximum", 2**40)
    edges = [low, high, low - 1, high + 1, 0, INT32_MAX, INT32_MAX + 1]
    if is_integer:  # integral floats are integers to the API server; int64 bounds them
        edges += [float(low), float(high), low + 0.5, *INT64_EDGES]
    drawn = st.integers(low, high) if is_integer else st.floats(low, high, allow_nan=False)
    return st.one_of(st.sampled_from(edges), drawn)


def _map(node: dict) -> st.SearchStrategy:
    pattern = _key_pattern(node)
    values = from_schema(node["additionalProperties"])
    if node["additionalProperties"].get("x-kubernetes-int-or-string"):
        keys = st.one_of(st.sampled_from(RESOURCE_KEYS), st.from_regex(pattern, fullmatch=True))
    else:
        keys = st.from_regex(pattern, fullmatch=True) if pattern else st.text(max_size=8)
    return st.dictionaries(keys, values, max_size=3)


def _object(node: dict) -> st.SearchStrategy:
    properties = node.get("properties", {})
    required = set(node.get("required", []))
    # An optional field is sometimes an explicit null: pruned and defaulted by the API
    # server unless nullable.
    return st.fixed_dictionaries(
        {name: from_schema(sub) for name, sub in properties.items() if name in required},
        optional={
            name: st.one_of(st.none(), *[from_schema(sub)] * 4)
            for name, sub in properties.items()
            if name not in required
        },
    )


def from_schema(node: dict) -> st.SearchStrategy:
    """Values for one node of the CRD schema, valid or just past its bounds."""
    if node.get("x-kubernetes-int-or-string"):
        return st.one_of(st.sampled_from(ODD_QUANTITIES), st.integers(-1, 2**40))
    kind = node.get("type")
    if kind == "string":
        return _string(node)
    if kind in ("integer", "number"):
        return _number(node, kind == "integer")
    if kind == "boolean":
        return st.booleans()
    if kind == "array":
        return st.lists(from_schema(node["items"]), max_size=3)
    if "additionalProperties" in node:
        return _map(node)
    return _object(node)


def _source() -> st.SearchStrategy:
    pvc = st.fixed_dictionaries(
        {"claimName": st.from_regex(r"[a-z]{1,8}", fullmatch=True)},
        optional={"path": st.sampled_from(["/", "/Qwen3-8B", "a/b", "../x", "/a/../../b"])},
    )
    host = st.fixed_dictionaries({"path": st.sampled_from(HOST_PATHS)})
    hub = st.fixed_dictionaries(
        {"id": st.sampled_from(["Qwen/Qwen3-8B", "/etc", "a"])},
        optional={"revision": st.sampled_from(["main", "-x", "v1.0/rc"])},
    )
    return st.one_of(
        hub.map(lambda s: {"hub": s}),
        pvc.map(lambda s: {"pvc": s}),
        host.map(lambda s: {"hostPath": s}),
    )


def _set(spec: dict, path: str, value) -> None:
    *parents, last = path.split(".")
    for part in parents:
        if not isinstance(spec.get(part), dict):
            spec[part] = {}
        spec = spec[part]
    spec[last] = value


def _resources(values: dict) -> dict:
    return {"requests": dict(values), "limits": dict(values)}


# Each edit puts one edge case where the rules apply.
EDITS = [
    ("engine.podLabels", st.sampled_from(KEYS).map(lambda k: {k: "v"})),
    ("engine.podAnnotations", st.sampled_from(KEYS).map(lambda k: {k: "v"})),
    ("engine.podAnnotations", st.sampled_from(WELL_KNOWN_ANNOTATIONS).map(lambda kv: dict([kv]))),
    ("accelerator.nodeSelector", st.sampled_from(KEYS).map(lambda k: {k: "v"})),
    ("accelerator.tolerations", st.lists(st.sampled_from(TOLERATIONS), min_size=1, max_size=2)),
    ("engine.env", st.sampled_from(ENV_NAMES).map(lambda n: [{"name": n, "value": "1"}])),
    (
        "blend.kv",
        st.sampled_from(SECRET_KEYS).map(
            lambda k: {
                "sharedUrl": "redis://kv:6379/0",
                "sharedPasswordSecret": {"name": "kv", "key": k},
            }
        ),
    ),
    ("engine.resources", st.sampled_from(RESOURCE_VARIANTS).map(_resources)),
    ("lookupServer.resources", st.sampled_from(RESOURCE_VARIANTS).map(_resources)),
    ("engine.image", st.sampled_from(IMAGES)),
    ("lookupServer.image", st.sampled_from(IMAGES)),
    ("engine.extraArgs", st.lists(st.sampled_from(EXTRA_ARGS), min_size=1, max_size=3)),
    ("replicas", st.sampled_from([2.0, 2.5, None, *INT64_EDGES])),
]


@st.composite
def manifests(draw) -> dict:
    spec = draw(from_schema(SCHEMA["properties"]["spec"]))
    spec["model"] = {**spec["model"], "source": draw(_source())}
    for path, values in draw(st.lists(st.sampled_from(EDITS), max_size=3)):
        _set(spec, path, draw(values))
    name = draw(st.one_of(st.just("rag"), st.from_regex(r"[a-z][a-z0-9.-]{0,252}", fullmatch=True)))
    return {
        "apiVersion": "blend.holeblend.io/v1alpha1",
        "kind": "BlendDeployment",
        "metadata": {"name": name, "namespace": "serving", "uid": "u-1"},
        "spec": spec,
    }


def _model_problem(manifest: dict) -> str | None:
    try:
        BlendDeployment.model_validate(manifest)
    except pydantic.ValidationError as exc:
        return format_validation_error(exc)
    return None


def _names_a_field(message: str) -> bool:
    # `spec.engine.env.0.name: ...` from the models; `.spec.engine: ...` from the server.
    return re.match(r"\.?(spec|metadata)\b[^:]*: ", message) is not None


@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    # Shrinking a failure took minutes; the unshrunk spec is printed and reproducible.
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(manifests())
def test_specs_the_api_server_accepts_render_children_it_accepts(manifest):
    server_errors = api_server_errors(manifest)
    model_problem = _model_problem(manifest)
    if server_errors:
        assert model_problem is not None, (
            f"the models accept what the server refuses: {server_errors}"
        )
        assert all(_names_a_field(error) for error in server_errors), server_errors
        assert _names_a_field(model_problem), model_problem
        event("refused by the API server")
        return
    # Host-path prefixes are the operator's policy, which the API server cannot know.
    is_policy = model_problem is not None and "host paths this operator allows" in model_problem
    assert model_problem is None or is_policy, (
        f"the models refuse what the server accepts: {model_problem}"
    )
    assume(model_problem is None)
    event("accepted and rendered")
    bd = BlendDeployment.model_validate(manifest)
    children = render_children(bd)
    for child in children:
        assert child_problems(child) == [], child["kind"]
    _assert_no_reserved_flag_passed(bd, children[0])
    try:
        applied = reconcile.desired_children(BlendDeployment.model_validate(manifest), manifest)
    except reconcile.InvalidSpec as exc:  # a child's applied copy would take it over 256 KiB
        assert "annotations" in str(exc) and "spec." in str(exc), str(exc)
        event("refused by the operator: annotations over 256 KiB")
        return
    for child in applied:
        assert _annotation_bytes(child["metadata"]) <= 256 * 1024, child["kind"]


def _assert_no_reserved_flag_passed(bd: BlendDeployment, engine: dict) -> None:
    args = engine["spec"]["template"]["spec"]["containers"][0]["args"]
    user = list(bd.spec.engine.extra_args)
    # The user's arguments come last (render/engine.py: vllm_args).
    passed = args[len(args) - len(user) :] if user else []
    assert passed == user
    assert reserved.reserved_flag_problem(passed) is None, passed
    assert not [a for a in passed if reserved.flag_name(a) in reserved.RESERVED_FLAGS], passed


def child_problems(child: dict) -> list[str]:
    """What the API server would refuse in a rendered child."""
    problems = child_rule_problems(child)
    if child["kind"] != "ServiceMonitor":  # a custom resource: its CRD is not ours
        try:
            kubernetes_validate.validate(child, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            problems.append(str(exc))
    if child["kind"] == "Service" and not DNS_1035.fullmatch(child["metadata"]["name"]):
        problems.append(f"Service name {child['metadata']['name']!r} is not DNS-1035")
    problems += [*_metadata_problems(child), *_int32_problems(child)]
    if len(json.dumps(child)) >= 1024 * 1024:
        problems.append("object is 1 MiB or more")
    template = child.get("spec", {}).get("template")
    if template:
        problems += _pod_problems(template)
    return problems


def _metadata_problems(obj: dict) -> list[str]:
    meta = obj.get("metadata", {})
    problems = [f"label {k}={v}" for k, v in meta.get("labels", {}).items() if not _is_label(k, v)]
    # Annotation keys are checked lower-cased (ValidateAnnotations): 'Example.COM/x' is valid.
    annotations = meta.get("annotations", {})
    problems += [f"annotation key {k}" for k in annotations if not _is_key(k.lower())]
    if _annotation_bytes(meta) > 256 * 1024:
        problems.append("annotations over 256 KiB")
    return problems


def _annotation_bytes(meta: dict) -> int:
    return sum(len(k.encode()) + len(v.encode()) for k, v in meta.get("annotations", {}).items())


def _is_key(key: str) -> bool:
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not DNS_1123_SUBDOMAIN.fullmatch(prefix)):
        return False
    return bool(LABEL_NAME.fullmatch(name))


def _is_label(key: str, value: str) -> bool:
    return _is_key(key) and bool(LABEL_VALUE.fullmatch(value))


def _int32_problems(value, path: str = "") -> list[str]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        is_int64 = path.endswith("tolerationSeconds")
        return [] if is_int64 or -(2**31) <= value <= INT32_MAX else [f"{path}={value}"]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _int32_problems(v, f"{path}.{k}")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _int32_problems(v, f"{path}[{i}]")]
    return []


def _pod_problems(template: dict) -> list[str]:
    problems = _metadata_problems(template)
    pod = template["spec"]
    selector = pod.get("nodeSelector", {})
    problems += [f"nodeSelector {k}={v}" for k, v in selector.items() if not _is_label(k, v)]
    for volume in pod.get("volumes", []):
        size = volume.get("emptyDir", {}).get("sizeLimit")
        if size is not None:
            problems += _quantity_problems(f"volume {volume['name']}", size)
    for container in pod["containers"]:
        problems += _resource_problems(container.get("resources", {}))
    return problems


def _quantity_problems(where: str, quantity) -> list[str]:
    try:
        value = quantity_value(str(quantity))
    except ValueError:
        return [f"{where}: {quantity!r} does not parse"]
    return [] if value >= 0 else [f"{where}: {quantity!r} is negative"]


def _resource_problems(resources: dict) -> list[str]:
    requests, limits = resources.get("requests", {}), resources.get("limits", {})
    problems = []
    for section, values in (("requests", requests), ("limits", limits)):
        for name, quantity in values.items():
            problems += _quantity_problems(f"{section}.{name}", quantity)
            if "/" in name and not LABEL_NAME.fullmatch(name.rpartition("/")[2]):
                problems.append(f"resource name {name!r}")
    if problems:
        return problems
    for name, quantity in requests.items():
        if name in limits and quantity_value(quantity) > quantity_value(limits[name]):
            problems.append(f"request {name} above its limit")
        if ("/" in name or name.startswith("hugepages-")) and name not in limits:
            problems.append(f"extended resource {name} not in limits")
    return problems
