"""How a step's time changes with the tensor-parallel size of the CPU worker that runs it (issue 23).

Contract: one formula prices every TP worker of our engine (the router's cost model through
router/tp_pricing.py; anything else that prices a TP worker calls `TpScaling.factor`). A step
measured at TP m costs `factor(phase, n, m)` times as long at TP n, per phase (prefill, decode):

    factor = u(n) / u(m), in single-core step units u:
    TP 1, T threads:            u(1) = 1 / T                    (a TP 1 worker's threads; ideal
                                                                 thread scaling assumed)
    TP N > 1, one thread/rank:  u(N) = ((1 - r) / N + r) / (1 - s(N)),  s(N) = s2 * 2(N - 1) / N

r is the share of a one-thread TP 1 step that every rank repeats (model/tp.py replicates the
embedding, the norms and the LM head): in decode the LM head's share of the weights every row
reads (`lm_head_share`), in prefill 0 (the LM head runs on one row per sequence; the embedding and
the norms are O(d) per row beside the O(d^2) products). s(N) is the share of a TP N step that
rank 0 spends inside all_reduce: s2 at TP 2, growing with a ring's per-rank volume 2(N - 1)/N.
`ALLREDUCE_SHARE` is s2 as measured on the quiet 2-core machine (docs/tensor_parallel.md: 6.4 %
and 7.6 % of a 2k-token prefill step for `small` and the 107M); decode's share was not measured
and takes the same value. With T = 2, N = 2 and r = 0 the factor is 1 / 0.93 = 1.075, the
measured TP 2 / TP 1 prefill ratio being 1.05 (`small`) and 1.10 (107M).

The planner's GPU models (latency/roofline.py, latency/aic.py) price a tp x pp instance of a GPU
from hardware rates; this one prices our CPU engine's ranks relative to a measured profile.
"""

from __future__ import annotations

from dataclasses import dataclass

ALLREDUCE_SHARE = 0.07
PHASES = ("prefill", "decode")


@dataclass(frozen=True)
class PhaseShares:
    replicated: float  # r: share of a one-thread TP 1 step every rank repeats
    allreduce: float = ALLREDUCE_SHARE  # s2: share of a TP 2 step spent in all_reduce

    def __post_init__(self) -> None:
        if not (0 <= self.replicated <= 1 and 0 <= self.allreduce < 0.5):
            raise ValueError(f"need 0 <= replicated <= 1 and 0 <= allreduce < 0.5, got {self}")


@dataclass(frozen=True)
class TpScaling:
    """The model's shares per phase and the threads of a TP 1 worker."""

    prefill: PhaseShares
    decode: PhaseShares
    threads: int = 1

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")

    def units(self, phase: str, tp: int) -> float:
        """u(tp): a step's time in one-thread TP 1 steps."""
        if tp < 1:
            raise ValueError(f"tensor-parallel size must be >= 1, got {tp}")
        if tp == 1:
            return 1.0 / self.threads
        shares = self.prefill if phase == "prefill" else self.decode
        compute = (1.0 - shares.replicated) / tp + shares.replicated
        return compute / (1.0 - shares.allreduce * 2.0 * (tp - 1) / tp)

    def factor(self, phase: str, tp: int, measured_tp: int = 1) -> float:
        """Time of a `phase` step at `tp` over the same step measured at `measured_tp`."""
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        if tp == measured_tp:
            return 1.0
        return self.units(phase, tp) / self.units(phase, measured_tp)


def lm_head_share(vocab: int, hidden: int, intermediate: int, layers: int, q_dim: int, kv_dim: int) -> float:
    """The LM head's share of the weights a decode row reads: V*d over V*d + L*(q|k|v, o, gate|up|down)."""
    head = vocab * hidden
    layer = hidden * (q_dim + 2 * kv_dim) + q_dim * hidden + 3 * hidden * intermediate
    return head / (head + layers * layer)


def model_scaling(mc, threads: int, allreduce: float = ALLREDUCE_SHARE) -> TpScaling:
    """The documented model for a `ModelConfig` served with `threads` threads per TP 1 worker."""
    r = lm_head_share(mc.vocab_size, mc.hidden_size, mc.intermediate_size, mc.num_layers,
                      mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim)
    return TpScaling(PhaseShares(0.0, allreduce), PhaseShares(r, allreduce), threads)
