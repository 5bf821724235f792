"""The logits processors a request may ask for, applied before sampling: vLLM's `min_tokens` and
`repetition_penalty`.

Contract: `process(logits, seqs, eos_ids)` takes the [R, V] fp32 logits of R sampled rows (row r
samples the next token of `seqs[r]`) and returns the logits to sample from: `logits` itself when
no row asks for anything, else a copy in which
  - min_tokens: while a sequence has fewer than `min_tokens` output tokens, its stop token ids
    (the EOS ids unless ignore_eos, and stop_token_ids) are at -inf, so none can be sampled;
  - repetition_penalty p != 1: the logit of every token id in the prompt or in the output so far
    is divided by p when positive and multiplied by p otherwise.
min_tokens runs before the penalty, as vLLM orders its logits processors before its penalties.
Both read only the sequence's own tokens and parameters, so a decode worker that imported the
prompt and the first token applies them as a colocated worker does: the disaggregated output is
the colocated one. Logprobs stay those of the raw logits (engine/logprobs.py, vLLM's default).
"""

from __future__ import annotations

import torch

from pdserve.engine.sequence import SamplingParams, Sequence


def process(logits: torch.Tensor, seqs: list[Sequence], eos_ids: frozenset[int]) -> torch.Tensor:
    """logits: [R, V] fp32 -> [R, V] fp32 to sample from (see the module contract)."""
    rows = [r for r, seq in enumerate(seqs) if wants_processing(seq.params, len(seq.output_ids))]
    if not rows:
        return logits
    out = logits.clone()
    for r in rows:
        seq = seqs[r]
        if len(seq.output_ids) < seq.params.min_tokens:
            suppress(out[r], stop_token_ids(seq.params, eos_ids))
        if seq.params.repetition_penalty != 1.0:
            penalize_repeats(out[r], seq.tokens, seq.params.repetition_penalty)
    return out


def wants_processing(params: SamplingParams, num_output: int) -> bool:
    return num_output < params.min_tokens or params.repetition_penalty != 1.0


def stop_token_ids(params: SamplingParams, eos_ids: frozenset[int]) -> list[int]:
    """The ids that would end the sequence if sampled (vLLM's `all_stop_token_ids`)."""
    ids = frozenset(params.stop_token_ids)
    return sorted(ids if params.ignore_eos else ids | eos_ids)


def suppress(row: torch.Tensor, ids: list[int]) -> None:
    """row: [V], in place: `ids` can no longer be sampled."""
    if ids:
        row[torch.tensor(ids, device=row.device)] = float("-inf")


def penalize_repeats(row: torch.Tensor, tokens: list[int], penalty: float) -> None:
    """row: [V], in place: vLLM's repetition penalty over `tokens` (prompt + output)."""
    seen = torch.tensor(sorted(set(tokens)), device=row.device)
    values = row[seen]
    row[seen] = torch.where(values > 0, values / penalty, values * penalty)
