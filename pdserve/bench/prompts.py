"""Synthetic prompt content of a requested token length.

The server's tokenizer is unknown in general, so text prompts rest on one stated assumption:
a token is `bytes_per_token` bytes of ASCII text (pdserve's default model uses a byte-level
tokenizer: exactly one token per byte, plus one BOS token the server adds). Text is random
lowercase words, so no two requests share content by accident and BPE tokenizers see ordinary
word boundaries. With `format="ids"` the prompt is a list of token ids instead (OpenAI completions
accepts that); ids are drawn from [id_low, id_high), by default the byte values of 'a'..'z', which
are valid in any vocabulary of at least 123 entries and mean letters to a byte-level tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PROMPT_FORMATS = ("text", "ids")
_ALPHABET = np.array(list("abcdefghijklmnopqrstuvwxyz"))


@dataclass(frozen=True)
class PromptStyle:
    """How a token count becomes prompt content."""

    format: str = "text"
    bytes_per_token: float = 1.0
    bos_tokens: int = 1
    id_low: int = 97
    id_high: int = 123

    def __post_init__(self) -> None:
        if self.format not in PROMPT_FORMATS:
            raise ValueError(f"prompt format must be one of {PROMPT_FORMATS}")
        if self.bytes_per_token <= 0 or self.id_high <= self.id_low:
            raise ValueError("bytes_per_token must be > 0 and id_high > id_low")

    @property
    def implicit_tokens(self) -> int:
        """Tokens the server adds on its own (the BOS for text; none for ids)."""
        return self.bos_tokens if self.format == "text" else 0


def random_text(rng: np.random.Generator, num_chars: int) -> str:
    """`num_chars` ASCII characters of random lowercase words (about one space in six)."""
    if num_chars <= 0:
        return ""
    chars = rng.choice(_ALPHABET, size=num_chars)
    spaces = rng.random(num_chars) < 1 / 6
    spaces[0] = False
    chars[spaces] = " "
    return "".join(chars.tolist())


def text_for_tokens(rng: np.random.Generator, num_tokens: int, style: PromptStyle) -> str:
    """Text that a tokenizer of `style.bytes_per_token` turns into about `num_tokens` tokens."""
    return random_text(rng, max(1, round(num_tokens * style.bytes_per_token)))


def ids_for_tokens(rng: np.random.Generator, num_tokens: int, style: PromptStyle) -> tuple[int, ...]:
    """`num_tokens` token ids drawn uniformly from [id_low, id_high)."""
    return tuple(rng.integers(style.id_low, style.id_high, size=max(1, num_tokens)).tolist())
