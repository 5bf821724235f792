"""Splitwise's mixed pool in the router: which pool a `mixed` worker serves, decided per route.

A mixed worker (`pdserve serve --mode splitwise --mixed M`) runs both phases: it has a prefill
side (hands K/V off like a prompt worker) and a decode side (receives K/V, decodes, prefills
locally). Where the router offers it is one rule, over the pressure the Splitwise pool controller
already measures (router/splitwise/splitwise.py's signals; no second controller):

    prompt pool pressed            mixed workers join the prefill pool (they take prompt work)
    token pool pressed             mixed workers join the decode pool (they take token work)
    a pool with no worker of its   mixed workers join it (e.g. --prefill 0: they are the prompt
    own (none LIVE)                pool)
    otherwise                      mixed workers are offered in neither pool: a worker of the
                                   right pool is always preferred ...
    ... unless the route is        the router tries once more with the mixed workers in both
    refused (capacity, SLO)        pools (overflow) before it refuses the request

`PressureLatch` is the hysteresis: a pool counts as pressed after `hold` consecutive observations
over its high mark and stays pressed until `hold` consecutive observations under its low mark
(the controller's own marks, `Thresholds`). `MixedOffer` is the latched pair the controller hands
the router after every observation (Router.set_mixed_offer). `membership(...)` is the rule above.

When the policy's chosen prefill and decode slot are the same mixed worker (possible only while
it sits in both pools), the request runs whole there: a local prefill, the route the P/D
decision takes when it says no handoff (router.Router._decide_pd: `WHOLE_ON_MIXED`).

`MixedPools` keeps one snapshot builder (router/state/snapshot.py) per membership, created when first
used and patched with every load report and prefix change like the router's own builders; a
worker in both pools has two slots (a twin) in one snapshot. A cluster without mixed workers
never builds one (`present` is False and the router's snapshot is untouched).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass, field

from pdserve.router.kv.prefix_index import WorkerPrefixes
from pdserve.router.messages import Role, WorkerLoad
from pdserve.router.policy.pd_decision import PdDecision
from pdserve.router.pricing.cost import CostModel
from pdserve.router.pricing.tp_pricing import TpPricing
from pdserve.router.state.registry import Registry
from pdserve.router.state.reservations import InFlight
from pdserve.router.state.snapshot import Snapshot, SnapshotBuilder

WHOLE_ON_MIXED = PdDecision(False, "mixed_whole")  # both phases on one mixed worker: it runs the request whole


@dataclass(frozen=True)
class MixedOffer:
    """The pools' latched pressure: mixed workers take prompt work / token work."""

    prefill: bool = False
    decode: bool = False


@dataclass
class PressureLatch:
    """Pressed after `hold` consecutive values over `high`; released after `hold` under `low`."""

    high: float
    low: float
    hold: int
    pressed: bool = False
    streak: int = 0

    def observe(self, value: float) -> bool:
        crossing = value < self.low if self.pressed else value > self.high
        self.streak = self.streak + 1 if crossing else 0
        if self.streak >= self.hold:
            self.pressed, self.streak = not self.pressed, 0
        return self.pressed


@dataclass
class MixedLatches:
    """The two pools' latches; `observe(prompt pressure, token pressure)` -> the new offer."""

    prompt: PressureLatch
    token: PressureLatch

    def observe(self, prompt_pressure: float, token_pressure: float) -> MixedOffer:
        return MixedOffer(self.prompt.observe(prompt_pressure), self.token.observe(token_pressure))


def membership(offer: MixedOffer, num_prefill: int, num_decode: int, overflow: bool = False) -> tuple[bool, bool]:
    """(mixed workers in the prefill pool, in the decode pool), given the offer, the LIVE workers
    of each pool's own role, and whether the route was refused without them (module contract)."""
    if overflow:
        return True, True
    return offer.prefill or num_prefill == 0, offer.decode or num_decode == 0


@dataclass
class MixedPools:
    """Snapshot builders that put LIVE mixed workers into the pools `membership` names."""

    cost: CostModel | None = None
    pricing: TpPricing | None = None  # each slot at its worker's TP size (snapshot.py)
    prefixes: WorkerPrefixes | None = None  # the router's shared prefix matrix (prefix_index.py)
    builders: dict[tuple[bool, bool], SnapshotBuilder] = field(default_factory=dict)
    live_costs: dict[str, CostModel] = field(default_factory=dict)  # note_cost's, for builders made later
    _known: tuple[int, bool] = (-1, False)  # (membership generation, any LIVE mixed worker)

    def present(self, registry: Registry) -> bool:
        """Some mixed worker is LIVE (cached per membership generation)."""
        gen = registry.membership_generation
        if self._known[0] != gen:
            self._known = (gen, bool(registry.live((Role.MIXED,))))
        return self._known[1]

    def view(self, base: Snapshot, registry: Registry, in_flight: Mapping[str, InFlight], offer: MixedOffer,
             overflow: bool = False) -> Snapshot:
        """`base` (prefill and decode workers only) with the mixed workers added where the rule
        puts them; `base` itself when they go nowhere."""
        key = membership(offer, len(base.prefill), len(base.decode), overflow)
        if key == (False, False):
            return base
        return self.builder(key).build(registry, in_flight)

    def builder(self, key: tuple[bool, bool]) -> SnapshotBuilder:
        if key not in self.builders:
            self.builders[key] = SnapshotBuilder(colocated=False, cost=self.cost, mixed_in=key,
                                                 pricing=self.pricing, prefixes=self.prefixes)
            for worker_id, cost in self.live_costs.items():
                self.builders[key].note_cost(worker_id, cost)
        return self.builders[key]

    def note_load(self, worker_id: str, load: WorkerLoad) -> None:
        for builder in self.builders.values():
            builder.note_load(worker_id, load)

    def note_cost(self, worker_id: str, cost: CostModel | None) -> None:
        if cost is None:
            self.live_costs.pop(worker_id, None)
        else:
            self.live_costs[worker_id] = cost
        for builder in self.builders.values():
            builder.note_cost(worker_id, cost)

    def note_prefix(self, worker_id: str, held: Set[int], added: Iterable[int], removed: Iterable[int]) -> None:
        for builder in self.builders.values():
            builder.note_prefix(worker_id, held, added, removed)
