"""The closed loop, shortened (`make closed-loop` runs the full scenarios): the real engine
runs as a pod of the process kubelet under a RAG stream, its shadow proxies reach the
tuner (through a real Prometheus when installed), the tuner raises a ratio that is too low,
and the engine picks the new ratio up live."""

import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from holeblend_devtools import closed_loop, closed_loop_runs, prometheus
from holeblend_operator.api import BlendDeployment
from holeblend_operator.render import render_children


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


@pytest.mark.slow
@pytest.mark.skipif(
    not renders_holeblend_serve(), reason="CPU engine pods do not run holeblend-serve yet"
)
def test_the_tuner_raises_a_low_ratio_from_live_proxies_and_the_engine_follows(tmp_path):
    # A target no ratio this low meets, so the first trustworthy reading must raise it.
    tuning = closed_loop_runs.Tuning(
        target=0.99, band=0.0, interval_s=5, cooldown_s=10, min_samples=2
    )
    with closed_loop.LiveStack(tmp_path) as stack:
        body = closed_loop.example()
        body["spec"]["blend"]["recomputeRatio"] = 0.02
        body["spec"]["tuning"] = tuning.spec(None)
        body["spec"]["lookupServer"] = {"enabled": False}
        stack.apply(body)
        assert stack.wait_ready(closed_loop_runs.NAME, 240), stack.status(closed_loop_runs.NAME)
        if prometheus.is_installed():
            url = stack.start_prometheus(closed_loop_runs.NAME)
            stack.patch(closed_loop_runs.NAME, {"spec": {"tuning": {"prometheusURL": url}}})
        engine = stack.engine_url(closed_loop_runs.NAME)
        # Idle gaps between requests: the shadow prefill runs only there.
        stream = closed_loop.RagStream(engine, closed_loop_runs.WORKLOAD, think_s=1.5).start()
        try:
            deadline = time.monotonic() + 200
            while time.monotonic() < deadline and not ups(stack):
                time.sleep(1)
        finally:
            stream.stop()
        status = stack.status(closed_loop_runs.NAME)
        (first_up, *_) = ups(stack) or [None]
        reasons = [h["reason"] for h in (status.get("tuning") or {}).get("history") or []]
        assert first_up is not None, reasons
        assert first_up["reason"].startswith("BelowTarget: ")
        assert first_up["inputs"]["numSamples"] >= tuning.min_samples
        assert first_up["fromRatio"] == 0.02 and first_up["toRatio"] == 0.032
        # The ratio travels status -> ConfigMap -> mounted file -> the engine, no restart.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and engine_ratio(engine) != first_up["toRatio"]:
            time.sleep(0.5)
        assert engine_ratio(engine) == first_up["toRatio"]
        history = status["tuning"]["history"]
        assert all(tuning.min_ratio <= h["toRatio"] <= tuning.max_ratio for h in history)
        assert sum(s.status == 200 for s in stream.sent) >= 3


def ups(stack) -> list[dict]:
    history = (stack.status(closed_loop_runs.NAME).get("tuning") or {}).get("history") or []
    return [h for h in history if h["direction"] == "up"]
