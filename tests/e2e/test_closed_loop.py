"""The closed loop, shortened (`make closed-loop` runs the full scenarios): the real engine
runs as a pod of the process kubelet under a RAG stream, its shadow proxies reach the
tuner (through a real Prometheus when installed), the tuner decides on them, and a new
ratio reaches the running engine live."""

import dataclasses
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from holeblend_devtools import closed_loop, closed_loop_runs, prometheus
from holeblend_operator.api import BlendDeployment
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
    # Seeded shuffles of 3 documents: one in 6 keeps its order.
    assert reordered > len(prompts) // 2


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
        assert "ClampedToBounds" in " ".join(h["reason"] for h in history(stack))
        assert all(tuning.min_ratio <= h["toRatio"] <= tuning.max_ratio for h in history(stack))


def patch_out_of_bounds_until_clamped(stack, engine, max_ratio: float, timeout_s: float) -> bool:
    """Patch status.recomputeRatio to 0.95 (above the bounds) until the engine runs the
    clamped ratio. A hand patch can race with a tuner write of the same field, and the
    last writer wins (as on a real API server), so a patch the tuner overwrote is sent
    again; the tuner must then clamp it, never keep it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stack.cluster.call(
            stack.cluster.api.edit_object(
                closed_loop.BD,
                "default",
                closed_loop_runs.NAME,
                {"status": {"recomputeRatio": 0.95}},
            )
        )
        if wait_for(lambda: engine_ratio(engine) == max_ratio, 20):
            return True
    return False


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
