"""The connector's scheduler side on its own: what each step's metadata carries for a
request, as vLLM plans, allocates and finishes it, and which finished requests it offers
to the quality proxies' shadow (no engine, no tokenizer)."""

import itertools
import types

import pytest
import torch
from vllm import SamplingParams
from vllm.v1.engine import FinishReason

from holeblend_runtime.blend.config import BlendConfig
from holeblend_runtime.blend.keys import SegmentKeyer
from holeblend_runtime.blend.segments import SegmentSplitter
from holeblend_runtime.vllm_connector import connector
from holeblend_runtime.vllm_connector.settings import ConnectorSettings
from holeblend_runtime.vllm_connector.shadow import SHADOW_MARK

SEP = 9
# system | doc A | doc B | doc C | question, separated by SEP
PROMPT = [1, 2, 3, SEP, 10, 11, 12, 13, SEP, 20, 21, 22, 23, SEP, 30, 31, 32, 33, SEP, 40, 41]


class Index:
    """The tiers' keys, as the planner asks for them."""

    def __init__(self):
        self.keys: set[str] = set()

    def contains_many(self, keys):
        return [key in self.keys for key in keys]


@pytest.fixture
def side(monkeypatch):
    tokenizer = types.SimpleNamespace(encode=lambda text, add_special_tokens: [SEP])
    monkeypatch.setattr(connector, "_text_tokenizer", lambda vllm_config: tokenizer)
    model_config = types.SimpleNamespace(model="m", revision=None, dtype=torch.float32)
    vllm_config = types.SimpleNamespace(
        model_config=model_config, parallel_config=types.SimpleNamespace(tensor_parallel_size=1)
    )
    settings = ConnectorSettings(blend=BlendConfig(min_segment_tokens=2), quality_proxies=False)
    side = connector._SchedulerSide(vllm_config, settings, Index(), step_tokens=16)
    keys = side.planner.plan(PROMPT).keys
    # Everything cached but doc B: a hole inside the covered range.
    side.planner.index.keys = {k for i, k in enumerate(keys) if k is not None and i != 2}
    return side


def request(request_id):
    return types.SimpleNamespace(
        request_id=request_id, prompt_token_ids=list(PROMPT), kv_transfer_params=None
    )


def blocks(*ids):
    return types.SimpleNamespace(get_block_ids=lambda: (list(ids),))


def test_a_holes_store_goes_out_with_its_load_not_in_the_step_that_planned_it(side):
    """vLLM plans a request, then may not allocate it in that step (no free blocks): the
    hole's store waits for the step that carries the load, which stores the hole from
    its blend (a store sent alone would compute the hole once more, in canonical
    context, before the load stores it again)."""
    matched = side.matched(request("r"), 0)
    assert matched > 0
    first = side.step_plan()
    assert (first.loads, first.stores) == ((), ())
    assert side.matched(request("r"), 0) == matched  # asked again next step
    side.allocated(request("r"), blocks(0, 1), matched)
    second = side.step_plan()
    assert [load.request_id for load in second.loads] == ["r"]
    assert [(store.request_id, store.segments) for store in second.stores] == [("r", (2,))]
    assert side.step_plan().stores == ()


def test_a_hole_vllm_computes_itself_is_stored_and_one_never_loaded_is_dropped(side):
    """Allocated with no external tokens (vLLM computes the range itself): the hole's store
    goes out alone, computed by the worker. A request that finishes before any load:
    nothing is stored for it."""
    side.matched(request("a"), 0)
    side.allocated(request("a"), blocks(), 0)
    plan = side.step_plan()
    assert plan.loads == () and [(s.request_id, s.segments) for s in plan.stores] == [("a", (2,))]
    side.matched(request("b"), 0)
    side.finished("b", request("b"))
    side.allocated(request("b"), blocks(), 0)  # late: forgotten
    assert side.step_plan().stores == ()


def test_a_shadows_replay_is_blended_like_a_user_request_and_counted_as_none(side):
    """A replay (marked shadow and replay) is planned and blended as a user request, but it
    neither counts as a user request in flight nor adds to the user figures, and its
    figures go back in its answer with the replay's own answer, end, ratio and inline
    statistic for the shadow to score."""
    from holeblend_runtime.vllm_connector import metrics
    from holeblend_runtime.vllm_connector.worker import LoadOutcome

    marks = {"holeblend": {"shadow": SHADOW_MARK, "replay": True}}
    replay = request("replay")
    replay.kv_transfer_params = marks
    plain_shadow = request("shadow")
    plain_shadow.kv_transfer_params = {"holeblend": {"shadow": SHADOW_MARK}}
    assert side.matched(plain_shadow, 0) == 0  # a full-prefill shadow: nothing reused
    assert side.matched(replay, 0) > 0 and side.in_flight == set()
    side.ratios["replay"] = 0.15  # as its load records it
    blends = metrics.BLEND_SECONDS._sum.get()
    side.record_outcomes((LoadOutcome("replay", 8, 4, 6, 0, 2.5, 0.25, 0.15),))
    assert metrics.BLEND_SECONDS._sum.get() == blends  # not a user's blend
    replay.output_token_ids = [11, 12, 2]
    replay.get_finished_reason = lambda: "stop"
    replay.sampling_params = SamplingParams(temperature=0.0, max_tokens=64, stop_token_ids=[2])
    before = metrics.PROMPT_TOKENS._value.get()
    figures = side.finished("replay", replay)
    assert metrics.PROMPT_TOKENS._value.get() == before  # no user figure moved
    assert figures["replay"] == {
        "answer_ids": [11, 12], "stopped_at_eos": True, "ratio": 0.15, "inline_statistic": 0.25
    }  # fmt: skip
    # A user request still counts.
    side.matched(request("user"), 0)
    assert side.in_flight == {"user"}
    assert "replay" not in side.finished("user", None)
    assert metrics.PROMPT_TOKENS._value.get() == before + len(PROMPT)
    # A client's own marks (any client can send kv_transfer_params) make it no shadow.
    spoofed = request("spoofed")
    spoofed.kv_transfer_params = {"holeblend": {"shadow": True, "replay": True}}
    assert side.matched(spoofed, 0) > 0 and side.in_flight == {"spoofed"}
    assert "replay" not in side.finished("spoofed", None)
    assert metrics.PROMPT_TOKENS._value.get() == before + 2 * len(PROMPT)


def test_a_replay_that_ends_before_its_load_outcome_comes_back_is_still_no_users_blend(side):
    """vLLM finishes a request before it reads the step's connector output: a replay that
    ends at its first token is finished before its load's outcome arrives, and that
    outcome was counted as a user's blend (blend seconds, the inline proxy's statistics)."""
    from holeblend_runtime.vllm_connector import metrics
    from holeblend_runtime.vllm_connector.worker import LoadOutcome

    side.step_tokens = None  # whole blends: a request can end in the step that loaded it
    replay = request("replay")
    replay.kv_transfer_params = {"holeblend": {"shadow": SHADOW_MARK, "replay": True}}
    matched = side.matched(replay, 0)
    side.allocated(replay, blocks(0, 1), matched)
    assert [load.request_id for load in side.step_plan().loads] == ["replay"]
    replay.output_token_ids = [2]
    replay.get_finished_reason = lambda: "stop"
    replay.sampling_params = SamplingParams(temperature=0.0, max_tokens=64, stop_token_ids=[2])
    assert "replay" in side.finished("replay", replay)  # ended in the step that loaded it
    blends, count = metrics.BLEND_SECONDS._sum.get(), blend_count()
    side.record_outcomes((LoadOutcome("replay", 8, 4, 6, 0, 2.5, 0.25, 0.15),))
    assert (metrics.BLEND_SECONDS._sum.get(), blend_count()) == (blends, count)
    assert side.ended_replays == {}  # remembered only until its outcome came
    # A user request's late outcome still counts.
    user = request("user")
    side.allocated(user, blocks(2, 3), side.matched(user, 0))
    side.step_plan()
    side.finished("user", None)
    side.record_outcomes((LoadOutcome("user", 8, 4, 6, 0, 1.5, 0.25, 0.15),))
    assert metrics.BLEND_SECONDS._sum.get() == blends + 1.5 and blend_count() == count + 1


def blend_count() -> float:
    from holeblend_runtime.vllm_connector import metrics

    return metrics.REGISTRY.get_sample_value("holeblend_blend_seconds_count") or 0.0


class Shadow:
    """The shadow as `_offer` sees it: what it was offered (a real one has nothing else a
    finished request could call)."""

    eos_token_id = 1

    def __init__(self):
        self.offered = []

    def decode(self, ids):
        return " ".join(f"w{i}" for i in ids)

    def offer(self, shadow_request, idle):
        self.offered.append(shadow_request)


def offer(
    params: SamplingParams, answer=(11, 12, 13, 1), reason: FinishReason = FinishReason.STOP
) -> Shadow:
    """A blended request that finished (`reason`, as vLLM's engine saw it) with `answer`
    under `params`, offered."""
    shadow = Shadow()
    side = types.SimpleNamespace(shadow=shadow, budget=None, in_flight=set())
    side._eos_token_id = lambda: connector._SchedulerSide._eos_token_id(side)
    side._finished_answer = lambda r: connector._SchedulerSide._finished_answer(side, r)
    prompt = types.SimpleNamespace(
        token_ids=[1, 5, 6], question=types.SimpleNamespace(token_ids=[6])
    )
    plan = types.SimpleNamespace(is_blended=lambda n: True, prompt=prompt)
    finished = types.SimpleNamespace(
        output_token_ids=list(answer), get_finished_reason=lambda: reason, sampling_params=params
    )
    connector._SchedulerSide._offer(side, plan, {"num_reused_tokens": 10}, finished, 0.15, 0.3)
    return shadow


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, max_tokens=16),  # vLLM's default without temperature
        SamplingParams(temperature=0.7, top_p=0.9, max_tokens=16),
        SamplingParams(temperature=0.0, min_tokens=8, max_tokens=16),
        SamplingParams(temperature=0.0, logit_bias={5: 2.0}, max_tokens=16),
        SamplingParams(temperature=0.0, allowed_token_ids=[11, 12, 13], max_tokens=16),
    ],
)
def test_an_answer_that_is_not_the_models_argmax_is_offered_as_a_greedy_replay(params):
    """The shadow scores an answer against full prefill's argmax at each position: a sampled
    answer (vLLM samples at temperature 1 when a client leaves it out: most clients), or
    one whose picks were constrained, departs from it with no blending at all and would
    read as blending error. It was counted as `not_greedy` and never scored, so a pod
    whose clients sample gave the tuner nothing. It is now offered as a replay: the
    shadow sends its prompt again, greedy and blended, and scores that answer."""
    (offered,) = offer(params).offered
    assert offered.replay and offered.answer_ids == () and offered.prompt_ids == (1, 5, 6)
    assert offered.max_tokens == 16 and offered.ratio == 0.15


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=16),
        SamplingParams(temperature=0.8, top_k=1, max_tokens=16),  # top-1 of the argmax only
    ],
)
def test_a_greedy_answer_is_offered(params):
    """Temperature 0, or top_k 1 at any temperature, picks the argmax: offered, with its
    EOS taken off."""
    (offered,) = offer(params).offered
    assert offered.answer_ids == (11, 12, 13) and offered.stopped_at_eos is True


def test_an_answer_ending_at_a_generation_config_eos_stopped_at_its_end():
    """vLLM adds generation_config's other EOS ids (Gemma's `<end_of_turn>`, here 107;
    the tokenizer's EOS is 1) to the request's stop token ids, stops there and keeps the
    token. That answer stopped at its end: the token is taken off and full prefill is
    asked whether it ends there too (else an answer that stops early is never
    penalised, since full prefill's own answer is capped at the blended length)."""
    params = SamplingParams(temperature=0.0, max_tokens=64)
    params.update_from_generation_config({"eos_token_id": [1, 107]}, 1)
    (offered,) = offer(params, answer=(11, 12, 107)).offered
    assert offered.answer_ids == (11, 12) and offered.stopped_at_eos is True
    assert offered.stop_token_ids == (107,)
    # A stop token id the client asked for ends the answer the same way.
    params = SamplingParams(temperature=0.0, stop_token_ids=[42], max_tokens=64)
    (offered,) = offer(params, answer=(11, 42)).offered
    assert (offered.answer_ids, offered.stopped_at_eos, offered.stop_token_ids) == (
        (11,), True, (42,)
    )  # fmt: skip


def test_an_answer_ended_by_a_stop_string_is_offered_with_the_requests_stop_strings():
    """vLLM's API server checks stop strings itself: once the answer's text reaches one it
    aborts the request in the engine, so the connector sees it finish aborted, often with
    tokens decoded after the stop string. It was dropped as a client's abort and never
    scored; it is offered with its stop strings (the shadow decodes "w11 w12 w13"), for
    the shadow to score it as the client got it."""
    params = SamplingParams(temperature=0.0, stop=["w12"], max_tokens=64)
    (offered,) = offer(params, answer=(11, 12, 13), reason=FinishReason.ABORT).offered
    assert offered.answer_ids == (11, 12, 13) and offered.stop == ("w12",)
    assert not offered.include_stop and offered.stopped_at_eos is False
    # A client that left: aborted before its text reached any stop string.
    assert offer(params, answer=(11, 13), reason=FinishReason.ABORT).offered == []
    # Ended in the engine (its limit) in the step its text reached one: carried all the
    # same, with the stop string kept in the answer when the request asked for it.
    params = SamplingParams(
        temperature=0.0, stop=["w12"], include_stop_str_in_output=True, max_tokens=2
    )
    (offered,) = offer(params, answer=(11, 12), reason=FinishReason.LENGTH).offered
    assert (offered.stop, offered.include_stop) == (("w12",), True)
    # A sampled request's replay is scored up to the same stop strings.
    params = SamplingParams(temperature=1.0, stop=["w12", "w7"], max_tokens=16)
    (offered,) = offer(params, answer=(11, 12, 13), reason=FinishReason.ABORT).offered
    assert offered.replay and offered.stop == ("w12", "w7")


def test_the_model_name_keys_the_same_weights_path_apart(monkeypatch, tmp_path):
    """The operator passes `/models` to `vllm serve` for every hostPath source: blend.json's
    model.name tells new weights behind it apart. Two names: other keys and another
    calibration scope on the scheduler side; one name: the same keys and model id in the
    scheduler and in the workers (each process reads blend.json itself)."""
    from holeblend_contract.blend_settings import BlendSettings, ModelSettings
    from holeblend_runtime.vllm_connector.settings import load_settings

    scopes, numbers = [], itertools.count()

    class Calibration:
        @classmethod
        def to(cls, url, scope, pod, inline):
            scopes.append(scope)
            return cls()

        def start(self):
            return self

    monkeypatch.setattr(connector, "SharedCalibration", Calibration)
    tokenizer = types.SimpleNamespace(encode=lambda text, add_special_tokens: [SEP])
    monkeypatch.setattr(connector, "_text_tokenizer", lambda vllm_config: tokenizer)
    model_config = types.SimpleNamespace(
        model="/models", revision=None, dtype=torch.float32,
        get_num_layers=lambda parallel: 30, get_num_kv_heads=lambda parallel: 3,
        get_head_size=lambda: 64,
    )  # fmt: skip
    vllm_config = types.SimpleNamespace(
        model_config=model_config, parallel_config=types.SimpleNamespace(tensor_parallel_size=1)
    )

    def settings_of(name):
        path = tmp_path / f"{next(numbers)}.json"
        blend = BlendSettings(
            model=ModelSettings(name=name), min_segment_tokens=2,
            lookup_server_url="http://lookup:8080", shadow_sample_rate=0,
        )  # fmt: skip
        path.write_text(blend.to_json())
        return load_settings({"holeblend_config": str(path), "kv_dir": str(tmp_path / "kv")})

    def scheduler_keys(settings):
        side = connector._SchedulerSide(vllm_config, settings, Index(), step_tokens=16)
        return side.planner.plan(PROMPT).keys

    base, tuned = settings_of("org/base"), settings_of("org/tuned")
    base_keys, tuned_keys = scheduler_keys(base), scheduler_keys(tuned)
    assert any(base_keys) and not {k for k in base_keys if k} & set(tuned_keys)
    assert len(scopes) == 2 and scopes[0] != scopes[1]
    # The workers: their engine's model id and the stored entries' layout.
    worker = settings_of("org/base")
    model_id, kv_dtype = connector.model_identity(vllm_config, worker)
    assert model_id == "org/base|/models@main" and kv_dtype == "float32"
    assert connector.kv_layout(vllm_config, worker).model_id == model_id
    split = SegmentSplitter((SEP,), worker.blend.min_segment_tokens).split(PROMPT)
    worker_keyer = SegmentKeyer.for_model(model_id, "float32", worker.blend)  # the engine's
    assert tuple(worker_keyer.keys(split)) == base_keys == scheduler_keys(worker)


def scheduled_alone(request_id, num_tokens, block_ids):
    """vLLM's `SchedulerOutput` of a step that schedules one new request from token 0."""
    new = types.SimpleNamespace(req_id=request_id, block_ids=(block_ids,), num_computed_tokens=0)
    cached = types.SimpleNamespace(
        req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
    )
    return types.SimpleNamespace(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={request_id: num_tokens},
    )


def test_a_failed_lookups_segments_are_stored_only_where_the_tier_lacks_them(side):
    """An index that fails plans a full miss naming every cacheable segment missing,
    though the tier may hold them all (it failed to say). Those stores were sent without
    `check_stored`, so the worker rewrote every segment the tier already held from the
    forward's K/V (counted as `source="forward"`) on every request while the index was
    down; a late lookup's stores already check first. (Stores computed in canonical
    context check the tier whatever the flag says.)"""
    assert side.forward_stores is not None  # store policy in-context, the default

    def down(keys):
        raise ConnectionError("lookup server unreachable")

    side.planner.index.contains_many = down
    assert side.matched(request("r"), 0) == 0
    assert side.plans["r"].is_lookup_failed and side.plans["r"].missing_segments
    side.allocated(request("r"), blocks(), 0)
    stores = side.step_plan(scheduled_alone("r", len(PROMPT), [0, 1, 2])).stores
    named = sorted(i for store in stores for i in store.segments)
    assert named == sorted(side.plans["r"].missing_segments)
    assert all(store.check_stored for store in stores)


def test_a_request_ending_before_its_outcome_counts_the_ratio_its_blend_ran_with(side):
    """A request that finishes in the step that loaded it is counted from its plan (its
    outcome comes a step later). Its recomputed tokens were derived from the ratio in
    force when it finished, not the one its blend ran with: a live ratio change (the
    tuner rewriting blend.json) misreported every such request of that step."""
    side.step_tokens = None  # whole blends: a request can end in the step that loaded it
    side.ratio = types.SimpleNamespace(ratio=lambda: 0.0)
    r = request("r")
    side.allocated(r, blocks(0, 1), side.matched(r, 0))
    (load,) = side.step_plan().loads
    plan = side.plans["r"]
    side.ratio = types.SimpleNamespace(ratio=lambda: 1.0)  # changed before it finished
    figures = side.finished("r", None)
    assert figures["source"] == "plan" and load.ratio == 0.0
    assert figures["num_recomputed_tokens"] == connector._planned_recompute(plan, 0.0)
    assert figures["num_recomputed_tokens"] < connector._planned_recompute(plan, 1.0)


def reuse_counts() -> tuple[float, float]:
    from holeblend_runtime.vllm_connector import metrics

    value = metrics.REGISTRY.get_sample_value
    return (
        value("holeblend_reused_tokens_total") or 0.0,
        value("holeblend_prompt_tokens_total") or 0.0,
    )


def test_a_request_that_ends_before_it_ran_counts_no_reuse(side):
    """vLLM finishes a request that never ran (aborted while it waited for blocks, or
    refused) like any other: its plan's reused tokens went into the hit rate though
    nothing was loaded or computed. A request that ran counts as before."""
    from holeblend_runtime.vllm_connector.worker import LoadOutcome

    waiting = request("waiting")
    assert side.matched(waiting, 0) > 0
    side.step_plan()  # not allocated: no free blocks
    before = reuse_counts()
    waiting.num_computed_tokens = 0
    assert side.finished("waiting", waiting) is None
    assert reuse_counts() == before
    ran = request("ran")
    side.allocated(ran, blocks(0, 1), side.matched(ran, 0))
    side.step_plan()
    side.record_outcomes((LoadOutcome("ran", 8, 4, 6, 0, 0.5, None, 0.15),))
    ran.num_computed_tokens = len(PROMPT)
    figures = side.finished("ran", ran)
    assert figures["num_reused_tokens"] > 0
    assert reuse_counts() == (
        before[0] + figures["num_reused_tokens"],
        before[1] + len(PROMPT),
    )


def test_a_request_that_ends_while_its_blend_is_under_way_counts_no_reuse(side):
    """With stepwise loads vLLM parks a request until its load ends, and the load's
    outcome comes back in that same step. A request aborted while its blend was under way
    (the worker drops the blend) ran nothing, yet its plan's reused tokens went into the
    hit rate and its mode into the requests counted. One whose load failed is a full miss,
    as before."""
    aborted = request("aborted")
    side.allocated(aborted, blocks(0, 1), side.matched(aborted, 0))
    (load,) = side.step_plan().loads
    assert load.is_async
    before = reuse_counts()
    aborted.num_computed_tokens = 0  # vLLM's own prefix cache held none of it
    assert side.finished("aborted", aborted) is None
    assert reuse_counts() == before
    failed = request("failed")
    side.allocated(failed, blocks(2, 3), side.matched(failed, 0))
    side.step_plan()
    side.record_failed_loads(["failed"])
    figures = side.finished("failed", failed)
    assert figures["is_load_failed"] and figures["num_reused_tokens"] == 0


def test_a_request_that_ends_before_its_whole_blends_outcome_is_counted_from_the_outcome(side):
    """With whole blends a request can end in the step that loaded it (or be aborted before
    vLLM reads that step's output): vLLM finishes it before the load's outcome comes back.
    Its counters took the plan's figures, so a segment rejected at load (evicted since
    the lookup) still counted as reused; they now wait for the outcome. A load that fails
    instead counts as a full miss."""
    from holeblend_runtime.vllm_connector.worker import LoadOutcome

    side.step_tokens = None
    r = request("r")
    side.allocated(r, blocks(0, 1), side.matched(r, 0))
    side.step_plan()
    before = reuse_counts()
    figures = side.finished("r", r)
    assert figures["source"] == "plan" and figures["num_reused_tokens"] > 4
    side.record_outcomes((LoadOutcome("r", 4, 8, 12, 1, 0.5, None, 0.15),))
    assert reuse_counts() == (before[0] + 4, before[1] + len(PROMPT))
    assert side.awaiting_outcomes == {}
    failed = request("failed")
    side.allocated(failed, blocks(2, 3), side.matched(failed, 0))
    side.step_plan()
    side.finished("failed", failed)
    side.record_failed_loads(["failed"])
    assert reuse_counts() == (before[0] + 4, before[1] + 2 * len(PROMPT))
    assert side.awaiting_outcomes == {}
