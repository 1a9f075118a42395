"""`holeblend_store_queue_segments` is true or absent: the engine-core process exports it
only when a worker shares the process (tensor parallel 1), never a 0 for the queues of
workers it cannot see (tensor parallel > 1)."""

import subprocess
import sys

# A fresh process, as vLLM's engine core: the scheduler side imports the metrics; a worker
# side, where one runs in the process, hands its store's queue over.
_EXPORTED = """
from prometheus_client import generate_latest
from holeblend_runtime.vllm_connector import metrics

def queue_lines():
    text = generate_latest(metrics.REGISTRY).decode()
    return [line for line in text.splitlines() if line.startswith("holeblend_store_queue_segments")]

print(queue_lines())
metrics.STORE_QUEUE.set_function(lambda: 3)
print(queue_lines())
"""


def test_the_store_queue_is_exported_only_by_a_process_with_a_worker():
    result = subprocess.run(
        [sys.executable, "-I", "-c", _EXPORTED], capture_output=True, text=True, check=True
    )
    without_worker, with_worker = result.stdout.splitlines()
    assert without_worker == "[]"
    assert with_worker == "['holeblend_store_queue_segments 3.0']"
