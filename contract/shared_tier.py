"""The shared KV tier's names, agreed by the operator (renders) and the runtime (connects).

- URL: `redis://`, `rediss://` (TLS), `valkey://` or `valkeys://` (TLS), host, port and
  database, optionally a user name; never a password, because the URL sits in a
  ConfigMap. The password comes from a Secret, as the env var `PASSWORD_ENV`.
- Keys: `holeblend:{namespace}/{name}:kv:v{format}:{segment key}`, one per segment, so
  several BlendDeployments can share one Redis and a new blob format never reads an
  old blob. The runtime learns `{namespace}/{name}` from `DEPLOYMENT_ENV`.
"""

from __future__ import annotations

from urllib.parse import urlsplit

SCHEMES = ("redis", "rediss", "valkey", "valkeys")
# Env var with the shared tier's password (from the Secret spec.blend.kv.sharedPasswordSecret).
PASSWORD_ENV = "HOLEBLEND_SHARED_TIER_PASSWORD"
# Env var with the BlendDeployment's "namespace/name", the prefix of its keys.
DEPLOYMENT_ENV = "HOLEBLEND_DEPLOYMENT"
KEY_ROOT = "holeblend"


def check_shared_url(url: str, field: str = "spec.blend.kv.sharedUrl") -> str:
    """`url` when it names a supported store without a password; else ValueError naming `field`."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as error:
        raise ValueError(f"{field}: {url!r} is not a valid URL ({error})") from None
    if parts.scheme not in SCHEMES:
        raise ValueError(
            f"{field}: scheme {parts.scheme!r} is not supported; use one of "
            f"{', '.join(s + '://' for s in SCHEMES)} (e.g. redis://kv-cache:6379/0)"
        )
    if not parts.hostname:
        raise ValueError(f"{field}: {url!r} names no host; e.g. redis://kv-cache:6379/0")
    if parts.password is not None:
        raise ValueError(
            f"{field}: the URL carries a password, which would be stored in a ConfigMap; "
            "remove it from the URL and reference a Secret key in "
            "spec.blend.kv.sharedPasswordSecret instead"
        )
    del port  # parsed only to reject a malformed port
    return url


def key_prefix(deployment: str, blob_format: int) -> str:
    """The prefix of every shared-tier key of one BlendDeployment ("namespace/name")."""
    if not deployment:
        raise ValueError("deployment: must not be empty (namespace/name of the BlendDeployment)")
    return f"{KEY_ROOT}:{deployment}:kv:v{blob_format}:"
