"""Operator settings: one frozen object, read once from flags and HOLEBLEND_OPERATOR_* env vars."""

import argparse
import dataclasses
import math
import os
from collections.abc import Mapping

from holeblend_contract.dual_stack import EVERY_ADDRESS
from holeblend_operator.host_paths import DEFAULT_HOST_PATH_PREFIXES

ENV_PREFIX = "HOLEBLEND_OPERATOR_"
# Where the pods the operator runs (engines, lookup servers) listen: every IPv4 address. "::"
# (every address, IPv6 and IPv4) is for IPv6-only and dual-stack clusters; not the default,
# as vLLM cannot start on "::" on a node whose kernel has IPv6 turned off.
DEFAULT_POD_LISTEN_ADDRESS = "0.0.0.0"
# What --pod-listen-address takes: every IPv4 address, or every address (IPv6 and IPv4).
POD_LISTEN_ADDRESSES = (DEFAULT_POD_LISTEN_ADDRESS, EVERY_ADDRESS)


@dataclasses.dataclass(frozen=True)
class OperatorSettings:
    namespaces: tuple[str, ...] = ()  # namespaces to serve; empty serves the whole cluster
    peering: str | None = None  # kopf peering name for HA (one active replica); None: standalone
    peering_priority: int = 0  # highest live priority is active; 0 picks a random one per process
    peering_lifetime_s: int = 60  # a silent peer counts as dead after this; standby takes over
    # where /healthz and /metrics listen; "::": every address, IPv6 and IPv4 (dual-stack)
    health_host: str = EVERY_ADDRESS
    health_port: int = 8080  # 0 picks a free port (tests)
    status_debounce_s: float = 0.5  # child events within this window cause one refresh per owner
    requeue_s: float = 30.0  # look again at an owner that is not ready (or failed) after this
    backoff_base_s: float = 1.0  # first retry delay after a transient API failure
    backoff_cap_s: float = 60.0  # longest retry delay
    blocked_retry_s: float = 60.0  # retry delay when a person must fix something first
    request_timeout_s: float = 10.0  # one Kubernetes API request
    api_concurrency: int = 16  # Kubernetes API requests in flight
    log_format: str = "json"  # json or plain
    log_level: str = "info"  # debug, info, warning
    # node directories BlendDeployments may mount (hostPath); see holeblend_operator.host_paths
    host_path_prefixes: tuple[str, ...] = DEFAULT_HOST_PATH_PREFIXES
    pod_listen_address: str = DEFAULT_POD_LISTEN_ADDRESS  # "0.0.0.0", or "::" (IPv6 and IPv4)

    def __post_init__(self) -> None:
        for field in (
            "requeue_s",
            "status_debounce_s",
            "backoff_base_s",
            "backoff_cap_s",
            "blocked_retry_s",
            "request_timeout_s",
        ):
            # NaN is not < 0 either, and an infinite delay never comes due: refuse both.
            if not 0 <= getattr(self, field) < math.inf:
                raise ValueError(f"{field} must be >= 0 and finite, got {getattr(self, field)}")
        if self.request_timeout_s == 0:  # aiohttp and kopf read a zero timeout as none at all
            raise ValueError("request_timeout_s must be > 0: a request without a timeout can hang")
        if not 0 <= self.health_port <= 65535:
            raise ValueError(f"health_port must be a TCP port (0-65535), got {self.health_port}")
        if self.peering_lifetime_s < 1:
            raise ValueError(f"peering_lifetime_s must be >= 1, got {self.peering_lifetime_s}")
        if self.api_concurrency < 1:
            raise ValueError(f"api_concurrency must be >= 1, got {self.api_concurrency}")
        if self.log_format not in ("json", "plain"):
            raise ValueError(f"log_format must be json or plain, got {self.log_format!r}")
        for prefix in self.host_path_prefixes:
            if not prefix.startswith("/") or ".." in prefix.split("/"):
                raise ValueError(
                    f"host_path_prefixes: {prefix!r} must be an absolute path without '..'"
                )
        if self.log_level not in ("debug", "info", "warning"):
            raise ValueError(f"log_level must be debug, info or warning, got {self.log_level!r}")
        if self.pod_listen_address not in POD_LISTEN_ADDRESSES:
            raise ValueError(
                "pod_listen_address (--pod-listen-address) must be 0.0.0.0 (every IPv4 "
                "address) or :: (every address, IPv6 and IPv4): one address for every pod "
                f"would be no pod's own; got {self.pod_listen_address!r}"
            )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field; a flag overrides the environment variable of the same name."""
    for field in dataclasses.fields(OperatorSettings):
        flag = "--" + field.name.replace("_", "-")
        if field.name == "namespaces":
            parser.add_argument(
                "--namespace",
                "-n",
                dest="namespaces",
                action="append",
                help=f"namespace to serve (repeatable; env {ENV_PREFIX}NAMESPACES, comma-separated)",
            )
        elif field.name == "host_path_prefixes":
            parser.add_argument(
                "--host-path-prefix",
                dest="host_path_prefixes",
                action="append",
                help="node directory BlendDeployments may mount (repeatable; env "
                f"{ENV_PREFIX}HOST_PATH_PREFIXES, comma-separated)",
            )
        else:
            parser.add_argument(
                flag, dest=field.name, default=None, help=f"env {ENV_PREFIX}{field.name.upper()}"
            )


def from_sources(
    args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None
) -> OperatorSettings:
    """Defaults, then env vars, then flags; ValueError names the field that is wrong."""
    environ = os.environ if environ is None else environ
    values = {}
    for field in dataclasses.fields(OperatorSettings):
        raw = getattr(args, field.name, None) if args is not None else None
        raw = raw if raw is not None else environ.get(ENV_PREFIX + field.name.upper())
        if raw is not None:
            values[field.name] = _convert(field, raw)
    return OperatorSettings(**values)


def _convert(field: dataclasses.Field, raw):
    default = field.default
    try:
        if field.name in ("namespaces", "host_path_prefixes"):
            items = raw if isinstance(raw, list) else raw.split(",")
            return tuple(item.strip() for item in items if item.strip())
        if field.name == "peering":
            return raw or None
        return type(default)(raw)
    except ValueError as exc:
        raise ValueError(f"{field.name}: cannot read {raw!r} as {type(default).__name__}") from exc
