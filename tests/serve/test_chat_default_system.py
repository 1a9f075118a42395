"""A chat without a system message gets the system prompt the model's chat template writes
then, so holeblend-serve feeds the model the prompt vLLM renders for the same request, and
the vLLM connector's split of that prompt finds holeblend-serve's segment keys."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from holeblend_devtools.hf_export import CHATML_TEMPLATE
from holeblend_runtime.engine import BlendEngine
from holeblend_runtime.model.gguf import find_smollm2_gguf
from holeblend_runtime.model.tokenizer import default_system_prompt
from holeblend_runtime.serve import requests as parsing
from holeblend_runtime.serve.app import Server
from holeblend_runtime.serve.settings import ServeSettings
from holeblend_runtime.vllm_connector.planning import ReusePlanner
from tests.serve.conftest import example_settings_json

SEP = " # #"
DOCUMENTS = (
    "The Varn river bridge was built in 1871 and has seven stone arches.",
    "Oskeby museum opened in 1923 in a former grain store by the harbour.",
)
DOCUMENTS_AND_QUESTION = "".join(f"{SEP} {d}" for d in DOCUMENTS) + f"{SEP} How many arches?"


def never_control(_: str) -> bool:
    return False


@pytest.fixture(scope="module")
def gguf_template() -> str:
    """The GGUF's chat template, read here with the gguf package alone."""
    field = gguf.GGUFReader(str(find_smollm2_gguf())).fields["tokenizer.chat_template"]
    return field.contents()


@pytest.fixture(scope="module")
def engine() -> BlendEngine:
    return BlendEngine.load(num_threads=1)


@pytest.fixture
def server(tmp_path: Path, engine: BlendEngine):
    config = tmp_path / "blend.json"
    config.write_text(example_settings_json())
    server = Server(ServeSettings(config=config, torch_threads=1))
    server.engine = engine
    yield server
    server.close()


def rendered(template: str, messages: list[dict]) -> str:
    """The prompt as transformers and vLLM render a chat: a sandboxed, trimmed Jinja."""
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return environment.from_string(template).render(messages=messages, add_generation_prompt=True)


def served_prompt(server: Server, messages: list[dict]):
    body = json.dumps({"model": server.model_name, "messages": messages}).encode()
    _, prompt, _ = server._parse(body, parsing.parse_chat)
    return prompt


def test_a_chat_without_a_system_message_has_no_system_prompt_an_empty_one_has_one():
    def system_of(*messages: dict) -> str | None:
        body = {"model": "m", "messages": list(messages)}
        return parsing.parse_chat(body, SEP, never_control).system

    user = {"role": "user", "content": DOCUMENTS_AND_QUESTION}
    assert system_of(user) is None
    assert system_of({"role": "user", "content": "What is a bridge?"}) is None
    assert system_of({"role": "system", "content": ""}, user) == ""
    assert system_of({"role": "user", "content": f"Be brief.{DOCUMENTS_AND_QUESTION}"}) == (
        "Be brief."
    )


def test_a_chat_without_a_system_message_is_the_prompt_the_models_template_renders(
    server, engine, gguf_template
):
    messages = [{"role": "user", "content": DOCUMENTS_AND_QUESTION}]
    prompt = served_prompt(server, messages)
    expected = engine.tokenizer.encode_prompt(rendered(gguf_template, messages))
    assert list(prompt.token_ids) == expected


def test_the_connector_splits_vllms_prompt_into_holeblend_serves_segment_keys(
    server, engine, gguf_template
):
    """vLLM renders the chat with the template; the connector splits its token ids on the
    separator's and keys the segments: the same keys as holeblend-serve's, the system
    segment's (and documents', cached after it) included."""
    messages = [{"role": "user", "content": DOCUMENTS_AND_QUESTION}]
    prompt = served_prompt(server, messages)
    vllm_ids = engine.tokenizer.encode_prompt(rendered(gguf_template, messages))
    planner = ReusePlanner(engine.prompt_builder.separator_ids, engine.keyer, index=None)
    plan = planner.plan_late(vllm_ids)
    keys = engine.keyer.keys(prompt)
    assert None not in keys[:-1]  # the system prompt and documents are cached
    assert plan.keys == tuple(keys)
    assert plan.prompt.segments == prompt.segments


def test_an_empty_system_message_stays_an_empty_system_turn_as_the_template_writes_it(
    server, engine, gguf_template
):
    messages = [
        {"role": "system", "content": ""},
        {"role": "user", "content": DOCUMENTS_AND_QUESTION},
    ]
    prompt = served_prompt(server, messages)
    expected = engine.tokenizer.encode_prompt(rendered(gguf_template, messages))
    assert list(prompt.token_ids) == expected


def test_a_user_message_may_open_with_the_separator_after_a_system_message():
    """The form vLLM's split needs (the first separator right after the system turn) was a
    400, "document 0 ... is empty"; it is the same request as without the separator."""
    system = {"role": "system", "content": "Answer from the documents."}
    opened = [system, {"role": "user", "content": DOCUMENTS_AND_QUESTION}]
    plain = [system, {"role": "user", "content": DOCUMENTS_AND_QUESTION.removeprefix(SEP)}]
    requests = [
        parsing.parse_chat({"model": "m", "messages": m}, SEP, never_control)
        for m in (opened, plain)
    ]
    assert requests[0] == requests[1]
    assert requests[0].documents == DOCUMENTS


def test_a_chat_with_a_system_message_and_the_separator_first_is_the_templates_prompt(
    server, engine, gguf_template
):
    messages = [
        {"role": "system", "content": "Answer from the documents."},
        {"role": "user", "content": DOCUMENTS_AND_QUESTION},
    ]
    prompt = served_prompt(server, messages)
    expected = engine.tokenizer.encode_prompt(rendered(gguf_template, messages))
    assert list(prompt.token_ids) == expected


@pytest.mark.parametrize(
    "template",
    [
        None,
        CHATML_TEMPLATE,  # ChatML without a default system prompt
        "{% for message in messages %}",  # does not compile
        "{{ raise_exception('no') }}",  # fails as it renders
        "[INST] {{ messages[0]['content'] }} [/INST]",  # not ChatML
    ],
)
def test_a_template_without_a_default_chatml_system_prompt_gives_none(template):
    """The builder then writes an empty system turn, as before templates were read."""
    assert default_system_prompt(template) is None


def test_the_default_system_prompt_is_the_text_of_the_templates_system_turn(gguf_template):
    default = default_system_prompt(gguf_template)
    messages = [{"role": "user", "content": "Hi"}]
    assert default
    assert rendered(gguf_template, messages).startswith(f"<|im_start|>system\n{default}<|im_end|>")
