"""The operator's log filters: quiet per-event noise, keep what a person must see."""

import logging

import pytest

from holeblend_operator import run_command

MONITORS = "Selector(group='monitoring.coreos.com', version='v1', any_name='servicemonitors')"
OWNERS = "Selector(group='blend.holeblend.io', version='v1alpha1', any_name='blenddeployments')"


def record(level: int, message: str) -> logging.LogRecord:
    return logging.LogRecord("kopf", level, __file__, 1, message, None, None)


@pytest.mark.parametrize(
    ("level", "message", "kept"),
    [
        (logging.INFO, "Handler 'child-deployments' succeeded.", False),
        (logging.INFO, "Handler 'blenddeployments' succeeded.", False),
        (logging.ERROR, "Handler 'blenddeployments' failed with an exception. Will ignore.", True),
        (logging.INFO, "default/demo reconciled (create) in 0.010 s", True),
    ],
)
def test_successful_event_handler_calls_are_not_logged(level, message, kept):
    assert run_command._quiet_event_handlers(record(level, message)) is kept


@pytest.mark.parametrize(
    ("unresolved", "kept"),
    [
        (MONITORS, False),  # optional: prometheus-operator is not installed
        (OWNERS, True),  # our own CRD is missing: the operator can do nothing
        (f"{OWNERS}, {MONITORS}", True),
    ],
)
def test_only_a_missing_service_monitor_crd_goes_unmentioned(unresolved, kept):
    message = f"Unresolved resources cannot be served (try creating their CRDs): {unresolved}"
    assert run_command._quiet_optional_resources(record(logging.WARNING, message)) is kept
