"""The closed loop's request stream (`holeblend_devtools.closed_loop.RagStream`) against a
recording HTTP server: what a paired stream sends, in which order, with which think times."""

import http.server
import json
import threading
import time

import pytest

from holeblend_devtools import closed_loop
from holeblend_devtools.closed_loop_runs import WORKLOAD
from holeblend_runtime.bench.workload import generate_workload
from tests.serve.conftest import StandInHandler

THINK_S = 0.8


class Recorder(http.server.ThreadingHTTPServer):
    def __init__(self):
        super().__init__(("127.0.0.1", 0), Handler)
        self.bodies: list[tuple[float, dict]] = []  # (monotonic arrival, request body)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(StandInHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append((time.monotonic(), body))
        self.reply(200, json.dumps({"usage": {"prompt_tokens": 10}}).encode())


@pytest.fixture
def recorder():
    server = Recorder()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def run_stream(url: str, requests: int, **options) -> closed_loop.RagStream:
    stream = closed_loop.RagStream(url, WORKLOAD, think_s=THINK_S, is_paired=True, **options)
    stream.start()
    deadline = time.monotonic() + 30
    while len(stream.sent) < requests and time.monotonic() < deadline:
        time.sleep(0.02)
    stream.stop()
    return stream


def test_a_warm_up_pair_caches_the_documents_then_asks_the_hole_request_at_once(recorder):
    stream = run_stream(recorder.url, 6, warm_max_tokens=1)
    bodies = recorder.bodies[:6]
    assert len(bodies) == 6 and all(s.status == 200 for s in stream.sent[:6])
    prompts = generate_workload(WORKLOAD)
    for pair in range(3):
        (warm_at, warm), (hole_at, hole) = bodies[2 * pair], bodies[2 * pair + 1]
        qa = prompts[pair]
        assert warm["max_tokens"] == 1 and hole["max_tokens"] == 8
        assert hole["documents"] == [d.text for d in qa.documents]  # the whole prompt
        missing = {qa.documents[i].text for i in qa.hole_documents}
        assert missing and not missing & set(warm["documents"])  # pass 1 lacks the holes
        # No think time after the warm-up (a think time would be >= THINK_S * 0.9 below).
        assert hole_at - warm_at < THINK_S * 0.9
        if pair:
            assert warm_at - bodies[2 * pair - 1][0] >= THINK_S * 0.9  # after the hole request


def test_without_warm_up_both_requests_of_a_pair_ask_a_full_answer_and_think(recorder):
    run_stream(recorder.url, 4)
    bodies = recorder.bodies[:4]
    assert [b["max_tokens"] for _, b in bodies] == [8, 8, 8, 8]
    gaps = [later - earlier for (earlier, _), (later, _) in zip(bodies, bodies[1:], strict=False)]
    assert min(gaps) >= THINK_S * 0.9
