"""kv.sharedIdentity: each BlendDeployment is its own ACL user of the shared tier, refused
consistently by the CRD's CEL rules (as the API server applies them) and by the model."""

import pytest
from pydantic import ValidationError

from holeblend_contract.shared_tier import acl_user
from tests.operator.crd_validation import api_server_errors
from tests.operator.test_render import MINIMAL, engine_container, make_bd

SECRET = {"name": "rag-kv", "key": "password"}
URL = "redis://kv:6379/0"


def manifest(**kv) -> dict:
    return {**MINIMAL, "spec": {**MINIMAL["spec"], "blend": {"kv": kv}}}


def shared_env(bd) -> dict:
    return {v["name"]: v for v in engine_container(bd)["env"] if "SHARED" in v["name"]}


def test_by_default_the_pods_connect_as_the_deployments_own_user():
    bd = make_bd(blend={"kv": {"sharedUrl": URL, "sharedPasswordSecret": SECRET}})
    env = shared_env(bd)
    assert env["HOLEBLEND_SHARED_TIER_USER"]["value"] == acl_user("serving/rag")
    assert env["HOLEBLEND_SHARED_TIER_PASSWORD"]["valueFrom"] == {"secretKeyRef": SECRET}


def test_a_shared_identity_renders_no_user():
    kv = {"sharedUrl": URL, "sharedPasswordSecret": SECRET, "sharedIdentity": "shared"}
    assert "HOLEBLEND_SHARED_TIER_USER" not in shared_env(make_bd(blend={"kv": kv}))


@pytest.mark.parametrize(
    ("kv", "field", "words"),
    [
        ({"sharedUrl": URL}, "sharedPasswordSecret", "shared-tier-acl"),
        ({"sharedUrl": "redis://someone@kv:6379/0", "sharedPasswordSecret": SECRET},
         "sharedUrl", "names a user"),
    ],
)  # fmt: skip
def test_the_deployment_identity_needs_its_secret_and_no_url_user(kv, field, words):
    errors = api_server_errors(manifest(**kv))
    assert any(field in e and words in e for e in errors), errors
    with pytest.raises(ValidationError, match=words):
        make_bd(blend={"kv": kv})
    # With the shared identity both are what the user asked for.
    shared = {**kv, "sharedIdentity": "shared"}
    assert api_server_errors(manifest(**shared)) == []
    make_bd(blend={"kv": shared})


def test_an_unknown_identity_is_refused():
    errors = api_server_errors(manifest(sharedUrl=URL, sharedIdentity="tenant"))
    assert any("sharedIdentity" in e for e in errors), errors
