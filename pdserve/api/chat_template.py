"""The chat template: a list of (role, content) messages -> one prompt string.

pdserve's tokenizer wrapper carries no Jinja chat template, so every chat request is rendered
with this fixed, documented template (the built-in models are random and have no native one):

    <|system|>\\n{content}\\n      (one block per message, in order, role as sent)
    <|user|>\\n{content}\\n
    <|assistant|>\\n              (the generation prompt, always appended)

The tokenizer then encodes the string with its BOS. Role markers are plain text: the tokenizer
encodes special-token spellings as ordinary text, so a message cannot inject control ids.
"""

from __future__ import annotations

from collections.abc import Iterable

GENERATION_PROMPT_ROLE = "assistant"


def role_marker(role: str) -> str:
    return f"<|{role}|>\n"


def render_chat(messages: Iterable[tuple[str, str]]) -> str:
    """[(role, content), ...] -> the prompt text ending with the assistant marker."""
    parts = [f"{role_marker(role)}{content}\n" for role, content in messages]
    parts.append(role_marker(GENERATION_PROMPT_ROLE))
    return "".join(parts)
