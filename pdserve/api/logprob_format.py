"""Engine log-probabilities in OpenAI's two response shapes.

Contract: a token's string is its id decoded alone with special tokens kept (vLLM's choice);
without a tokenizer it is `token_id:<id>` (vLLM's `return_tokens_as_token_ids` form), so every
entry stays identifiable. Values are passed through untouched (fp32 values widened to JSON
doubles). The prompt's first token has no logprob: it is `None` in the entries and `null` in
the body, as OpenAI's echo does.
- completions: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`; `top_logprobs` holds
  one {token string: logprob} dict per token, the k most likely plus the chosen token (with k = 0
  the chosen token alone, as vLLM); `text_offset` is each token's character offset in the
  concatenated token strings (the choice's text, echo included, wherever the tokens decode
  alone as they do together), continuing from `offset` (a stream's earlier tokens).
- chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}]}]}`, `bytes` the token string's UTF-8 bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.engine.outputs import TokenLogprobs


class TokenNames:
    """Token id -> its string, cached per request (the same ids recur across top-k lists)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        name = self.cache.get(token_id)
        if name is None:
            name = (f"token_id:{token_id}" if self.tokenizer is None
                    else self.tokenizer.decode([token_id], skip_special_tokens=False))
            self.cache[token_id] = name
        return name


def prompt_entries(prompt_ids: Sequence[int], scored: Sequence[TokenLogprobs] | None) -> list[TokenLogprobs | int]:
    """The prompt as logprob entries: its first token bare (no logprob), then the scored ones."""
    return [prompt_ids[0], *(scored or ())]


def completion_logprobs(entries: Sequence[TokenLogprobs | int], names: TokenNames, offset: int = 0) -> dict:
    """Completions' `logprobs` object; a bare int entry is a token without a logprob (null)."""
    tokens, values, tops, offsets = [], [], [], []
    for entry in entries:
        token_id = entry if isinstance(entry, int) else entry.token_id
        name = names(token_id)
        tokens.append(name)
        offsets.append(offset)
        offset += len(name)
        if isinstance(entry, int):
            values.append(None)
            tops.append(None)
            continue
        values.append(entry.logprob)
        tops.append(_top_dict(entry, names))
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _top_dict(entry: TokenLogprobs, names: TokenNames) -> dict[str, float]:
    """{token string: logprob} of the top entries, the chosen token included as OpenAI does."""
    top = {names(i): v for i, v in zip(entry.top_ids, entry.top_logprobs)}
    top.setdefault(names(entry.token_id), entry.logprob)
    return top


def chat_logprobs(entries: Sequence[TokenLogprobs], names: TokenNames) -> dict:
    """Chat's `logprobs` object: one content entry per output token."""
    return {"content": [_chat_entry(e.token_id, e.logprob, names) | {"top_logprobs": [
        _chat_entry(i, v, names) for i, v in zip(e.top_ids, e.top_logprobs)]} for e in entries]}


def _chat_entry(token_id: int, logprob: float, names: TokenNames) -> dict:
    name = names(token_id)
    return {"token": name, "logprob": logprob, "bytes": list(name.encode("utf-8"))}
