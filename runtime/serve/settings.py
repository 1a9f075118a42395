"""The server's own settings: every flag also readable from `HOLEBLEND_SERVE_<FLAG>`.

Precedence: a flag on the command line, then the variable, then the default. The blend
settings (separator, ratio, ...) are not flags: they come from the `blend.json` file that
`--config` names (the operator's ConfigMap in a pod).
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from holeblend_contract.blend_settings import CONFIG_ENV
from holeblend_contract.serve_settings import DRAIN_TIMEOUT_S, SHUTDOWN_TIMEOUT_S, env_name


@dataclass(frozen=True)
class ServeSettings:
    # The blend.json file (default: $HOLEBLEND_CONFIG, as the operator sets it in pods).
    config: Path
    host: str = "127.0.0.1"
    port: int = 8000
    # Requests that may wait for the compute thread, those whose bodies are still being read
    # or parsed included (each holds its place from the queue check until it is queued or
    # refused); up to max_batch more run. Full: 429.
    queue_size: int = 8
    # Requests decoding together (one batched forward pass per token for all of them).
    max_batch: int = 8
    # Byte budget of the decode pool's K and V (None: none): a request joins the decoding
    # batch only when the pool, grown for it and every answer in it to its limit, stays
    # within it; else it waits, first in line. A request over it alone runs alone.
    decode_pool_bytes: int | None = None
    # Seconds from arrival to the last token, queue wait included; then 504 (or an SSE error).
    # A streaming client that has not taken its answer 2 s later (app.WRITE_GRACE_S) is
    # disconnected.
    request_timeout: float = 120.0
    # max_tokens when a request sets none.
    default_max_tokens: int = 64
    # Seconds SIGTERM waits for queued and running requests before closing.
    drain_timeout: float = DRAIN_TIMEOUT_S
    # Seconds a request body may take to arrive once its head did; then 408.
    body_timeout: float = 30.0
    # Seconds a connection may stay idle, or take to send a request head; then it is closed.
    idle_timeout: float = 15.0
    # Seconds the listener's close waits for connections after the drain; then they are cut.
    shutdown_timeout: float = SHUTDOWN_TIMEOUT_S
    # Seconds between checks of the config directory for a new blend.json.
    reload_interval: float = 1.0
    # Threads torch uses on the compute thread.
    torch_threads: int = 2
    # Model cache directory (converted GGUF weights); None: $HOLEBLEND_CACHE_DIR or ~/.cache.
    cache_dir: Path | None = None
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        _at_least("port", self.port, 0)
        if self.port > 65535:
            raise ValueError(f"--port: must be <= 65535, got {self.port}")
        levels = logging.getLevelNamesMapping()
        if not isinstance(self.log_level, str) or self.log_level.upper() not in levels:
            names = ", ".join(sorted(name for name in levels if name != "NOTSET"))
            raise ValueError(f"--log-level: must be one of {names}, got {self.log_level!r}")
        _at_least("queue_size", self.queue_size, 1)
        if self.max_batch < 1:
            raise ValueError(
                f"--max-batch: must be >= 1 (requests decoding together), got {self.max_batch}"
            )
        if self.decode_pool_bytes is not None:
            _at_least("decode_pool_bytes", self.decode_pool_bytes, 1)
        _at_least("default_max_tokens", self.default_max_tokens, 1)
        _at_least("torch_threads", self.torch_threads, 1)
        for name in (
            "request_timeout", "drain_timeout", "reload_interval", "body_timeout",
            "idle_timeout", "shutdown_timeout",
        ):  # fmt: skip
            if not getattr(self, name) > 0:
                raise ValueError(f"{_flag(name)}: must be > 0, got {getattr(self, name)}")


def _at_least(name: str, value: int, low: int) -> None:
    if value < low:
        raise ValueError(f"{_flag(name)}: must be >= {low}, got {value}")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def parse_settings(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> ServeSettings:
    """Flags over HOLEBLEND_SERVE_* variables over defaults; SystemExit(2) on bad input."""
    environ = os.environ if environ is None else environ
    # No abbreviations: `--por=9000` must not read as `--port` (engine.extraArgs follow the
    # operator's flags on CPU pods, and the operator refuses only the flags it knows).
    parser = argparse.ArgumentParser(
        prog="holeblend-serve", description=__doc__.split("\n")[0], allow_abbrev=False
    )
    for field in fields(ServeSettings):
        kind = _value_type(field.name)
        help_text = f"(env {env_name(field.name)})"
        parser.add_argument(_flag(field.name), dest=field.name, type=kind, help=help_text)
    args = parser.parse_args(argv)
    values = {}
    for field in fields(ServeSettings):
        value = getattr(args, field.name)
        if value is None and env_name(field.name) in environ:
            value = _from_env(parser, field.name, environ[env_name(field.name)])
        if value is not None:
            values[field.name] = value
    if "config" not in values and CONFIG_ENV in environ:
        values["config"] = Path(environ[CONFIG_ENV])
    if "config" not in values:
        parser.error(f"--config is required (or {env_name('config')} or {CONFIG_ENV})")
    try:
        return ServeSettings(**values)
    except ValueError as error:
        parser.error(str(error))


_TYPES = {
    "config": Path,
    "cache_dir": Path,
    "host": str,
    "log_level": str,
    "request_timeout": float,
    "drain_timeout": float,
    "body_timeout": float,
    "idle_timeout": float,
    "shutdown_timeout": float,
    "reload_interval": float,
}


def _value_type(name: str):
    return _TYPES.get(name, int)


def _from_env(parser: argparse.ArgumentParser, name: str, text: str):
    try:
        return _value_type(name)(text)
    except ValueError:
        parser.error(f"{env_name(name)}: {text!r} is not a valid {_value_type(name).__name__}")
