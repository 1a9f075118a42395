"""What the API server refuses in a child is refused in the spec; what it accepts is accepted.

Each rule of tests/operator/kube_rules.py that a spec can reach has a pair here: a spec the
emulated API server (tests/operator/crd_validation.py: schema and CEL) and the API models
both refuse, naming the field, and one both accept whose children then pass the rule. Then
the emulation's own null and integer handling, and instance labels of long names.
"""

import copy

import kubernetes_validate
import pydantic
import pytest

from holeblend_operator.api import BlendDeployment, format_validation_error, kube_int64
from holeblend_operator.render import engine_selector, render_children
from holeblend_operator.render.naming import bounded_label_value
from tests.operator import kube_rules
from tests.operator.crd_validation import cel_errors, go_search, pruned, schema_errors

from .crd_validation import api_server_errors

MINIMAL = {
    "apiVersion": "blend.holeblend.io/v1alpha1",
    "kind": "BlendDeployment",
    "metadata": {"name": "rag", "namespace": "serving", "uid": "u-1"},
    "spec": {
        "model": {"name": "Qwen/Qwen3-8B", "source": {"pvc": {"claimName": "models"}}},
        "accelerator": {"type": "cpu", "count": 0},
    },
}
LONG_PREFIX = "a" * 250 + ".io"  # 253 characters: the longest DNS subdomain


def manifest(**spec) -> dict:
    out = copy.deepcopy(MINIMAL)
    for path, value in spec.items():
        node = out["spec"]
        *parents, last = path.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def model_problem(m: dict) -> str | None:
    try:
        BlendDeployment.model_validate(m)
    except pydantic.ValidationError as exc:
        return format_validation_error(exc)
    return None


def assert_refused(m: dict, field: str, fragment: str | tuple[str, ...]) -> None:
    """Refused by the emulated API server and by the models, naming `field` and saying
    `fragment` (or one of several: another rule, such as a tenant policy, may speak first)."""
    fragments = (fragment,) if isinstance(fragment, str) else fragment
    server, model = api_server_errors(m), model_problem(m)
    assert server, f"the API server would accept {m['spec']}"
    assert model is not None, "the models accept it"
    assert field and field in model and any(f in model for f in fragments), model
    assert any(f in e or field.rsplit(".", 1)[-1] in e for e in server for f in fragments), server


def assert_accepted(m: dict) -> BlendDeployment:
    assert api_server_errors(m) == []
    assert model_problem(m) is None
    bd = BlendDeployment.model_validate(m)
    for child in render_children(bd):
        assert kube_rules.child_rule_problems(child) == [], child["kind"]
        if child["kind"] != "ServiceMonitor":
            kubernetes_validate.validate(child, "1.30", strict=True)
    return bd


def engine_pod(bd: BlendDeployment) -> dict:
    return render_children(bd)[0]["spec"]["template"]


# Label, annotation and selector keys: IsQualifiedName; annotation keys lower-cased first.


@pytest.mark.parametrize("field", ["engine__podLabels", "accelerator__nodeSelector"])
def test_label_and_selector_key_prefixes_of_254_characters_are_refused(field):
    name = field.rsplit("__", 1)[-1]
    assert_refused(manifest(**{field: {"a" + LONG_PREFIX + "/x": "v"}}), name, "253 characters")
    assert_accepted(manifest(**{field: {LONG_PREFIX + "/x": "v"}}))


def test_service_monitor_label_key_prefix_is_bounded():
    monitor = {"enabled": True, "labels": {"a" + LONG_PREFIX + "/x": "v"}}
    assert_refused(manifest(monitoring__serviceMonitor=monitor), "labels", "253 characters")


def test_annotation_key_prefixes_may_have_upper_case_but_labels_not():
    bd = assert_accepted(manifest(engine__podAnnotations={"Example.COM/Team": "a"}))
    assert engine_pod(bd)["metadata"]["annotations"]["Example.COM/Team"] == "a"
    assert_refused(manifest(engine__podLabels={"Example.COM/team": "a"}), "podLabels", "label")
    assert_refused(
        manifest(engine__podAnnotations={"A" + LONG_PREFIX + "/x": "v"}),
        "podAnnotations",
        "253 characters",
    )
    assert kube_rules.annotations_problems({"Example.COM/Team": "a"}) == []
    assert kube_rules.labels_problems({"Example.COM/team": "a"}) != []


# Env var names (IsEnvVarName) and Secret keys (IsConfigMapKey): '.', '..', '..x'.


@pytest.mark.parametrize("name", [".", "..", "..x"])
def test_env_names_the_api_server_refuses_are_refused(name):
    assert_refused(manifest(engine__env=[{"name": name, "value": "1"}]), "env", "'..'")
    assert kube_rules.env_name_problems(name) != []


@pytest.mark.parametrize("name", [".x", "x..y", "my.env-name", "_X"])
def test_env_names_with_dots_elsewhere_are_accepted(name):
    bd = assert_accepted(manifest(engine__env=[{"name": name, "value": "1"}]))
    assert name in [var["name"] for var in engine_pod(bd)["spec"]["containers"][0]["env"]]


def _shared_tier(key: str) -> dict:
    secret = {"name": "kv-password", "key": key}
    return {"sharedUrl": "redis://kv:6379/0", "sharedPasswordSecret": secret}


@pytest.mark.parametrize("key", [".", "..", "..pass"])
def test_secret_keys_the_api_server_refuses_are_refused(key):
    assert_refused(manifest(blend__kv=_shared_tier(key)), "key", "'..'")
    assert kube_rules.config_map_key_problems(key) != []


def test_secret_keys_with_inner_dots_are_accepted():
    assert_accepted(manifest(blend__kv=_shared_tier("redis.password")))


# Extended resources are whole numbers; hugepages a multiple of the page size, with cpu or
# memory.


def _resources(**both) -> dict:
    return {"requests": dict(both), "limits": dict(both)}


@pytest.mark.parametrize("quantity", ["500m", "0.5", "1.5"])
def test_fractional_extended_resources_are_refused(quantity):
    resources = _resources(**{"example.com/foo": quantity})
    assert_refused(manifest(engine__resources=resources), "resources", "whole numbers")
    assert kube_rules.resources_problems(resources) != []


@pytest.mark.parametrize("quantity", ["2", "1.5k", "2e1", 3])
def test_whole_extended_resources_are_accepted(quantity):
    assert_accepted(manifest(engine__resources=_resources(**{"example.com/foo": quantity})))


@pytest.mark.parametrize("quantity", ["1.0", "1000m", "2.00", "0.0"])
def test_whole_extended_resources_written_with_decimals_are_refused_as_cel_reads_them(quantity):
    # CEL's isInteger() is Quantity.AsInt64: false at a negative scale, whatever the value.
    resources = _resources(**{"example.com/foo": quantity})
    assert_refused(manifest(engine__resources=resources), "resources", "whole numbers")


@pytest.mark.parametrize(
    ("quantity", "integer"),
    [("50k", 50000), ("1.5k", 1500), ("1e3", 1000), ("9E", 9 * 10**18), ("1Ti", 2**40)]
    + [("1.0", None), ("1000m", None), ("0.5Gi", None), ("1Pi", None), ("10E", None)],
)
def test_quantities_are_integers_where_kubernetes_keeps_them_as_int64(quantity, integer):
    assert kube_int64(quantity) == integer


def test_hugepages_written_as_a_fraction_of_a_larger_unit_are_refused():
    resources = _resources(**{"hugepages-2Mi": "0.5Gi", "memory": "8Gi"})
    assert_refused(manifest(engine__resources=resources), "resources", "0.5Gi")
    assert_accepted(
        manifest(engine__resources=_resources(**{"hugepages-2Mi": "512Mi", "memory": "8Gi"}))
    )


@pytest.mark.parametrize(
    ("name", "quantity"), [("hugepages-2Mi", "3Mi"), ("hugepages-2Mi", "1"), ("hugepages-x", "2")]
)
def test_hugepages_that_are_not_whole_pages_are_refused(name, quantity):
    resources = _resources(**{name: quantity, "memory": "1Gi"})
    assert_refused(manifest(engine__resources=resources), "resources", "page size")
    assert kube_rules.resources_problems(resources) != []


def test_hugepages_need_cpu_or_memory():
    alone = _resources(**{"hugepages-2Mi": "4Mi"})
    assert_refused(manifest(engine__resources=alone), "resources", "cpu or memory")
    assert_refused(manifest(lookupServer__resources=alone), "resources", "cpu or memory")
    assert "HugePages require cpu or memory" in " ".join(kube_rules.resources_problems(alone))
    with_cpu = {"requests": {"cpu": "1", **alone["requests"]}, "limits": alone["limits"]}
    assert_accepted(manifest(engine__resources=with_cpu))
    assert_accepted(
        manifest(engine__resources=_resources(**{"hugepages-1Gi": "2Gi", "memory": "8Gi"}))
    )


# Images: no leading or trailing whitespace (Go's unicode.IsSpace).


@pytest.mark.parametrize("image", [" vllm:1", "vllm:1 ", "vllm:1\n", "\tvllm:1", "vllm:1\xa0"])
@pytest.mark.parametrize("field", ["engine__image", "lookupServer__image"])
def test_images_with_surrounding_whitespace_are_refused(image, field):
    assert_refused(manifest(**{field: image}), "image", "whitespace")
    assert kube_rules.image_problems(image) != []


def test_an_image_with_inner_characters_only_is_accepted():
    assert_accepted(manifest(engine__image="registry.example.com:5000/vllm@sha256:abc"))


# Tolerations: an empty key needs operator Exists; Exists takes no value but ''.


@pytest.mark.parametrize(
    "toleration",
    [
        {"key": "", "operator": "Exists"},
        {"operator": "Exists", "value": ""},
        {"key": "", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 30},
        {"key": "example.com/npu", "operator": "Equal", "value": ""},
    ],
)
def test_valid_tolerations_are_accepted(toleration):
    bd = assert_accepted(manifest(accelerator__tolerations=[toleration]))
    assert engine_pod(bd)["spec"]["tolerations"][0]["operator"] == toleration["operator"]


@pytest.mark.parametrize(
    ("toleration", "fragment"),
    [
        ({"key": "", "operator": "Equal"}, "needs a key"),
        ({"operator": "Equal", "value": "x"}, "needs a key"),
        ({"operator": "Exists", "value": "x"}, "remove value"),
        ({"key": "a" + LONG_PREFIX + "/x", "operator": "Exists"}, "253 characters"),
    ],
)
def test_invalid_tolerations_are_refused(toleration, fragment):
    assert_refused(manifest(accelerator__tolerations=[toleration]), "tolerations", fragment)
    as_rendered = {"operator": "Equal"} | toleration
    assert kube_rules.toleration_problems(as_rendered) != []


# Well-known pod annotations. Security-profile annotations may also be refused outright by
# the operator's tenant policy, whose message then comes first.
SECURITY = ("seccomp", "AppArmor", "security profiles")


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("kubernetes.io/config.mirror", "x", "static pods"),
        ("scheduler.alpha.kubernetes.io/tolerations", '[{"operator": "x"}]', "tolerations"),
        ("controller.kubernetes.io/pod-deletion-cost", "abc", "32-bit"),
        ("controller.kubernetes.io/pod-deletion-cost", "+1", "32-bit"),
        ("controller.kubernetes.io/pod-deletion-cost", "01", "32-bit"),
        ("controller.kubernetes.io/pod-deletion-cost", "2147483648", "32-bit"),
        ("seccomp.security.alpha.kubernetes.io/pod", "unconfined", SECURITY),
        ("container.seccomp.security.alpha.kubernetes.io/engine", "localhost/../x", SECURITY),
        ("container.seccomp.security.alpha.kubernetes.io/engine", "bogus", SECURITY),
        ("container.apparmor.security.beta.kubernetes.io/other", "runtime/default", SECURITY),
        ("container.apparmor.security.beta.kubernetes.io/engine", "bogus", SECURITY),
    ],
)
def test_well_known_annotations_with_invalid_values_are_refused(key, value, fragment):
    assert_refused(manifest(engine__podAnnotations={key: value}), "podAnnotations", fragment)
    pod = {
        "containers": [{"name": "engine"}],
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
    }
    assert kube_rules.pod_annotation_problems({key: value}, pod) != []


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("scheduler.alpha.kubernetes.io/tolerations", ""),
        ("controller.kubernetes.io/pod-deletion-cost", "-5"),
        ("controller.kubernetes.io/pod-deletion-cost", "0"),
        ("controller.kubernetes.io/pod-deletion-cost", "2147483647"),
        ("controller.kubernetes.io/pod-deletion-cost", "-0000000000002147483648"),
    ],
)
def test_well_known_annotations_with_valid_values_are_accepted(key, value):
    assert_accepted(manifest(engine__podAnnotations={key: value}))


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("seccomp.security.alpha.kubernetes.io/pod", "runtime/default"),
        ("container.seccomp.security.alpha.kubernetes.io/engine", "localhost/profiles/a.json"),
        ("container.apparmor.security.beta.kubernetes.io/engine", "runtime/default"),
        ("container.apparmor.security.beta.kubernetes.io/engine", "localhost/k8s-vllm"),
    ],
)
def test_valid_security_profile_annotations_pass_the_api_servers_checks(key, value):
    pod = {
        "containers": [{"name": "engine"}],
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
    }
    assert kube_rules.pod_annotation_problems({key: value}, pod) == []


# Numbers and nulls as the API server reads them.


def test_an_integral_float_is_an_integer():
    bd = assert_accepted(manifest(replicas=2.0, engine__port=9000.0))
    assert bd.spec.replicas == 2 and isinstance(bd.spec.replicas, int)
    assert_refused(manifest(replicas=2.5), "replicas", "integer")


@pytest.mark.parametrize("value", [2**63, -(2**63) - 1, 2**64, 10**30])
def test_integers_beyond_int64_are_refused_not_a_crash(value):
    errors = api_server_errors(manifest(replicas=value))
    assert any("int64" in e for e in errors), errors
    assert model_problem(manifest(replicas=value)) is not None
    quantity = manifest(engine__resources={"limits": {"memory": value}})
    assert api_server_errors(quantity) and model_problem(quantity) is not None


def test_explicit_nulls_in_fields_that_are_not_nullable_are_pruned_and_defaulted():
    m = manifest(engine=None, tuning=None, replicas=None, blend__kv=None)
    m["spec"]["lookupServer"] = {"port": None, "image": None}
    bd = assert_accepted(m)
    assert bd.spec.replicas == 1 and bd.spec.engine.port == 8000
    assert bd.spec.lookup_server.port == 8100 and bd.spec.lookup_server.image is None


def test_a_null_required_field_is_missing():
    m = manifest()
    m["spec"]["model"]["source"] = None
    assert api_server_errors(m) and "source" in model_problem(m)


def test_a_null_in_a_nullable_field_is_absent_for_cel():
    schema = {
        "type": "object",
        "properties": {"url": {"type": "string", "nullable": True}},
        "x-kubernetes-validations": [{"rule": "!has(self.url)", "message": "url is set"}],
    }
    assert cel_errors(schema, {"url": None}) == []
    assert cel_errors(schema, {"url": "x"}) == ["<root>: url is set"]
    # The CRD's own rules: a null resourceName on cpu is no resourceName.
    m = manifest(accelerator={"type": "cpu", "count": 0, "resourceName": None})
    assert_accepted(m)


def test_nulls_are_pruned_only_where_not_nullable():
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string"}, "b": {"type": "string", "nullable": True}},
    }
    assert pruned({"a": None, "b": None}, schema) == {"b": None}


def test_the_emulated_schema_takes_integers_as_the_api_server_does():
    schema = {"type": "integer", "maximum": 2**62}
    assert schema_errors(schema, 3.0) == []
    assert schema_errors(schema, 2.0**60) != []  # beyond 2**53: no JSON integer
    assert "int64" in schema_errors(schema, 2**63)[0]
    cel = {"type": "object", "properties": {"n": {"type": "integer"}}}
    cel["x-kubernetes-validations"] = [{"rule": "self.n == 2", "message": "not 2"}]
    assert cel_errors(cel, {"n": 2.0}) == []


def test_patterns_and_matches_end_where_go_ends_them():
    assert not go_search("^a$", "a\n") and go_search("^a$", "a")
    assert schema_errors({"type": "string", "pattern": "^a$"}, "a\n") != []
    rule = {
        "type": "string",
        "x-kubernetes-validations": [{"rule": "self.matches('^a$')", "message": "no"}],
    }
    assert cel_errors(rule, "a\n") == ["<root>: no"]


def test_perl_classes_in_patterns_are_ascii_as_in_go():
    # RE2: \s is [\t\n\f\r ], \d [0-9], \w [0-9A-Za-z_]; Python's own are Unicode.
    assert go_search(r"^\S$", "\xa0") and go_search(r"^\S$", "\v")
    assert not go_search(r"^[\s\S]*\S[\s\S]*$", "  \t\r\n")
    assert not go_search(r"\d", "\u0662") and not go_search(r"^\w$", "\xe9")
    assert go_search(r"^[^\s]\D\W$", "\xa0\u0662\xe9")


@pytest.mark.parametrize("space", [" \t", "\xa0", "\v", "\u2003\u3000", "\x85\u2028"])
def test_a_separator_of_unicode_whitespace_alone_is_refused_by_both(space):
    assert_refused(manifest(blend={"separator": space}), "separator", "visible character")


# Instance labels: distinct names, distinct selectors.


def _bd(name: str) -> BlendDeployment:
    return BlendDeployment.model_validate(manifest() | {"metadata": {"name": name}})


def test_long_names_with_one_prefix_get_distinct_selectors():
    a, b = "x" * 60 + ".alpha", "x" * 60 + ".beta"
    assert engine_selector(_bd(a)) != engine_selector(_bd(b))
    for name in (a, b):
        assert kube_rules.label_value_problems(bounded_label_value(name)) == []


def test_a_shortened_label_never_equals_a_name_that_fits():
    long_name = "model-" * 20
    label = bounded_label_value(long_name)
    assert len(label) == 63 and "_" in label  # '_' is in no DNS subdomain, so in no name
    lookalike = label.replace("_", "-")  # what a name that fits could be
    assert bounded_label_value(lookalike) == lookalike != label


def test_names_that_fit_keep_their_labels_and_selectors():
    assert bounded_label_value("rag") == "rag"
    assert bounded_label_value("a" * 63) == "a" * 63
    assert engine_selector(_bd("rag"))["app.kubernetes.io/instance"] == "rag"


def test_extended_resource_prefixes_leave_room_for_the_quota_name():
    # "requests." + name must be a qualified name (IsExtendedResourceName).
    fits, too_long = "a" * 241 + ".io/x", "a" * 242 + ".io/x"
    assert_accepted(manifest(engine__resources=_resources(**{fits: "1"})))
    assert_refused(manifest(engine__resources=_resources(**{too_long: "1"})), "resources", "244")
    assert kube_rules.resources_problems(_resources(**{too_long: "1"})) != []
    nvidia = {"type": "nvidia", "count": 1, "resourceName": too_long}
    assert_refused(manifest(accelerator=nvidia), "resourceName", "244")


def test_an_integral_float_quantity_is_an_integer():
    bd = assert_accepted(manifest(engine__resources={"limits": {"memory": 8.0 * 2**30}}))
    assert bd.spec.engine.resources.limits["memory"] == str(2**33)


def test_integral_floats_in_a_list_of_integers_are_integers():
    bd = assert_accepted(manifest(blend={"filterLayers": [8.0, 16]}))
    assert bd.spec.blend.filter_layers == [8, 16]
    assert_refused(manifest(blend={"filterLayers": [8.5]}), "filterLayers", "integer")


def test_a_fractional_number_as_a_quantity_is_refused_with_the_quoted_fix():
    m = manifest(engine__resources={"requests": {"cpu": 0.5}})
    assert_refused(m, "requests.cpu", "quote it: '0.5'")
    assert_accepted(manifest(engine__resources={"requests": {"cpu": "0.5"}}))


@pytest.mark.parametrize("name", ["rag-", "Rag", "a..b", "a" * 254])
def test_the_emulated_server_checks_the_name_as_every_custom_resource_gets_it(name):
    m = manifest() | {"metadata": {"name": name}}
    assert any(e.startswith("metadata.name") for e in api_server_errors(m))
    assert "metadata.name" in model_problem(m)
