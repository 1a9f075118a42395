"""blend.json live reload: the kubelet's symlink swap is seen; bad files keep the last good."""

import asyncio
import json
import os
from pathlib import Path

import pytest

from holeblend_contract.blend_settings import BlendSettingsError
from holeblend_runtime.serve import live_config
from holeblend_runtime.serve.live_config import LiveConfig


def settings_text(**extra) -> str:
    return json.dumps({"formatVersion": 1, "model": {"name": "m"}, **extra})


class KubeletVolume:
    """A ConfigMap volume as the kubelet writes it: ..data -> a timestamped dir."""

    def __init__(self, root: Path) -> None:
        self.root, self.version = root, 0
        (root / "blend.json").symlink_to("..data/blend.json")

    @property
    def path(self) -> Path:
        return self.root / "blend.json"

    def publish(self, text: str) -> None:
        self.version += 1
        folder = self.root / f"..2026_{self.version}"
        folder.mkdir()
        (folder / "blend.json").write_text(text)
        (self.root / "..data_tmp").symlink_to(folder.name)
        os.replace(self.root / "..data_tmp", self.root / "..data")  # the atomic swap


@pytest.fixture
def volume(tmp_path: Path) -> KubeletVolume:
    volume = KubeletVolume(tmp_path)
    volume.publish(settings_text(recomputeRatio=0.15))
    return volume


def test_a_symlink_swap_updates_the_live_ratio(volume):
    live = LiveConfig(volume.path)
    volume.publish(settings_text(recomputeRatio=0.4))
    assert live.check() is True
    assert live.recompute_ratio == 0.4


def test_a_symlink_swap_updates_the_shadows_idle_floor(volume):
    live = LiveConfig(volume.path)
    assert (live.current.shadow_idle_samples, live.current.shadow_idle_seconds) == (0, 60.0)
    volume.publish(settings_text(shadowIdleSamples=4, shadowIdleSeconds=45))
    assert live.check() is True
    assert (live.current.shadow_idle_samples, live.current.shadow_idle_seconds) == (4, 45.0)
    assert live.startup.shadow_idle_samples == 0  # what the process started with


def test_an_unchanged_file_is_not_reapplied(volume):
    live = LiveConfig(volume.path)
    assert live.check() is False


@pytest.mark.parametrize(
    "bad",
    [
        "garbage{",
        settings_text(recomputeRatio=7),
        settings_text(formatVersion=9),
        settings_text(x=1),
        "[" * 100_000,  # the JSON parser's RecursionError
        '{"recomputeRatio": ' + "1" * 5000 + "}",  # ValueError: over the int digit limit
    ],
    ids=["garbage", "bad-ratio", "newer-format", "unknown-key", "deep-nesting", "huge-number"],
)
def test_a_bad_file_keeps_the_last_good_settings_and_is_counted(volume, bad):
    errors = []
    live = LiveConfig(volume.path, on_error=lambda: errors.append(1))
    volume.publish(settings_text(recomputeRatio=0.3))
    live.check()
    volume.publish(bad)
    assert live.check() is False
    assert live.recompute_ratio == 0.3 and errors == [1] and live.num_errors == 1
    volume.publish(settings_text(recomputeRatio=0.5))
    assert live.check() is True and live.recompute_ratio == 0.5


def test_a_missing_file_is_an_error_not_a_crash(volume):
    live = LiveConfig(volume.path)
    os.remove(volume.root / "..data")
    assert live.check() is False
    assert live.num_errors == 1 and live.recompute_ratio == 0.15


def test_keys_other_than_the_live_ones_wait_for_a_restart(volume):
    live = LiveConfig(volume.path)
    volume.publish(settings_text(recomputeRatio=0.2, separator=" ##", minSegmentTokens=4))
    assert live.check() is True
    assert live.recompute_ratio == 0.2
    assert live.current.separator == " # #" and live.current.min_segment_tokens == 8


def test_a_bad_file_at_start_is_refused(tmp_path):
    (tmp_path / "blend.json").write_text("{}")
    with pytest.raises(BlendSettingsError, match="model: Field required"):
        LiveConfig(tmp_path / "blend.json")


@pytest.mark.parametrize("bad", ["[" * 100_000, "1" * 5000], ids=["deep-nesting", "huge-number"])
def test_a_file_the_json_parser_chokes_on_is_a_bad_file_at_start(tmp_path, bad):
    """Deep nesting and over-long integers make the JSON parser raise RecursionError and
    ValueError; both are reported as a file that is not JSON, like any other garbage."""
    (tmp_path / "blend.json").write_text(bad)
    with pytest.raises(BlendSettingsError, match="not JSON"):
        LiveConfig(tmp_path / "blend.json")


def test_the_watcher_outlives_an_unexpected_error_and_applies_the_next_file(volume, monkeypatch):
    """Whatever a round raises, the watcher logs and counts it and keeps polling: a watcher
    that ended would ignore every later ratio the tuner writes, until a restart."""
    errors = []
    live = LiveConfig(volume.path, on_error=lambda: errors.append(1))
    load = live_config.load_blend_settings

    def load_once_failing(path):
        monkeypatch.setattr(live_config, "load_blend_settings", load)
        raise RuntimeError("unexpected")

    async def main():
        watcher = asyncio.create_task(live.watch(0.01))
        monkeypatch.setattr(live_config, "load_blend_settings", load_once_failing)
        volume.publish(settings_text(recomputeRatio=0.3))
        for _ in range(200):
            await asyncio.sleep(0.01)
            if errors:
                break
        volume.publish(settings_text(recomputeRatio=0.5))
        for _ in range(200):
            await asyncio.sleep(0.01)
            if live.recompute_ratio == 0.5 or watcher.done():
                break
        alive = not watcher.done()
        watcher.cancel()
        return alive

    assert asyncio.run(main()), "the watcher ended"
    assert live.recompute_ratio == 0.5 and errors == [1] and live.num_errors == 1


def test_a_file_swapped_in_while_the_server_starts_is_applied_by_the_first_check(
    volume, monkeypatch
):
    """The kubelet's swap may land between the start-up read of the settings and the read
    that remembers the file's bytes: those bytes were the new file's, so no check ever saw a
    change and the ratio the tuner wrote stayed unapplied until it wrote another."""
    load = live_config.load_blend_settings

    def load_then_swap(path):
        settings = load(path)
        volume.publish(settings_text(recomputeRatio=0.4))
        return settings

    monkeypatch.setattr(live_config, "load_blend_settings", load_then_swap)
    live = LiveConfig(volume.path)
    monkeypatch.setattr(live_config, "load_blend_settings", load)
    assert live.startup.recompute_ratio == 0.15
    assert live.check() is True and live.recompute_ratio == 0.4
