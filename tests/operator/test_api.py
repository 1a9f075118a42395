"""The pydantic models: defaults, bounds, camelCase and the rules mirrored from CEL."""

import pydantic
import pytest

from holeblend_operator.api import (
    BlendDeployment,
    BlendDeploymentSpec,
    format_validation_error,
)
from tests.operator.crd_validation import api_server_errors

MINIMAL = {
    "apiVersion": "blend.holeblend.io/v1alpha1",
    "kind": "BlendDeployment",
    "metadata": {"name": "rag"},
    "spec": {"model": {"name": "Qwen/Qwen3-8B", "source": {"pvc": {"claimName": "models"}}}},
}


def _with_spec(**changes):
    return {**MINIMAL, "spec": {**MINIMAL["spec"], **changes}}


def test_minimal_spec_gets_documented_defaults():
    spec = BlendDeployment.model_validate(MINIMAL).spec
    assert spec.replicas == 1
    assert spec.blend.mode == "hole" and spec.blend.recompute_ratio == 0.15
    assert spec.blend.separator == " # #" and spec.blend.check_layer == 2
    assert spec.accelerator.type == "ascend"
    assert spec.accelerator.effective_resource_name == "huawei.com/Ascend910"
    assert spec.lookup_server.enabled and spec.tuning.enabled


def test_wire_format_is_camel_case():
    dumped = BlendDeploymentSpec.model_validate(MINIMAL["spec"]).model_dump(by_alias=True)
    assert "recomputeRatio" in dumped["blend"] and "lookupServer" in dumped


def test_nvidia_resource_name_defaults_to_gpu():
    bd = BlendDeployment.model_validate(_with_spec(accelerator={"type": "nvidia"}))
    assert bd.spec.accelerator.effective_resource_name == "nvidia.com/gpu"


def test_cpu_has_no_device_resource():
    bd = BlendDeployment.model_validate(_with_spec(accelerator={"type": "cpu", "count": 0}))
    assert bd.spec.accelerator.effective_resource_name is None


def test_integer_quantities_are_accepted_like_kubernetes_does():
    bd = BlendDeployment.model_validate(_with_spec(engine={"resources": {"requests": {"cpu": 2}}}))
    assert bd.spec.engine.resources.requests == {"cpu": "2"}
    assert api_server_errors(_with_spec(engine={"resources": {"requests": {"cpu": 2}}})) == []


def test_ratio_one_is_allowed_without_tuning():
    bd = BlendDeployment.model_validate(
        _with_spec(blend={"recomputeRatio": 1}, tuning={"enabled": False})
    )
    assert bd.spec.blend.recompute_ratio == 1.0


def test_models_are_frozen():
    bd = BlendDeployment.model_validate(MINIMAL)
    with pytest.raises(pydantic.ValidationError):
        bd.spec.replicas = 3


def test_invalid_object_name_is_reported_with_its_path():
    with pytest.raises(pydantic.ValidationError) as caught:
        BlendDeployment.model_validate({**MINIMAL, "metadata": {"name": "Not_Valid"}})
    assert format_validation_error(caught.value).startswith("metadata.name: 'Not_Valid'")


def test_several_problems_come_in_one_line():
    with pytest.raises(pydantic.ValidationError) as caught:
        BlendDeployment.model_validate(_with_spec(replicas=-1, blend={"mode": "x"}))
    message = format_validation_error(caught.value)
    assert "spec.replicas" in message and "spec.blend.mode" in message and "\n" not in message


def test_minimal_manifest_passes_the_api_server_checks():
    assert api_server_errors(MINIMAL) == []


@pytest.mark.parametrize(
    "model_dtype, store_dtype, accepted",
    [
        ("auto", "bfloat16", True),  # the model's dtype is known only to the engine
        ("float32", "bfloat16", True),
        ("float32", "float16", True),
        ("float32", "float8_e4m3fn", True),
        ("bfloat16", "auto", True),
        ("bfloat16", "bfloat16", True),
        ("bfloat16", "float8_e4m3fn", True),
        ("float16", "float8_e4m3fn", True),
        ("bfloat16", "float16", False),
        ("float16", "bfloat16", False),
        ("float16", "float32", False),
    ],
)
def test_kv_store_dtype_must_be_narrower_than_a_known_model_dtype(
    model_dtype, store_dtype, accepted
):
    manifest = _with_spec(
        model={**MINIMAL["spec"]["model"], "dtype": model_dtype},
        blend={"kv": {"storeDtype": store_dtype}},
    )
    errors = api_server_errors(manifest)
    if accepted:
        assert errors == []
        assert BlendDeployment.model_validate(manifest).spec.blend.kv.store_dtype == store_dtype
        return
    assert any("blend.kv.storeDtype must be auto, model.dtype or float8" in e for e in errors), (
        errors
    )
    with pytest.raises(pydantic.ValidationError, match="set it to auto"):
        BlendDeployment.model_validate(manifest)
