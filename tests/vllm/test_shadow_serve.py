"""The quality proxies on a vLLM pod: vLLM's OpenAI server with the connector, as the
operator renders it with the proxies on (blend.json with `engineUrl`,
$HOLEBLEND_METRICS_PORT, `--scheduling-policy priority --scheduler-cls ...`).

A hole request that blended cached documents is scored by shadow requests the connector
sends back to the server at once, within the default token budget; the scores (the end
of the answer included) match the blend engine's own shadow scorer on the same
prompt and answer, the shadow requests are not counted as traffic, and each blend's
inline statistic is exported and paired with its shadow score. With a sample rate that
samples nothing, the idle floor alone scores the requests that end while no other user
request is in flight."""

import threading
import time

import pytest

from holeblend_devtools.vllm_probe import ProbeConfig, build_prompts
from holeblend_devtools.vllm_server import serve
from holeblend_runtime.engine import BlendEngine
from holeblend_runtime.quality.shadow import ShadowRequest, ShadowScorer

ANSWER_TOKENS = 12


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("serve"), ratio=0.15, shadow_sample_rate=1.0) as server:
        yield server


def wait_for_stores(server) -> None:
    """A request's stores are written behind it: a later lookup finds them once written."""
    deadline = time.monotonic() + 60
    while server.sample("holeblend_store_queue_segments") > 0:
        assert time.monotonic() < deadline, "the stores were never written"
        time.sleep(0.05)


def wait_for_scored(server, count: int) -> None:
    deadline = time.monotonic() + 120
    while server.sample("holeblend_shadow_requests_total", outcome="scored") < count:
        assert time.monotonic() < deadline, "the hole request was never scored"
        time.sleep(0.5)


def test_hole_requests_are_scored_as_the_reference_engine_scores_them(server):
    pairs = build_prompts(ProbeConfig(is_connector=True, work_dir=None, num_questions=2))
    answers = []
    for first, second in pairs:
        server.complete(first, 1)  # caches the documents it has
        wait_for_stores(server)
        before = server.sample("holeblend_shadow_requests_total", outcome="scored")
        choice = server.complete(second, ANSWER_TOKENS)["choices"][0]
        answers.append((choice["token_ids"], choice["finish_reason"] == "stop"))
        wait_for_scored(server, before + 1)
    found = server.samples()

    def value(name: str, **labels: str) -> float:
        return found.get((name, tuple(sorted(labels.items()))), 0.0)

    # Every hole request was offered and scored; pass 1 (a full miss) was not offered.
    assert value("holeblend_shadow_requests_total", outcome="scored") == len(pairs)
    assert value("holeblend_f1_proxy_count", ratio="0.15") == len(pairs)
    assert value("holeblend_top1_agreement_count", ratio="0.15") == len(pairs)
    # The shadow requests went through the connector unplanned and uncounted.
    requests = sum(v for (name, _), v in found.items() if name == "holeblend_requests_total")
    assert requests == 2 * len(pairs)
    prompt_tokens = sum(len(first) + len(second) for first, second in pairs)
    assert value("holeblend_prompt_tokens_total") == prompt_tokens

    # The same proxies as holeblend-serve's scorer on the same prompts and answers (our
    # model is vLLM's within 2e-4, tests/vllm/test_model_oracle.py).
    loaded = BlendEngine.load(num_threads=2)
    scorer = ShadowScorer(loaded.model, loaded.tokenizer, 1.0)
    splitter = loaded.prompt_builder.splitter
    eos = loaded.model.config.eos_token_id
    expected = [
        scorer.score(
            ShadowRequest(
                splitter.split(second), tuple(t for t in answer if t != eos), 0.15,
                stopped_at_eos=at_eos, max_tokens=ANSWER_TOKENS,
            )
        )
        for (_, second), (answer, at_eos) in zip(pairs, answers, strict=True)
    ]  # fmt: skip
    scorer.close()
    f1_sum = value("holeblend_f1_proxy_sum", ratio="0.15")
    top1_sum = value("holeblend_top1_agreement_sum", ratio="0.15")
    assert f1_sum == pytest.approx(sum(s.f1 for s in expected), abs=1e-6)
    assert top1_sum == pytest.approx(sum(s.top1 for s in expected), abs=1e-6)
    assert 0 < top1_sum < len(pairs) + 1e-9
    # Each blend's inline statistic is exported; each scored one calibrates (too few
    # pairs for an estimate yet: the calibrated proxy says nothing).
    assert value("holeblend_inline_residual_deviation_count", ratio="0.15") == len(pairs)
    assert value("holeblend_inline_proxy_pairs", ratio="0.15") == len(pairs)
    assert value("holeblend_inline_f1_proxy_count", ratio="0.15") == 0
    assert value("holeblend_shadow_tokens_total") > 0


def test_a_sampled_request_is_scored_on_a_greedy_replay_counted_as_no_user_request(server):
    """Most clients sample (vLLM samples at temperature 1 when a client leaves it out); a
    sampled answer is not full prefill's argmax even unblended, so such requests were
    never scored and the tuner of a pod whose clients sample got nothing. The connector
    now offers one as a replay: the shadow sends its prompt again, greedy and blended,
    through this server, and scores the answer the connector returns in that replay's
    kv_transfer_params. The replay is neither a user request nor user prompt tokens."""
    first, second = build_prompts(ProbeConfig(is_connector=True, work_dir=None, num_questions=3))[2]
    server.complete(first, 1)  # caches the documents it has
    wait_for_stores(server)
    before = server.samples()
    scored = server.sample("holeblend_shadow_requests_total", outcome="scored")
    answer = server.complete(second, ANSWER_TOKENS, temperature=1.0, seed=7)
    assert answer["choices"][0]["token_ids"]
    wait_for_scored(server, scored + 1)
    wait_for_stores(server)
    after = server.samples()

    def grew(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    def total(found: dict, name: str) -> float:
        return sum(v for (n, _), v in found.items() if n == name)

    assert grew("holeblend_shadow_requests_total", outcome="scored") == 1
    for outcome in ("replay_not_blended", "failed", "not_greedy"):
        assert grew("holeblend_shadow_requests_total", outcome=outcome) == 0, outcome
    assert grew("holeblend_f1_proxy_count", ratio="0.15") == 1
    assert 0.0 <= grew("holeblend_top1_agreement_sum", ratio="0.15") <= 1.0
    # The replay's own blend calibrated the inline proxy (its statistic came back with it).
    assert grew("holeblend_inline_proxy_pairs", ratio="0.15") == 1
    # Only the user's request counted: the replay blended, but as nobody's traffic.
    assert total(after, "holeblend_requests_total") - total(before, "holeblend_requests_total") == 1
    assert grew("holeblend_prompt_tokens_total") == len(second)


def test_the_idle_floor_scores_requests_that_end_with_no_other_in_flight(tmp_path):
    pairs = build_prompts(ProbeConfig(is_connector=True, work_dir=None, num_questions=3))
    with serve(tmp_path, ratio=0.15, shadow_sample_rate=1e-9, shadow_idle=(2, 3600.0)) as server:
        for first, _ in pairs:
            server.complete(first, 1)  # caches the documents it has
        wait_for_stores(server)
        server.complete(pairs[0][1], ANSWER_TOKENS)  # blends, and ends with nothing else
        wait_for_scored(server, 1)  # in flight: scored though the sample rate skips all
        # A hole request ends while another decodes: not idle, so the sample rate decides.
        long = threading.Thread(
            target=server.complete, args=(pairs[1][1], 160), kwargs={"ignore_eos": True}
        )
        long.start()
        time.sleep(1.0)
        short = server.complete(pairs[2][1], 1)
        assert short["usage"]["prompt_tokens"] == len(pairs[2][1])
        assert server.sample("holeblend_shadow_requests_total", outcome="not_sampled") == 1
        long.join(180)
        wait_for_scored(server, 2)  # the long one ended with the engine idle
        outcomes = {
            outcome: server.sample("holeblend_shadow_requests_total", outcome=outcome)
            for outcome in ("scored", "not_sampled", "over_budget", "dropped_full", "failed")
        }
        assert outcomes == {
            "scored": 2, "not_sampled": 1, "over_budget": 0, "dropped_full": 0, "failed": 0
        }  # fmt: skip
