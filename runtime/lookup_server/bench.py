"""`holeblend-lookup bench`: lookup throughput and latency, and shared-tier GB/s vs raw redis-py.

1. Lookups: a real lookup server process on loopback is loaded with `--entries`
   segments; 1 and 8 client processes each send 16-key batch lookups (three of four
   keys hit) for `--duration` seconds over keep-alive connections; a third row paces
   one client to 20,000 lookups/s, the goal's load, to read p99 there. Per row:
   `lookups_per_s` counts keys looked up per second (each key is one lookup),
   `batches_per_s` requests per second, and p50/p99 request latency in milliseconds.
2. Shared tier: segment blobs of 1, 8 and 32 MB (SmolLM2's KV layout) stored and
   loaded through `SharedTier` (checksum + SET of the pieces, GET + checks) and, in the same
   run and interleaved, the same bytes through raw redis-py SET/GET. Per row: GB/s of
   each and the ratio.

Output: `{"results": [{"clients", "lookups_per_s", "p50_ms", "p99_ms", ...}],
"shared_tier": [{"blob_mb", "tier_put_gb_s", "raw_set_gb_s", ...}]}`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from holeblend_runtime.kv.shared_tier import BlobHeader, SharedTier, SharedTierConfig, blob_pieces
from holeblend_runtime.lookup_server.cli import _POSITIVE_FLOAT, _POSITIVE_INT
from holeblend_runtime.lookup_server.client import ClientConfig, LookupClient
from holeblend_runtime.lookup_server.processes import LookupProcess, RedisProcess
from holeblend_runtime.lookup_server.wire import Entry

BATCH_KEYS = 16
CLIENT_COUNTS = (1, 8)
# The goal's load: p99 is also measured with one client paced to this many lookups/s.
PACED_LOOKUPS_PER_S = 20_000
BLOB_MB = (1, 8, 32)
# SmolLM2-135M: 30 layers, 3 KV heads, head dim 64, fp32.
KV_SHAPE = (30, 3, 64)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="holeblend-lookup bench", description=__doc__.split("\n")[0], allow_abbrev=False
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument(
        "--duration", type=_POSITIVE_FLOAT, default=3.0, help="seconds per client count"
    )
    parser.add_argument(
        "--entries", type=_POSITIVE_INT, default=10_000, help="segments in the index"
    )
    parser.add_argument("--url", help="an already running lookup server (default: start one)")
    parser.add_argument("--redis-url", help="an existing Redis (default: start redis-server)")
    parser.add_argument(
        "--repeats",
        type=_POSITIVE_INT,
        default=15,
        help="round trips per blob size (median reported)",
    )
    parser.add_argument("--skip-shared-tier", action="store_true")
    return parser.parse_args(argv)


# --- lookups --------------------------------------------------------------------------------


def _load_index(url: str, num_entries: int) -> None:
    client = LookupClient(url, ClientConfig(timeout_ms=5000))
    for start in range(0, num_entries, 1000):
        entries = [
            Entry(f"seg-{i}", 100, "bench", "float32", None, 4_608_000, True).to_wire()
            for i in range(start, min(start + 1000, num_entries))
        ]
        if client.call({"op": "admit", "pod": "bench-pod", "entries": entries}) is None:
            raise RuntimeError(f"could not load the index at {url}")
    client.close()


def _client_loop(args: tuple[str, float, int, int, float, float | None]) -> tuple[list[float], int]:
    """(latencies in ms, degraded calls) of one client process; paced to `rate` batches/s."""
    url, duration, num_entries, seed, start_at, rate = args
    client = LookupClient(url, ClientConfig(timeout_ms=1000, retries=0, breaker_failures=1_000_000))
    # Three of four keys exist; the rest miss.
    keys = [f"seg-{(seed * 7919 + i * 104729) % (num_entries * 4 // 3)}" for i in range(4096)]
    while time.time() < start_at:
        time.sleep(0.001)
    latencies, i = [], 0
    started = time.perf_counter()
    deadline = started + duration
    while (now := time.perf_counter()) < deadline:
        if rate is not None and (due := started + len(latencies) / rate) > now:
            time.sleep(due - now)
            now = time.perf_counter()
        batch = keys[i % 4080 : i % 4080 + BATCH_KEYS]
        client.lookup(batch)
        latencies.append((time.perf_counter() - now) * 1000)
        i += BATCH_KEYS
    return latencies, client.stats.degraded_lookups


def bench_lookups(url: str, duration: float, num_entries: int) -> list[dict]:
    """Rows for 1 and 8 clients as fast as they can, then 1 client paced to the goal rate."""
    rows = [_lookup_run(url, duration, num_entries, clients, None) for clients in CLIENT_COUNTS]
    paced = _lookup_run(url, duration, num_entries, 1, PACED_LOOKUPS_PER_S / BATCH_KEYS)
    return rows + [paced | {"target_lookups_per_s": PACED_LOOKUPS_PER_S}]


def _lookup_run(
    url: str, duration: float, num_entries: int, clients: int, rate: float | None
) -> dict:
    start_at = time.time() + 0.5
    with multiprocessing.get_context("fork").Pool(clients) as pool:
        jobs = [(url, duration, num_entries, seed, start_at, rate) for seed in range(clients)]
        outcomes = pool.map(_client_loop, jobs)
    return _lookup_row(clients, duration, outcomes)


def _lookup_row(clients: int, duration: float, outcomes: list[tuple[list[float], int]]) -> dict:
    latencies = [ms for client_latencies, _ in outcomes for ms in client_latencies]
    num_batches = len(latencies)
    return {
        "clients": clients,
        "batch_keys": BATCH_KEYS,
        "batches": num_batches,
        "batches_per_s": round(num_batches / duration, 1),
        "lookups_per_s": round(num_batches * BATCH_KEYS / duration, 1),
        "p50_ms": round(_percentile(latencies, 0.50), 4),
        "p99_ms": round(_percentile(latencies, 0.99), 4),
        "degraded": sum(degraded for _, degraded in outcomes),
    }


def _percentile(values: list[float], q: float) -> float:
    """Interpolated between the closest ranks, as numpy's default (the lookup pod has no
    numpy); NaN when no batch came back."""
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[round(100 * q) - 1]


# --- shared tier ----------------------------------------------------------------------------


def _blob_parts(size_mb: int) -> tuple[BlobHeader, list[bytes]]:
    layers, heads, head_dim = KV_SHAPE
    per_token = 2 * layers * heads * head_dim * 4 + 8
    num_tokens = (size_mb << 20) // per_token
    header = BlobHeader(
        f"bench-{size_mb}mb", "bench", "float32", (layers, heads, num_tokens, head_dim)
    )
    kv = os.urandom(header.kv_bytes)
    return header, [kv, kv, os.urandom(num_tokens * 8)]


def bench_shared_tier(redis_url: str, repeats: int) -> list[dict]:
    tier = SharedTier(SharedTierConfig(redis_url, "bench/lookup", timeout_s=30))
    rows = []
    for size_mb in BLOB_MB:
        header, parts = _blob_parts(size_mb)
        raw_value = b"".join(parts)
        times: dict[str, list[float]] = {
            "tier_put": [],
            "tier_get": [],
            "raw_set": [],
            "raw_get": [],
        }
        for repeat in range(repeats):
            # Interleaved, alternating which goes first, so both see the same machine load.
            steps = [_raw_round, _tier_round] if repeat % 2 == 0 else [_tier_round, _raw_round]
            for step in steps:
                step(tier, header, parts, raw_value, times)
        rows.append(_tier_row(size_mb, len(raw_value), times))
    tier.client.delete("bench:raw", tier.redis_key("bench-1mb"), tier.redis_key("bench-8mb"))
    tier.close()
    return rows


def _raw_round(tier: SharedTier, header, parts, raw_value: bytes, times: dict) -> None:
    times["raw_set"].append(_timed(tier.client.set, "bench:raw", raw_value))
    times["raw_get"].append(_timed(tier.client.get, "bench:raw"))


def _tier_round(tier: SharedTier, header: BlobHeader, parts, raw_value, times: dict) -> None:
    times["tier_put"].append(_timed(_tier_put, tier, header, parts))
    times["tier_get"].append(_timed(_must_load, tier, header))


def _tier_put(tier: SharedTier, header: BlobHeader, parts: list[bytes]) -> None:
    if not tier.put_pieces(header.key, blob_pieces(header, parts, tier.deployment)):
        raise RuntimeError("the shared tier refused the benchmark blob")


def _must_load(tier: SharedTier, header: BlobHeader) -> None:
    if tier.get_checked(header) is None:
        raise RuntimeError("the shared tier lost the benchmark blob")


def _timed(function, *args) -> float:
    started = time.perf_counter()
    function(*args)
    return time.perf_counter() - started


def _tier_row(size_mb: int, num_bytes: int, times: dict[str, list[float]]) -> dict:
    rates = {name: num_bytes / statistics.median(values) / 1e9 for name, values in times.items()}
    return {
        "blob_mb": size_mb,
        **{f"{name}_gb_s": round(rate, 3) for name, rate in rates.items()},
        "put_vs_raw": round(rates["tier_put"] / rates["raw_set"], 3),
        "get_vs_raw": round(rates["tier_get"] / rates["raw_get"], 3),
    }


# --- main -----------------------------------------------------------------------------------


def run_bench(args: argparse.Namespace) -> dict:
    report: dict = {"cpus": os.cpu_count(), "duration_s": args.duration, "entries": args.entries}
    if args.url:
        _load_index(args.url, args.entries)
        report["results"] = bench_lookups(args.url, args.duration, args.entries)
    else:
        with LookupProcess() as server:
            _load_index(server.url, args.entries)
            report["results"] = bench_lookups(server.url, args.duration, args.entries)
    if args.skip_shared_tier:
        return report
    if args.redis_url:
        report["shared_tier"] = bench_shared_tier(args.redis_url, args.repeats)
    else:
        with RedisProcess(maxmemory="1gb") as redis_server:
            report["shared_tier"] = bench_shared_tier(redis_server.url, args.repeats)
    return report


def main(argv: Sequence[str]) -> None:
    args = parse_args(argv)
    report = run_bench(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
