"""How a step's time changes with the tensor-parallel size of the CPU worker that runs it (issue 23).

Contract: one formula prices every TP worker of our engine (the router's cost model through
router/pricing/tp_pricing.py, scripts/tp_pricing_check.py; anything else that prices a TP worker calls
`TpScaling.price`). A step of `rows` rows measured at TP m (time t_m) costs at TP n

    t_n = (c(n) / c(m)) * (t_m - o(m, rows)) + o(n, rows)                     (`StepPrice`)

    compute, in one-thread TP 1 step units:
      c(1) = 1 / T                   (a TP 1 worker's T threads; ideal thread scaling assumed)
      c(N) = (1 - r) / N + r         (N one-thread ranks)
    fixed costs of a TP step (o(1, rows) = 0):
      o(N, rows) = K * (alpha_N + rows * B * beta_N) + sync_N,   K = 2 * layers

r is the share of a one-thread TP 1 step that every rank repeats: at least what the shapes say
(model/tp.py replicates the embedding, the norms and the LM head: in decode the LM head's share
of the weights every row reads, `lm_head_share`; in prefill 0), and at least `MEASURED_REPLICATED`,
rank 0's measured thread CPU time of a TP 2 step over a one-thread TP 1 step's (r = 2 x ratio - 1,
capped at 1; scripts/tp_step_components.py, docs/tensor_parallel.md): prefill 128 and 512 tokens
0.58 and 0.52 (r 0.16, 0.04: the step's host work is not divided), decode 4 x 256 and 16 x 512
0.89 and 0.80 (r 0.78, 0.59: rank 0 adds the step broadcast's pickling and the all_reduce calls'
own CPU time, counted again, in part, by alpha and sync below; measured once TP decode read the
pool in place, c9b3d9b: before, through padded groups, 1.04 and 1.48, r 1). K is the step's all_reduce count
(one after each layer's o_proj and one after its down_proj), each of a [rows, d] partial of B = d x
the compute dtype's bytes; alpha_N is gloo's per-call latency, beta_N its seconds per byte and
sync_N rank 0's pickled broadcast of the step's rows to the followers (engine/tp_group.py), all
three MEASURED on the machine (latency/tp_collectives.py; `pdserve profile --tp N` and
`--pd-profile auto` record them as the profile's `collectives`). alpha and beta are the
engine-shaped figures where the profile has them (each all_reduce issued after the rank's share
of a layer's products, as in a step, mean over bursts: `CollectiveCosts.engine_shaped`), else the
back-to-back floor: under load the shaped figures priced a TP 2 prefill 8-19 points closer to the
measured ratio in three runs, and a decode step neither better nor worse (+10/-18/+10 % against
+30/-13/+1 %: inside that load's noise), so one set prices both (docs/tensor_parallel.md). A TP size not measured is derived from the nearest measured one
as a ring would scale: alpha and sync by (N - 1) / (M - 1) (2(N - 1) sequential messages; N - 1
receivers), beta by ((N - 1) / N) / ((M - 1) / M) (each rank's share of the bytes). Without any
measurement `DEFAULT_COLLECTIVES` stands in: TP 2 on the 2-core AMD EPYC of
docs/tensor_parallel.md, pinned, as measured there. On a core that another process also wants,
every message waits for the partner's time slice, so alpha is milliseconds, not microseconds:
that, not bandwidth, is what a short decode step pays. A served worker's own steps can stand in for
the measurement at its size: `price(..., live=costs)` takes the alpha, beta and sync its rank 0
shows live (router/pricing/live_collectives.py fits them from its heartbeats), by the same formula.

The planner's GPU models (latency/roofline.py, latency/aic.py) price a tp x pp instance of a GPU
from hardware rates; this one prices our CPU engine's ranks relative to a measured profile.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.latency.tp_collectives import CollectiveCosts

PHASES = ("prefill", "decode")
# r's measured floor per phase on this engine (module docstring; AMD EPYC, 2 cores, the 107M, bf16)
MEASURED_REPLICATED = {"prefill": 0.1, "decode": 0.8}
# TP 2, pinned, the 2-core AMD EPYC of docs/tensor_parallel.md (least burst mean of 7, load ~7)
DEFAULT_COLLECTIVES = CollectiveCosts(tp=2, pinned=True, allreduce_s=1.6e-3, allreduce_s_per_byte=1.1e-9,
                                      step_sync_s=1.1e-3)


@dataclass(frozen=True)
class StepPrice:
    """A step at the priced TP size: `factor` x the measured step + `fixed_s` + `per_row_s` x rows."""

    factor: float
    fixed_s: float = 0.0
    per_row_s: float = 0.0

    def step_s(self, measured_s: float, rows: float) -> float:
        return self.factor * measured_s + self.fixed_s + self.per_row_s * rows

    def relative_to(self, base: StepPrice) -> StepPrice:
        """This price over a step already priced by `base` (both from the same measured step)."""
        f = self.factor / base.factor
        return StepPrice(f, self.fixed_s - f * base.fixed_s, self.per_row_s - f * base.per_row_s)


@dataclass(frozen=True)
class PhaseShares:
    replicated: float  # r: share of a one-thread TP 1 step every rank repeats

    def __post_init__(self) -> None:
        if not 0 <= self.replicated <= 1:
            raise ValueError(f"need 0 <= replicated <= 1, got {self}")


def ring_costs(measured: CollectiveCosts, tp: int) -> CollectiveCosts:
    """`measured` carried to TP `tp` as a ring scales (module docstring)."""
    if tp == measured.tp:
        return measured
    steps = (tp - 1) / (measured.tp - 1)
    share = ((tp - 1) / tp) / ((measured.tp - 1) / measured.tp)
    return CollectiveCosts(tp=tp, pinned=measured.pinned, allreduce_s=measured.allreduce_s * steps,
                           allreduce_s_per_byte=measured.allreduce_s_per_byte * share,
                           step_sync_s=measured.step_sync_s * steps)


@dataclass(frozen=True)
class TpScaling:
    """The model's shares per phase, a TP 1 worker's threads, the step's collectives and their costs."""

    prefill: PhaseShares
    decode: PhaseShares
    threads: int = 1
    num_layers: int = 0  # K = 2 * num_layers all_reduces per step
    row_bytes: int = 0  # B: one [1, d] partial in the compute dtype
    collectives: tuple[CollectiveCosts, ...] = ()  # measured; none: DEFAULT_COLLECTIVES

    def __post_init__(self) -> None:
        if self.threads < 1 or self.num_layers < 0 or self.row_bytes < 0:
            raise ValueError(f"need threads >= 1 and non-negative layers and row bytes, got {self}")

    def units(self, phase: str, tp: int) -> float:
        """c(tp): a step's compute in one-thread TP 1 steps."""
        if tp < 1:
            raise ValueError(f"tensor-parallel size must be >= 1, got {tp}")
        if tp == 1:
            return 1.0 / self.threads
        r = (self.prefill if phase == "prefill" else self.decode).replicated
        return (1.0 - r) / tp + r

    def costs_at(self, tp: int) -> CollectiveCosts:
        """The collective costs at TP `tp`: measured there, else from the nearest measured size;
        the engine-shaped all_reduce where it was measured (module docstring)."""
        known = self.collectives or (DEFAULT_COLLECTIVES,)
        return ring_costs(min(known, key=lambda c: (abs(c.tp - tp), c.tp)).engine_shaped(), tp)

    def overhead(self, tp: int, costs: CollectiveCosts | None = None) -> StepPrice:
        """o(tp, rows) as (fixed_s, per_row_s); zero at TP 1. `costs`: these collectives at `tp`
        instead of `costs_at(tp)`."""
        if tp == 1:
            return StepPrice(0.0)
        c, k = costs or self.costs_at(tp), 2 * self.num_layers
        return StepPrice(0.0, k * c.allreduce_s + c.step_sync_s, k * self.row_bytes * c.allreduce_s_per_byte)

    def price(self, phase: str, tp: int, measured_tp: int = 1, live: CollectiveCosts | None = None) -> StepPrice:
        """A `phase` step at `tp` from the same step measured at `measured_tp`. `live`: the
        collectives a served TP `tp` worker's own steps show (router/pricing/live_collectives.py) in place
        of the measured ones at `tp`; the measured step keeps the measured ones at `measured_tp`,
        so a worker profiled at its own size pays o_live - o_measured on top of its steps."""
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        if tp == measured_tp and (live is None or tp == 1):
            return StepPrice(1.0)
        f = self.units(phase, tp) / self.units(phase, measured_tp)
        there, here = self.overhead(tp, live), self.overhead(measured_tp)
        return StepPrice(f, there.fixed_s - f * here.fixed_s, there.per_row_s - f * here.per_row_s)

    def factor(self, phase: str, tp: int, measured_tp: int = 1) -> float:
        """The compute part of `price`: c(tp) / c(measured_tp)."""
        return self.price(phase, tp, measured_tp).factor


def lm_head_share(vocab: int, hidden: int, intermediate: int, layers: int, q_dim: int, kv_dim: int) -> float:
    """The LM head's share of the weights a decode row reads: V*d over V*d + L*(q|k|v, o, gate|up|down)."""
    head = vocab * hidden
    layer = hidden * (q_dim + 2 * kv_dim) + q_dim * hidden + 3 * hidden * intermediate
    return head / (head + layers * layer)


def model_scaling(mc, threads: int, compute_bytes: int = 2, collectives: tuple[CollectiveCosts, ...] = ()) -> TpScaling:
    """The documented model for a `ModelConfig` served with `threads` threads per TP 1 worker,
    activations of `compute_bytes` bytes (bf16: 2) and the measured `collectives` (none: defaults)."""
    head = lm_head_share(mc.vocab_size, mc.hidden_size, mc.intermediate_size, mc.num_layers,
                         mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim)
    prefill, decode = max(0.0, MEASURED_REPLICATED["prefill"]), max(head, MEASURED_REPLICATED["decode"])
    return TpScaling(PhaseShares(prefill), PhaseShares(decode), threads, mc.num_layers, mc.hidden_size * compute_bytes,
                     tuple(collectives))
