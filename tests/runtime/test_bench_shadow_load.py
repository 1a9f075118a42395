"""The shadow-load benchmark (`make bench-shadow`): the streamed timings, the request plan,
the two load shapes, the proxy counters read off /metrics and the rows' arithmetic (ratios,
samples per interval, verdicts), on fakes; then the whole flow against a fake
OpenAI-compatible server over HTTP, and shrunk on the real holeblend-serve (slow). The
speed goals themselves are the benchmark's to measure (docs/tuning.md), not these tests'."""

import argparse
import contextlib
import dataclasses
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy
import pytest

from holeblend_runtime.bench import shadow_load
from holeblend_runtime.bench.shadow_load import Timing


def sse(*payloads) -> list[bytes]:
    return [f"data: {json.dumps(p) if isinstance(p, dict) else p}\n".encode() for p in payloads]


def text(value: str) -> dict:
    return {"choices": [{"text": value}]}


class Clock:
    """Returns the given times in turn."""

    def __init__(self, *times: float):
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0)


# --- the client -------------------------------------------------------------------------


def test_ttft_is_the_first_chunk_with_text_and_itls_the_gaps_between_chunks_with_text():
    lines = [b": comment\n", *sse(text(""), text("A"), text(" b"), text(""), text("c")), b"\n"]
    lines += sse({"choices": [{"text": "", "finish_reason": "length"}]}, "[DONE]")
    # A time is read for each data line but [DONE] (5 chunks, then the last one), then the end.
    timing = shadow_load.read_stream(
        iter(lines), arrived=10.0, clock=Clock(10.5, 11.0, 11.2, 11.3, 11.6, 11.7, 12.0)
    )
    assert timing.ok
    assert timing.ttft_s == pytest.approx(1.0)  # the empty first chunk does not count
    assert timing.itls_s == pytest.approx([0.2, 0.4])  # " b" after "A", "c" after " b"
    assert timing.return_s == pytest.approx(2.0)


def test_chat_deltas_count_as_text_and_an_error_event_or_no_text_fails_the_request():
    chat = shadow_load.read_stream(
        iter(sse({"choices": [{"delta": {"content": "x"}}]}, "[DONE]")), 0.0, clock=Clock(1.0, 2.0)
    )
    assert chat.ok and chat.ttft_s == 1.0
    error = shadow_load.read_stream(
        iter(sse(text("x"), {"error": {"message": "boom"}})), 0.0, clock=Clock(1.0, 1.5, 2.0)
    )
    assert not error.ok and "boom" in error.error
    empty = shadow_load.read_stream(iter(sse(text(""), "[DONE]")), 0.0, clock=Clock(1.0, 2.0))
    assert not empty.ok and empty.error == "no text streamed"


def test_a_stream_that_ends_before_done_fails_the_request():
    """A connection closed mid-answer (the server's process died, say) ends the stream
    without `data: [DONE]`: a failed request, not a success with a short return time."""
    cut = shadow_load.read_stream(iter(sse(text("A"), text(" b"))), 0.0, clock=Clock(1.0, 1.2, 1.3))
    assert not cut.ok and "[DONE]" in cut.error
    stats = shadow_load.arm_stats([dataclasses.asdict(cut)])
    assert stats["failed_requests"] == 1 and stats["ttft_p99_s"] is None
    whole = shadow_load.read_stream(
        iter(sse(text("A"), text(" b"), "[DONE]")), 0.0, clock=Clock(1.0, 1.2, 1.3)
    )
    assert whole.ok


def test_a_whole_prompt_follows_its_first_pass_lag_requests_later():
    order = shadow_load.interleave(["a", "b", "c"], lag=2)
    assert order == [
        ("a", False), ("b", False), ("c", False), ("a", True), ("b", True), ("c", True),
    ]  # fmt: skip
    order = shadow_load.interleave(list(range(6)), lag=2)
    assert sorted(order) == sorted([(q, h) for q in range(6) for h in (False, True)])
    for question in range(6):
        first, whole = order.index((question, False)), order.index((question, True))
        assert whole - first >= 2  # at least `lag` requests between (here: first passes)


def fake_body(system, documents, question, max_tokens) -> dict:
    return {"question": question, "documents": list(documents), "max_tokens": max_tokens}


def test_the_plan_gives_each_phase_its_own_questions_and_the_calibration_one_token_first_passes():
    plan = shadow_load.build_plan(
        fake_body, warm_questions=2, paced_questions=3, saturated_questions=4, max_tokens=8,
        calibrate_questions=5,
    )  # fmt: skip
    assert len(plan.warm) == 4 and len(plan.calibrate) == 5
    assert (len(plan.phases["paced"]), len(plan.phases["saturated"])) == (6, 8)
    questions = {
        name: {b["question"] for b in bodies}
        for name, bodies in (
            ("warm", plan.warm), ("calibrate", [b for pair in plan.calibrate for b in pair]),
            *plan.phases.items(),
        )
    }  # fmt: skip
    assert [len(q) for q in questions.values()] == [2, 5, 3, 4]
    assert len(set().union(*questions.values())) == 14  # no question in two parts
    for load, bodies in plan.phases.items():
        for body, is_hole in zip(bodies, plan.is_hole[load], strict=True):
            assert body["max_tokens"] == 8
            # The whole prompt has the hole document its first pass left out.
            first = next(b for b in bodies if b["question"] == body["question"] and b is not body)
            bigger = body if is_hole else first
            assert (
                len(bigger["documents"])
                == len(first["documents"] if is_hole else body["documents"]) + 1
            )
    for first, whole in plan.calibrate:
        assert (first["max_tokens"], whole["max_tokens"]) == (1, 8)
        assert len(whole["documents"]) == len(first["documents"]) + 1
    again = shadow_load.build_plan(
        fake_body, warm_questions=2, paced_questions=3, saturated_questions=4, max_tokens=8,
        calibrate_questions=5,
    )  # fmt: skip
    assert again == plan  # the same requests in every run and every invocation
    other = shadow_load.build_plan(
        fake_body, warm_questions=2, paced_questions=3, saturated_questions=4, max_tokens=8,
        seed=1,
    )  # fmt: skip
    assert other.phases != plan.phases


def test_a_negative_seed_is_refused_by_both_engines_benchmarks(capsys):
    """Python seeds `random.Random(-7)` as `random.Random(7)`: a negative seed would run seed
    7's workload and gaps under another name, not a held-out one. The vLLM benchmark's
    parser takes the same options (`add_plan_arguments`)."""
    vllm_parser = argparse.ArgumentParser()
    shadow_load.add_plan_arguments(vllm_parser, sample_rate=0.2)
    for parser in (shadow_load._parser(), vllm_parser):
        with pytest.raises(SystemExit) as caught:
            parser.parse_args(["--seed", "-7"])
        assert caught.value.code == 2
        assert "--seed: must be >= 0, got -7" in capsys.readouterr().err
        assert parser.parse_args(["--seed", "7"]).seed == 7


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--clients", "0", "must be >= 1, got 0"),
        ("--warm-questions", "0", "must be >= 1, got 0"),
        ("--paced-questions", "-1", "must be >= 0, got -1"),
        ("--load", "0", "must be a finite number > 0, got 0"),
        ("--load", "nan", "must be a finite number > 0, got nan"),
        ("--ratio", "1.5", "must be within [0, 1], got 1.5"),
        ("--ratio", "x", "must be a number within [0, 1], got 'x'"),
        ("--sample-rate", "-0.2", "must be within [0, 1], got -0.2"),
        ("--max-tokens", "0", "must be >= 1, got 0"),
    ],
)
def test_plan_options_a_run_cannot_use_are_refused_by_name_before_any_server_starts(
    capsys, option, value, message
):
    """Zero clients, zero load (no service rate to pace at) or no warm-up (no service time
    to measure) ended a run in a traceback after its first server had served requests; a
    ratio or sample rate outside [0, 1] in the settings' validation error as the first
    server was about to start, and an answer length below 1 in a failed warm-up."""
    parser = argparse.ArgumentParser()
    shadow_load.add_plan_arguments(parser, sample_rate=0.2)
    with pytest.raises(SystemExit) as caught:
        parser.parse_args([option, value])
    assert caught.value.code == 2
    assert f"{option}: {message}" in capsys.readouterr().err
    assert vars(parser.parse_args([option, "1"]))[option[2:].replace("-", "_")] == 1


def recording_send(delay_s: float):
    """A fake `stream`: records sends, the times they were due (paced) and the most
    requests in flight at once."""
    state = {"sent": [], "scheduled": [], "in_flight": 0, "most": 0}
    lock = threading.Lock()

    def send(url, body, scheduled=None):
        with lock:
            state["sent"].append((time.monotonic(), body["i"]))
            if scheduled is not None:
                state["scheduled"].append((scheduled, body["i"]))
            state["in_flight"] += 1
            state["most"] = max(state["most"], state["in_flight"])
        time.sleep(delay_s)
        with lock:
            state["in_flight"] -= 1
        return Timing(ttft_s=delay_s, return_s=delay_s)

    return send, state


def test_saturated_clients_keep_exactly_their_number_of_requests_in_flight_without_think_time():
    send, state = recording_send(0.2)
    bodies = [{"i": i} for i in range(12)]
    started = time.monotonic()
    timings = shadow_load.drive_saturated("u", bodies, clients=3, send=send)
    assert [t.ok for t in timings] == [True] * 12
    assert sorted(i for _, i in state["sent"]) == list(range(12))
    assert [i for _, i in state["sent"]][:3] == sorted(i for _, i in state["sent"][:3])
    assert state["most"] == 3
    # 12 requests of 0.2 s on 3 clients with no think time: 4 rounds (0.8 s), not 12 (2.4 s).
    assert time.monotonic() - started < 0.2 * 12 * 0.7
    with pytest.raises(ValueError, match="clients"):
        shadow_load.drive_saturated("u", bodies, clients=0, send=send)


def test_paced_arrivals_keep_their_schedule_whether_or_not_earlier_requests_returned():
    send, state = recording_send(1.5)
    bodies = [{"i": i} for i in range(4)]
    started = time.monotonic()
    shadow_load.drive_paced("u", bodies, [0.0, 0.2, 0.2, 0.2], send=send)
    offsets = [t - started for t, _ in sorted(state["sent"])]
    assert [i for _, i in sorted(state["sent"])] == [0, 1, 2, 3]
    assert offsets == pytest.approx([0.0, 0.2, 0.4, 0.6], abs=0.15)
    assert state["most"] == 4  # open loop: all four in flight at once
    # Each send is handed the time it was due: the schedule itself, not when it got sent.
    due = [t for t, _ in sorted(state["scheduled"], key=lambda s: s[1])]
    assert numpy.diff(due) == pytest.approx([0.2, 0.2, 0.2])


# --- the proxy counters and the rows ----------------------------------------------------------


def metrics(f1=0.0, inline=0.0, blended=0.0, pairs=None, correlation=None, **offers):
    found = {
        ("holeblend_f1_proxy_count", (("ratio", "0.15"),)): f1,
        ("holeblend_inline_f1_proxy_count", (("ratio", "0.15"),)): inline,
        ("holeblend_inline_residual_deviation_count", (("ratio", "0.15"),)): blended,
        ("holeblend_ttft_seconds_count", ()): 99.0,  # not a proxy counter
    }
    for outcome, count in offers.items():
        found[("holeblend_shadow_requests_total", (("outcome", outcome),))] = count
    for ratio, count in (pairs or {}).items():
        found[("holeblend_inline_proxy_pairs", (("ratio", ratio),))] = count
    for ratio, value in (correlation or {}).items():
        found[("holeblend_inline_proxy_correlation", (("ratio", ratio),))] = value
    return found


def test_the_proxy_counters_sum_over_ratios_and_take_the_calibration_with_the_most_pairs():
    found = metrics(f1=3, inline=40, blended=12, pairs={"0.15": 9, "0.3": 4})
    found[("holeblend_f1_proxy_count", (("ratio", "0.3"),))] = 2.0
    found[("holeblend_inline_proxy_correlation", (("ratio", "0.15"),))] = -0.6
    found[("holeblend_inline_proxy_correlation", (("ratio", "0.3"),))] = 0.9
    counts = shadow_load.proxy_counts(found)
    assert (counts["shadow_scored"], counts["inline_samples"], counts["blended"]) == (5, 40, 12)
    assert (counts["inline_pairs"], counts["inline_f1_correlation"]) == (9, -0.6)
    none = shadow_load.proxy_counts(metrics())
    assert (none["inline_pairs"], none["inline_f1_correlation"], none["offers"]) == (0, None, {})


def test_the_shadow_units_are_read_by_the_engines_state_and_summed_over_the_on_phases():
    found = metrics()
    found[("holeblend_shadow_units_total", (("engine_state", "serving"),))] = 7.0
    found[("holeblend_shadow_unit_seconds_total", (("engine_state", "serving"),))] = 0.5
    units = shadow_load.proxy_counts(found)["units"]
    assert units == {
        "idle": {"units": 0.0, "seconds": 0.0},
        "serving": {"units": 7.0, "seconds": 0.5},
    }
    result = fake_result()
    on_paced = [p for p in result["phases"] if p["arm"] == "on" and p["load"] == "paced"]
    for i, p in enumerate(on_paced):
        p["before"]["units"] = {"idle": {"units": 10.0 * i, "seconds": float(i)}}
        p["after"]["units"] = {
            "idle": {"units": 10.0 * i + 30, "seconds": i + 0.3},
            "serving": {"units": 2.0, "seconds": 0.02},
        }
    paced, saturated = shadow_load.summarize(result)
    assert paced["shadow_units"]["idle"] == {"units": 60.0, "seconds": pytest.approx(0.6)}
    assert paced["shadow_units"]["serving"] == {"units": 4.0, "seconds": pytest.approx(0.04)}
    # Scrapes without the gate's series (vLLM, older servers): zero, not an error.
    assert saturated["shadow_units"]["serving"] == {"units": 0.0, "seconds": 0.0}


def test_a_shadow_is_in_flight_while_a_blended_request_has_no_outcome_yet():
    counts = shadow_load.proxy_counts(metrics(f1=2, blended=5, scored=2, over_budget=2))
    assert shadow_load.shadows_in_flight(counts) == 1
    counts = shadow_load.proxy_counts(metrics(f1=3, blended=5, scored=3, over_budget=2))
    assert shadow_load.shadows_in_flight(counts) == 0


def test_the_service_time_is_the_median_of_the_later_half_of_the_warm_up():
    assert shadow_load.service_time([9.0, 8.0, 0.4, 0.5, 30.0]) == 0.5
    with pytest.raises(ValueError):
        shadow_load.service_time([])


def timings(ttfts, itl=0.1, failed=0):
    rows = [dataclass_dict(Timing(ttft_s=t, itls_s=[itl, 2 * itl], return_s=t + 1)) for t in ttfts]
    return rows + [dataclass_dict(Timing(return_s=1.0, error="HTTP 500"))] * failed


def dataclass_dict(timing: Timing) -> dict:
    return {
        "ttft_s": timing.ttft_s,
        "itls_s": timing.itls_s,
        "return_s": timing.return_s,
        "error": timing.error,
    }


def counts(scored=0.0, inline=0.0, blended=0.0, pairs=0.0, correlation=None, offers=None):
    return {
        "shadow_scored": scored, "inline_samples": inline, "blended": blended,
        "offers": offers or {}, "inline_pairs": pairs, "inline_f1_correlation": correlation,
    }  # fmt: skip


def phase(run, arm, load, ttfts, wall_s, before, after, itl=0.1, failed=0):
    return {
        "run": run, "arm": arm, "load": load, "wall_s": wall_s, "calibration": None,
        "timings": timings(ttfts, itl, failed), "before": before, "after": after,
    }  # fmt: skip


def fake_result() -> dict:
    zero = counts()
    return {
        "engine": "serve",
        "phases": [
            phase(0, "off", "paced", [1.0, 2.0], 30.0, zero, zero),
            phase(0, "off", "saturated", [3.0, 4.0], 20.0, zero, zero, itl=0.2),
            phase(1, "on", "saturated", [3.0, 5.0], 20.0, counts(1, 0, 5, 1), counts(2, 10, 15, 2), itl=0.2),
            phase(1, "on", "paced", [1.0, 2.5], 30.0, counts(2, 10, 15, 2, offers={"scored": 2}), counts(4, 30, 25, 9, -0.5, {"scored": 4, "over_budget": 3})),
            phase(2, "on", "paced", [1.5, 2.0], 30.0, counts(), counts(1, 0, 9, 3, None, {"scored": 1}), itl=0.11),
            phase(2, "on", "saturated", [4.0, 4.0], 20.0, counts(1, 0, 9, 3), counts(3, 12, 19, 8, 0.4), itl=0.3),
            phase(3, "off", "saturated", [2.0, 3.5], 20.0, zero, zero, itl=0.2, failed=1),
            phase(3, "off", "paced", [1.0, 1.0], 30.0, zero, zero),
        ],
    }  # fmt: skip


def test_one_row_per_load_with_on_over_off_p99_ratios_of_both_runs_of_each_arm():
    rows = shadow_load.summarize(fake_result())
    assert [(r["engine"], r["load"]) for r in rows] == [("serve", "paced"), ("serve", "saturated")]
    paced, saturated = rows
    p99 = lambda values: float(numpy.percentile(values, 99))  # noqa: E731
    assert paced["off"]["ttft_p99_s"] == pytest.approx(p99([1.0, 2.0, 1.0, 1.0]))
    assert paced["on"]["ttft_p99_s"] == pytest.approx(p99([1.0, 2.5, 1.5, 2.0]))
    assert paced["ttft_p99_ratio"] == pytest.approx(p99([1.0, 2.5, 1.5, 2.0]) / p99([1, 2, 1, 1]))
    assert paced["on"]["ttft_p50_s"] == pytest.approx(1.75)
    # Inter-token latencies: every gap of every request of the arm.
    assert paced["off"]["itl_count"] == 8 and paced["on"]["itl_count"] == 8
    assert paced["itl_p99_ratio"] == pytest.approx(
        p99([0.1, 0.2] * 2 + [0.11, 0.22] * 2) / p99([0.1, 0.2] * 4)
    )
    assert saturated["ttft_p99_ratio"] == pytest.approx(p99([3, 5, 4, 4]) / p99([3, 4, 2, 3.5]))
    # A failed request counts as failed, not in the percentiles.
    assert (saturated["off"]["requests"], saturated["off"]["failed_requests"]) == (5, 1)
    assert (paced["off"]["runs"], paced["on"]["runs"]) == ([0, 3], [1, 2])


def test_samples_per_interval_are_the_phases_growth_over_their_wall_time_per_60_s():
    paced, saturated = shadow_load.summarize(fake_result())
    # paced on: shadow 2 + 1, inline 20 + 0 over 60 s.
    assert paced["shadow_scored"] == 3 and paced["inline_samples"] == 20
    assert paced["shadow_samples_per_interval"] == pytest.approx(3.0)
    assert paced["inline_samples_per_interval"] == pytest.approx(20.0)
    assert paced["samples_per_interval"] == pytest.approx(20.0)  # the better signal
    assert paced["blended_requests"] == 10 + 9
    assert paced["shadow_offers"] == {"scored": 3, "over_budget": 3}
    # saturated on: shadow 1 + 2, inline 10 + 12 over 40 s.
    assert saturated["shadow_samples_per_interval"] == pytest.approx(3 / 40 * 60)
    assert saturated["inline_samples_per_interval"] == pytest.approx(22 / 40 * 60)
    # The correlation of the on phase whose server's calibration held the most pairs.
    assert (paced["inline_pairs"], paced["inline_f1_correlation"]) == (9, -0.5)
    assert (saturated["inline_pairs"], saturated["inline_f1_correlation"]) == (8, 0.4)


def test_the_verdicts_follow_the_goals():
    paced, saturated = shadow_load.summarize(fake_result())
    for row in (paced, saturated):
        answered = row["latency_unmet_because"] is None
        assert row["meets"]["ttft_p99_ratio"] == (row["ttft_p99_ratio"] <= 1.10 and answered)
        assert row["meets"]["itl_p99_ratio"] == (row["itl_p99_ratio"] <= 1.10 and answered)
        assert row["meets"]["samples_per_interval"] == (row["samples_per_interval"] >= 5)
    assert paced["meets"]["ttft_p99_ratio"] is False  # 2.485 / 1.97
    assert saturated["meets"]["samples_per_interval"] is True
    assert paced["latency_unmet_because"] is None
    assert "1 of 5 proxies-off requests failed" in saturated["latency_unmet_because"]
    result = fake_result()
    for p in result["phases"]:
        if p["arm"] == "on":
            p["after"] = p["before"]  # no sample at all
    assert [r["meets"]["samples_per_interval"] for r in shadow_load.summarize(result)] == [
        False
    ] * 2


def even_result(on_failed: int, off_failed: int) -> dict:
    """Both arms answer alike (ratios 1.0, 10 samples per interval on); each arm's first
    run also fails the given number of requests."""
    phases = []
    for run, (arm, loads) in enumerate(shadow_load.ORDER):
        failed = {"on": on_failed, "off": off_failed}[arm] if run < 2 else 0
        after = counts(5) if arm == "on" else counts()
        for load in loads:
            phases.append(phase(run, arm, load, [1.0, 2.0], 30.0, counts(), after, failed=failed))
    return {"engine": "serve", "phases": phases}


def test_a_latency_verdict_is_not_met_when_either_arm_lost_requests():
    """A p99 over the answered requests leaves the failed ones out: a proxies-on arm that
    lost requests would meet the latency goals with its cost hidden in the failures, and
    with failures in either arm the two p99s are over different requests."""
    for row in shadow_load.summarize(even_result(on_failed=0, off_failed=0)):
        assert row["ttft_p99_ratio"] == row["itl_p99_ratio"] == 1.0
        assert all(row["meets"].values()) and row["latency_unmet_because"] is None
    for on_failed, off_failed in ((1, 0), (1, 1), (0, 2)):
        for row in shadow_load.summarize(even_result(on_failed, off_failed)):
            assert row["ttft_p99_ratio"] == row["itl_p99_ratio"] == 1.0
            assert row["meets"] == {
                "ttft_p99_ratio": False, "itl_p99_ratio": False, "samples_per_interval": True,
            }  # fmt: skip
            assert (
                f"{on_failed} of {4 + on_failed} proxies-on and {off_failed} of "
                f"{4 + off_failed} proxies-off requests failed"
            ) in row["latency_unmet_because"]


def test_merging_keeps_every_engines_rows_and_runs():
    serve = shadow_load.report({"seed": 0}, [fake_result()])
    vllm = shadow_load.report({"seed": 0, "kv": 1}, [fake_result() | {"engine": "vllm"}])
    merged = shadow_load.merge([serve, vllm])
    assert [(r["engine"], r["load"]) for r in merged["rows"]] == [
        ("serve", "paced"), ("serve", "saturated"), ("vllm", "paced"), ("vllm", "saturated"),
    ]  # fmt: skip
    assert merged["config"] == {"serve": {"seed": 0}, "vllm": {"seed": 0, "kv": 1}}
    assert len(merged["runs"]) == 2 and merged["goals"] == shadow_load.GOALS
    json.dumps(merged)


# --- the whole flow against a fake server -------------------------------------------------------


class FakeEngine(BaseHTTPRequestHandler):
    """Streams three tokens per completion; each whole prompt ("hole") blends, and with the
    proxies on is scored and observed by a calibrated inline proxy."""

    state: dict = {}

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        state = self.server.state
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for index in range(body["max_tokens"]):
            time.sleep(0.002)
            self.wfile.write(f"data: {json.dumps(text(f't{index}'))}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")
        with state["lock"]:
            state["requests"].append(body)
            if body["hole"] and state["on"]:
                state["blended"] += 1
                state["scored"] += 1
                state["inline"] += 1

    def do_GET(self):
        state = self.server.state
        page = (
            f'holeblend_shadow_requests_total{{outcome="scored"}} {state["scored"]}\n'
            f'holeblend_f1_proxy_count{{ratio="0.15"}} {state["scored"]}\n'
            f'holeblend_inline_f1_proxy_count{{ratio="0.15"}} {state["inline"]}\n'
            f'holeblend_inline_residual_deviation_count{{ratio="0.15"}} {state["blended"]}\n'
            f'holeblend_inline_proxy_pairs{{ratio="0.15"}} {state["scored"]}\n'
        )
        self.send_response(200)
        self.end_headers()
        self.wfile.write(page.encode())

    def log_message(self, *_):
        pass


@contextlib.contextmanager
def fake_server(on: bool):
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeEngine)
    server.state = {
        "lock": threading.Lock(), "on": on, "requests": [], "blended": 0, "scored": 0, "inline": 0,
    }  # fmt: skip
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield server, shadow_load.Target(f"{url}/v1/completions", f"{url}/metrics")
    finally:
        server.shutdown()
        server.server_close()


def test_every_run_sends_the_same_requests_and_proxies_on_runs_calibrate(capsys):
    def make_body(system, documents, question, max_tokens):
        # The workload's questions have 4 documents; pass 1 leaves the middle one out.
        return {"q": question, "hole": len(documents) == 4, "max_tokens": max_tokens}

    plan = shadow_load.build_plan(
        make_body, warm_questions=2, paced_questions=2, saturated_questions=2, max_tokens=3,
        calibrate_questions=4,
    )  # fmt: skip
    servers = []

    @contextlib.contextmanager
    def start(arm, index):
        with fake_server(arm == "on") as (server, target):
            servers.append((arm, server))
            yield target

    result = shadow_load.run_engine("fake", start, plan, load=0.5, clients=2, seed=0, min_pairs=3)
    assert [arm for arm, _ in servers] == ["off", "on", "on", "off"]
    sent = [[(b["q"], b["hole"]) for b in s.state["requests"]] for _, s in servers]
    # Every run, proxies on or off, sends the same requests: the settling pairs in order
    # before the phases (pass 1 first), then the phases.
    assert all(sorted(run) == sorted(sent[0]) for run in sent)
    settling = [(b["q"], b["hole"]) for pair in plan.calibrate for b in pair]
    assert len(settling) == 8
    assert all(run[4 : 4 + len(settling)] == settling for run in sent)  # after the warm-up
    # Proxies on: calibrated (the warm-up's 2 pairs and the 4 settling ones) before the
    # phases began; off: the same requests, no calibration.
    calibrations = {p["arm"]: p["calibration"] for p in result["phases"]}
    assert calibrations["on"]["calibrated"] and calibrations["on"]["inline_pairs"] == 6
    assert calibrations["off"] == calibrations["off"] | {"requests": 8, "calibrated": False}
    assert calibrations["on"]["requests"] == 8
    assert [p["load"] for p in result["phases"]] == [
        "paced", "saturated", "saturated", "paced", "paced", "saturated", "saturated", "paced",
    ]  # fmt: skip
    rows = shadow_load.summarize(result)
    for row in rows:
        assert row["on"]["requests"] == row["off"]["requests"] == 2 * 4
        assert row["on"]["failed_requests"] == 0 and row["on"]["itl_count"] == 2 * 4 * 2
        assert row["shadow_scored"] == 2 * 2  # each run's two whole prompts of the phase
        assert row["samples_per_interval"] > 0
    assert result["service_s"] > 0
    assert "fake run 1 (on)" in capsys.readouterr().out


def test_a_paced_request_sent_after_its_time_counts_the_wait_in_its_latency():
    """Coordinated omission: a paced request whose send lags its schedule (the driver or
    the machine fell behind) is timed from when it was due, as its user waits from then;
    the lag is recorded. A closed-loop request has no schedule: timed from its send."""
    late_s = 0.3

    def late_send(url, body, scheduled):
        time.sleep(late_s)  # the sending thread gets its turn this late
        return shadow_load.stream(url, body, scheduled=scheduled)

    bodies = [{"hole": False, "max_tokens": 2}] * 3
    with fake_server(on=False) as (_, target):
        paced = shadow_load.drive_paced(
            target.completions_url, bodies, [0.0, 0.05, 0.05], late_send
        )
        saturated = shadow_load.drive_saturated(target.completions_url, bodies, clients=2)
    assert [t.ok for t in paced + saturated] == [True] * 6
    for timing in paced:
        assert timing.lag_s >= late_s
        assert timing.ttft_s >= timing.lag_s and timing.return_s >= timing.ttft_s
    assert all(t.lag_s is None for t in saturated)
    stats = shadow_load.arm_stats([dataclasses.asdict(t) for t in paced + saturated])
    assert stats["lag_max_s"] == max(t.lag_s for t in paced) >= late_s
    assert shadow_load.arm_stats([dataclasses.asdict(t) for t in saturated])["lag_max_s"] is None


class BrokenEngine(BaseHTTPRequestHandler):
    """Answers a request as its body's `reply` says: a status line that is not HTTP, a
    chunked stream that breaks off after one token in a chunk-size line longer than HTTP
    allows, or three streamed tokens."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body["reply"] == "not http":
            self.wfile.write(b"NOT HTTP AT ALL\r\n\r\n")
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        if body["reply"] == "long line":
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            event = f"data: {json.dumps(text('t0'))}\n\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
            self.wfile.write(b"1" * 70_000 + b"\r\n")
            return
        self.end_headers()
        for index in range(3):
            self.wfile.write(f"data: {json.dumps(text(f't{index}'))}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *_):
        pass


def test_a_reply_http_cannot_parse_fails_its_request_and_the_client_sends_on():
    """A status line that is not HTTP (BadStatusLine) or a line longer than HTTP allows
    (LineTooLong), like an IncompleteRead, is an `http.client.HTTPException`, not an
    OSError: a failed request, not a client thread that dies and leaves the phase one
    client short."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), BrokenEngine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/completions"
    try:
        bad = [shadow_load.stream(url, {"reply": r}) for r in ("not http", "long line")]
        bodies = [{"reply": r} for r in ("not http", "ok", "long line", "ok")]
        timings = shadow_load.drive_saturated(url, bodies, clients=1)
    finally:
        server.shutdown()
        server.server_close()
    assert [t.ok for t in bad] == [False, False]
    assert "BadStatusLine" in bad[0].error and "LineTooLong" in bad[1].error
    assert [t.ok for t in timings] == [False, True, False, True]
    assert "did not return" not in {t.error for t in timings}


# --- holeblend-serve for real, shrunk -------------------------------------------------------


@pytest.mark.slow
def test_holeblend_serve_is_driven_with_the_proxies_off_and_on(tmp_path):
    plan = shadow_load.build_plan(
        shadow_load.serve_body, warm_questions=1, paced_questions=1, saturated_questions=2,
        max_tokens=3, calibrate_questions=1,
    )  # fmt: skip
    settings = {}

    @contextlib.contextmanager
    def start(arm, index):
        settings[arm] = json.loads(shadow_load.serve_settings(0.15, arm == "on", 1.0))
        with shadow_load.serve_engine(
            tmp_path / f"run{index}", json.dumps(settings[arm]), 2
        ) as target:
            yield target

    order = (("off", ("paced", "saturated")), ("on", ("saturated", "paced")))
    result = shadow_load.run_engine("serve", start, plan, load=0.5, clients=2, seed=0, order=order)
    assert settings["on"]["qualityProxies"] is True and settings["off"]["qualityProxies"] is False
    assert settings["on"]["engineUrl"] is None  # holeblend-serve scores in-process
    # The idle floor as the operator renders it for a default BlendDeployment, on only.
    floor = (settings["on"]["shadowIdleSamples"], settings["on"]["shadowIdleSeconds"])
    assert floor == shadow_load.RENDERED_IDLE_FLOOR and settings["off"]["shadowIdleSamples"] == 0
    rows = shadow_load.summarize(result)
    assert [r["load"] for r in rows] == ["paced", "saturated"]
    for row in rows:
        assert row["off"]["failed_requests"] == row["on"]["failed_requests"] == 0
        assert row["off"]["itl_count"] > 0 and row["ttft_p99_ratio"] > 0
    on = [p for p in result["phases"] if p["arm"] == "on"]
    off = [p for p in result["phases"] if p["arm"] == "off"]
    # Only the proxies-on server blends with an inline statistic and offers shadows.
    assert on[-1]["after"]["blended"] >= 1 and on[-1]["after"]["offers"]
    assert all(p["after"]["blended"] == 0 and not p["after"]["offers"] for p in off)


def _counting_server(monkeypatch, *requests):
    """A server's proxy counters over time: 5 blended requests scored before, then one
    more per (counted at, outcome at) in `requests` (seconds from now): counted as
    blended at the first, its offer's outcome (dropped, or its shadow done) at the second."""
    started = time.monotonic()

    def counts(samples):
        elapsed = time.monotonic() - started
        blended = 5 + sum(elapsed >= counted for counted, _ in requests)
        done = 5 + sum(elapsed >= outcome for _, outcome in requests)
        return {"blended": blended, "offers": {"scored": done}}

    monkeypatch.setattr(shadow_load, "scrape", lambda url: None)
    monkeypatch.setattr(shadow_load, "proxy_counts", counts)
    return started


def test_the_wait_for_a_shadow_first_waits_for_the_server_to_count_the_request(monkeypatch):
    # An engine that counts a request (and offers it to the shadow) only after its
    # response: the count moves at 0.2 s, its shadow ends at 0.9 s.
    started = _counting_server(monkeypatch, (0.2, 0.9))
    assert shadow_load.wait_shadows_done("m", blended_over=5)
    assert 0.9 <= time.monotonic() - started < 2.5  # it read on until the shadow was done
    started = _counting_server(monkeypatch, (0.2, 0.9))
    assert shadow_load.wait_shadows_done("m")  # without: the race returns at once
    assert time.monotonic() - started < 0.2
    # A request that did not blend leaves the count: the wait gives up on it in time.
    started = _counting_server(monkeypatch)
    assert shadow_load.wait_shadows_done("m", blended_over=5, count_wait_s=0.3)
    assert 0.3 <= time.monotonic() - started < 2


def test_the_wait_reads_on_until_both_requests_of_a_pair_are_counted(monkeypatch):
    # Both requests of a pair blended: the first is counted at 0.1 s (its offer not
    # taken), the second at 0.4 s with its shadow in flight until 1.2 s. A wait that
    # stopped at the first count would let that shadow run into the next pair.
    started = _counting_server(monkeypatch, (0.1, 0.1), (0.4, 1.2))
    assert shadow_load.wait_shadows_done("m", blended_over=5)
    assert time.monotonic() - started >= 1.2
    started = _counting_server(monkeypatch, (0.1, 0.1), (0.4, 1.2))
    assert shadow_load.wait_shadows_done("m", blended_over=5, count_stable_s=0.0)
    assert time.monotonic() - started < 0.4  # the old wait: returned after the first count


class SlowMetrics(BaseHTTPRequestHandler):
    """Answers the metrics page, the first `stalls` times only after `stall_s`."""

    def do_GET(self):
        state = self.server.state
        with state["lock"]:
            state["calls"] += 1
            stall = state["calls"] <= state["stalls"]
        if stall:
            time.sleep(state["stall_s"])
        page = b"# TYPE holeblend_requests counter\nholeblend_requests_total 3.0\n"
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)
        except OSError:
            pass  # the client gave up on this one

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def slow_metrics(stalls: int):
    server = ThreadingHTTPServer(("127.0.0.1", 0), SlowMetrics)
    server.state = {"lock": threading.Lock(), "calls": 0, "stalls": stalls, "stall_s": 0.6}
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server, f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        server.server_close()


def test_a_late_metrics_page_is_asked_for_again_within_the_attempts():
    with slow_metrics(stalls=2) as (server, url):
        page = shadow_load.scrape(url, timeout_s=0.2, attempts=3)
    assert page[("holeblend_requests_total", ())] == 3.0
    assert server.state["calls"] == 3
    with slow_metrics(stalls=3) as (server, url), pytest.raises((TimeoutError, OSError)):
        shadow_load.scrape(url, timeout_s=0.2, attempts=3)
    assert server.state["calls"] == 3
