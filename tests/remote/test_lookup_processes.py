"""The local server processes of the tests and the benchmark: a failed start leaves nothing behind."""

import sys

import pytest

from holeblend_runtime.lookup_server.processes import LookupProcess


def test_a_server_that_never_becomes_ready_is_ended_when_its_start_fails():
    """A start that timed out raised and left the process running: it held its port and
    outlived the test (the context manager that stops it was never entered)."""
    never_ready = LookupProcess()
    try:
        with pytest.raises(RuntimeError, match="not ready after 0.5 s"):
            never_ready.start_command([sys.executable, "-c", "import time; time.sleep(60)"], 0.5)
        assert never_ready.process.poll() is not None
    finally:
        never_ready.kill()
