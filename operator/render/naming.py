"""Names of child objects: `<bd-name>-<suffix>`, always a valid DNS-1035 label.

Services need DNS-1035 labels (at most 63 characters, lowercase letters, digits and '-',
starting with a letter), the strictest rule among the child kinds, so every child name obeys
it. A BlendDeployment name may be a 253-character DNS subdomain with dots, so a name that
does not fit is cleaned, truncated and suffixed with a hash of the full name: stable across
reconciles, and distinct for BlendDeployments that share a long prefix.
"""

import hashlib
import re

MAX_NAME_LENGTH = 63
HASH_LENGTH = 8
_DNS_1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def bounded_name(name: str, max_length: int = MAX_NAME_LENGTH) -> str:
    """`name` itself when it is a DNS-1035 label that fits, else a cleaned, hashed form."""
    if len(name) <= max_length and _DNS_1035_LABEL.fullmatch(name):
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:HASH_LENGTH]
    stem = _clean(name)[: max_length - HASH_LENGTH - 1].rstrip("-")
    return f"{stem}-{digest}" if stem else f"x-{digest}"


# A shortened label value carries 64 bits of the full name's hash, after a '_': no DNS
# subdomain (a BlendDeployment's name) contains '_', so a shortened value can never equal the
# value of a BlendDeployment whose name fits as it is.
LABEL_HASH_LENGTH = 16
LABEL_HASH_SEPARATOR = "_"


def bounded_label_value(value: str, max_length: int = MAX_NAME_LENGTH) -> str:
    """A DNS subdomain as a label value: itself when short enough, else truncated and hashed.

    The instance label is in every selector, so distinct names must give distinct values:
    the hash is of the full name, and the '_' before it keeps a shortened value apart from
    every name short enough to be its own value.
    """
    if len(value) <= max_length:
        return value
    digest = hashlib.sha256(value.encode()).hexdigest()[:LABEL_HASH_LENGTH]
    stem = value[: max_length - LABEL_HASH_LENGTH - 1].rstrip("-.")
    return f"{stem}{LABEL_HASH_SEPARATOR}{digest}"


def _clean(name: str) -> str:
    stem = re.sub(r"[^a-z0-9-]+", "-", name.lower())
    # A leading digit or '-' is invalid in a DNS-1035 label; drop it rather than invent a prefix.
    return stem.lstrip("-0123456789")


def child_name(bd_name: str, suffix: str) -> str:
    """Name of the child `suffix` (e.g. 'engine') of the BlendDeployment `bd_name`."""
    return bounded_name(f"{bd_name}-{suffix}")


def engine_name(bd_name: str) -> str:
    """Engine Deployment, Service and PodDisruptionBudget."""
    return child_name(bd_name, "engine")


def lookup_name(bd_name: str) -> str:
    """Lookup-server Deployment and Service."""
    return child_name(bd_name, "lookup")


def runtime_config_name(bd_name: str) -> str:
    """Runtime ConfigMap."""
    return child_name(bd_name, "runtime")


def service_monitor_name(bd_name: str) -> str:
    """ServiceMonitor of the engine and lookup-server metrics."""
    return child_name(bd_name, "metrics")
