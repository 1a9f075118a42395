"""Operator settings refuse values that would pass a plain `< 0` check yet break the process."""

import pytest

from holeblend_operator import settings


@pytest.mark.parametrize("raw", ["nan", "inf"])
@pytest.mark.parametrize("field", ["requeue_s", "backoff_cap_s", "request_timeout_s"])
def test_durations_that_are_not_finite_numbers_are_refused_by_name(field, raw):
    with pytest.raises(ValueError, match=f"{field} must be >= 0 and finite"):
        settings.from_sources(None, {f"HOLEBLEND_OPERATOR_{field.upper()}": raw})


def test_a_zero_request_timeout_is_refused_since_it_would_mean_no_timeout():
    with pytest.raises(ValueError, match="request_timeout_s must be > 0"):
        settings.from_sources(None, {"HOLEBLEND_OPERATOR_REQUEST_TIMEOUT_S": "0"})


def test_zero_still_turns_off_the_status_debounce():
    config = settings.from_sources(None, {"HOLEBLEND_OPERATOR_STATUS_DEBOUNCE_S": "0"})
    assert config.status_debounce_s == 0.0
