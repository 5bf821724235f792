"""DistServe's placement rule as an option: one prefill and one decode instance per node segment.

Contract: DistServe's simulator search (LLMServe/DistServe `simdistserve/benchmarks/
search_configs.py`, `search_binary.py`) scores each low-affinity configuration (pp_cross, tp_p,
pp_p, tp_d, pp_d) as ONE prefill instance beside ONE decode instance (`DisaggCluster`'s defaults),
simulated end to end, at goodput / (GPUs of both), and replicates that pair; pdserve's own search
replicates each phase freely (`plans.py`). Here the same rule runs on pdserve's scores:

- `segment_pairs` lists every (prefill, decode, s) DistServe's low-affinity search admits: s node
  segments dividing both PP degrees (DistServe's pp_cross), both instances' slices of a segment
  within one node (gpus_p / s + gpus_d / s <= gpus_per_node), s within the budget's nodes and
  s x the segment's GPUs within the budget; each pair's bound is min(g_p, g_d), the slower phase;
- `score_pairs` simulates pairs end to end (one prefill + one decode instance, K/V over NVLink,
  the space's attainment definition, decode batch cap and prefill policy), best bound per GPU
  first, and prunes a pair whose bound per GPU is more than `TIE` below the best simulated pair's
  goodput per GPU (a pair cannot beat its slower phase alone; pairs within the goodput search's 5%
  resolution of the best are simulated, so the end-to-end run breaks near-ties, as DistServe's).
  A pair's goodput is held to the smaller of its two instances' sustained rates (`Score.bound_rps`),
  as each instance's score is (`phase_search.py`): a finite end-to-end run passes an overloaded
  pair where the queue's wait fits a loose SLO.

`best_pairs` runs the whole rule on a `SearchSpace`: every shape that can share a node segment
scored per phase with `score_all(..., prune=False)` (the rule needs every shape, not each phase's
best per GPU), then the pairs. A deployment is the best pair replicated budget // pair GPUs
times, as DistServe's. The rule is an option of the search (scripts/distserve_segments.py drives
it), not part of `pdserve plan`.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.search.candidates import Parallel
from pdserve.search.phase_search import Progress, Score, SearchSpace, score_all
from pdserve.search.plans import common_segments, sustained_rps
from pdserve.sim.goodput import goodput_rps, ladder_around
from pdserve.sim.simulator import SimConfig, simulate
from pdserve.sim.transfer import LinkSpec

TIE = 0.05  # the goodput search's relative resolution


@dataclass(frozen=True)
class SegmentPair:
    """One prefill and one decode instance cut into `segments` node segments, and its goodput."""

    prefill: Score
    decode: Score
    segments: int
    bound_rps: float  # min of the two phases' goodputs
    goodput_rps: float = 0.0  # end to end, when simulated
    status: str = "bound"  # "simulated" | "pruned" | "bound"
    joint_at_goodput: float = 0.0  # share of requests meeting both SLOs at that rate (breaks ties)

    @property
    def gpus(self) -> int:
        return self.prefill.par.gpus + self.decode.par.gpus

    @property
    def per_gpu(self) -> float:
        return self.goodput_rps / self.gpus

    @property
    def label(self) -> str:
        return f"P {self.prefill.par} + D {self.decode.par} ({self.segments} seg)"


def best_pairs(space: SearchSpace, shapes: list[Parallel], budget: int, progress: Progress = lambda _m: None,
               transfer_overlap: str = "layer") -> list[SegmentPair]:
    """DistServe's low-affinity search on `space`: every shape that can share a node segment with
    another scored per phase without pruning, then every admissible pair (`score_pairs`)."""
    per_node = space.hardware.gpus_per_node
    room = (per_node - 1) * max(1, budget // per_node)
    cands = [(p, 0) for p in shapes if p.gpus <= room]
    prefill = score_all(space, "prefill", cands, progress, prune=False)
    decode = score_all(space, "decode", cands, progress, prune=False)
    return score_pairs(space, segment_pairs(prefill, decode, per_node, budget), progress, transfer_overlap)


def segment_pairs(prefill: list[Score], decode: list[Score], gpus_per_node: int, budget: int) -> list[SegmentPair]:
    """Every admissible (prefill, decode, segments) of viable scores (module contract), best
    bound per GPU first."""
    nodes = max(1, budget // gpus_per_node)
    pairs = []
    for p in (s for s in prefill if s.goodput_rps > 0):
        for d in (s for s in decode if s.goodput_rps > 0):
            gpus = p.par.gpus + d.par.gpus
            for s in common_segments(p.par.pp, d.par.pp):
                if s <= nodes and gpus // s <= gpus_per_node and gpus <= budget:
                    pairs.append(SegmentPair(p, d, s, min(p.goodput_rps, d.goodput_rps)))
    return sorted(pairs, key=lambda c: (-c.bound_rps / c.gpus, c.gpus, c.label))


def score_pairs(space: SearchSpace, pairs: list[SegmentPair], progress: Progress = lambda _m: None,
                transfer_overlap: str = "layer") -> list[SegmentPair]:
    """Each pair simulated end to end or pruned (module contract), best goodput per GPU first;
    ties (equal rates on the same ladder) go to fewer GPUs, then to the higher joint attainment at
    that rate (the faster prefill of two beside one decode shape), then to labels."""
    out: list[SegmentPair] = []
    best = 0.0
    for i, pair in enumerate(pairs, 1):
        if pair.bound_rps / pair.gpus < best * (1 - TIE):
            out.append(SegmentPair(pair.prefill, pair.decode, pair.segments, pair.bound_rps, 0.0, "pruned"))
            continue
        found = goodput_rps(_pair_runner(space, pair, transfer_overlap), space.slo, ladder_around(pair.bound_rps, 1.5),
                            space.definition)
        rate = min(found.rate, sustained_rps(pair.prefill, 1, pair.decode, 1))
        joint = _joint_at(found, rate)
        out.append(SegmentPair(pair.prefill, pair.decode, pair.segments, pair.bound_rps, rate, "simulated", joint))
        best = max(best, out[-1].per_gpu)
        progress(f"pair {i}/{len(pairs)} {pair.label}: {found.rate:.3g} rps ({out[-1].per_gpu:.3g}/GPU)")
    return sorted(out, key=lambda c: (-c.per_gpu, c.gpus, -c.joint_at_goodput, c.label))


def _joint_at(found, rate: float) -> float:
    """Joint attainment at `rate`: measured there, else at the nearest measured rate above it."""
    above = [r for r in found.points if r >= rate]
    return found.points[min(above)].joint if above else 0.0


def _pair_runner(space: SearchSpace, pair: SegmentPair, transfer_overlap: str):
    """Records of one prefill + one decode instance at a rate; K/V on the decode GPUs' NVLink."""
    hw, d = space.hardware, pair.decode.par
    link = LinkSpec(d.gpus * hw.nvlink_send_bytes_per_s, transfer_overlap, space.model.geometry.layers)
    config = SimConfig(mode="disaggregated", prefill=space.prefill_policy, max_decode_seqs=space.max_seqs, link=link)
    pm, dm = space.latency(pair.prefill.par), space.decode_latency(d)
    return lambda rate: simulate(space.decode_requests, rate, config, pm, dm).records
