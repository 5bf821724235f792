"""vLLM's /tokenize and /detokenize: the ids the server would prefill for a prompt, and back.

    POST /tokenize   {model?, prompt, add_special_tokens? = true}                 -> {count, max_model_len, tokens}
                     {model?, messages, add_special_tokens? = false,
                      add_generation_prompt? = true, chat_template_kwargs?}
    POST /detokenize {model?, tokens}                                             -> {prompt}

Contract: a prompt is encoded as /v1/completions encodes it (BOS when `add_special_tokens`);
messages give exactly the ids /v1/chat/completions would prefill (`chat_template.py`), with BOS
prepended on top only when `add_special_tokens` is true, as in vLLM. /detokenize keeps special
tokens in the text (vLLM's default), so tokenize -> detokenize round-trips. Every failure is a
400 OpenAI error (404 for another model's name): neither or both of prompt and messages, a
template that cannot render, an id outside the tokenizer's vocabulary, no tokenizer.
"""

from __future__ import annotations

from typing import Any

from pdserve.api.chat_template import chat_prompt_ids
from pdserve.api.errors import bad_request
from pdserve.api.protocol import ChatMessage, ServedModel, StrictBody, check_model, template_messages


class TokenizeRequest(StrictBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages (vLLM's defaults)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(StrictBody):
    model: str | None = None
    tokens: list[int]


def tokenize(body: TokenizeRequest, served: ServedModel) -> dict:
    _check_optional_model(body.model, served)
    tokenizer = _tokenizer(served)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("send exactly one of prompt and messages", param="prompt")
    if body.prompt is not None:
        ids = tokenizer.encode(body.prompt, add_bos=body.add_special_tokens is not False)
    else:
        if not body.messages:
            raise bad_request("messages is empty", param="messages")
        ids = chat_prompt_ids(template_messages(body.messages), tokenizer, body.add_generation_prompt,
                              body.chat_template_kwargs)
        if body.add_special_tokens and tokenizer.bos_token_id is not None:
            ids = [tokenizer.bos_token_id, *ids]
    return {"count": len(ids), "max_model_len": served.max_model_len, "tokens": ids}


def detokenize(body: DetokenizeRequest, served: ServedModel) -> dict:
    _check_optional_model(body.model, served)
    tokenizer = _tokenizer(served)
    vocab_size = tokenizer.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})", param="tokens",
                          code="token_out_of_vocabulary")
    return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}


def _check_optional_model(model: str | None, served: ServedModel) -> None:
    if model is not None:
        check_model(model, served)


def _tokenizer(served: ServedModel):
    if served.tokenizer is None:
        raise bad_request("this model has no tokenizer", param="model")
    return served.tokenizer
