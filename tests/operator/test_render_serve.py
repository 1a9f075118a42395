"""CPU engine pods run holeblend-serve with the mounted blend.json; device pods keep vLLM."""

import dataclasses

import pytest

from holeblend_contract.blend_settings import CONFIG_PATH
from tests.operator.test_render import engine_pod, make_bd


def cpu_bd(**engine):
    return make_bd(accelerator={"type": "cpu", "count": 0}, engine=engine)


def test_cpu_pods_run_holeblend_serve_on_the_config_file():
    container = engine_pod(cpu_bd(port=8080))["spec"]["containers"][0]
    assert container["command"] == ["holeblend-serve"]
    assert container["args"] == ["--config", CONFIG_PATH, "--host", "0.0.0.0", "--port", "8080"]
    assert {"name": "HOLEBLEND_CONFIG", "value": CONFIG_PATH} in container["env"]


def test_cpu_pods_probe_ready_and_healthz():
    container = engine_pod(cpu_bd())["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["startupProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_extra_args_are_holeblend_serve_flags_on_cpu():
    container = engine_pod(cpu_bd(extraArgs=["--queue-size", "16"]))["spec"]["containers"][0]
    assert container["args"][-2:] == ["--queue-size", "16"]


@pytest.mark.parametrize("accelerator", ["nvidia", "ascend"])
def test_device_pods_keep_vllm(accelerator):
    bd = make_bd(accelerator={"type": accelerator, "count": 1})
    assert engine_pod(bd)["spec"]["containers"][0]["command"] == ["vllm"]


# The kubelet runs the preStop hook inside the grace period and sends SIGTERM with what is
# left, never less than 2 s (killContainer in pkg/kubelet/kuberuntime/kuberuntime_container.go:
# gracePeriod -= preStop time; minimumGracePeriodInSeconds = 2), then SIGKILL.
KUBELET_MINIMUM_GRACE_SECONDS = 2


def seconds_after_pre_stop(pod_spec: dict) -> int:
    sleep = pod_spec["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]
    return max(pod_spec["terminationGracePeriodSeconds"] - sleep, KUBELET_MINIMUM_GRACE_SECONDS)


@pytest.mark.parametrize("grace", [30, 45, 120, 600])
def test_a_stopping_cpu_pod_has_time_for_holeblend_serves_whole_drain(grace):
    from holeblend_runtime.serve.settings import ServeSettings

    defaults = {f.name: f.default for f in dataclasses.fields(ServeSettings)}
    stop = defaults["drain_timeout"] + defaults["shutdown_timeout"]
    pod = engine_pod(cpu_bd(terminationGracePeriodSeconds=grace))["spec"]
    assert seconds_after_pre_stop(pod) > stop
    assert pod["terminationGracePeriodSeconds"] >= grace


@pytest.mark.parametrize("accelerator", ["nvidia", "ascend"])
def test_device_pods_keep_the_grace_period_they_ask_for(accelerator):
    bd = make_bd(
        accelerator={"type": accelerator, "count": 1}, engine={"terminationGracePeriodSeconds": 30}
    )
    assert engine_pod(bd)["spec"]["terminationGracePeriodSeconds"] == 30


def holeblend_serve_stop_seconds(container: dict) -> float:
    """Drain plus close, as the server itself reads them from the rendered container."""
    from holeblend_runtime.serve.settings import parse_settings

    env = {var["name"]: var["value"] for var in container["env"]}
    settings = parse_settings(container["args"], env)
    return settings.drain_timeout + settings.shutdown_timeout


@pytest.mark.parametrize(
    ("extra_args", "env"),
    [
        (["--drain-timeout", "120"], {}),
        (["--drain-timeout=90.5"], {}),
        (["--drain-timeout", "200", "--queue-size", "16", "--drain-timeout=75"], {}),
        (["--shutdown-timeout", "60"], {}),
        ([], {"HOLEBLEND_SERVE_DRAIN_TIMEOUT": "100"}),
        (["--drain-timeout", "45"], {"HOLEBLEND_SERVE_DRAIN_TIMEOUT": "300"}),
    ],
)
def test_a_stopping_cpu_pod_has_time_for_the_drain_its_flags_ask_for(extra_args, env):
    env_vars = [{"name": name, "value": value} for name, value in env.items()]
    bd = cpu_bd(terminationGracePeriodSeconds=30, extraArgs=extra_args, env=env_vars)
    pod = engine_pod(bd)["spec"]
    assert seconds_after_pre_stop(pod) > holeblend_serve_stop_seconds(pod["containers"][0])


@pytest.mark.parametrize(
    "extra_args",
    [
        ["--drain-timeout", "soon"],
        ["--drain-timeout="],
        ["--drain-timeout"],
        ["--drain-timeout", "inf"],
    ],
)
def test_a_drain_that_is_no_finite_number_leaves_the_default_grace(extra_args):
    pod = engine_pod(cpu_bd(terminationGracePeriodSeconds=30, extraArgs=extra_args))["spec"]
    default = engine_pod(cpu_bd(terminationGracePeriodSeconds=30))["spec"]
    assert pod["terminationGracePeriodSeconds"] == default["terminationGracePeriodSeconds"]
