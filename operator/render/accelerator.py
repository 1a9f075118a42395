"""The parts of the engine pod that depend on the accelerator type.

Ascend pods get their NPUs from a device plugin (MindCluster's `huawei.com/Ascend910` by
default), which injects the /dev/davinci* device nodes; the runtime libraries that talk to
them (driver, DCMI, npu-smi) stay on the node and are mounted read-only from it. NVIDIA
pods need only the device resource: the NVIDIA container toolkit injects the driver.
"""

from holeblend_operator.api import (
    AcceleratorSpec,
    AcceleratorType,
    BlendDeployment,
    EnvVar,
    Toleration,
)
from holeblend_operator.render.pods import (
    RESTRICTED_CONTAINER_SECURITY,
    RESTRICTED_POD_SECURITY,
    ascend_container_security,
    ascend_pod_security,
    resources,
)

# (volume name, path on the node, path in the container, hostPath type)
ASCEND_HOST_MOUNTS = (
    ("ascend-dcmi", "/usr/local/dcmi", "/usr/local/dcmi", "Directory"),
    ("ascend-npu-smi", "/usr/local/bin/npu-smi", "/usr/local/bin/npu-smi", "File"),
    ("ascend-install-info", "/etc/ascend_install.info", "/etc/ascend_install.info", "File"),
)
ASCEND_DRIVER_VOLUME = "ascend-driver"
# Where CANN looks for the driver inside the container, whatever its path on the node.
ASCEND_DRIVER_DIR = "/usr/local/Ascend/driver"
HCCN_CONF_VOLUME = "ascend-hccn-conf"
HCCN_CONF_PATH = "/etc/hccn.conf"
VISIBLE_DEVICES_ENV = {AcceleratorType.ASCEND: "ASCEND_RT_VISIBLE_DEVICES"}
# Interface variables of the collective-communication libraries per accelerator type.
INTERFACE_ENV = {
    AcceleratorType.ASCEND: ("HCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME"),
    AcceleratorType.NVIDIA: ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"),
    AcceleratorType.CPU: ("GLOO_SOCKET_IFNAME",),
}


def device_resources(accelerator: AcceleratorSpec) -> dict[str, str]:
    """Device-plugin resources of one engine pod; none for cpu."""
    resource_name = accelerator.effective_resource_name
    if resource_name is None:
        return {}
    return {resource_name: str(accelerator.count)}


def container_resources(bd: BlendDeployment) -> dict:
    """The user's requests and limits with the devices added to both (extended resources
    cannot be overcommitted, so the API server requires requests == limits for them)."""
    user, devices = bd.spec.engine.resources, device_resources(bd.spec.accelerator)
    return resources(user.requests | devices, user.limits | devices)


def accelerator_env(bd: BlendDeployment) -> list[EnvVar]:
    """Visible-device variables, numbered 0..count-1 inside the container, and the
    collective-communication interface when one is set."""
    return [*_visible_devices_env(bd.spec.accelerator), *_interface_env(bd.spec.accelerator)]


def _visible_devices_env(accelerator: AcceleratorSpec) -> list[EnvVar]:
    variable = VISIBLE_DEVICES_ENV.get(accelerator.type)
    if variable is None:
        return []
    devices = ",".join(str(index) for index in range(accelerator.count))
    return [EnvVar(name=variable, value=devices)]


def _interface_env(accelerator: AcceleratorSpec) -> list[EnvVar]:
    interface = accelerator.network_interface
    if interface is None:
        return []
    return [EnvVar(name=name, value=interface) for name in INTERFACE_ENV[accelerator.type]]


def host_mounts(bd: BlendDeployment) -> tuple[tuple[str, str, str, str], ...]:
    """(volume, node path, container path, hostPath type) of every node file the pod reads."""
    accelerator = bd.spec.accelerator
    if accelerator.type != AcceleratorType.ASCEND:
        return ()
    driver = (ASCEND_DRIVER_VOLUME, accelerator.driver_host_path, ASCEND_DRIVER_DIR, "Directory")
    return (driver, *ASCEND_HOST_MOUNTS, *_hccn_conf_mount(bd))


def _hccn_conf_mount(bd: BlendDeployment) -> tuple[tuple[str, str, str, str], ...]:
    # HCCL reads the NPUs' network settings when the model is sharded over several NPUs.
    path = bd.spec.accelerator.hccn_conf_host_path
    if path is None or bd.spec.engine.tensor_parallel_size < 2:
        return ()
    return ((HCCN_CONF_VOLUME, path, HCCN_CONF_PATH, "File"),)


def host_volumes(bd: BlendDeployment) -> list[dict]:
    return [
        {"name": name, "hostPath": {"path": node_path, "type": path_type}}
        for name, node_path, _, path_type in host_mounts(bd)
    ]


def host_volume_mounts(bd: BlendDeployment) -> list[dict]:
    return [
        {"name": name, "mountPath": container_path, "readOnly": True}
        for name, _, container_path, _ in host_mounts(bd)
    ]


def scheduling(accelerator: AcceleratorSpec) -> dict:
    """nodeSelector, tolerations and schedulerName of the pod spec, only those that are set."""
    fields = {
        "nodeSelector": dict(sorted(accelerator.node_selector.items())),
        "tolerations": [toleration(t) for t in accelerator.tolerations],
        "schedulerName": accelerator.scheduler_name,
    }
    return {key: value for key, value in fields.items() if value}


def toleration(t: Toleration) -> dict:
    """A toleration as the API server stores it: unset and "" fields left out (its string
    fields are `omitempty`; "" means the same as unset), so that the live object matches."""
    fields = t.model_dump(by_alias=True, exclude_none=True, mode="json")
    return {key: value for key, value in fields.items() if value != ""}


# Scratch space of engines with a read-only root filesystem: $HOME (caches of vLLM, torch,
# Triton and hub downloads) and /tmp, on emptyDir volumes.
ENGINE_HOME = "/home/holeblend"
SCRATCH_MOUNTS = (("home", ENGINE_HOME), ("tmp", "/tmp"))


def is_restricted(accelerator: AcceleratorSpec) -> bool:
    """Whether the engine pod can meet the `restricted` Pod Security Standard."""
    return accelerator.type != AcceleratorType.ASCEND


def pod_security(accelerator: AcceleratorSpec) -> dict:
    if is_restricted(accelerator):
        return dict(RESTRICTED_POD_SECURITY)
    return ascend_pod_security()


def container_security(accelerator: AcceleratorSpec) -> dict:
    if is_restricted(accelerator):
        return dict(RESTRICTED_CONTAINER_SECURITY)
    return ascend_container_security()


def scratch_env(accelerator: AcceleratorSpec) -> list[EnvVar]:
    return [EnvVar(name="HOME", value=ENGINE_HOME)] if is_restricted(accelerator) else []


def scratch_volumes(accelerator: AcceleratorSpec) -> list[dict]:
    if not is_restricted(accelerator):
        return []
    return [{"name": name, "emptyDir": {}} for name, _ in SCRATCH_MOUNTS]


def scratch_volume_mounts(accelerator: AcceleratorSpec) -> list[dict]:
    if not is_restricted(accelerator):
        return []
    return [{"name": name, "mountPath": path} for name, path in SCRATCH_MOUNTS]
