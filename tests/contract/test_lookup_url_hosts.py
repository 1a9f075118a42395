"""lookupServerUrl hosts: a name no DNS query can carry is refused when blend.json loads.

Such a name (an empty label, a label over 63 characters, a name over 253) would let the pod
start and fail every lookup it makes; IP addresses and the names the operator renders load.
"""

import json
from pathlib import Path

import pytest
import yaml

from holeblend_contract.blend_settings import (
    BlendSettingsError,
    parse_blend_settings,
    parse_lookup_url,
)
from holeblend_operator.api import BlendDeployment
from holeblend_operator.render.runtime_config import blend_settings

ROOT = Path(__file__).resolve().parents[2]
LABEL = "a" * 63


def blend_json(url: str) -> str:
    return json.dumps({"model": {"name": "m"}, "lookupServerUrl": url})


@pytest.mark.parametrize(
    "host",
    [
        "lookup..svc",
        ".svc",
        "a" * 64 + ".default.svc",
        ".".join([LABEL] * 4),  # 255 characters
        "ü" * 63 + ".svc",  # 63 characters, longer in the xn-- form DNS carries
    ],
    ids=["empty-label", "leading-dot", "label-over-63", "name-over-253", "idna-label-over-63"],
)
def test_a_host_no_dns_query_can_carry_is_refused_naming_the_key_and_the_fix(host):
    with pytest.raises(BlendSettingsError) as caught:
        parse_blend_settings(blend_json(f"http://{host}:8080"))
    message = str(caught.value)
    assert message.startswith("blend.json: lookupServerUrl: host ")
    assert "is not a DNS name" in message and "http://NAME.NAMESPACE.svc:PORT" in message


@pytest.mark.parametrize(
    ("url", "host"),
    [
        ("http://10.0.0.7:8080", "10.0.0.7"),
        ("http://[fd00::7]:8080", "fd00::7"),
        ("http://lookup.default.svc.:8080", "lookup.default.svc."),
        (f"http://{LABEL}.svc:8080", f"{LABEL}.svc"),
        (f"http://{'.'.join([LABEL] * 3 + ['a' * 61])}:8080", ".".join([LABEL] * 3 + ["a" * 61])),
    ],
)
def test_ip_addresses_and_names_within_the_dns_limits_load(url, host):
    assert parse_blend_settings(blend_json(url)).lookup_server_url == url
    assert parse_lookup_url(url) == (host, 8080)


def test_the_url_the_operator_renders_for_the_longest_names_loads():
    """A 253-character name and a 63-character namespace: the Service's host stays a DNS
    name (the child name is a bounded label)."""
    body = yaml.safe_load((ROOT / "examples" / "cpu.yaml").read_text())
    body["metadata"].update(name=".".join([LABEL] * 3 + ["a" * 61]), namespace="n" * 63)
    settings = blend_settings(BlendDeployment.model_validate(body))

    host, _ = parse_lookup_url(settings.lookup_server_url)
    assert parse_blend_settings(settings.to_json()).lookup_server_url == settings.lookup_server_url
    assert len(host) <= 253
