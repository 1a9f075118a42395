"""One engine process of the cross-process reuse test: the real model over the real tiers.

    python -I engine_worker.py compute|reuse LOOKUP_URL REDIS_URL OUT_JSON

`compute` (process A) prefills prompts that together contain every document, so the
engine stores each one (local tier, shared tier, then admit to the lookup server).
`reuse` (process B, a fresh process with an empty local tier) prefills prompts over the
same documents in other orders and subsets in hole mode, and at ratio 1.0 compares the
answer with full prefill. Both write what they saw to OUT_JSON.
"""

import json
import sys

from holeblend_runtime.engine import ReferenceEngine
from holeblend_runtime.lookup_client import AnnouncerConfig
from holeblend_runtime.tiered_store import KVLayout, TierSettings, open_tiered_store

SYSTEM = "You answer questions about the people described in the documents."
PEOPLE = [
    ("Alice Moreau", "Lyon", "chemistry", "Grenoble", "battery cells"),
    ("Bob Lindqvist", "Oslo", "naval design", "Bergen", "sailing boats"),
    ("Carol Zhang", "Chengdu", "physics", "Shanghai", "solar panels"),
    ("Dmitri Volkov", "Kazan", "mathematics", "Moscow", "railway timetables"),
    ("Elena Rossi", "Turin", "architecture", "Milan", "concert halls"),
    ("Farid Haddad", "Beirut", "medicine", "Paris", "heart valves"),
]
DOCUMENTS = [
    f" {name} was born in {city} and studied {subject} at the university of {school}."
    f" After graduating, {name.split()[0]} spent ten years designing {product} for a"
    f" small company, wrote two books about the work, and now teaches evening classes"
    f" about {product} to apprentices who come from all over the region. On weekends"
    f" {name.split()[0]} walks in the hills above {city} with an old dog called Pepper."
    for name, city, subject, school, product in PEOPLE
]
QUESTION = " Who designs sailing boats?"
COMPUTE_SETS = [[0, 1, 2], [3, 4, 5]]
REUSE_SETS = [[5, 3, 1, 0], [2, 4, 0, 1, 3, 5], [1, 2, 4]]


def open_engine(lookup_url: str, redis_url: str, pod: str) -> ReferenceEngine:
    engine = ReferenceEngine.load(num_threads=1)
    layout = KVLayout.of(engine.config, engine.kv_dtype)
    settings = TierSettings(
        1 << 30, redis_url, lookup_url, "test/rag", pod, announcer=AnnouncerConfig(heartbeat_s=0.2)
    )
    engine.store = open_tiered_store(settings, layout)
    return engine


def compute(engine: ReferenceEngine) -> dict:
    for indexes in COMPUTE_SETS:
        engine.prefill(
            engine.build_prompt(SYSTEM, [DOCUMENTS[i] for i in indexes], QUESTION), "hole"
        )
    assert engine.store.announcer.flush(10)
    return {"stored": engine.store.stats.shared_stores, "holdings": len(engine.store.holdings())}


def reuse(engine: ReferenceEngine) -> dict:
    requests = []
    for indexes in REUSE_SETS:
        prompt = engine.build_prompt(SYSTEM, [DOCUMENTS[i] for i in indexes], QUESTION)
        cacheable = sum(s.num_tokens for s in prompt.segments if s is not prompt.question)
        blended = engine.prefill(prompt, "hole", ratio=1.0)
        full = engine.prefill(prompt, "full")
        requests.append(
            {
                "prompt_tokens": prompt.num_tokens,
                "cacheable_tokens": cacheable,
                "reused_tokens": blended.num_reused_tokens,
                "hole_tokens": blended.num_hole_tokens,
                "answer_at_ratio_1": engine.generate(blended, max_new_tokens=8),
                "answer_full": engine.generate(full, max_new_tokens=8),
                "max_logit_diff": float((blended.logits - full.logits).abs().max()),
            }
        )
    store = engine.store
    return {
        "requests": requests,
        "shared_hits": store.stats.shared_hits,
        "load_failures": store.stats.load_failures,
    }


def main() -> None:
    role, lookup_url, redis_url, out = sys.argv[1:5]
    engine = open_engine(lookup_url, redis_url, f"pod-{role}")
    result = compute(engine) if role == "compute" else reuse(engine)
    engine.store.close()
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
