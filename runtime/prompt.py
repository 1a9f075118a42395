"""Build RAG prompts in the model's chat template, split into segments.

Layout: ``system SEP doc_0 SEP ... SEP doc_{n-1} SEP question`` inside ChatML. The system
segment carries the template's opening (system turn, then the user turn's header); the
question segment carries the closing (end of the user turn, assistant header). Every
document and the question start with one space, so a separator such as " # #" never
merges with its neighbours and the pieces tokenize exactly as the whole prompt does;
the builder checks that and refuses a separator for which it does not hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from holeblend_runtime.segments import SegmentedPrompt, SegmentSplitter
from holeblend_runtime.tokenizer import TextTokenizer


@dataclass(frozen=True)
class ChatMLTemplate:
    """ChatML as SmolLM2's chat template writes it."""

    def opening(self, system: str) -> str:
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
        self.template = template or ChatMLTemplate()

    def pieces(self, system: str, documents: Sequence[str], question: str) -> list[str]:
        """The prompt's text pieces in order, separators included."""
        pieces = [self.template.opening(system)]
        for document in documents:
            pieces += [self.separator, _with_leading_space(document)]
        closing = _with_leading_space(question) + self.template.closing()
        return pieces + [self.separator, closing]

    def build(self, system: str, documents: Sequence[str], question: str) -> SegmentedPrompt:
        """Tokenize piece by piece; ValueError when that differs from the whole string."""
        for i, document in enumerate(documents):
            if not document.strip():
                raise ValueError(f"documents[{i}]: empty document")
            if self.separator in document:
                raise ValueError(f"documents[{i}]: contains the separator {self.separator!r}")
        pieces = self.pieces(system, documents, question)
        token_ids = self._encode_pieces(pieces)
        prompt = self.splitter.split(token_ids)
        if len(prompt.documents) != len(documents):
            raise ValueError(
                f"separator: {self.separator!r} splits the prompt into "
                f"{len(prompt.documents)} documents, expected {len(documents)}"
            )
        return prompt

    def _encode_pieces(self, pieces: list[str]) -> list[int]:
        joined = [token for piece in pieces for token in self.tokenizer.encode(piece)]
        whole = self.tokenizer.encode("".join(pieces))
        if joined != whole:
            raise ValueError(
                f"separator: {self.separator!r} tokenizes differently inside the prompt than "
                f"alone ({_first_difference(joined, whole, self.tokenizer)}); "
                "choose a separator that does not merge with its neighbours"
            )
        if self.tokenizer.add_bos_token:
            return [self.tokenizer.bos_token_id, *joined]
        return joined


def _with_leading_space(text: str) -> str:
    return " " + text.strip()


def _first_difference(a: list[int], b: list[int], tokenizer: TextTokenizer) -> str:
    i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return (
        f"at token {i}: pieces give {tokenizer.decode(a[i : i + 3])!r}, "
        f"whole prompt gives {tokenizer.decode(b[i : i + 3])!r}"
    )
