"""The question's words the vLLM pods' shadow skips in the F1, with the tokenizer and chat
template vLLM serves SmolLM2 with: the question as written, as holeblend-serve and
holeblend-bench skip it (no engine, no server)."""

from transformers import AutoTokenizer

from holeblend_devtools.hf_export import export_smollm2
from holeblend_runtime.blend.config import BlendConfig
from holeblend_runtime.blend.segments import SegmentSplitter
from holeblend_runtime.quality.scores import answer_words
from holeblend_runtime.quality.shadow import question_words
from holeblend_runtime.vllm_connector.shadow import template_closing

QUESTION = "Who founded the lab?"


def test_a_chat_requests_question_words_are_the_questions_own():
    """vLLM renders a chat request with the model's template: the question segment ends
    with ChatML's closing, which the shadow decodes to "\\nassistant\\n". Its words are the
    template's; taken for the question's, "assistant" was dropped from both answers."""
    tokenizer = AutoTokenizer.from_pretrained(export_smollm2())

    def decode(ids):
        return tokenizer.decode(list(ids), skip_special_tokens=True)

    separator = BlendConfig().separator
    user = f"The lab opened in 1874.{separator} Talia Mirvok founded it.{separator} {QUESTION}"
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": user}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    splitter = SegmentSplitter(tokenizer.encode(separator, add_special_tokens=False), 1)
    prompt = splitter.split(tokenizer.encode(text, add_special_tokens=False))
    segment = decode(prompt.question.token_ids)
    assert "assistant" in answer_words(segment)
    closing = template_closing(tokenizer, decode)
    assert question_words(segment, closing) == answer_words(QUESTION)
