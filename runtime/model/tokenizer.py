"""Text <-> token ids with the model's own byte-level BPE vocabulary, and what the model's
chat template writes for a conversation without a system message."""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from holeblend_runtime.model.config import ModelConfig

log = logging.getLogger(__name__)


def build_bpe_tokenizer(
    *,
    tokens: Sequence[str],
    merges: Sequence[str],
    special_tokens: Sequence[str],
    pre_tokenizer: str,
) -> Tokenizer:
    """A GPT-2 style tokenizer; `pre_tokenizer` is llama.cpp's name for the split regex."""
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(pre_tokenizer)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in special_tokens]
    )
    return tokenizer


def _pre_tokenizer(name: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name == "gpt2":
        return byte_level
    if name == "smollm":
        # llama.cpp's "smollm": every digit alone, then GPT-2's regex over bytes.
        digits = pre_tokenizers.Digits(individual_digits=True)
        return pre_tokenizers.Sequence([digits, byte_level])
    raise ValueError(f"tokenizer.ggml.pre: unsupported pre-tokenizer {name!r}")


class TextTokenizer:
    """Encodes the way the model's tokenizer does, BOS included only if it adds one."""

    def __init__(
        self, tokenizer: Tokenizer, config: ModelConfig, chat_template: str | None = None
    ) -> None:
        self._tokenizer = tokenizer
        self.bos_token_id = config.bos_token_id
        self.eos_token_id = config.eos_token_id
        self.add_bos_token = config.add_bos_token and config.bos_token_id is not None
        # The model's Jinja chat template (GGUF `tokenizer.chat_template`); None: unknown.
        self.chat_template = chat_template

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` alone (no BOS): pieces concatenate into prompts. ValueError
        for a lone surrogate (text that is not Unicode)."""
        try:
            return self._tokenizer.encode(text, add_special_tokens=False).ids
        except TypeError:
            _refuse_lone_surrogates([text])
            raise

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` of each text, in one call that releases the GIL while it tokenizes
        (`encode` holds it: 0.3 s for 600 KB of text, during which no other thread of the
        process runs, such as a server's event loop)."""
        try:
            encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        except TypeError:
            _refuse_lone_surrogates(texts)
            raise
        return [encoding.ids for encoding in encodings]

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a whole prompt: BOS first when the model's tokenizer adds it."""
        prefix = [self.bos_token_id] if self.add_bos_token else []
        return prefix + self.encode(text)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    @functools.cached_property
    def control_tokens(self) -> tuple[str, ...]:
        """The texts `encode` turns into control tokens (ChatML's `<|im_end|>`, SmolLM2's
        `<file_sep>` ...), longest first."""
        added = self._tokenizer.get_added_tokens_decoder().values()
        return tuple(sorted({t.content for t in added if t.special}, key=len, reverse=True))

    @functools.cached_property
    def default_system_prompt(self) -> str | None:
        """The system prompt the chat template writes when a conversation has none
        (`default_system_prompt`), without the model's control tokens; None otherwise."""
        default = default_system_prompt(self.chat_template)
        if default is not None and any(token in default for token in self.control_tokens):
            log.warning("the chat template's default system prompt holds a control token")
            return None
        return default

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes any one token decodes to (at least 1): a text of n bytes
        is at least n / max_token_bytes tokens, a bound that needs no tokenizing. Tokens
        that decode to part of a character count the replacement character's 3 bytes,
        which only loosens the bound."""
        decode = self._tokenizer.decode
        size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        return (
            max(
                (len(decode([i], skip_special_tokens=False).encode()) for i in range(size)),
                default=1,
            )
            or 1
        )


# A user message no template writes by itself: where it lies in the rendered probe
# conversation tells the template's system turn from the user's.
_PROBE_MESSAGE = "holeblend-probe-message"
_CHATML_SYSTEM = "<|im_start|>system\n"
_CHATML_USER = "<|im_end|>\n<|im_start|>user\n"
_CHATML_CLOSING = "<|im_end|>\n<|im_start|>assistant\n"


def default_system_prompt(chat_template: str | None) -> str | None:
    """The system prompt `chat_template` writes for a conversation of one user message
    (SmolLM2's: "You are a helpful AI assistant named SmolLM, trained by Hugging Face"),
    rendered as transformers and vLLM render it (a sandboxed Jinja environment, trimmed
    blocks). None when there is no template, it renders no system turn for that
    conversation, it cannot be rendered, or it is not ChatML (the prompt builder writes
    ChatML, so another template's text would not be what the model sees)."""
    if not chat_template:
        return None
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # a dependency of torch

    try:
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        rendered = environment.from_string(chat_template).render(
            messages=[{"role": "user", "content": _PROBE_MESSAGE}], add_generation_prompt=True
        )
    except Exception as error:  # any template error: the builder's own rendering stands
        log.warning("the chat template cannot be rendered (%s); no default system prompt", error)
        return None
    head, probe, tail = rendered.partition(_PROBE_MESSAGE)
    is_chatml = probe and tail == _CHATML_CLOSING and head.endswith(_CHATML_USER)
    if not is_chatml or not head.startswith(_CHATML_SYSTEM):
        return None
    return head[len(_CHATML_SYSTEM) : -len(_CHATML_USER)]


def _refuse_lone_surrogates(texts: Sequence[object]) -> None:
    """ValueError for the first text holding a lone surrogate: JSON carries one
    (`"\\ud800"`) into a Python string, but UTF-8 cannot, and the tokenizer then says
    only that the text "must be str"."""
    for text in texts:
        if not isinstance(text, str):
            continue
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ValueError(
                f"text: contains a lone surrogate at character {error.start} (after "
                f"{text[max(error.start - 20, 0) : error.start]!r}); pass valid Unicode"
            ) from None
