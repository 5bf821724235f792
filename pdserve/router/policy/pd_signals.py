"""What the router observes between routes for the P/D decision, and the decision for a chosen pair.

Contract: `PdSignals` keeps the traffic and the decode workers' clocks the decision reads: the
recent arrival rate and median prompt (`observe_route`, once per routed or refused request, after
its decision), the handoffs' outcomes (`transfer_ended`; `failure_rate`), and per decode worker the
mean TPOT of its live requests (`note_measured_tpot`) and its running decodes' own budgets with
their recent p90 inter-token gap (`note_decode_clocks`), both from the frontend once per heartbeat
(pricing/decode_clocks.py). `decide(...)` is the decision for the policy's chosen pair over the
snapshot the policy read (pd_decision.py), priced by the pair's cost model; nothing here holds
blocks or routes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from pdserve.ledger.margin import DecodeBudget
from pdserve.router.messages import RouteRequest
from pdserve.router.policy.choice import Choice
from pdserve.router.policy.pd_decision import PdDecision, PdPolicy, decide_pd, decision_slos, facts_for
from pdserve.router.pricing.cost import CostModel
from pdserve.router.pricing.decode_clocks import ArrivalRate, PromptLengths
from pdserve.router.state.snapshot import Snapshot


class PdSignals:
    def __init__(self, clock: Callable[[], float]):
        self._clock = clock
        self.arrivals = ArrivalRate()  # the recent arrival rate
        self.prompts = PromptLengths()  # and the recent median prompt (its default TTFT target)
        self._transfers: Counter[str] = Counter()  # "ended", "failed": the observed failure rate
        self._measured_tpot: dict[str, float] = {}  # per decode worker: its live requests' mean TPOT
        self._decode_clocks: dict[str, tuple[tuple[DecodeBudget, ...], float]] = {}  # per decode worker: budgets, p90 ITL

    def observe_route(self, prompt_tokens: int) -> None:
        """A request was decided: after its decision, which read the rate of the arrivals before it."""
        self.arrivals.observe(self._clock())
        self.prompts.observe(prompt_tokens)

    def transfer_ended(self, failed: bool) -> None:
        self._transfers["ended"] += 1
        self._transfers["failed"] += int(failed)

    def failure_rate(self) -> float:
        return self._transfers["failed"] / self._transfers["ended"] if self._transfers["ended"] else 0.0

    def note_measured_tpot(self, worker_id: str, tpot_s: float) -> None:
        """The mean TPOT a worker's live requests have had so far (the frontend, per heartbeat)."""
        self._measured_tpot[worker_id] = tpot_s

    def note_decode_clocks(self, worker_id: str, budgets: tuple[DecodeBudget, ...], itl_p90_s: float) -> None:
        """A decode worker's running decodes' own budgets and its recent p90 inter-token gap (the
        frontend's token clocks, per heartbeat): the decision's slack and gap terms."""
        self._decode_clocks[worker_id] = (budgets, itl_p90_s)

    def decide(self, snapshot: Snapshot, request: RouteRequest, choice: Choice, cost: CostModel, policy: PdPolicy,
               slos: tuple[float, float], decode_routed: Callable[[str], int]) -> PdDecision:
        """The decision for the chosen pair of two workers; `slos` the configured (TTFT, TPOT) targets,
        `decode_routed(worker)` the live routes to a decode worker."""
        if policy.mode == "never" or (policy.mode == "always" and not policy.min_prompt_tokens):
            return decide_pd(None, policy, cost, *slos)  # no facts read: the hot path
        ps, ds = choice.prefill_slot, choice.decode_slot
        decode_id = snapshot.decode.worker_ids[ds]
        budgets, itl_p90_s = self._decode_clocks.get(decode_id, ((), 0.0))
        p_hit = choice.prefill_hit_blocks if choice.terms is None else choice.terms.hit_blocks  # with a fetch that pays
        facts = facts_for(request, p_hit, choice.decode_hit_blocks, bool(snapshot.same_host[ps, ds]),
                          int(snapshot.decode.active_batch[ds]), int(snapshot.prefill.pending_tokens[ps]),
                          self.failure_rate(), cost, int(snapshot.decode.pending_tokens[ds]),
                          self.arrivals.rate(self._clock()), decode_routed(decode_id),
                          self._measured_tpot.get(decode_id, 0.0), budgets, itl_p90_s)
        return decide_pd(facts, policy, cost, *decision_slos(request, facts, policy, cost, self.prompts.median()))
