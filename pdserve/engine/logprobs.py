"""Log-probabilities of sampled and prompt tokens, from the raw logits.

Contract: a token's log-probability is `log_softmax` of the model's raw next-token logits (fp32,
before temperature, top-k or top-p: vLLM's default "raw_logprobs"), taken at the position that
predicts it. `TokenLogprobs` (engine/outputs.py) carries the chosen token's value and, when asked for k > 0, the k
most likely tokens of that position, most likely first (ties: lower id first). It is small on
purpose: it crosses the worker -> router wire once per token, and only for requests that asked.
Prompt logprobs cover prompt positions 1..P-1 (position 0 has no predecessor; the API reports it
as null); the logits of position p predict the token at p + 1.
"""

from __future__ import annotations

import torch

from pdserve.engine.outputs import TokenLogprobs  # the wire type (outputs.py: the router's process imports it without torch)


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """logits: [R, V] -> log-probabilities [R, V] fp32 (the one formula)."""
    return torch.log_softmax(logits.float(), dim=-1)


def token_logprobs(logits: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprobs]:
    """logits: [R, V] raw; token_ids: R chosen ids -> one TokenLogprobs per row, top-k when k > 0."""
    if not token_ids:
        return []
    lp = log_probs(logits)  # [R, V]
    chosen = lp[torch.arange(len(token_ids)), torch.tensor(token_ids, dtype=torch.int64)].tolist()
    if k <= 0:
        return [TokenLogprobs(t, v) for t, v in zip(token_ids, chosen)]
    top_ids, top_vals = _top_k(lp, min(k, lp.shape[-1]))
    return [TokenLogprobs(t, v, tuple(ids), tuple(vals)) for t, v, ids, vals in zip(token_ids, chosen, top_ids, top_vals)]


def requested_logprobs(k: int | None, logits: torch.Tensor, token_ids: list[int]) -> tuple[TokenLogprobs, ...]:
    """logits: [R, V] raw rows that sampled `token_ids` -> their logprobs, or () when the request
    did not ask (k is None)."""
    return () if k is None else tuple(token_logprobs(logits, token_ids, k))


def score_prompt_rows(prompt_rows, logits: torch.Tensor) -> None:
    """logits: [Q, V], the prompt-logprob rows of a step in `prompt_rows` order ((sequence, first
    position, rows), runner.py); each sequence's `prompt_logprobs` grows by its rows' scores."""
    at = 0
    for seq, first, rows in prompt_rows:
        if not seq.finished:
            targets = list(seq.prompt_ids[first + 1 : first + 1 + rows])
            seq.prompt_logprobs += token_logprobs(logits[at : at + rows], targets, seq.params.prompt_logprobs)
        at += rows


def _top_k(lp: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
    """lp: [R, V] -> per row the k largest (ids, values), larger first, equal values by lower id."""
    values, ids = torch.topk(lp, k, dim=-1)  # [R, k]
    ids, order = torch.sort(ids, dim=-1)  # ids ascending, then a stable sort by value descending
    values = torch.gather(values, -1, order)
    values, order = torch.sort(values, dim=-1, descending=True, stable=True)
    return torch.gather(ids, -1, order).tolist(), values.tolist()
