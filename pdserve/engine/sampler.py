"""Next-token sampling: greedy, temperature, top-k, top-p, per-request seeds.

Contract: the token sampled for output position i of a request depends only on its logits, its
sampling parameters, its seed and i. Randomness comes from a generator seeded with (seed, i), so
the same seed gives the same tokens whatever the batch mates, across preemption and recompute,
and across a prefill -> decode handoff (the decode worker needs only the seed and i). The n
sequences of one request draw from per-sequence seeds (`sequence_seed`).
Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) draws exactly from p.
"""

from __future__ import annotations

import torch

from pdserve.engine.sequence import SamplingParams

_MASK64 = (1 << 63) - 1


def position_seed(seed: int, index: int) -> int:
    """A well-mixed 63-bit seed for output position `index` (splitmix64 finalizer)."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & _MASK64


def sequence_seed(seed: int, index: int) -> int:
    """The seed of output sequence `index` of an n > 1 request with seed `seed`. Sequence 0 keeps
    the request's seed, so choice 0 of n equals the n = 1 answer; the others are mixed apart.
    Every worker derives the same value, so a forked sequence samples the same tokens wherever
    it runs (prefill worker, decode worker, colocated)."""
    return seed if index == 0 else position_seed(seed ^ 0x5DEECE66D, -(index + 1)) & _MASK64


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [V] fp32 -> temperature-scaled logits with top-k / top-p exclusions at -inf."""
    x = logits / params.temperature
    if 0 < params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # drop a token when the mass strictly before it already reaches top_p; the most likely is
        # always kept (a top_p below fp32's range compares as 0 and would drop every token)
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def sample_one(logits: torch.Tensor, params: SamplingParams, seed: int, index: int) -> int:
    """logits: [V] fp32 -> token id."""
    if params.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(filter_logits(logits, params), dim=-1)
    gen = torch.Generator(device=logits.device).manual_seed(position_seed(seed, index))  # the same seed, device: the same draw
    race = torch.empty_like(probs).exponential_(generator=gen)
    return int(torch.argmax(probs / race))


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], indices: list[int]) -> list[int]:
    """logits: [R, V] fp32, one row per sampled sequence -> R token ids."""
    greedy_ids = torch.argmax(logits, dim=-1).tolist()  # one vectorised pass for the common case
    return [
        greedy_ids[r] if p.greedy else sample_one(logits[r], p, s, i)
        for r, (p, s, i) in enumerate(zip(params, seeds, indices))
    ]
