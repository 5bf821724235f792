"""Chat messages -> prompt ids: the checkpoint's own template when it ships one, else the fallback.

The checkpoint's template (`model/checkpoint_template.py`, Jinja in a sandbox) renders the
messages as transformers' `apply_chat_template` does and its text is encoded with
`Tokenizer.encode_chat` (the template writes BOS and its control tokens). A template that cannot
render a request (`raise_exception`, an unknown variable, a type error) answers 400.

Only a checkpoint without a template uses the built-in fallback, a fixed, documented template
(the built-in models are random and have no native one):

    <|system|>\\n{content}\\n      (one block per message, in order, role as sent)
    <|user|>\\n{content}\\n
    <|assistant|>\\n              (the generation prompt, appended unless add_generation_prompt is false)

The fallback's text is encoded with the tokenizer's BOS. Its role markers are plain text: the
tokenizer encodes special-token spellings as ordinary text, so a message cannot inject control ids.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pdserve.api.errors import bad_request
from pdserve.model.checkpoint_template import ChatTemplateError

GENERATION_PROMPT_ROLE = "assistant"


def role_marker(role: str) -> str:
    return f"<|{role}|>\n"


def render_chat(messages: Iterable[tuple[str, str]], add_generation_prompt: bool = True) -> str:
    """The fallback: [(role, content), ...] -> the prompt text, ending with the assistant marker."""
    parts = [f"{role_marker(role)}{content}\n" for role, content in messages]
    if add_generation_prompt:
        parts.append(role_marker(GENERATION_PROMPT_ROLE))
    return "".join(parts)


def chat_prompt_ids(messages: list[dict[str, Any]], tokenizer: Any, add_generation_prompt: bool = True,
                    variables: dict[str, Any] | None = None) -> list[int]:
    """[{"role", "content", ...}] -> prompt ids through the checkpoint's template or the fallback.
    `tokenizer` is a `pdserve.model.tokenizer.Tokenizer` (None -> 400: chat needs text)."""
    if tokenizer is None:
        raise bad_request("this model has no tokenizer; use /v1/completions with token ids", param="messages")
    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        text = render_chat(((m["role"], m["content"]) for m in messages), add_generation_prompt)
        return tokenizer.encode(text)
    try:
        text = template.render(messages, add_generation_prompt, variables)
    except ChatTemplateError as exc:
        raise bad_request(str(exc), param="messages", code="chat_template_error") from exc
    return tokenizer.encode_chat(text)
