"""The shared KV tier's names, agreed by the operator (renders) and the runtime (connects).

- URL: `redis://`, `rediss://` (TLS), `valkey://` or `valkeys://` (TLS), host, port and
  database, optionally a user name; never a password, a credential in the query
  (`?password=`) or a fragment, because the URL sits in a ConfigMap. The password comes
  from a Secret, as the env var `PASSWORD_ENV`.
- Keys: `holeblend:{namespace}/{name}:kv:v{format}:{segment key}`, one per segment, so
  several BlendDeployments can share one Redis and a new blob format never reads an
  old blob. The runtime learns `{namespace}/{name}` from `DEPLOYMENT_ENV`.
- Identity: each BlendDeployment connects as its own ACL user, `acl_user(deployment)`
  (from `USER_ENV`), whose rules (`acl_rules`) allow only the commands the runtime sends
  and only the keys under its deployment's prefix. So one deployment's pods can neither
  read nor overwrite another's KV, even with the store's address in hand.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

SCHEMES = ("redis", "rediss", "valkey", "valkeys")
# Env var with the shared tier's password (from the Secret spec.blend.kv.sharedPasswordSecret).
PASSWORD_ENV = "HOLEBLEND_SHARED_TIER_PASSWORD"
# Env var with the BlendDeployment's "namespace/name", the prefix of its keys.
DEPLOYMENT_ENV = "HOLEBLEND_DEPLOYMENT"
# Env var with the ACL user the engine pods connect as (`acl_user`).
USER_ENV = "HOLEBLEND_SHARED_TIER_USER"
KEY_ROOT = "holeblend"
# redis-py's from_url passes every query parameter to the connection, over the password the
# runtime gives it (?password=, ?username=, ?ssl_password=): a parameter whose name holds
# one of these words (any case), or is percent-encoded (names are decoded), is refused. The
# CRD's CEL rule uses the same pattern (RE2 and Python's re read it alike).
CREDENTIAL_QUERY_PATTERN = r"[?&][^=&]*(?i:pass|user|auth|token|secret|cred|%)"
# What the runtime sends: AUTH/HELLO (always allowed), SELECT (a database other than 0),
# PING, GET, SET, DEL, UNLINK, EXISTS. (redis-py's CLIENT SETINFO on connect may be
# refused: it ignores the error, and Redis before 7.2 has no such command to allow.)
ACL_COMMANDS = ("select", "ping", "get", "set", "del", "unlink", "exists")


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
    if "#" in url:
        raise ValueError(
            f"{field}: the URL has a '#' fragment, which a store URL never uses and which "
            "would be stored in a ConfigMap; remove it (a password belongs in a Secret key "
            "referenced by spec.blend.kv.sharedPasswordSecret)"
        )
    if re.search(CREDENTIAL_QUERY_PATTERN, url):
        raise ValueError(
            f"{field}: the URL's query carries a credential (a parameter named like password, "
            "username or token), which would be stored in a ConfigMap and win over the "
            "Secret; remove it from the URL and reference a Secret key in "
            "spec.blend.kv.sharedPasswordSecret instead"
        )
    if port == 0:
        raise ValueError(
            f"{field}: {url!r} names port 0, where no server listens; give the store's "
            "port (e.g. redis://kv-cache:6379/0) or leave it out for the default"
        )
    return url


def key_prefix(deployment: str, blob_format: int) -> str:
    """The prefix of every shared-tier key of one BlendDeployment ("namespace/name")."""
    if not deployment:
        raise ValueError("deployment: must not be empty (namespace/name of the BlendDeployment)")
    return f"{KEY_ROOT}:{deployment}:kv:v{blob_format}:"


def acl_user(deployment: str) -> str:
    """The ACL user name of one BlendDeployment ("namespace/name")."""
    _check_deployment(deployment)
    return f"{KEY_ROOT}:{deployment}"


def acl_key_pattern(deployment: str) -> str:
    """Every key the deployment may touch, any blob format (a Redis ACL glob)."""
    _check_deployment(deployment)
    return f"{KEY_ROOT}:{deployment}:kv:*"


def acl_rules(deployment: str) -> list[str]:
    """The rules of the deployment's ACL user, after `reset` and before its password:
    `ACL SETUSER <acl_user> reset on ><password> <rules...>`, or a line of an ACL file,
    `user <acl_user> on #<sha256 of the password> <rules...>`."""
    return [
        f"~{acl_key_pattern(deployment)}",
        "resetchannels",
        "-@all",
        *(f"+{command}" for command in ACL_COMMANDS),
    ]


def _check_deployment(deployment: str) -> None:
    namespace, _, name = deployment.partition("/")
    # DNS-1123 labels and subdomains: no space (ACL syntax) and no glob character.
    if not namespace or not name or any(c in deployment for c in " *?[]\\\n") or "/" in name:
        raise ValueError(f"deployment: expected 'namespace/name', got {deployment!r}")
