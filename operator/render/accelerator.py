"""The parts of the engine pod that depend on the accelerator type.

Ascend pods get their NPUs from a device plugin (MindCluster's `huawei.com/Ascend910` by
default), which injects the /dev/davinci* device nodes; the runtime libraries that talk to
them (driver, DCMI, npu-smi) stay on the node and are mounted read-only from it. NVIDIA
pods need only the device resource: the NVIDIA container toolkit injects the driver.
"""

from holeblend_operator.api import AcceleratorSpec, AcceleratorType, BlendDeployment, EnvVar
from holeblend_operator.render.pods import resources

# (volume name, path on the node and in the container, hostPath type)
ASCEND_HOST_MOUNTS = (
    ("ascend-dcmi", "/usr/local/dcmi", "Directory"),
    ("ascend-npu-smi", "/usr/local/bin/npu-smi", "File"),
    ("ascend-install-info", "/etc/ascend_install.info", "File"),
)
ASCEND_DRIVER_VOLUME = "ascend-driver"
VISIBLE_DEVICES_ENV = {AcceleratorType.ASCEND: "ASCEND_RT_VISIBLE_DEVICES"}


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
    """Visible-device variables, numbered 0..count-1 inside the container."""
    variable = VISIBLE_DEVICES_ENV.get(bd.spec.accelerator.type)
    if variable is None:
        return []
    devices = ",".join(str(index) for index in range(bd.spec.accelerator.count))
    return [EnvVar(name=variable, value=devices)]


def host_mounts(accelerator: AcceleratorSpec) -> tuple[tuple[str, str, str], ...]:
    if accelerator.type != AcceleratorType.ASCEND:
        return ()
    driver = (ASCEND_DRIVER_VOLUME, accelerator.driver_host_path, "Directory")
    return (driver, *ASCEND_HOST_MOUNTS)


def host_volumes(accelerator: AcceleratorSpec) -> list[dict]:
    return [
        {"name": name, "hostPath": {"path": path, "type": path_type}}
        for name, path, path_type in host_mounts(accelerator)
    ]


def host_volume_mounts(accelerator: AcceleratorSpec) -> list[dict]:
    return [
        {"name": name, "mountPath": path, "readOnly": True}
        for name, path, _ in host_mounts(accelerator)
    ]


def scheduling(accelerator: AcceleratorSpec) -> dict:
    """nodeSelector, tolerations and schedulerName of the pod spec, only those that are set."""
    fields = {
        "nodeSelector": dict(sorted(accelerator.node_selector.items())),
        "tolerations": [
            t.model_dump(by_alias=True, exclude_none=True, mode="json")
            for t in accelerator.tolerations
        ],
        "schedulerName": accelerator.scheduler_name,
    }
    return {key: value for key, value in fields.items() if value}
