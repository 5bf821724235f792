"""The planner's one decision rule: colocate or disaggregate, and which test decided it.

Contract: `decide` disaggregates only when all three hold, checked in this order; the first that
fails decides for colocation and is named in `Verdict.decided_by`:

1. ``kv_link``: a disaggregated plan exists, has positive goodput, and its K/V transfer demand
   fits the link it was planned on;
2. ``goodput_per_gpu``: its goodput per GPU beats the best colocated plan's by more than
   `margin` (a fraction). This is the capacity test: requests served within both SLOs per GPU;
3. ``net_margin``: at a matched offered load (both deployments inside their SLOs) the ledger's
   `should_enable_pd` holds: dT (seconds saved per request: interference saved minus exposed
   transfer, routing delta and failure penalty) is above `safety_margin_s`, and the
   disaggregated deployment passes the attainment gates there. This is the latency test.

A positive dT beside ``colocate`` therefore always means: requests would finish sooner
disaggregated, but the disaggregated plan serves too few of them per GPU (test 2 decided). A
``disaggregate`` verdict always carries dT > safety margin. With no colocated plan at all the
disaggregated one wins on test 1 alone (``decided_by = "no_colocated_plan"``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.ledger.margin import MarginTerms, net_margin_s, should_enable_pd

DECIDERS = ("kv_link", "goodput_per_gpu", "net_margin", "no_colocated_plan", "all")


@dataclass(frozen=True)
class Verdict:
    """The decision, the test that decided it, and the two figures behind tests 2 and 3."""

    decision: str  # "colocate" | "disaggregate"
    decided_by: str  # one of DECIDERS ("all": every test passed)
    goodput_gain: float | None  # disaggregated / colocated goodput per GPU - 1
    delta_t_s: float | None  # ledger net margin at the matched load

    def explain(self, margin: float) -> str:
        """One sentence naming the deciding test and what it measured."""
        gain = "-" if self.goodput_gain is None else f"{self.goodput_gain:+.1%}"
        dt = "-" if self.delta_t_s is None else f"{self.delta_t_s * 1e3:+.1f} ms/request"
        return {
            "kv_link": "no K/V-feasible disaggregated plan with positive goodput",
            "goodput_per_gpu": f"goodput per GPU: disaggregated {gain} vs colocated, needs > +{margin:.0%} "
                               f"(dT {dt} at matched load is a latency saving, not a capacity one)",
            "net_margin": f"net margin: goodput per GPU {gain} passes, but dT {dt} at matched load does not "
                          "(or the disaggregated plan misses an attainment gate there)",
            "no_colocated_plan": "no colocated plan fits; the disaggregated one is the only deployment",
            "all": f"goodput per GPU {gain} (> +{margin:.0%}) and dT {dt} > 0 with both attainment gates passing",
        }[self.decided_by]


def decide(colo_per_gpu: float | None, disagg_per_gpu: float | None, disagg_feasible: bool, margin: float,
           terms: MarginTerms | None, gates: tuple[bool, bool] = (True, True),
           safety_margin_s: float = 0.0) -> Verdict:
    """Apply the rule of the module contract. `colo_per_gpu` / `disagg_per_gpu` are goodput per
    GPU (None or 0: no plan), `terms` the ledger's dT terms at the matched load and `gates` the
    disaggregated deployment's (TTFT, TPOT) attainment gates there."""
    delta = None if terms is None else net_margin_s(terms)
    if not disagg_feasible or not disagg_per_gpu:
        return Verdict("colocate", "kv_link", None, delta)
    if not colo_per_gpu:
        return Verdict("disaggregate", "no_colocated_plan", None, delta)
    gain = disagg_per_gpu / colo_per_gpu - 1
    if gain <= margin:
        return Verdict("colocate", "goodput_per_gpu", gain, delta)
    if terms is None or not should_enable_pd(terms, safety_margin_s, *gates):
        return Verdict("colocate", "net_margin", gain, delta)
    return Verdict("disaggregate", "all", gain, delta)
