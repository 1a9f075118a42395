"""How an answer ends, on a server in this process with the real model: the tokens its usage
counts (as vLLM counts them), a stop sequence's answer standing whatever the compute thread
reports after it; and before it starts, both prompt shapes building the same prompt and a
refused control token naming the field it came from."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from aiohttp.test_utils import TestClient, TestServer

from holeblend_runtime.engine import Mode
from holeblend_runtime.serve import requests as parsing
from holeblend_runtime.serve.app import Server
from tests.serve.conftest import in_process_server
from tests.serve.test_batching import settles_to_zero

# A question SmolLM2 answers in a few tokens, then its end-of-sequence token.
ENDS_AT_EOS = {
    "model": "smollm2", "messages": [{"role": "user", "content": "What is 2+2?"}],
    "max_tokens": 40,
}  # fmt: skip
SYSTEM = "Answer from the documents."
DOCUMENTS = [
    "The Aral Sea was once the fourth largest lake in the world, fed by two great rivers.",
    "Lichens are partnerships of a fungus with algae, and they grow on bare rock slowly.",
]


@pytest.fixture(scope="module")
def in_process(tmp_path_factory) -> Iterator[Server]:
    with in_process_server(tmp_path_factory.mktemp("answer-ends")) as server:
        yield server


def completion_tokens_counted(server: Server) -> float:
    sample = "holeblend_completion_tokens_total"
    return server.metrics.registry.get_sample_value(sample, {"mode": "full"}) or 0.0


async def answer(client: TestClient, body: dict, stream: bool) -> tuple[str, str, int]:
    """Text, finish_reason and usage.completion_tokens of a chat answer."""
    if not stream:
        response = await client.post("/v1/chat/completions", json=body)
        reply = await response.json()
        assert response.status == 200, reply
        choice = reply["choices"][0]
        return (
            choice["message"]["content"],
            choice["finish_reason"],
            reply["usage"]["completion_tokens"],
        )
    streamed = body | {"stream": True, "stream_options": {"include_usage": True}}
    response = await client.post("/v1/chat/completions", json=streamed)
    events = sse_events(await response.text())
    assert not [event for event in events if "error" in event], events
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    return text, events[-2]["choices"][0]["finish_reason"], events[-1]["usage"]["completion_tokens"]


def sse_events(body: str) -> list[dict]:
    """The JSON events of an SSE body, which must end with `[DONE]`."""
    lines = body.split("\n\n")
    assert lines[-2:] == ["data: [DONE]", ""], body
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-2]]


@pytest.mark.parametrize("stream", [False, True])
async def test_an_answer_that_ends_at_eos_counts_that_token_as_vllm_does(in_process, stream):
    """vLLM's output token ids hold the end-of-sequence token the answer stopped at, and
    its `max_tokens` counts it: an answer of n tokens and EOS reports n + 1, and finishes
    with "stop" when `max_tokens` is n + 1. holeblend-serve reported n (bills and
    dashboards differed between pod kinds), and a client that asked for that many got
    "length"; the counter of completion tokens follows the usage."""
    server = in_process
    async with TestClient(TestServer(server.app())) as client:
        before = completion_tokens_counted(server)
        text, finish, num_tokens = await answer(client, ENDS_AT_EOS, stream)
        assert finish == "stop" and num_tokens < ENDS_AT_EOS["max_tokens"]
        assert completion_tokens_counted(server) - before == num_tokens
        exact = await answer(client, ENDS_AT_EOS | {"max_tokens": num_tokens}, stream)
        assert exact == (text, "stop", num_tokens)
        cut = await answer(client, ENDS_AT_EOS | {"max_tokens": num_tokens - 1}, stream)
    assert cut == (text, "length", num_tokens - 1)


def tokens_completing(server: Server, body: dict, stop: str) -> int:
    """How many tokens of the greedy answer to `body` it takes for its text to hold `stop`."""
    _, prompt, _ = server._parse(json.dumps(body).encode(), parsing.parse_chat)
    engine = server.engine
    token_ids = list(engine.generate_stream(engine.prefill(prompt, Mode.FULL), 16, True))
    decode = engine.tokenizer.decode
    return next(k for k in range(1, 17) if stop in decode(token_ids[:k]))


@pytest.mark.parametrize("stream", [False, True])
async def test_an_answer_that_reached_its_stop_sequence_stands_when_a_later_step_fails(
    in_process, monkeypatch, stream
):
    """The compute thread decodes on until the answer's `stopped` reaches it; the route
    waited for its end, so a decode step that failed (or a deadline that passed) after the
    stop sequence turned a finished answer into an error: a 500, or an error event in
    place of the stream's last chunk. The answer ends at its stop sequence; nothing the
    thread reports later reaches the client."""
    server = in_process
    body = {
        "model": "smollm2", "messages": [{"role": "system", "content": SYSTEM}, {
            "role": "user", "content": "Which lake shrank?"}],
        "documents": DOCUMENTS[:1], "max_tokens": 12, "ignore_eos": True,
    }  # fmt: skip
    async with TestClient(TestServer(server.app())) as client:
        whole, finish, _ = await answer(client, body, stream=False)
        assert finish == "length"
        stop = whole.split()[1]
        num_tokens = tokens_completing(server, body, stop)
        jobs, steps = [], []
        submit, step = server.worker.submit, server.engine.decode_step

        def failing_after_the_stop(sequences, tokens):
            steps.append(len(sequences))
            # The step after the answer's `num_tokens`-th token, which completed the stop
            # sequence: once the route has seen it, the step fails.
            if len(steps) == num_tokens and jobs[0].stopped.wait(10):
                raise RuntimeError("step broke")
            step(sequences, tokens)

        monkeypatch.setattr(server.worker, "submit", lambda job: (jobs.append(job), submit(job)))
        monkeypatch.setattr(server.engine, "decode_step", failing_after_the_stop)
        text, finish, _ = await answer(client, body | {"stop": stop}, stream)
        assert settles_to_zero(server.worker)  # the route no longer waits for the thread
    assert len(steps) == num_tokens  # the step after the stop sequence failed
    assert (text, finish) == (whole[: whole.index(stop)], "stop")


def chat_body(system: str, user: str, **fields) -> dict:
    messages = [{"role": "user", "content": user}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    return {"model": "smollm2", "messages": messages, **fields}


@pytest.mark.parametrize("system", ["Answer from the documents.\n", "  Be brief. ", "Be brief."])
def test_both_prompt_shapes_build_the_same_prompt_for_the_same_content(in_process, system):
    """The docs promise that both shapes give the same segments, so they share cached
    documents. LMCache's shape stripped the system prompt written before the first
    separator; the structured shape's `system` (and a system message) is the system prompt
    as written, as the chat template writes it: a system prompt ending with a newline gave
    two prompts, whose documents, cached after different system prompts, were not shared."""
    server = in_process
    separator = server.engine.blend_config.separator
    question = "Which lake shrank?"
    lmcache = separator.join([system, *DOCUMENTS, question])

    def prompt(body: dict, parse):
        return server._parse(json.dumps(body).encode(), parse)[1]

    shapes = [
        (
            {"model": "smollm2", "system": system, "documents": DOCUMENTS, "prompt": question},
            {"model": "smollm2", "prompt": lmcache},
            parsing.parse_completion,
        ),
        (
            chat_body(system, question, documents=DOCUMENTS),
            chat_body(None, lmcache),
            parsing.parse_chat,
        ),
    ]
    for structured, lmcache_shape, parse in shapes:
        expected, got = prompt(structured, parse), prompt(lmcache_shape, parse)
        assert got.token_ids == expected.token_ids
        assert got.segments == expected.segments
        assert server.engine.segment_keys(got) == server.engine.segment_keys(expected)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", chat_body(SYSTEM, "What is <file_sep>?"), "messages[1].content"),
        ("/v1/chat/completions", chat_body("Be <file_sep> brief.", "Q?"), "messages[0].content"),
        (
            "/v1/chat/completions",
            chat_body(None, "Be <file_sep>. # # D # # Q?"),
            "messages[0].content",
        ),
        (
            "/v1/completions",
            {"model": "smollm2", "system": "Be <file_sep>.", "documents": ["D"], "prompt": "Q?"},
            "system",
        ),
        ("/v1/completions", {"model": "smollm2", "prompt": "What is <file_sep>?"}, "prompt"),
    ],
)
async def test_a_control_token_not_shaped_like_chatmls_is_refused_naming_its_field(
    in_process, path, body, param
):
    """SmolLM2's `<file_sep>` is found by the prompt's build, not by the request's parse
    (which finds `<|...|>`); its refusal named the piece ("question", "system") in the
    message and put the endpoint's `prompt` or `messages` in `param`, not the field."""
    async with TestClient(TestServer(in_process.app())) as client:
        response = await client.post(path, json=body)
        error = (await response.json())["error"]
    assert response.status == 400 and error["param"] == param, error
    assert (
        error["message"] == f"{param}: contains the model's control token '<file_sep>'; remove it"
    )
