"""lookupServerUrl: a user, password, query or fragment is refused, not dropped.

The lookup client opens a plain connection to HOST:PORT and sends nothing else of the URL: a
URL with credentials in it would look protected while the client never sends them. The
refusal names the key and the form to write, and does not quote the URL (a password in it
would reach the pod's log)."""

import json

import pytest

from holeblend_contract.blend_settings import (
    BlendSettingsError,
    parse_blend_settings,
    parse_lookup_url,
)


def blend_json(url: str) -> str:
    return json.dumps({"model": {"name": "m"}, "lookupServerUrl": url})


@pytest.mark.parametrize(
    ("url", "what"),
    [
        ("http://u@lookup.default.svc:8080", "a user or password"),
        ("http://user:s3cret@lookup.default.svc:8080/", "a user or password"),
        ("http://lookup.default.svc:8080/?token=s3cret", "a query"),
        ("http://lookup.default.svc:8080/#f", "a fragment"),
        ("http://u@lookup:80/#f", "a user or password and a fragment"),
        ("redis://user:s3cret@lookup:6379/0?x=1", "a user or password and a query"),
    ],
)
def test_a_url_with_credentials_a_query_or_a_fragment_is_refused_naming_the_key_and_the_form(
    url, what
):
    with pytest.raises(BlendSettingsError) as caught:
        parse_blend_settings(blend_json(url))
    message = str(caught.value)
    assert message.startswith(f"blend.json: lookupServerUrl: has {what}, ")
    assert "write http://HOST:PORT" in message
    assert "s3cret" not in message
    with pytest.raises(ValueError, match=f"^lookupServerUrl: has {what}, "):
        parse_lookup_url(url)


@pytest.mark.parametrize("url", ["http://lookup.default.svc:8080", "http://[fd00::7]:8080/"])
def test_a_plain_host_and_port_still_loads(url):
    assert parse_blend_settings(blend_json(url)).lookup_server_url == url
