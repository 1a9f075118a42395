"""The shared tier's eviction policy (docs/shared-tier.md): on a Zipf stream of RAG
documents, a real redis-server with `allkeys-lfu` serves more from the same memory than
with `allkeys-lru`."""

import redis

from holeblend_runtime.bench.load_workload import LoadWorkloadConfig, generate_load_workload
from holeblend_runtime.bench.workload import approximate_token_count
from holeblend_runtime.lookup_server.processes import RedisProcess

BYTES_PER_TOKEN = 200  # small blobs: the policy, not the bandwidth, is measured


def _hit_share(policy: str, seed: int) -> float:
    """Replay the vLLM load benchmark's document stream against Redis as pods use it (GET;
    SET on a miss), with memory for half the corpus: the share of tokens served."""
    config = LoadWorkloadConfig(
        seed=seed, documents_per_request=8, num_warmup=0, num_requests=1000,
        min_document_tokens=200, max_document_tokens=260,
    )  # fmt: skip
    requests = generate_load_workload(config)
    sizes = {
        rank: approximate_token_count(text)
        for request in requests
        for rank, text in zip(request.document_ranks, request.documents, strict=True)
    }
    with RedisProcess(maxmemory="0", policy=policy) as server:
        client = redis.Redis.from_url(server.url)
        base = client.info("memory")["used_memory"]
        client.config_set("maxmemory", base + sum(sizes.values()) * BYTES_PER_TOKEN // 2)
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == policy
        hit = total = 0
        for request in requests:
            for rank in request.document_ranks:
                total += sizes[rank]
                if client.get(f"doc{rank}") is not None:
                    hit += sizes[rank]
                else:
                    client.set(f"doc{rank}", b"k" * (sizes[rank] * BYTES_PER_TOKEN))
        client.close()
    return hit / total


def test_lfu_serves_more_of_a_zipf_stream_than_lru_from_the_same_memory():
    for seed in (0, 1):
        lru, lfu = _hit_share("allkeys-lru", seed), _hit_share("allkeys-lfu", seed)
        assert lfu > lru + 0.05, (seed, lru, lfu)
