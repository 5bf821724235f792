"""Candidate instance shapes and the analytic bounds that prune them before simulation.

Contract: `parallel_shapes` lists every TP x PP shape that divides the model (heads by tp, layers
by pp), keeps TP inside one node, and fits the model and one largest request in memory (the
ledger's `fits_on_gpus` plus the roofline's K/V capacity). Degrees are any such divisors, not
only powers of two (OPT-66B's 72 heads take TP 3 and 6; DistServe placed OPT-175B at TP 3 x PP 3),
with PP up to `MAX_PP` stages. The bounds are per instance:

- prefill: zero when one mean prompt alone misses the TTFT gate; otherwise the sustained rate
  B / S(B), B the largest batch of mean prompts the policy allows whose latency meets the TTFT
  (one prompt by default: 1 / S), S its first-stage interval (`prefill_stage_s`: D/pp plus any
  serial part); and an M/D/1 estimate (solve D + R S^2 / (2(1 - R S)) = tau_f) that centres the
  simulated sweep;
- decode: zero when a lone sequence misses the TPOT gate; otherwise the sustained rate, the
  largest b / ((O - 1) * step(b)) for b up to the TPOT batch B (`tpot_batch`): the largest batch
  whose step at the steady context meets tau_o within `--max-seqs` and the K/V (a steady batch
  holds each sequence at its prompt plus half its output, weighted by its decode steps:
  `WorkloadShape.decode_context`); usually b = B, a smaller b where the step jumps at a tile;
- colocated: min of the two phase capacities (an estimate: the phases taking turns).

Bounds are capacities (no queueing): a candidate whose bound per GPU is below the best simulated
goodput per GPU cannot win and is not simulated, and a phase instance's score is held to its
bound (`phase_search.score_all`): above it the queue grows without end, however long a finite run
hides it. Each is the rate of the phase's largest batch that meets its own SLO: for ragged prompts
1 / S(mean prompt) is an upper bound (S grows faster than the prompt), never a cut.

`DecodeTokenCap` is DistServe's decode batch budget as an explicit option (not a default): its
simulator admits decodes to an iteration while their context sum stays within 50,000 tokens, at
every TP degree (LLMServe/DistServe `simdistserve/base/worker.py`, `_enter_decodes`), and each
pipeline stage batches on its own, so an instance holds at most cap x pp tokens of decode batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from pdserve.bench.metrics import Slo
from pdserve.ledger.placement import fits_on_gpus
from pdserve.latency.geometry import ModelSpec
from pdserve.latency.hardware import HardwareProfile
from pdserve.sim.requests import SimRequests
from pdserve.latency.base import LatencyModel
from pdserve.latency.roofline import RooflineLatency
from pdserve.latency.spec import LatencyFamily

MAX_PP = 16


@dataclass(frozen=True)
class Parallel:
    """Tensor x pipeline shape of one instance."""

    tp: int
    pp: int

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    def __str__(self) -> str:
        return f"tp{self.tp}pp{self.pp}"


@dataclass(frozen=True)
class WorkloadShape:
    """Mean new prompt and output lengths, the largest prompt + output, and the mean context of a
    sequence in a steady decode batch (prompt, cached part included, plus half its output; each
    request weighted by its decode steps, as long outputs stay longer in the batch)."""

    mean_prompt: float
    mean_output: float
    max_tokens: int
    decode_context: float

    @classmethod
    def of(cls, requests: SimRequests) -> WorkloadShape:
        n = len(requests)
        prompts, outputs = requests.prompt_tokens, requests.output_tokens
        new = [p - c for p, c in zip(prompts, requests.cached_tokens)]
        steps = [o - 1 for o in outputs]  # a one-token output never decodes
        weights = steps if sum(steps) else [1] * n
        context = sum(w * (p + o / 2) for w, p, o in zip(weights, prompts, outputs)) / sum(weights)
        return cls(sum(new) / n, sum(outputs) / n, max(p + o for p, o in zip(prompts, outputs)), context)


def parallel_shapes(model: ModelSpec, hw: HardwareProfile, max_gpus: int, shape: WorkloadShape,
                    family: LatencyFamily | None = None) -> list[Parallel]:
    """Every TP x PP shape within `max_gpus` that divides the model and fits in memory (K/V
    capacity from `family`'s model of the shape; the roofline's when None)."""
    g = model.geometry
    out = []
    for tp in range(1, hw.gpus_per_node + 1):
        for pp in range(1, MAX_PP + 1):
            par = Parallel(tp, pp)
            if par.gpus > max_gpus or g.q_heads % tp or g.kv_heads % tp and tp % g.kv_heads:
                continue
            if g.layers % pp or not fits_on_gpus(model.total_weight_bytes, par.gpus, int(hw.usable_memory_bytes)):
                continue
            if latency_for(model, hw, par, family).kv_capacity_tokens >= shape.max_tokens:
                out.append(par)
    return out


def latency_for(model: ModelSpec, hw: HardwareProfile, par: Parallel, family: LatencyFamily | None = None) -> LatencyModel:
    """The latency model of one `par` instance: `family`'s (e.g. aiconfigurator's), else the roofline."""
    return family(par.tp, par.pp) if family is not None else RooflineLatency(model, hw, par.tp, par.pp)


@dataclass(frozen=True)
class DecodeTokenCap(LatencyModel):
    """`inner` with its decode batch held to `cap_tokens` of context per pipeline stage (DistServe's
    `decode_max_tokens = 50000`; see the module contract): every time is `inner`'s, only
    `kv_capacity_tokens` (which sizes the decode batch in the bound and the simulator) shrinks to
    min(inner's K/V capacity, cap x stages). Physical memory still binds where it is smaller
    (DistServe's simulator does not check it)."""

    inner: LatencyModel
    cap_tokens: int

    @property
    def pipeline_stages(self) -> int:  # type: ignore[override]
        return self.inner.pipeline_stages

    @property
    def kv_bytes_per_token(self) -> int:  # type: ignore[override]
        return self.inner.kv_bytes_per_token

    @property
    def kv_capacity_tokens(self) -> int:  # type: ignore[override]
        cap, memory = self.cap_tokens * self.inner.pipeline_stages, self.inner.kv_capacity_tokens
        return cap if memory is None else min(cap, memory)

    def prefill_batch_s(self, new_tokens: Sequence[int], cached_tokens: Sequence[int]) -> float:
        return self.inner.prefill_batch_s(new_tokens, cached_tokens)

    def prefill_stage_s(self, latency_s: float) -> float:
        return self.inner.prefill_stage_s(latency_s)

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        return self.inner.decode_step_s(batch, context_tokens)

    def decode_segment_s(self, batch: int, context_tokens: int) -> tuple[float, float]:
        return self.inner.decode_segment_s(batch, context_tokens)

    def mixed_step_s(self, chunk_tokens: int, chunk_pairs: int, chunk_kv_tokens: int, chunk_fraction: float,
                     batch: int, context_tokens: int) -> float:
        return self.inner.mixed_step_s(chunk_tokens, chunk_pairs, chunk_kv_tokens, chunk_fraction, batch, context_tokens)

    def to_dict(self) -> dict:
        return {**self.inner.to_dict(), "decode_token_cap": self.cap_tokens}


def prefill_bound(model: LatencyModel, shape: WorkloadShape, slo: Slo, max_batch: int = 1,
                  max_batch_tokens: int | None = None) -> tuple[float, float]:
    """(sustained rps, M/D/1 estimate rps) of one prefill instance; (0, 0) when infeasible.
    `max_batch` and `max_batch_tokens` are the prefill policy's batch limits."""
    prompt = round(shape.mean_prompt)
    d = model.prefill_s(prompt, 0)
    if d > slo.ttft_s:
        return 0.0, 0.0
    s = model.prefill_stage_s(d)
    slack = slo.ttft_s - d
    limit = max_batch if max_batch_tokens is None else min(max_batch, max(1, max_batch_tokens // max(prompt, 1)))
    batch = _largest_doubling(lambda b: model.prefill_batch_s((prompt,) * b, (0,) * b) <= slo.ttft_s, limit)
    sustained = batch / model.prefill_stage_s(model.prefill_batch_s((prompt,) * batch, (0,) * batch))
    return max(sustained, 1 / s), 2 * slack / (s * s + 2 * slack * s)


def tpot_batch(model: LatencyModel, shape: WorkloadShape, slo: Slo, max_seqs: int) -> int:
    """The largest steady decode batch whose step meets the TPOT gate within `max_seqs` and the
    K/V (0: a lone sequence misses it)."""
    context = shape.decode_context
    if model.decode_step_s(1, context) > slo.tpot_s:
        return 0
    capacity = model.kv_capacity_tokens
    fit = max_seqs if capacity is None else int(capacity // context)
    return _largest(lambda b: model.decode_step_s(b, b * context) <= slo.tpot_s, max(1, min(max_seqs, fit)))


def decode_bound(model: LatencyModel, shape: WorkloadShape, slo: Slo, max_seqs: int) -> float:
    """Sustained rps of one decode instance: the best rate of any batch up to its TPOT batch, one
    token per sequence a step. A loaded pool settles at the smallest batch whose rate reaches the
    arrivals, so where the step jumps (a GEMM tile boundary) a smaller batch carries more."""
    batch = tpot_batch(model, shape, slo, max_seqs)
    if batch == 0:
        return 0.0
    steps = max(shape.mean_output - 1, 1)
    return max(b / (steps * model.decode_step_s(b, b * shape.decode_context)) for b in range(1, batch + 1))


def colocated_bound(model: LatencyModel, shape: WorkloadShape, slo: Slo, max_seqs: int) -> tuple[float, float]:
    """(capacity, estimate) rps of one colocated instance.

    Capacity: neither phase can run faster than it would alone, min(1 / S, decode capacity),
    S the prefill stage interval. Estimate: the phases take turns, 1 / (S + 1 / decode
    capacity); mixing shares the weight
    reads, so the truth lies between the two.
    """
    d = model.prefill_s(round(shape.mean_prompt), 0)
    decode_rps = decode_bound(model, shape, slo, max_seqs)
    if d > slo.ttft_s or decode_rps <= 0:
        return 0.0, 0.0
    stage_s = model.prefill_stage_s(d)
    return min(1 / stage_s, decode_rps), 1 / (stage_s + 1 / decode_rps)


def _largest_doubling(ok, hi: int) -> int:
    """Largest b in [1, hi] with ok(b) (monotone), for an `hi` too large to list: double, then bisect."""
    b = 1
    while b < hi and ok(min(2 * b, hi)):
        b = min(2 * b, hi)
    return _largest(ok, min(2 * b, hi), lo=b)


def _largest(ok, hi: int, lo: int = 1) -> int:
    """Largest b in [lo, hi] with ok(b), assuming ok is monotone (true then false) and ok(lo)."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo
