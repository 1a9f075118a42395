"""blend.json refusals say what is wrong with the file as written.

A newer formatVersion is refused as newer however its writer spelt the number (2, 2.0,
"2": the int field reads all three as 2), so the reader says to upgrade instead of reading
a file whose keys may have changed meaning. A filterLayers error compares against the
file's own checkLayer, never the default when the file's checkLayer was itself refused."""

import json
import re

import pytest

from holeblend_contract.blend_settings import (
    DEFAULT_CHECK_LAYER,
    FORMAT_VERSION,
    BlendSettingsError,
    parse_blend_settings,
)


def blend_json(**keys) -> str:
    return json.dumps({"model": {"name": "m"}, **keys})


@pytest.mark.parametrize(
    "version", [FORMAT_VERSION + 1, float(FORMAT_VERSION + 1), str(FORMAT_VERSION + 1)]
)
def test_a_newer_format_version_is_refused_however_the_number_is_written(version):
    with pytest.raises(BlendSettingsError) as caught:
        parse_blend_settings(blend_json(formatVersion=version, someFutureKey=1))
    message = str(caught.value)
    assert f"formatVersion: {FORMAT_VERSION + 1} is newer" in message
    assert "upgrade the runtime" in message
    assert "unknown key" not in message


@pytest.mark.parametrize("version", [FORMAT_VERSION, float(FORMAT_VERSION), str(FORMAT_VERSION)])
def test_the_current_format_version_loads_however_the_number_is_written(version):
    assert parse_blend_settings(blend_json(formatVersion=version)).format_version == FORMAT_VERSION


def test_filter_layers_are_not_judged_against_the_default_when_check_layer_was_refused():
    with pytest.raises(BlendSettingsError) as caught:
        parse_blend_settings(blend_json(checkLayer=0, filterLayers=[1]))
    message = str(caught.value)
    assert "checkLayer: " in message
    assert f"checkLayer {DEFAULT_CHECK_LAYER}" not in message


@pytest.mark.parametrize(("check_layer", "layers"), [(None, [DEFAULT_CHECK_LAYER]), (5, [5])])
def test_filter_layers_at_or_below_the_check_layer_are_still_refused(check_layer, layers):
    keys = {"filterLayers": layers} | ({} if check_layer is None else {"checkLayer": check_layer})
    expected = DEFAULT_CHECK_LAYER if check_layer is None else check_layer
    with pytest.raises(
        BlendSettingsError, match=re.escape(f"above checkLayer {expected}, got {layers}")
    ):
        parse_blend_settings(blend_json(**keys))
