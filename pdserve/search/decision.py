"""The planner's decision rule: colocate or disaggregate, the test that decided, and what dT means.

Contract: `decide` applies one rule, in this order; the first test that settles it is named in
`Verdict.decided_by`:

1. ``kv_link``: no disaggregated plan with positive goodput whose K/V transfer demand fits the
   link it was planned on -> colocate;
2. ``no_colocated_plan``: no colocated plan fits -> disaggregate;
3. ``goodput_per_gpu``: disaggregate exactly when the disaggregated plan's goodput per GPU beats
   the colocated plan's by more than `margin` (a fraction). Goodput counts only requests that
   meet both SLOs, so the spec's TTFT and TPOT attainment gates are inside this test.

The ledger's net margin dT (seconds a request saves disaggregated at a matched offered load,
transfer, routing and failure costs taken off) is reported beside the verdict but does not
decide: at the matched load both deployments already meet their SLOs, so dT is a latency
difference within the SLOs, and it mixes in each plan's own parallelism (a TP4 decode instance
steps faster than a TP2 one whether or not the phases interfere). `Verdict.explain` says so in
the report whenever dT and the verdict point different ways; `agrees` tells whether they do.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.ledger.margin import MarginTerms, net_margin_s

DECIDERS = ("kv_link", "no_colocated_plan", "goodput_per_gpu")


@dataclass(frozen=True)
class Verdict:
    """The decision, the test that decided it, and the figures behind it."""

    decision: str  # "colocate" | "disaggregate"
    decided_by: str  # one of DECIDERS
    goodput_gain: float | None  # disaggregated / colocated goodput per GPU - 1
    delta_t_s: float | None  # ledger net margin at the matched load (reported, not deciding)

    @property
    def agrees(self) -> bool | None:
        """Whether dT points the same way as the verdict (None when there is no dT)."""
        if self.delta_t_s is None:
            return None
        return (self.delta_t_s > 0) == (self.decision == "disaggregate")

    def explain(self, margin: float) -> str:
        """The deciding test and its figure, then what dT says when it points the other way."""
        gain = "-" if self.goodput_gain is None else f"{self.goodput_gain:+.1%}"
        reason = {
            "kv_link": "no K/V-feasible disaggregated plan with positive goodput",
            "no_colocated_plan": "no colocated plan fits; the disaggregated one is the only deployment",
            "goodput_per_gpu": f"goodput per GPU (both SLOs met): disaggregated {gain} vs colocated, "
                               f"disaggregate only above +{margin:.0%}",
        }[self.decided_by]
        if self.agrees is False:
            faster = "disaggregated" if self.delta_t_s > 0 else "colocated"
            reason += (f"; dT {self.delta_t_s * 1e3:+.1f} ms/request: at matched load a request finishes sooner "
                       f"{faster}, within both SLOs (latency, not capacity: it does not decide)")
        return reason


def decide(colo_per_gpu: float | None, disagg_per_gpu: float | None, disagg_feasible: bool, margin: float,
           terms: MarginTerms | None) -> Verdict:
    """Apply the rule of the module contract. `colo_per_gpu` / `disagg_per_gpu` are goodput per
    GPU (None or 0: no plan), `terms` the ledger's dT terms at the matched load (None: not run)."""
    delta = None if terms is None else net_margin_s(terms)
    if not disagg_feasible or not disagg_per_gpu:
        return Verdict("colocate", "kv_link", None, delta)
    if not colo_per_gpu:
        return Verdict("disaggregate", "no_colocated_plan", None, delta)
    gain = disagg_per_gpu / colo_per_gpu - 1
    return Verdict("disaggregate" if gain > margin else "colocate", "goodput_per_gpu", gain, delta)


TIE_BAND = 0.1  # a disagg/colocated ratio within 1 +- TIE_BAND is a tie: the terms named decide it


def is_tie(goodput_gain: float | None, band: float = TIE_BAND) -> bool:
    """Whether a disaggregated-vs-colocated gain is within the tie band."""
    return goodput_gain is not None and abs(goodput_gain) <= band


def tie_reading(ratio_a: float | None, ratio_b: float | None, band: float = TIE_BAND) -> str:
    """Two planners' disagg/colocated ratios read together: "agree" (same side of 1), "tie" (they
    straddle 1, both within `band` of it: neither verdict is confident), "disagree" or "n/a"."""
    if ratio_a is None or ratio_b is None:
        return "n/a"
    if (ratio_a > 1) == (ratio_b > 1):
        return "agree"
    return "tie" if abs(ratio_a - 1) <= band and abs(ratio_b - 1) <= band else "disagree"
