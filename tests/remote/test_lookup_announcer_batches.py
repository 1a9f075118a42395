"""The announcer's batches fit what the server takes in one request."""

import time

import pytest

from holeblend_runtime.lookup_server.client import (
    Announcer,
    AnnouncerConfig,
    ClientConfig,
    LookupClient,
)
from holeblend_runtime.lookup_server.processes import LookupProcess
from holeblend_runtime.lookup_server.wire import Entry


def test_evicts_over_the_servers_max_keys_go_in_several_requests():
    """A `batch` over the server's `--max-keys` made every evict of a full batch a
    `too_many_keys` refusal: the index kept advertising the dropped segments until the
    next resync repaired it."""
    entries = [Entry(f"k{i}", 4, "m", "float32", None, 64, False) for i in range(20)]
    with LookupProcess("--max-keys", "8") as server:
        client = LookupClient(server.url, ClientConfig(timeout_ms=2000, max_keys=8))
        config = AnnouncerConfig(heartbeat_s=60, batch=20)
        announcer = Announcer(client, "pod-a", lambda: entries, config).start()
        try:
            wait_for_stat(client, "resynced", 20)  # the first heartbeat's announcement
            for entry in entries:
                announcer.evict(entry.key)
            assert announcer.flush()
            stats = client.call({"op": "stats"})["stats"]
            assert stats["evicts"] == 20 and stats["entries"] == 0
            assert client.stats.refused == 0
        finally:
            announcer.stop()


def wait_for_stat(client: LookupClient, name: str, value: int) -> None:
    deadline = time.monotonic() + 5
    while (client.call({"op": "stats"}) or {}).get("stats", {}).get(name) != value:
        assert time.monotonic() < deadline, f"the server's {name} never reached {value}"
        time.sleep(0.02)


def test_a_batch_over_the_entries_the_server_takes_in_one_request_is_refused():
    """The server takes at most 4096 entries in one admit or resync (not a flag): a
    larger batch failed every full admit and every resync of a pod holding more."""
    with pytest.raises(ValueError, match=r"^batch: must be in 1\.\.4096 .* got 4097$"):
        AnnouncerConfig(batch=4097)
    AnnouncerConfig(batch=4096)
