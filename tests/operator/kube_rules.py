"""The API server's own checks of the children we render, written once for the tests.

kubernetes-validate checks the OpenAPI schema of a child; these are the rules of the API
server's Go validation that no schema states, each with the Kubernetes source it follows
(github.com/kubernetes/kubernetes):

- qualified names (label keys, annotation keys lower-cased, selector keys), label values:
  staging/src/k8s.io/apimachinery/pkg/api/validate/content/kube.go (IsLabelKey,
  IsLabelValue); staging/src/k8s.io/apimachinery/pkg/api/validation/objectmeta.go
  (ValidateAnnotations lower-cases the key first; 256 KiB in all);
- env var names and Secret/ConfigMap keys: staging/src/k8s.io/apimachinery/pkg/util/
  validation/validation.go (IsEnvVarName, IsConfigMapKey, hasChDirPrefix);
- quantities: staging/src/k8s.io/apimachinery/pkg/api/resource/quantity.go (what parses),
  pkg/apis/core/validation/validation.go (ValidateResourceRequirements: >= 0, extended
  resources whole, requests <= limits, extended resources and hugepages in limits and equal,
  hugepages a multiple of the page size and only with cpu or memory);
  pkg/apis/core/helper/helpers.go (IsExtendedResourceName, IsHugePageResourceValueDivisible);
- images: pkg/apis/core/validation/validation.go (no leading or trailing whitespace);
- tolerations: pkg/apis/core/validation/validation.go (ValidateTolerations);
- well-known pod annotations: pkg/apis/core/validation/validation.go
  (ValidatePodSpecificAnnotations: mirror pods, the tolerations annotation, the
  pod-deletion cost, seccomp and AppArmor profiles; validateSeccompAnnotationsAndFields on
  the pods the Deployment creates).
"""

import json
import re
from decimal import Decimal

from holeblend_operator.quantity import quantity_value

DNS_1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
LABEL_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")
CONFIG_MAP_KEY = re.compile(r"[-._a-zA-Z0-9]+")
# unicode.IsSpace, what strings.TrimSpace trims.
GO_SPACE = "\t\n\v\f\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008"
GO_SPACE += "\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MAX = 2**63 - 1
ANNOTATIONS_MAX_BYTES = 256 * 1024


def qualified_name_problems(key: str) -> list[str]:
    """IsQualifiedName (= IsLabelKey)."""
    parts = key.split("/")
    if len(parts) > 2:
        return [f"{key!r}: at most one '/'"]
    problems = []
    name = parts[-1]
    if len(parts) == 2:
        prefix = parts[0]
        if not prefix:
            problems.append(f"{key!r}: empty prefix")
        elif len(prefix) > 253 or not DNS_1123_SUBDOMAIN.fullmatch(prefix):
            problems.append(f"{key!r}: prefix is no DNS-1123 subdomain of <= 253 characters")
    if not name or len(name) > 63 or not LABEL_NAME.fullmatch(name):
        problems.append(f"{key!r}: name part is no qualified name of <= 63 characters")
    return problems


def label_value_problems(value: str) -> list[str]:
    """IsLabelValue."""
    if value == "":
        return []
    if len(value) > 63 or not LABEL_NAME.fullmatch(value):
        return [f"label value {value!r}"]
    return []


def labels_problems(labels: dict[str, str], where: str = "labels") -> list[str]:
    """ValidateLabels (also what a selector's matchLabels and a nodeSelector must be)."""
    return [
        f"{where}: {problem}"
        for key, value in labels.items()
        for problem in [*qualified_name_problems(key), *label_value_problems(value)]
    ]


def annotations_problems(annotations: dict[str, str], where: str = "annotations") -> list[str]:
    """ValidateAnnotations: qualified names once lower-cased, 256 KiB in all."""
    problems = [
        f"{where}: {problem}"
        for key in annotations
        for problem in qualified_name_problems(key.lower())
    ]
    # Go's len: UTF-8 bytes, not characters.
    if (
        sum(len(k.encode()) + len(v.encode()) for k, v in annotations.items())
        > ANNOTATIONS_MAX_BYTES
    ):
        problems.append(f"{where}: over 256 KiB")
    return problems


def _has_chdir_prefix(value: str) -> bool:
    return value in (".", "..") or value.startswith("..")


def env_name_problems(name: str) -> list[str]:
    """IsEnvVarName (without the RelaxedEnvironmentVariableValidation gate)."""
    if not ENV_NAME.fullmatch(name) or _has_chdir_prefix(name):
        return [f"env name {name!r}"]
    return []


def config_map_key_problems(key: str) -> list[str]:
    """IsConfigMapKey, for Secret and ConfigMap keys."""
    if len(key) > 253 or not CONFIG_MAP_KEY.fullmatch(key) or _has_chdir_prefix(key):
        return [f"Secret/ConfigMap key {key!r}"]
    return []


def image_problems(image: str) -> list[str]:
    if not image:
        return ["image is empty"]
    if image[0] in GO_SPACE or image[-1] in GO_SPACE:
        return [f"image {image!r} has leading or trailing whitespace"]
    return []


def _quantity(value) -> Decimal | None:
    try:
        return quantity_value(str(value))
    except ValueError:
        return None


def _is_extended(name: str) -> bool:
    # IsExtendedResourceName: not native (a '/' and not under kubernetes.io/), and
    # "requests." + name a qualified name.
    return (
        "/" in name
        and "kubernetes.io/" not in name
        and not qualified_name_problems("requests." + name)
    )


def _is_whole(value: Decimal) -> bool:
    return value == int(value)


def resources_problems(resources: dict, where: str = "resources") -> list[str]:
    """ValidateResourceRequirements of one container."""
    requests, limits = resources.get("requests", {}), resources.get("limits", {})
    problems = []
    for section, values in (("requests", requests), ("limits", limits)):
        for name, raw in values.items():
            at = f"{where}.{section}[{name}]"
            if "/" in name and "kubernetes.io/" not in name and not _is_extended(name):
                problems.append(f"{at}: does not follow the extended resource name standard")
            value = _quantity(raw)
            if value is None:
                problems.append(f"{at}: {raw!r} does not parse")
                continue
            if value < 0:
                problems.append(f"{at}: negative")
            if _is_extended(name) and not _is_whole(value):
                problems.append(f"{at}: {raw!r} is not a whole number")
            if name.startswith("hugepages-") and not _hugepage_divisible(name, value):
                problems.append(f"{at}: {raw!r} is not a multiple of the page size")
    if problems:
        return problems
    for name, raw in requests.items():
        overcommit = name in ("cpu", "memory", "ephemeral-storage")
        if name in limits:
            limit = quantity_value(str(limits[name]))
            if quantity_value(str(raw)) > limit:
                problems.append(f"{where}: request {name} above its limit")
            if not overcommit and quantity_value(str(raw)) != limit:
                problems.append(f"{where}: request {name} must equal its limit")
        elif not overcommit:
            problems.append(f"{where}: {name} is not in limits")
    names = [*requests, *limits]
    if any(n.startswith("hugepages-") for n in names) and not {"cpu", "memory"} & set(names):
        problems.append(f"{where}: HugePages require cpu or memory")
    return problems


def _hugepage_divisible(name: str, value: Decimal) -> bool:
    # IsHugePageResourceValueDivisible: Value() rounds up.
    page = _quantity(name.removeprefix("hugepages-"))
    if page is None or page <= 0 or not _is_whole(page):
        return False
    return -(-value // 1) % page == 0


def toleration_problems(toleration: dict, where: str = "toleration") -> list[str]:
    """ValidateTolerations of one toleration."""
    key, operator = toleration.get("key", ""), toleration.get("operator", "")
    value, effect = toleration.get("value", ""), toleration.get("effect", "")
    problems = [f"{where}: {p}" for p in qualified_name_problems(key)] if key else []
    if not key and operator != "Exists":
        problems.append(f"{where}: operator must be Exists when key is empty")
    if "tolerationSeconds" in toleration and effect != "NoExecute":
        problems.append(f"{where}: tolerationSeconds needs effect NoExecute")
    if operator in ("Equal", ""):
        problems += [f"{where}: {p}" for p in label_value_problems(value)]
    elif operator == "Exists":
        if value:
            problems.append(f"{where}: value must be empty with operator Exists")
    else:
        problems.append(f"{where}: unsupported operator {operator!r}")
    if effect not in ("", "NoSchedule", "PreferNoSchedule", "NoExecute"):
        problems.append(f"{where}: unsupported effect {effect!r}")
    return problems


def _seccomp_profile_ok(profile: str) -> bool:
    if profile in ("runtime/default", "docker/default", "unconfined"):
        return True
    path = profile.removeprefix("localhost/")
    return path != profile and not path.startswith("/") and ".." not in path.split("/")


def _deletion_cost_ok(value: str) -> bool:
    if not value or not (value[0] == "-" or value == "0" or value[0] in "123456789"):
        return False
    if not re.fullmatch(r"-?[0-9]+", value):
        return False
    return INT32_MIN <= int(value) <= INT32_MAX


def _seccomp_field_annotation(field: dict | None) -> set[str]:
    # The annotation values that match a seccompProfile field.
    kind = (field or {}).get("type")
    if kind == "RuntimeDefault":
        return {"runtime/default", "docker/default"}
    if kind == "Unconfined":
        return {"unconfined"}
    if kind == "Localhost":
        return {"localhost/" + field.get("localhostProfile", "")}
    return set()


def pod_annotation_problems(annotations: dict[str, str], pod: dict) -> list[str]:
    """ValidatePodSpecificAnnotations, and the seccomp annotation/field match the pods the
    controller creates must pass."""
    problems = []
    containers = [c["name"] for c in [*pod.get("initContainers", []), *pod["containers"]]]
    if "kubernetes.io/config.mirror" in annotations and not pod.get("nodeName"):
        problems.append("mirror pod annotation without spec.nodeName")
    tolerations = annotations.get("scheduler.alpha.kubernetes.io/tolerations", "")
    if tolerations:
        try:
            parsed = json.loads(tolerations)
            problems += [p for t in parsed for p in toleration_problems(t, "annotation")]
        except (ValueError, TypeError, AttributeError):
            problems.append("tolerations annotation does not parse")
    cost = annotations.get("controller.kubernetes.io/pod-deletion-cost")
    if cost is not None and not _deletion_cost_ok(cost):
        problems.append(f"pod-deletion-cost {cost!r} is no 32-bit integer")
    for key, value in annotations.items():
        is_seccomp = key == "seccomp.security.alpha.kubernetes.io/pod" or key.startswith(
            "container.seccomp.security.alpha.kubernetes.io/"
        )
        if is_seccomp and not _seccomp_profile_ok(value):
            problems.append(f"{key}: {value!r} is no seccomp profile")
        if key.startswith("container.apparmor.security.beta.kubernetes.io/"):
            if key.rpartition("/")[2] not in containers:
                problems.append(f"{key}: container not found")
            ok = value in ("", "runtime/default", "unconfined") or value.startswith("localhost/")
            if not ok:
                problems.append(f"{key}: {value!r} is no AppArmor profile")
    pod_seccomp = pod.get("securityContext", {}).get("seccompProfile")
    value = annotations.get("seccomp.security.alpha.kubernetes.io/pod")
    if value is not None and pod_seccomp and value not in _seccomp_field_annotation(pod_seccomp):
        problems.append("seccomp pod annotation does not match the pod's seccompProfile")
    return problems


def container_problems(container: dict, where: str) -> list[str]:
    problems = image_problems(container.get("image", ""))
    for var in container.get("env", []):
        problems += env_name_problems(var["name"])
        ref = var.get("valueFrom", {}).get("secretKeyRef") or var.get("valueFrom", {}).get(
            "configMapKeyRef"
        )
        if ref:
            problems += config_map_key_problems(ref["key"])
    problems += resources_problems(container.get("resources", {}), f"{where}.resources")
    return [f"{where}: {p}" for p in problems]


def pod_template_problems(template: dict) -> list[str]:
    meta, pod = template.get("metadata", {}), template["spec"]
    problems = labels_problems(meta.get("labels", {}), "template labels")
    annotations = meta.get("annotations", {})
    problems += annotations_problems(annotations, "template annotations")
    problems += pod_annotation_problems(annotations, pod)
    problems += labels_problems(pod.get("nodeSelector", {}), "nodeSelector")
    for index, toleration in enumerate(pod.get("tolerations", [])):
        problems += toleration_problems(toleration, f"tolerations[{index}]")
    for container in [*pod.get("initContainers", []), *pod["containers"]]:
        problems += container_problems(container, f"container {container['name']}")
    for volume in pod.get("volumes", []):
        for item in volume.get("configMap", {}).get("items", []):
            problems += config_map_key_problems(item["key"])
        for item in volume.get("secret", {}).get("items", []):
            problems += config_map_key_problems(item["key"])
    return problems


def child_rule_problems(child: dict) -> list[str]:
    """Every rule above that applies to `child` (any kind we render)."""
    meta = child.get("metadata", {})
    problems = labels_problems(meta.get("labels", {}))
    problems += annotations_problems(meta.get("annotations", {}))
    spec = child.get("spec", {})
    selector = spec.get("selector") or {}
    # A Service's selector is the map itself; the others' is a LabelSelector.
    match_labels = selector if child.get("kind") == "Service" else selector.get("matchLabels", {})
    problems += labels_problems(match_labels, "selector")
    if child.get("kind") == "ConfigMap":
        problems += [p for key in child.get("data", {}) for p in config_map_key_problems(key)]
    if "template" in spec:
        problems += pod_template_problems(spec["template"])
    return problems
