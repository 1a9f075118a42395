"""Build RAG prompts in the model's chat template, split into segments.

Layout: ``system SEP doc_0 SEP ... SEP doc_{n-1} SEP question`` inside ChatML. The system
segment carries the template's opening (system turn, then the user turn's header); the
question segment carries the closing (end of the user turn, assistant header). Every
document and the question start with one space, so a separator such as " # #" never
merges with its neighbours and the pieces tokenize exactly as the whole prompt does;
the builder checks that and refuses a separator for which it does not hold. Segment
boundaries come from the pieces (where each separator piece's tokens lie), never from
searching the joined tokens: a document ending in the separator's first tokens (" ... #"
before " # #") would otherwise be cut in the wrong place. A system prompt or question
holding the separator is refused, as a document is: split on the separator's tokens (the
vLLM connector, holeblend-serve's requests), it would make a document of its own.

A conversation without a system prompt (None) gets the one the model's chat template writes
then (SmolLM2's "You are a helpful AI assistant named SmolLM, ..."), as transformers and
vLLM render it; an empty system prompt ("") is an empty system turn, as the template writes
an empty system message.

The system prompt, documents and question are text, never template: one holding a control
token's text (`<|im_end|>`, SmolLM2's `<file_sep>` ...) is refused naming it, since the
tokenizer would encode it as that control token (a document could end the user's turn and
write the assistant's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from holeblend_runtime.blend.segments import SegmentedPrompt, SegmentSplitter
from holeblend_runtime.model.tokenizer import TextTokenizer


@dataclass(frozen=True)
class ChatMLTemplate:
    """ChatML as SmolLM2's chat template writes it."""

    # The system prompt of a conversation without one ("": an empty system turn, for a
    # model whose template writes none or is unknown).
    default_system: str = ""

    def opening(self, system: str | None) -> str:
        system = self.default_system if system is None else system
        return f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n"

    def closing(self) -> str:
        return "<|im_end|>\n<|im_start|>assistant\n"


class PromptBuilder:
    """Text pieces -> a `SegmentedPrompt` whose segments are exactly the pieces."""

    def __init__(
        self,
        tokenizer: TextTokenizer,
        separator: str,
        min_segment_tokens: int,
        template: ChatMLTemplate | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.separator = separator
        self.separator_ids = tokenizer.encode(separator)
        if not self.separator_ids:
            raise ValueError(f"separator: {separator!r} tokenizes to nothing")
        self.splitter = SegmentSplitter(self.separator_ids, min_segment_tokens)
        self.template = template or ChatMLTemplate(_default_system(tokenizer, separator))

    def pieces(self, system: str | None, documents: Sequence[str], question: str) -> list[str]:
        """The prompt's text pieces in order, separators included."""
        pieces = [self.template.opening(system)]
        for document in documents:
            pieces += [self.separator, _with_leading_space(document)]
        closing = _with_leading_space(question) + self.template.closing()
        return pieces + [self.separator, closing]

    def build(self, system: str | None, documents: Sequence[str], question: str) -> SegmentedPrompt:
        """Tokenize piece by piece; ValueError when that differs from the whole string.
        `system` None: the conversation has none (the template's default)."""
        system = self.template.default_system if system is None else system
        texts = [("system", system), *((f"documents[{i}]", d) for i, d in enumerate(documents))]
        for field, text in [*texts, ("question", question)]:
            if token := next((t for t in self.tokenizer.control_tokens if t in text), None):
                raise ValueError(
                    f"{field}: contains the model's control token {token!r}; remove it"
                )
        for i, document in enumerate(documents):
            if not document.strip():
                raise ValueError(f"documents[{i}]: empty document")
            if self.separator in _with_leading_space(document):
                raise ValueError(f"documents[{i}]: contains the separator {self.separator!r}")
        for field, text in (("system", system), ("question", _with_leading_space(question))):
            if self.separator in text:
                raise ValueError(
                    f"{field}: contains the separator {self.separator!r} outside the "
                    "documents; remove it"
                )
        pieces = self.pieces(system, documents, question)
        token_ids, separator_ranges = self._encode_pieces(pieces)
        return SegmentedPrompt.from_separators(token_ids, separator_ranges)

    def _encode_pieces(self, pieces: list[str]) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of the pieces and the token range of every separator piece."""
        *encoded, whole = self.tokenizer.encode_batch([*pieces, "".join(pieces)])
        joined = [token for piece_ids in encoded for token in piece_ids]
        if joined != whole:
            raise ValueError(
                f"separator: {self.separator!r} tokenizes differently inside the prompt than "
                f"alone ({_first_difference(joined, whole, self.tokenizer)}); "
                "choose a separator that does not merge with its neighbours"
            )
        prefix = [self.tokenizer.bos_token_id] if self.tokenizer.add_bos_token else []
        separator_ranges, position = [], len(prefix)
        for i, piece_ids in enumerate(encoded):
            # pieces() alternates: opening, SEP, doc, SEP, doc, ..., SEP, closing.
            if i % 2 == 1:
                separator_ranges.append((position, position + len(piece_ids)))
            position += len(piece_ids)
        return prefix + joined, separator_ranges


def _default_system(tokenizer: TextTokenizer, separator: str) -> str:
    """The template's default system prompt; "" when it has none, or when it holds the
    separator (every chat without a system prompt would be refused for it)."""
    default = tokenizer.default_system_prompt or ""
    return "" if separator in default else default


def _with_leading_space(text: str) -> str:
    return " " + text.strip()


def _first_difference(a: list[int], b: list[int], tokenizer: TextTokenizer) -> str:
    i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return (
        f"at token {i}: pieces give {tokenizer.decode(a[i : i + 3])!r}, "
        f"whole prompt gives {tokenizer.decode(b[i : i + 3])!r}"
    )
