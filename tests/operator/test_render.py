"""The pure render functions: golden files, Kubernetes schemas, names and behaviour.

Golden files live in tests/operator/golden/<example>/<kind>-<name>.yaml, one per rendered
child of each manifest in examples/. After an intended change of the rendered objects,
regenerate them and review the diff:

    make golden   # or: HOLEBLEND_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/operator/test_render.py
    git diff tests/operator/golden
"""

import importlib.metadata
import os
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from holeblend_operator import reconcile
from holeblend_operator.api import BlendDeployment
from holeblend_operator.quantity import quantity_bytes
from holeblend_operator.render import (
    CONFIG_HASH_ANNOTATION,
    engine_selector,
    render_children,
    selector_string,
)
from holeblend_operator.render.images import DEFAULT_ENGINE_IMAGES, HOLEBLEND_VERSION
from holeblend_operator.render.naming import bounded_label_value, bounded_name, child_name
from holeblend_operator.render_command import object_yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
GOLDEN = Path(__file__).resolve().parent / "golden"
UPDATE_GOLDEN = os.environ.get("HOLEBLEND_UPDATE_GOLDEN") == "1"
KUBERNETES_VERSIONS = ["1.30", kubernetes_validate.latest_version()]
DNS_1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")

MINIMAL = {
    "apiVersion": "blend.holeblend.io/v1alpha1",
    "kind": "BlendDeployment",
    "metadata": {"name": "rag", "namespace": "serving"},
    "spec": {"model": {"name": "Qwen/Qwen3-8B", "source": {"pvc": {"claimName": "models"}}}},
}


def make_bd(name: str = "rag", **spec) -> BlendDeployment:
    manifest = {**MINIMAL, "metadata": {**MINIMAL["metadata"], "name": name}}
    return BlendDeployment.model_validate({**manifest, "spec": {**MINIMAL["spec"], **spec}})


def load_example(path: Path) -> BlendDeployment:
    return BlendDeployment.model_validate(yaml.safe_load(path.read_text()))


def golden_name(child: dict) -> str:
    return f"{child['kind'].lower()}-{child['metadata']['name']}.yaml"


def find(children: list[dict], kind: str, component: str) -> dict:
    matches = [
        c
        for c in children
        if c["kind"] == kind and c["metadata"]["labels"]["app.kubernetes.io/component"] == component
    ]
    assert len(matches) == 1, f"expected one {kind} of {component}, got {len(matches)}"
    return matches[0]


def engine_pod(bd: BlendDeployment) -> dict:
    return find(render_children(bd), "Deployment", "engine")["spec"]["template"]


def engine_container(bd: BlendDeployment) -> dict:
    return engine_pod(bd)["spec"]["containers"][0]


def env_of(container: dict) -> dict[str, str]:
    return {var["name"]: var["value"] for var in container["env"]}


def blend_json(bd: BlendDeployment) -> dict:
    configmap = find(render_children(bd), "ConfigMap", "runtime-config")
    return yaml.safe_load(configmap["data"]["blend.json"])


# --- golden files --------------------------------------------------------------------


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_rendered_children_match_golden_files(path):
    folder = GOLDEN / path.stem
    children = render_children(load_example(path))
    if UPDATE_GOLDEN:
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob("*.yaml"):
            stale.unlink()
        for child in children:
            (folder / golden_name(child)).write_text(object_yaml(child))
    for child in children:
        golden = folder / golden_name(child)
        assert golden.exists(), f"{golden} missing; regenerate with HOLEBLEND_UPDATE_GOLDEN=1"
        assert object_yaml(child) == golden.read_text(), f"{golden} differs from the render"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_golden_folder_holds_no_stale_files(path):
    rendered = {golden_name(child) for child in render_children(load_example(path))}
    assert {p.name for p in (GOLDEN / path.stem).glob("*.yaml")} == rendered


def test_every_golden_folder_belongs_to_an_example():
    assert {p.name for p in GOLDEN.iterdir() if p.is_dir()} == {p.stem for p in EXAMPLES}


# --- Kubernetes schemas --------------------------------------------------------------


def built_in_children():
    for path in EXAMPLES:
        for child in render_children(load_example(path)):
            if child["kind"] != "ServiceMonitor":
                yield pytest.param(child, id=f"{path.stem}-{golden_name(child)[:-5]}")


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("child", list(built_in_children()))
def test_rendered_objects_pass_kubernetes_validate_strict(child, version):
    kubernetes_validate.validate(child, version, strict=True)


def test_strict_validation_rejects_a_misspelled_field():
    # Guards the test above: the validator must see unknown fields in our objects.
    deployment = find(render_children(make_bd()), "Deployment", "engine")
    deployment["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, "1.30", strict=True)


def test_service_monitor_has_the_prometheus_operator_shape():
    bd = make_bd(monitoring={"serviceMonitor": {"enabled": True, "intervalSeconds": 30}})
    monitor = find(render_children(bd), "ServiceMonitor", "metrics")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}
    assert set(monitor["spec"]) == {"selector", "endpoints"}
    endpoints = [
        {k: v for k, v in e.items() if k != "relabelings"} for e in monitor["spec"]["endpoints"]
    ]
    assert endpoints == [
        {"port": "http", "path": "/metrics", "interval": "30s"},
        {"port": "blend-metrics", "path": "/metrics", "interval": "30s"},
    ]
    assert re.fullmatch(r"(\d+(ms|s|m|h))+", monitor["spec"]["endpoints"][0]["interval"])


@pytest.mark.parametrize("name", ["rag", "llama-3.1-8b", "8b-chat", "rag." + "x" * 200])
def test_service_monitor_labels_every_series_with_the_exact_blenddeployment_name(name):
    """The chart's alerts and dashboard join the engine and lookup series with the operator's
    tuning series (`name`) on `blenddeployment`, and tell the two components apart by
    `component`: Service names and the instance label are hashed for names like these, so
    only a relabeling's replacement carries the name as it is."""
    bd = make_bd(name, monitoring={"serviceMonitor": {"enabled": True}})
    monitor = find(render_children(bd), "ServiceMonitor", "metrics")
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["relabelings"] == [
            {"action": "replace", "targetLabel": "blenddeployment", "replacement": name},
            {
                "action": "replace",
                "sourceLabels": ["__meta_kubernetes_service_label_app_kubernetes_io_component"],
                "targetLabel": "component",
            },
        ]


def test_vllm_pods_export_the_connectors_metrics_on_their_own_port_and_service_port():
    bd = make_bd(engine={"metricsPort": 9500}, monitoring={"serviceMonitor": {"enabled": True}})
    container = engine_container(bd)
    assert env_of(container)["HOLEBLEND_METRICS_PORT"] == "9500"
    assert {"name": "blend-metrics", "containerPort": 9500, "protocol": "TCP"} in container["ports"]
    service = find(render_children(bd), "Service", "engine")
    (metrics,) = [p for p in service["spec"]["ports"] if p["name"] == "blend-metrics"]
    assert (metrics["port"], metrics["targetPort"]) == (9500, "blend-metrics")


@pytest.mark.parametrize(
    "spec",
    [
        {"accelerator": {"type": "cpu"}},  # holeblend-serve exports everything on `port`
        {"blend": {"mode": "off"}},  # plain vLLM: no connector
    ],
)
def test_pods_without_the_connector_have_no_connector_metrics_port(spec):
    bd = make_bd(monitoring={"serviceMonitor": {"enabled": True}}, **spec)
    children = render_children(bd)
    container = find(children, "Deployment", "engine")["spec"]["template"]["spec"]["containers"][0]
    assert "HOLEBLEND_METRICS_PORT" not in env_of(container)
    assert [p["name"] for p in container["ports"]] == ["http"]
    monitor = find(children, "ServiceMonitor", "metrics")
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["http"]


def test_service_monitor_selects_the_engine_and_lookup_services_by_their_labels():
    bd = make_bd(monitoring={"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}})
    children = render_children(bd)
    monitor = find(children, "ServiceMonitor", "metrics")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    selected = [c for c in children if c["kind"] == "Service" and selects(monitor, c)]
    assert [s["metadata"]["name"] for s in selected] == ["rag-engine", "rag-lookup"]
    assert all(s["spec"]["ports"][0]["name"] == "http" for s in selected)


def selects(monitor: dict, service: dict) -> bool:
    labels, selector = service["metadata"]["labels"], monitor["spec"]["selector"]
    matches_labels = selector["matchLabels"].items() <= labels.items()
    return matches_labels and all(
        labels.get(e["key"]) in e["values"] for e in selector["matchExpressions"]
    )


# --- names and labels ----------------------------------------------------------------


def test_short_names_are_kept():
    assert child_name("rag", "engine") == "rag-engine"


def test_long_names_are_truncated_with_a_stable_hash():
    name = child_name("a" * 70, "engine")
    assert len(name) == 63 and DNS_1035_LABEL.fullmatch(name)
    assert name == child_name("a" * 70, "engine")
    assert re.fullmatch(r"a+-[0-9a-f]{8}", name)


def test_long_names_that_share_a_prefix_stay_distinct():
    assert child_name("p" * 80 + "-one", "engine") != child_name("p" * 80 + "-two", "engine")


def test_names_with_dots_or_a_leading_digit_become_dns_labels():
    for bd_name in ("my.model", "8b-model", "x" * 250 + ".v1"):
        assert DNS_1035_LABEL.fullmatch(bounded_name(f"{bd_name}-engine"))
        assert len(bounded_name(f"{bd_name}-engine")) <= 63


def test_every_child_of_a_long_named_deployment_fits_63_characters():
    bd = make_bd("m" * 250, monitoring={"serviceMonitor": {"enabled": True}})
    children = render_children(bd)
    names = [c["metadata"]["name"] for c in children]
    assert all(len(n) <= 63 and DNS_1035_LABEL.fullmatch(n) for n in names), names
    for child in children:
        assert all(len(value) <= 63 for value in child["metadata"]["labels"].values())
        if child["kind"] != "ServiceMonitor":
            kubernetes_validate.validate(child, "1.30", strict=True)


def test_long_instance_label_is_truncated_with_a_hash():
    assert len(bounded_label_value("z" * 100)) == 63
    assert bounded_label_value("z" * 100) != bounded_label_value("z" * 99)
    assert bounded_label_value("my.model") == "my.model"


def test_children_carry_the_standard_labels():
    for child in render_children(make_bd()):
        labels = child["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "holeblend"
        assert labels["app.kubernetes.io/instance"] == "rag"
        assert labels["app.kubernetes.io/managed-by"] == "holeblend-operator"
        assert labels["app.kubernetes.io/part-of"] == "holeblend"
        assert labels["app.kubernetes.io/version"] == HOLEBLEND_VERSION


def test_children_live_in_the_blend_deployments_namespace():
    assert {c["metadata"]["namespace"] for c in render_children(make_bd())} == {"serving"}


def test_selectors_do_not_change_across_updates():
    before = make_bd()
    after = make_bd(
        replicas=5,
        engine={"image": "registry.example/engine:2", "env": [{"name": "A", "value": "1"}]},
        blend={"mode": "prefix", "recomputeRatio": 0.3},
    )
    selectors = [
        [c["spec"]["selector"] for c in render_children(bd) if "selector" in c.get("spec", {})]
        for bd in (before, after)
    ]
    assert selectors[0] == selectors[1]


def test_selector_string_selects_the_engine_pods():
    bd = make_bd()
    pairs = dict(item.split("=") for item in selector_string(bd).split(","))
    assert pairs == engine_selector(bd)
    assert pairs.items() <= engine_pod(bd)["metadata"]["labels"].items()


def test_default_images_follow_the_package_version():
    assert importlib.metadata.version("holeblend") == HOLEBLEND_VERSION


# --- determinism and purity ------------------------------------------------------------


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_rendering_twice_gives_equal_objects(path):
    bd = load_example(path)
    first, second = render_children(bd), render_children(bd)
    assert first == second
    assert [object_yaml(c) for c in first] == [object_yaml(c) for c in second]


def test_children_share_no_mutable_objects():
    # The reconcile step mutates children (kopf.adopt); a shared dict would leak into others.
    bd = make_bd(monitoring={"serviceMonitor": {"enabled": True}})
    seen: set[int] = set()

    def walk(value):
        if isinstance(value, dict | list):
            assert id(value) not in seen, f"shared object {value!r}"
            seen.add(id(value))
            for item in value.values() if isinstance(value, dict) else value:
                walk(item)

    walk(render_children(bd))


def test_children_come_in_a_stable_order():
    bd = make_bd(monitoring={"serviceMonitor": {"enabled": True}})
    assert [(c["kind"], c["metadata"]["name"]) for c in render_children(bd)] == [
        ("Deployment", "rag-engine"),
        ("Service", "rag-engine"),
        ("ConfigMap", "rag-runtime"),
        ("Deployment", "rag-lookup"),
        ("Service", "rag-lookup"),
        ("PodDisruptionBudget", "rag-engine"),
        ("ServiceMonitor", "rag-metrics"),
    ]


# --- accelerators ----------------------------------------------------------------------


def test_ascend_pods_request_the_configured_resource_name():
    bd = make_bd(
        accelerator={"type": "ascend", "count": 2, "resourceName": "huawei.com/ascend-1980"},
        engine={"tensorParallelSize": 2},
    )
    resources = engine_container(bd)["resources"]
    assert resources["requests"]["huawei.com/ascend-1980"] == "2"
    assert resources["limits"]["huawei.com/ascend-1980"] == "2"
    assert "huawei.com/Ascend910" not in resources["limits"]


def test_ascend_pods_default_to_mindclusters_resource_name():
    resources = engine_container(make_bd(accelerator={"type": "ascend"}))["resources"]
    assert resources == {
        "requests": {"huawei.com/Ascend910": "1"},
        "limits": {"huawei.com/Ascend910": "1"},
    }


def test_device_count_wins_over_a_user_set_device_resource():
    bd = make_bd(
        accelerator={"type": "ascend", "count": 4},
        engine={
            "tensorParallelSize": 4,
            "resources": {
                "requests": {"huawei.com/Ascend910": "1", "cpu": "8"},
                "limits": {"huawei.com/Ascend910": "1"},
            },
        },
    )
    resources = engine_container(bd)["resources"]
    assert resources["requests"] == {"cpu": "8", "huawei.com/Ascend910": "4"}
    assert resources["limits"] == {"huawei.com/Ascend910": "4"}


def test_ascend_pods_mount_the_driver_from_the_node_read_only_where_cann_looks():
    bd = make_bd(accelerator={"type": "ascend", "driverHostPath": "/usr/local/Ascend/drv-24"})
    pod = engine_pod(bd)["spec"]
    host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert set(host_paths.values()) == {
        "/usr/local/Ascend/drv-24",
        "/usr/local/dcmi",
        "/usr/local/bin/npu-smi",
        "/etc/ascend_install.info",
    }
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    for name, path in host_paths.items():
        expected = "/usr/local/Ascend/driver" if name == "ascend-driver" else path
        assert mounts[name]["mountPath"] == expected and mounts[name]["readOnly"] is True


def test_multi_npu_ascend_pods_get_hccn_conf_and_the_interface_env():
    bd = make_bd(
        accelerator={"type": "ascend", "count": 2, "networkInterface": "eth1"},
        engine={"tensorParallelSize": 2},
    )
    pod = engine_pod(bd)["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["ascend-hccn-conf"]["hostPath"] == {"path": "/etc/hccn.conf", "type": "File"}
    env = env_of(pod["containers"][0])
    assert env["HCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth1"
    assert env["TP_SOCKET_IFNAME"] == "eth1"


def test_single_npu_pods_mount_no_hccn_conf():
    pod = engine_pod(make_bd(accelerator={"type": "ascend"}))["spec"]
    assert "ascend-hccn-conf" not in {v["name"] for v in pod["volumes"]}


def test_pod_labels_and_annotations_pass_through_beside_ours():
    bd = make_bd(
        engine={
            "podLabels": {"volcano.sh/queue-name": "inference"},
            "podAnnotations": {"hami.io/vnpu-mode": "hami-core"},
        }
    )
    meta = engine_pod(bd)["metadata"]
    assert meta["labels"]["volcano.sh/queue-name"] == "inference"
    assert meta["labels"]["app.kubernetes.io/component"] == "engine"
    assert meta["annotations"]["hami.io/vnpu-mode"] == "hami-core"
    assert CONFIG_HASH_ANNOTATION in meta["annotations"]


def test_rollout_deadline_covers_the_startup_probe_budget():
    deployment = find(render_children(make_bd()), "Deployment", "engine")
    startup = deployment["spec"]["template"]["spec"]["containers"][0]["startupProbe"]
    budget = startup["periodSeconds"] * startup["failureThreshold"]
    assert deployment["spec"]["progressDeadlineSeconds"] > budget


def test_engine_pods_drain_before_they_stop():
    pod = engine_pod(make_bd(engine={"terminationGracePeriodSeconds": 300}))["spec"]
    sleep = pod["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] == 300 > sleep


def test_cpu_and_nvidia_engines_and_lookup_pods_are_restricted():
    for accelerator in ({"type": "cpu", "count": 0}, {"type": "nvidia"}):
        children = render_children(make_bd(accelerator=accelerator))
        for component in ("engine", "lookup-server"):
            pod = find(children, "Deployment", component)["spec"]["template"]["spec"]
            assert pod["securityContext"]["runAsNonRoot"] is True
            assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
            container = pod["containers"][0]["securityContext"]
            assert container["allowPrivilegeEscalation"] is False
            assert container["capabilities"] == {"drop": ["ALL"]}
            assert not [v for v in pod["volumes"] if "hostPath" in v] if "volumes" in pod else True


def test_ascend_visible_devices_are_numbered_from_zero():
    bd = make_bd(accelerator={"type": "ascend", "count": 4}, engine={"tensorParallelSize": 4})
    assert env_of(engine_container(bd))["ASCEND_RT_VISIBLE_DEVICES"] == "0,1,2,3"


def test_user_set_visible_devices_are_refused():
    env = [{"name": "ASCEND_RT_VISIBLE_DEVICES", "value": "1"}]
    with pytest.raises(ValueError, match="set accelerator.count instead"):
        make_bd(engine={"env": env})


def test_nvidia_pods_request_gpus_and_no_ascend_mounts():
    container = engine_container(
        make_bd(accelerator={"type": "nvidia", "count": 2}, engine={"tensorParallelSize": 2})
    )
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "2"}
    assert "ASCEND_RT_VISIBLE_DEVICES" not in env_of(container)
    assert not [m for m in container["volumeMounts"] if m["name"].startswith("ascend")]


def test_cpu_pods_request_no_devices():
    bd = make_bd(
        accelerator={"type": "cpu", "count": 0},
        engine={"resources": {"requests": {"cpu": "2", "memory": "4Gi"}}},
    )
    pod = engine_pod(bd)["spec"]
    assert pod["containers"][0]["resources"] == {"requests": {"cpu": "2", "memory": "4Gi"}}
    assert not [v for v in pod["volumes"] if "hostPath" in v]
    assert "ASCEND_RT_VISIBLE_DEVICES" not in env_of(pod["containers"][0])


@pytest.mark.parametrize("accelerator", ["ascend", "nvidia", "cpu"])
def test_every_engine_gets_a_memory_backed_shm_of_the_configured_size(accelerator):
    count = 0 if accelerator == "cpu" else 1
    bd = make_bd(accelerator={"type": accelerator, "count": count}, engine={"shmSize": "3Gi"})
    pod = engine_pod(bd)["spec"]
    shm = next(v for v in pod["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "3Gi"}
    assert {"name": "shm", "mountPath": "/dev/shm"} in pod["containers"][0]["volumeMounts"]


@pytest.mark.parametrize(
    ("budget", "size"), [("16Gi", "16640Mi"), ("1000000", "257Mi"), (0, "256Mi")]
)
def test_vllm_pods_keep_their_kv_tier_on_a_memory_volume_of_its_own_sized_by_the_budget(
    budget, size, monkeypatch
):
    """The connector's directory lived under /dev/shm, sized by engine.shmSize (8Gi by
    default) whatever blend.kv.localCpuBytes said: a 16Gi budget filled the tmpfs half way
    and every later store failed. It now has a volume of its own, the budget plus headroom,
    mounted where the connector (reading the rendered --kv-transfer-config) keeps it."""
    from holeblend_runtime.vllm_connector.settings import load_settings

    bd = make_bd(blend={"kv": {"localCpuBytes": budget}})
    pod = engine_pod(bd)["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "kv-cache")
    assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": size}
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "kv-cache")
    args = pod["containers"][0]["args"]
    extra = yaml.safe_load(args[args.index("--kv-transfer-config") + 1])
    monkeypatch.delenv("HOLEBLEND_CONFIG", raising=False)
    settings = load_settings(extra["kv_connector_extra_config"] | {"holeblend_config": None})
    assert str(settings.kv_dir) == mount["mountPath"] != "/dev/shm"
    assert not str(settings.kv_dir).startswith("/dev/shm/")
    # holeblend-serve keeps its tier in its process; plain vLLM (blending off) has none.
    for other in (make_bd(accelerator={"type": "cpu", "count": 0}), make_bd(blend={"mode": "off"})):
        names = {v["name"] for v in engine_pod(other)["spec"]["volumes"]}
        assert "kv-cache" not in names


@pytest.mark.parametrize(
    ("limit", "budget", "ok"),
    [("48Gi", "16Gi", True), ("16Gi", "16Gi", False), ("4Gi", None, False), (None, "64Gi", True)],
)
def test_the_kv_budget_must_be_below_the_engines_memory_limit(limit, budget, ok):
    """The pod's own tier is memory charged to the engine's limit: a budget at or above it
    (the 4Gi default included) is refused, naming both fields; no limit, no check."""
    engine = {} if limit is None else {"resources": {"limits": {"memory": limit}}}
    blend = {} if budget is None else {"kv": {"localCpuBytes": budget}}
    if ok:
        make_bd(engine=engine, blend=blend)
        return
    with pytest.raises(
        ValueError, match=r"localCpuBytes must be below engine.resources.limits.memory"
    ):
        make_bd(engine=engine, blend=blend)


@pytest.mark.parametrize("accelerator", ["ascend", "nvidia", "cpu"])
def test_default_engine_image_follows_the_accelerator(accelerator):
    count = 0 if accelerator == "cpu" else 1
    bd = make_bd(accelerator={"type": accelerator, "count": count})
    assert engine_container(bd)["image"] == DEFAULT_ENGINE_IMAGES[accelerator]


def test_a_configured_engine_image_is_used_as_is():
    bd = make_bd(engine={"image": "registry.example/holeblend:dev"})
    assert engine_container(bd)["image"] == "registry.example/holeblend:dev"


def test_scheduling_settings_reach_the_engine_pod():
    toleration = {"key": "npu", "operator": "Exists", "effect": "NoSchedule"}
    bd = make_bd(
        accelerator={
            "nodeSelector": {"accelerator": "huawei-Ascend910"},
            "tolerations": [toleration],
            "schedulerName": "volcano",
        }
    )
    pod = engine_pod(bd)["spec"]
    assert pod["nodeSelector"] == {"accelerator": "huawei-Ascend910"}
    assert pod["tolerations"] == [toleration]
    assert pod["schedulerName"] == "volcano"


def test_unset_scheduling_settings_are_left_out():
    pod = engine_pod(make_bd())["spec"]
    assert not {"nodeSelector", "tolerations", "schedulerName"} & set(pod)


# --- the vLLM command line and the model source --------------------------------------------


def test_engine_serves_the_model_with_our_kv_connector():
    bd = make_bd(
        model={
            "name": "Qwen/Qwen3-8B",
            "servedName": "qwen",
            "dtype": "bfloat16",
            "maxModelLen": 8192,
            "source": {"pvc": {"claimName": "models", "path": "/Qwen3-8B"}},
        },
        accelerator={"count": 2},
        engine={"tensorParallelSize": 2, "port": 9000, "extraArgs": ["--max-num-seqs", "8"]},
    )
    args = engine_container(bd)["args"]
    assert args[:2] == ["serve", "/models/Qwen3-8B"]
    flags = {name: args[i + 1] for i, name in enumerate(args[:-1]) if name.startswith("--")}
    assert flags["--served-model-name"] == "qwen" and flags["--dtype"] == "bfloat16"
    assert flags["--max-model-len"] == "8192" and flags["--tensor-parallel-size"] == "2"
    assert flags["--port"] == "9000"
    connector = yaml.safe_load(flags["--kv-transfer-config"])
    assert connector["kv_connector_module_path"] == "holeblend_runtime.vllm_connector"
    assert connector["kv_connector_extra_config"] == {
        "holeblend_config": "/etc/holeblend/blend.json",
        "kv_dir": "/var/cache/holeblend/kv",
        "shadow_chunk_tokens": 128,  # the quality proxies are on by default
    }
    assert args[-2:] == ["--max-num-seqs", "8"]


@pytest.mark.parametrize(("value", "expected"), [(None, 256), (0, None), (512, 512)])
def test_blend_step_tokens_reach_the_connector_through_the_kv_transfer_config(
    value, expected, monkeypatch
):
    """spec.engine.blendStepTokens, rendered and then read as the connector reads it (unset:
    the connector's default, an eighth of vLLM's step budget; 0: whole blends)."""
    from holeblend_runtime.vllm_connector.settings import load_settings, step_tokens

    engine = {} if value is None else {"blendStepTokens": value}
    args = engine_container(make_bd(engine=engine))["args"]
    extra = yaml.safe_load(args[args.index("--kv-transfer-config") + 1])
    extra = extra["kv_connector_extra_config"]
    assert extra.pop("holeblend_config") == "/etc/holeblend/blend.json"
    assert ("blend_step_tokens" in extra) is (value is not None)
    monkeypatch.delenv("HOLEBLEND_CONFIG", raising=False)  # blend.json's defaults
    assert step_tokens(load_settings(extra), max_num_batched_tokens=2048) == expected


@pytest.mark.parametrize("value", [None, 1, 250, 60000])
def test_the_lookup_deadline_reaches_the_connector_through_the_kv_transfer_config(
    value, monkeypatch
):
    """spec.engine.lookupDeadlineMs, rendered and read back as the connector reads it."""
    from holeblend_runtime.vllm_connector.settings import load_settings

    engine = {} if value is None else {"lookupDeadlineMs": value}
    args = engine_container(make_bd(engine=engine))["args"]
    extra = yaml.safe_load(args[args.index("--kv-transfer-config") + 1])
    extra = extra["kv_connector_extra_config"]
    extra.pop("holeblend_config")
    assert ("lookup_deadline_ms" in extra) is (value is not None)
    monkeypatch.delenv("HOLEBLEND_CONFIG", raising=False)
    deadline = load_settings(extra).lookup_deadline_s
    assert deadline == (None if value is None else value / 1000)


@pytest.mark.parametrize("value", [0, -5, 60001])
def test_a_lookup_deadline_out_of_range_is_refused_naming_the_field(value):
    with pytest.raises(ValueError, match=r"lookupDeadlineMs|lookup_deadline_ms"):
        make_bd(engine={"lookupDeadlineMs": value})


def test_a_negative_blend_step_tokens_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"blendStepTokens|blend_step_tokens"):
        make_bd(engine={"blendStepTokens": -1})


def test_engine_finds_its_settings_through_holeblend_config():
    container = engine_container(make_bd())
    assert env_of(container)["HOLEBLEND_CONFIG"] == "/etc/holeblend/blend.json"
    mount = next(m for m in container["volumeMounts"] if m["name"] == "runtime-config")
    # Mounted without subPath so the kubelet refreshes the file when the ratio changes.
    assert mount == {"name": "runtime-config", "mountPath": "/etc/holeblend", "readOnly": True}


def test_pvc_source_mounts_the_claim_read_only():
    pod = engine_pod(make_bd())["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "model")
    assert volume["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert pod["containers"][0]["args"][1] == "/models"


def test_host_path_source_mounts_the_node_directory():
    source = {"hostPath": {"path": "/data/models/qwen"}}
    pod = engine_pod(make_bd(model={"name": "qwen", "source": source}))["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "model")
    assert volume["hostPath"] == {"path": "/data/models/qwen", "type": "Directory"}
    assert pod["containers"][0]["args"][1] == "/models"


def test_hub_source_passes_the_model_id_without_a_volume():
    source = {"hub": {"id": "HuggingFaceTB/SmolLM2-135M-Instruct", "revision": "main"}}
    pod = engine_pod(make_bd(model={"name": "smol", "source": source}))["spec"]
    args = pod["containers"][0]["args"]
    assert args[1] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert args[args.index("--revision") + 1] == "main"
    assert "model" not in {v["name"] for v in pod["volumes"]}


def test_served_name_defaults_to_the_model_name():
    args = engine_container(make_bd())["args"]
    assert args[args.index("--served-model-name") + 1] == "Qwen/Qwen3-8B"


# --- runtime ConfigMap and rollouts ---------------------------------------------------------


def test_runtime_config_carries_the_blend_settings():
    bd = make_bd(
        blend={
            "mode": "prefix",
            "checkLayer": 3,
            "recomputeRatio": 0.2,
            "kv": {
                "localCpuBytes": "1Gi",
                "admission": "always",
                "storeDtype": "bfloat16",
                "sharedUrl": "redis://kv:6379/0",
                "sharedPasswordSecret": {"name": "rag-kv", "key": "password"},
            },
        },
    )
    config = blend_json(bd)
    assert config["mode"] == "prefix" and config["checkLayer"] == 3
    assert config["recomputeRatio"] == 0.2 and config["separator"] == " # #"
    assert config["kv"] == {
        "localCpuBytes": 2**30,
        "admission": "always",
        "storeDtype": "bfloat16",
        "sharedUrl": "redis://kv:6379/0",
    }
    assert blend_json(make_bd())["kv"]["admission"] == "frequency"
    assert blend_json(make_bd())["kv"]["storeDtype"] == "auto"
    assert config["model"] == {
        "name": "Qwen/Qwen3-8B", "servedName": None, "dtype": "auto", "maxModelLen": None
    }  # fmt: skip
    assert config["lookupServerUrl"] == "http://rag-lookup.serving.svc:8100"
    # holeblend-serve (CPU pods) reads model.maxModelLen here (vLLM takes the flag).
    limited = make_bd(model={"name": "m", "maxModelLen": 2048, "source": {"hub": {"id": "m/m"}}})
    assert blend_json(limited)["model"]["maxModelLen"] == 2048


def test_runtime_config_json_has_sorted_keys():
    configmap = find(render_children(make_bd()), "ConfigMap", "runtime-config")
    keys = list(yaml.safe_load(configmap["data"]["blend.json"]))
    assert keys == sorted(keys)


def test_ratio_change_does_not_roll_engine_pods():
    before, after = make_bd(), make_bd(blend={"recomputeRatio": 0.3})
    assert blend_json(before)["recomputeRatio"] != blend_json(after)["recomputeRatio"]
    assert engine_pod(before) == engine_pod(after)


@pytest.mark.parametrize(
    "blend", [{"mode": "prefix"}, {"checkLayer": 3}, {"separator": " ##"}, {"minSegmentTokens": 16}]
)
def test_other_blend_changes_roll_engine_pods(blend):
    before, after = engine_pod(make_bd()), engine_pod(make_bd(blend=blend))
    annotation = CONFIG_HASH_ANNOTATION
    assert (
        before["metadata"]["annotations"][annotation]
        != after["metadata"]["annotations"][annotation]
    )


def with_status_ratio(bd: BlendDeployment, ratio: float) -> BlendDeployment:
    # A tuned ratio counts only while it derives from the spec's current ratio.
    tuning = bd.status.tuning.model_copy(update={"base_ratio": bd.spec.blend.recompute_ratio})
    status = bd.status.model_copy(update={"recompute_ratio": ratio, "tuning": tuning})
    return bd.model_copy(update={"status": status})


def test_tuned_ratio_from_status_reaches_the_configmap_within_bounds():
    bd = make_bd(tuning={"minRatio": 0.05, "maxRatio": 0.4})
    assert blend_json(with_status_ratio(bd, 0.25))["recomputeRatio"] == 0.25
    assert blend_json(with_status_ratio(bd, 0.9))["recomputeRatio"] == 0.4
    assert engine_pod(with_status_ratio(bd, 0.25)) == engine_pod(bd)


def test_tuned_ratio_is_ignored_when_tuning_is_off():
    bd = make_bd(tuning={"enabled": False}, blend={"recomputeRatio": 0.7})
    assert blend_json(with_status_ratio(bd, 0.25))["recomputeRatio"] == 0.7


def test_replica_count_follows_the_spec():
    deployment = find(render_children(make_bd(replicas=3)), "Deployment", "engine")
    assert deployment["spec"]["replicas"] == 3


# --- optional children ------------------------------------------------------------------


def test_lookup_server_children_disappear_when_disabled():
    bd = make_bd(lookupServer={"enabled": False}, monitoring={"serviceMonitor": {"enabled": True}})
    children = render_children(bd)
    components = {c["metadata"]["labels"]["app.kubernetes.io/component"] for c in children}
    assert "lookup-server" not in components
    assert blend_json(bd)["lookupServerUrl"] is None
    monitor = find(children, "ServiceMonitor", "metrics")
    assert monitor["spec"]["selector"]["matchExpressions"][0]["values"] == ["engine"]


def test_lookup_server_runs_the_runtime_module_on_its_port():
    bd = make_bd(lookupServer={"port": 9100, "replicas": 2})
    children = render_children(bd)
    deployment = find(children, "Deployment", "lookup-server")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert deployment["spec"]["replicas"] == 2
    assert container["command"] == ["python", "-m", "holeblend_runtime.lookup_server"]
    assert container["ports"] == [{"name": "http", "containerPort": 9100, "protocol": "TCP"}]
    assert container["args"] == ["--host", "0.0.0.0", "--port", "9100"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert find(children, "Service", "lookup-server")["spec"]["ports"][0]["port"] == 9100


def test_engine_service_exposes_the_engine_port_as_http():
    service = find(render_children(make_bd(engine={"port": 8080})), "Service", "engine")
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["ports"][0] == {
        "name": "http",
        "port": 8080,
        "targetPort": "http",
        "protocol": "TCP",
    }
    assert service["spec"]["selector"] == engine_selector(make_bd())


def test_disruption_budget_follows_the_spec():
    bd = make_bd(disruptionBudget={"maxUnavailable": 2})
    budget = find(render_children(bd), "PodDisruptionBudget", "engine")
    assert budget["spec"]["maxUnavailable"] == 2
    assert budget["spec"]["selector"] == {"matchLabels": engine_selector(bd)}
    disabled = make_bd(disruptionBudget={"enabled": False})
    assert "PodDisruptionBudget" not in {c["kind"] for c in render_children(disabled)}


def test_disruption_budget_never_blocks_a_drain_on_pods_that_are_not_ready():
    # With two replicas both crash-looping (or still loading), currentHealthy 0 < desiredHealthy
    # 1: under the default IfHealthyBudget policy the eviction API refuses them forever and
    # `kubectl drain` hangs; AlwaysAllow lets not-ready pods go (Kubernetes >= 1.27).
    budget = find(render_children(make_bd(replicas=2)), "PodDisruptionBudget", "engine")
    assert budget["spec"].get("unhealthyPodEvictionPolicy") == "AlwaysAllow"


def test_service_monitor_is_off_by_default():
    assert "ServiceMonitor" not in {c["kind"] for c in render_children(make_bd())}


# --- quantities -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("quantity", "num_bytes"),
    [
        ("4Gi", 4 * 2**30),
        ("512Mi", 512 * 2**20),
        ("1G", 10**9),
        ("1e3", 1000),
        ("1.5Ki", 1536),
        ("100", 100),
        ("1500m", 2),
        ("1u", 1),
        ("2000000000n", 2),
    ],
)
def test_quantities_convert_to_whole_bytes(quantity, num_bytes):
    assert quantity_bytes(quantity, "field") == num_bytes


def test_a_bad_quantity_names_the_field():
    with pytest.raises(ValueError, match="spec.blend.kv.localCpuBytes"):
        quantity_bytes("four gigs", "spec.blend.kv.localCpuBytes")


def test_a_byte_budget_the_parser_cannot_read_is_an_invalid_spec():
    # The quantity pattern (as in the CRD) admits a fractional exponent; the byte budget
    # must still be readable, so the spec is rejected with the field named, before render.
    body = make_bd().model_dump(by_alias=True, exclude_none=True)
    body["spec"]["blend"]["kv"]["localCpuBytes"] = "1e1.5"
    with pytest.raises(reconcile.InvalidSpec, match=r"spec\.blend\.kv\.localCpuBytes"):
        reconcile.prepare(body)


@pytest.mark.parametrize(
    ("accelerator", "block_size"),
    [({"type": "ascend"}, "128"), ({"type": "nvidia"}, "16")],
)
def test_vllm_pods_get_the_flags_blending_needs(accelerator, block_size):
    args = engine_container(make_bd(accelerator=accelerator))["args"]
    for flag in (
        "--enforce-eager",
        "--no-enable-prefix-caching",
        "--disable-hybrid-kv-cache-manager",
    ):
        assert flag in args
    assert args[args.index("--block-size") + 1] == block_size
    assert "--kv-transfer-config" in args


def test_blend_mode_off_serves_plain_vllm():
    args = engine_container(make_bd(accelerator={"type": "nvidia"}, blend={"mode": "off"}))["args"]
    assert "--kv-transfer-config" not in args and "--enforce-eager" not in args


def test_runtime_images_are_one_setting_read_from_the_charts_env():
    from holeblend_operator.render.images import RuntimeImages

    images = RuntimeImages.from_environ(
        {
            "HOLEBLEND_RUNTIME_IMAGE_REPOSITORY": "registry.example/rt",
            "HOLEBLEND_RUNTIME_IMAGE_TAG": "9",
        }
    )
    assert images.image("ascend-a3") == "registry.example/rt-ascend-a3:9"
    assert (
        RuntimeImages.from_environ({}).image("cuda")
        == f"ghcr.io/holeblend/runtime-cuda:{HOLEBLEND_VERSION}"
    )
