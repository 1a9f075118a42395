"""The shared KV tier and the lookup server as the operator renders and reports them."""

import pydantic
import pytest

from holeblend_operator.render import render_children
from holeblend_operator.status import Observed, build_status
from tests.operator.test_render import blend_json, engine_container, find, make_bd
from tests.operator.test_status import blend_deployment, conditions, deployment

SECRET = {"name": "kv-cache", "key": "password"}


def test_the_shared_tier_password_comes_from_the_secret_as_an_env_var():
    bd = make_bd(blend={"kv": {"sharedUrl": "redis://kv:6379/0", "sharedPasswordSecret": SECRET}})
    env = {var["name"]: var for var in engine_container(bd)["env"]}
    assert env["HOLEBLEND_SHARED_TIER_PASSWORD"] == {
        "name": "HOLEBLEND_SHARED_TIER_PASSWORD",
        "valueFrom": {"secretKeyRef": SECRET},
    }
    assert env["HOLEBLEND_DEPLOYMENT"]["value"] == "serving/rag"
    assert blend_json(bd)["kv"]["sharedUrl"] == "redis://kv:6379/0"
    configmap = find(render_children(bd), "ConfigMap", "runtime-config")
    assert "password" not in str(configmap["data"])


def test_without_a_shared_tier_no_shared_tier_env_is_rendered():
    names = {var["name"] for var in engine_container(make_bd())["env"]}
    assert not names & {"HOLEBLEND_SHARED_TIER_PASSWORD", "HOLEBLEND_DEPLOYMENT"}


def test_a_user_env_var_cannot_replace_the_deployments_key_prefix():
    # HOLEBLEND_DEPLOYMENT prefixes every shared-tier key: another deployment's name there
    # would read and overwrite that deployment's KV.
    with pytest.raises(
        pydantic.ValidationError, match="HOLEBLEND_DEPLOYMENT is set by the operator"
    ):
        make_bd(
            blend={"kv": {"sharedUrl": "redis://kv:6379/0", "sharedPasswordSecret": SECRET}},
            engine={"env": [{"name": "HOLEBLEND_DEPLOYMENT", "value": "shared/prefix"}]},
        )


def test_engine_pods_get_the_lookup_server_address():
    assert blend_json(make_bd(lookupServer={"port": 9100}))["lookupServerUrl"] == (
        "http://rag-lookup.serving.svc:9100"
    )


def test_lookup_server_ready_follows_the_pods_readiness_probes():
    bd = blend_deployment()
    not_ready = build_status(bd, Observed(deployment(), deployment(ready=0), []), [], "t")
    assert conditions(not_ready)["LookupServerReady"] == ("False", "NotAvailable")
    message = {c["type"]: c["message"] for c in not_ready["conditions"]}["LookupServerReady"]
    assert "0/1 pass GET /ready" in message
    ready = build_status(bd, Observed(deployment(), deployment(), []), [], "t")
    assert conditions(ready)["LookupServerReady"] == ("True", "Available")
