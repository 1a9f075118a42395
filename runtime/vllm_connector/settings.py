"""The connector's settings: the operator's blend.json plus the connector's own keys.

blend.json (rendered by the operator into the runtime ConfigMap, path in
`kv_connector_extra_config.holeblend_config` or `$HOLEBLEND_CONFIG`) gives the blend
settings; `recomputeRatio` is live: `RatioSource` re-reads the file when it changes.
`kv_connector_extra_config` may also name `kv_dir`, the directory of the segment KV tier
shared by the scheduler and the worker processes (default: under /dev/shm).
Without a settings file the defaults of `BlendConfig` apply.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from holeblend_runtime.blend_config import K_DEVIATION, RANDOM, BlendConfig, check_ratio

log = logging.getLogger(__name__)

CONFIG_ENV = "HOLEBLEND_CONFIG"
CONFIG_KEY = "holeblend_config"
KV_DIR_KEY = "kv_dir"
DEFAULT_KV_DIR = "/dev/shm/holeblend-kv"
DEFAULT_KV_BYTES = 4 << 30
SUPPORTED_FORMAT_VERSION = 1
_SELECTIONS = {"kDeviation": K_DEVIATION, "random": RANDOM}
_MODES = ("hole", "prefix", "off")


@dataclass(frozen=True)
class ConnectorSettings:
    """Validated once at start-up; only the ratio changes afterwards (see RatioSource)."""

    # hole | prefix (standard CacheBlend) | off (the connector provides nothing).
    mode: str = "hole"
    blend: BlendConfig = field(default_factory=BlendConfig)
    # Directory of the segment KV tier (one file per segment key).
    kv_dir: Path = Path(DEFAULT_KV_DIR)
    # Byte budget of that directory; least recently used files go first.
    kv_bytes: int = DEFAULT_KV_BYTES
    # The settings file, re-read for the live ratio; None: the ratio is fixed.
    config_path: Path | None = None
    # The fleet's lookup server; None: lookups go to the KV tier only.
    lookup_server_url: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in _MODES:
            raise ValueError(f"mode: expected one of {_MODES}, got {self.mode!r}")
        if self.kv_bytes < 1:
            raise ValueError(f"kv.localCpuBytes: must be >= 1, got {self.kv_bytes}")


def load_settings(extra_config: Mapping[str, Any]) -> ConnectorSettings:
    """Settings from `kv_connector_extra_config` and the blend.json it (or the env) names."""
    path = extra_config.get(CONFIG_KEY) or os.environ.get(CONFIG_ENV)
    kv_dir = Path(str(extra_config.get(KV_DIR_KEY) or DEFAULT_KV_DIR))
    if not path:
        return ConnectorSettings(kv_dir=kv_dir)
    return settings_from_file(Path(path), kv_dir)


def settings_from_file(path: Path, kv_dir: Path) -> ConnectorSettings:
    data = read_json(path)
    version = data.get("formatVersion", SUPPORTED_FORMAT_VERSION)
    if version != SUPPORTED_FORMAT_VERSION:
        raise ValueError(
            f"{path}: formatVersion {version} is not supported (this runtime reads "
            f"{SUPPORTED_FORMAT_VERSION}); upgrade the runtime image"
        )
    kv = data.get("kv") or {}
    return ConnectorSettings(
        mode=data.get("mode", "hole"),
        blend=_blend_config(data, path),
        kv_dir=kv_dir,
        kv_bytes=int(kv.get("localCpuBytes") or DEFAULT_KV_BYTES),
        config_path=path,
        lookup_server_url=data.get("lookupServerUrl"),
    )


def _blend_config(data: Mapping[str, Any], path: Path) -> BlendConfig:
    defaults = BlendConfig()
    check_layers = data.get("checkLayers") or [defaults.check_layer]
    selection = data.get("selection", "kDeviation")
    if selection not in _SELECTIONS:
        raise ValueError(f"{path}: selection: expected one of {sorted(_SELECTIONS)}")
    return BlendConfig(
        check_layer=int(check_layers[0]),
        ratio=float(data.get("recomputeRatio", defaults.ratio)),
        selection=_SELECTIONS[selection],
        separator=data.get("separator", defaults.separator),
        min_segment_tokens=int(data.get("minSegmentTokens", defaults.min_segment_tokens)),
        cache_after_system=data.get("segmentContext", "afterSystem") == "afterSystem",
    )


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{CONFIG_KEY}: cannot read {path}: {error}") from error
    if not isinstance(data, dict):
        raise ValueError(f"{CONFIG_KEY}: {path} must hold a JSON object")
    return data


class RatioSource:
    """The live recompute ratio: the file's `recomputeRatio`, re-read when it changes.

    A file that cannot be read or holds a bad ratio keeps the last good value (logged):
    the kubelet swaps the mounted file atomically, but serving never fails on it.
    """

    def __init__(self, settings: ConnectorSettings) -> None:
        self._path = settings.config_path
        self._ratio = settings.blend.ratio
        self._stamp: tuple[int, int] | None = None

    def ratio(self) -> float:
        if self._path is None:
            return self._ratio
        try:
            stat = self._path.stat()
            stamp = (stat.st_mtime_ns, stat.st_size)
            if stamp != self._stamp:
                self._ratio = check_ratio(float(read_json(self._path)["recomputeRatio"]))
                self._stamp = stamp
        except (OSError, KeyError, TypeError, ValueError) as error:
            log.warning("keeping recompute ratio %s: %s", self._ratio, error)
        return self._ratio
