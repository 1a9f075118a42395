"""holeblend-serve's settings that the operator reads from a pod's spec.

On CPU pods the operator sizes the pod's grace period from the server's drain and close
timeouts, which a user may set in `engine.extraArgs` or as `HOLEBLEND_SERVE_*` variables in
`engine.env`; the server reads the same names with these defaults.
"""

ENV_PREFIX = "HOLEBLEND_SERVE_"
# Seconds SIGTERM waits for queued and running requests before closing (--drain-timeout).
DRAIN_TIMEOUT_S = 30.0
# Seconds the listener's close waits for connections after the drain (--shutdown-timeout).
SHUTDOWN_TIMEOUT_S = 3.0


def env_name(setting: str) -> str:
    """The variable of a setting, `drain_timeout` -> `HOLEBLEND_SERVE_DRAIN_TIMEOUT`."""
    return ENV_PREFIX + setting.upper()
