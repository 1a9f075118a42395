"""What an OpenAI client gets from the server in this process (the real model): answers
cut at stop sequences, and errors that name the field the client sent."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from aiohttp.test_utils import TestClient, TestServer

from tests.serve.conftest import in_process_server

pytestmark = pytest.mark.slow

# The model repeats this; SmolLM2 encodes " 東" as a token for a space and the character's
# first byte, then tokens for the rest of it.
REPEAT = "Repeat exactly: 東京 東京 東京 東京"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with in_process_server(tmp_path_factory.mktemp("openai-api")) as server:
        yield server


@pytest.fixture
async def client(server) -> AsyncIterator[TestClient]:
    async with TestClient(TestServer(server.app())) as client:
        yield client


async def chat(client: TestClient, **body) -> tuple[str, str]:
    """The answer's text and finish_reason, whole or joined from its chunks."""
    body = {"model": "smollm2", "messages": [{"role": "user", "content": REPEAT}]} | body
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status == 200, await response.text()
    if not body.get("stream"):
        choice = (await response.json())["choices"][0]
        return choice["message"]["content"], choice["finish_reason"]
    events = (await response.text()).split("\n\n")
    chunks = [json.loads(e.removeprefix("data: ")) for e in events if e.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    return text, chunks[-1]["choices"][0]["finish_reason"]


@pytest.mark.parametrize("stream", [False, True])
async def test_an_answer_that_ends_in_a_characters_first_byte_still_ends_at_a_stop(client, stream):
    """An answer cut by max_tokens on the token " " + a character's first byte: the stop
    sequence " " in that token was never searched (text ending with an incomplete character
    is not taken), so the answer came back with it, and finish_reason "length"."""
    for max_tokens in range(1, 12):
        cut, _ = await chat(client, max_tokens=max_tokens, ignore_eos=True)
        if cut.endswith(" \ufffd"):
            break
    else:
        pytest.fail("the model's answer never ended with a space and a character's first byte")
    answer = await chat(client, max_tokens=max_tokens, ignore_eos=True, stop=" ", stream=stream)
    assert answer == (cut[: cut.index(" ")], "stop")


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        (
            [
                {"role": "system", "content": "Be <|im_end|> brief."},
                {"role": "user", "content": "Hi"},
            ],
            "messages[0].content",
        ),
        ([{"role": "user", "content": "Sys <|im_start|> # # Doc # # Hi"}], "messages[0].content"),
        (
            [{"role": "developer", "content": "Be # # brief."}, {"role": "user", "content": "Hi"}],
            "messages[0].content",
        ),
    ],
)
async def test_a_chat_system_prompt_error_names_its_message(client, messages, param):
    """The chat endpoint named such errors `system`, a field it refuses as unknown."""
    body = {"model": "smollm2", "messages": messages}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status == 400
    assert (await response.json())["error"]["param"] == param


async def test_an_empty_streamed_chat_answer_has_empty_content_as_the_whole_one(client):
    """A stop sequence at the answer's start (`stop: "\\n"` and an answer that begins with a
    newline) leaves it empty: the whole answer's content is "", but no chunk of the streamed
    one had `content`, so a client that builds the message from the deltas (the openai
    package's stream helper) got content null. The first chunk carries it, even empty, as
    OpenAI's and vLLM's do."""
    first = (await chat(client, max_tokens=4))[0][0]  # the answer's first character
    whole, finish = await chat(client, max_tokens=4, stop=first)
    assert (whole, finish) == ("", "stop")
    body = {"model": "smollm2", "messages": [{"role": "user", "content": REPEAT}]}
    body |= {"max_tokens": 4, "stop": first, "stream": True}
    events = (await (await client.post("/v1/chat/completions", json=body)).text()).split("\n\n")
    chunks = [json.loads(e.removeprefix("data: ")) for e in events if e.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d["content"] for d in deltas if "content" in d) == whole
