"""`AnnouncerConfig` refuses settings the announcer cannot run with, naming the field."""

import math

import pytest

from holeblend_runtime.lookup_server.client import AnnouncerConfig


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("heartbeat_s", 0.0),  # heartbeats back to back: a busy loop
        ("heartbeat_s", -1.0),
        ("heartbeat_s", math.nan),
        ("heartbeat_s", math.inf),  # the announcer thread dies waiting (OverflowError)
        ("resync_s", 0.0),  # a full re-announcement on every heartbeat
        ("resync_s", -60.0),
        ("resync_s", math.nan),
        ("batch", 0),  # every send fails: nothing is ever announced
        ("batch", -1),
        ("max_pending", 0),  # the first admit raised IndexError into the store
        ("max_pending", -5),
    ],
)
def test_a_bad_setting_is_refused_under_its_own_name(field, value):
    with pytest.raises(ValueError, match=f"^{field}: must be"):
        AnnouncerConfig(**{field: value})


def test_the_defaults_and_a_resync_that_never_comes_unasked_are_accepted():
    AnnouncerConfig()
    AnnouncerConfig(heartbeat_s=0.05, resync_s=math.inf, batch=1, max_pending=1)
