"""The lookup client's, index's and server's settings refuse NaN and infinity under the
field's own name: the classes are the library interface, not only the CLI's."""

import math

import pytest

from holeblend_runtime.lookup_server.client import ClientConfig
from holeblend_runtime.lookup_server.index import IndexLimits
from holeblend_runtime.lookup_server.server import ServerConfig


@pytest.mark.parametrize(
    ("config", "field", "value"),
    [
        # An infinite budget raised OverflowError (the lock's and the socket's timeouts)
        # into every request that looked up.
        (ClientConfig, "timeout_ms", math.inf),
        (ClientConfig, "timeout_ms", math.nan),
        (ClientConfig, "breaker_open_s", math.inf),  # the first outage skipped the server for good
        (ClientConfig, "breaker_open_s", math.nan),
        # Silent pods and their locations were never dropped; under uvloop the sweeper
        # died at once (NaN), and with it the garbage collector's sweeps.
        (IndexLimits, "pod_timeout_s", math.inf),
        (IndexLimits, "pod_timeout_s", math.nan),
        # SIGTERM's handler failed under uvloop (NaN) or waited for good (inf): the
        # server never exited.
        (ServerConfig, "drain_s", math.nan),
        (ServerConfig, "drain_s", math.inf),
    ],
)
def test_a_non_finite_setting_is_refused_under_its_own_name(config, field, value):
    with pytest.raises(ValueError, match=f"^{field}: must be .*finite, got {value}$"):
        config(**{field: value})


def test_finite_settings_at_their_bounds_are_accepted():
    ClientConfig(timeout_ms=0.001, breaker_open_s=0.0)
    IndexLimits(pod_timeout_s=0.001)
    ServerConfig(drain_s=0.0)
