"""Router configuration: serving mode, cluster shape, SLO targets, heartbeat timing, policy.

`--mode disaggregated --prefill N --decode M` (any xPyD) and `--mode colocated --replicas N`
map onto `ClusterShape`; both drive the same `Router` API, only the accepted worker roles differ.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pdserve.router.kv.kv_index import DEFAULT_MAX_ENTRIES
from pdserve.router.messages import Role
from pdserve.router.policy.pd_decision import PdPolicy
from pdserve.router.pricing.cost import CostModel
from pdserve.router.pricing.tp_pricing import TpPricing


class Mode(str, enum.Enum):
    DISAGGREGATED = "disaggregated"
    COLOCATED = "colocated"

    @property
    def roles(self) -> frozenset[Role]:
        if self is Mode.COLOCATED:
            return frozenset({Role.COLOCATED})
        # colocated workers join a disaggregated cluster while its disaggregation is switched off
        return frozenset({Role.PREFILL, Role.DECODE, Role.COLOCATED, Role.MIXED})


@dataclass(frozen=True)
class ClusterShape:
    """How many workers of each role a launcher starts."""

    mode: Mode
    num_prefill: int = 0
    num_decode: int = 0
    num_colocated: int = 0
    num_mixed: int = 0  # Splitwise's mixed pool (splitwise mode: --mixed M)

    def __post_init__(self) -> None:
        counts = (self.num_prefill, self.num_decode, self.num_colocated, self.num_mixed)
        if min(counts) < 0:
            named = zip(("--prefill", "--decode", "--replicas", "--mixed"), counts)
            raise ValueError("worker counts must be >= 0, got " + " ".join(f"{flag} {n}" for flag, n in named if n))
        if not sum(counts):
            raise ValueError("no workers: give at least one (--prefill/--decode, --mixed in splitwise mode, --replicas)")
        if self.mode is Mode.DISAGGREGATED and self.num_mixed and self.num_colocated:
            raise ValueError("a mixed pool takes no replicas")
        if self.mode is Mode.DISAGGREGATED and not self.num_mixed and (self.num_prefill < 1 or self.num_decode < 1 or self.num_colocated):
            raise ValueError("disaggregated mode needs --prefill >= 1 and --decode >= 1 and no replicas")
        if self.mode is Mode.COLOCATED and (self.num_colocated < 1 or self.num_prefill or self.num_decode or self.num_mixed):
            raise ValueError("colocated mode needs --replicas >= 1 and no prefill/decode/mixed workers")

    @classmethod
    def disaggregated(cls, num_prefill: int, num_decode: int, num_mixed: int = 0) -> ClusterShape:
        return cls(Mode.DISAGGREGATED, num_prefill=num_prefill, num_decode=num_decode, num_mixed=num_mixed)

    @classmethod
    def colocated(cls, replicas: int) -> ClusterShape:
        return cls(Mode.COLOCATED, num_colocated=replicas)

    def roles(self) -> list[Role]:
        """One role per worker to launch, prefill workers first."""
        return ([Role.PREFILL] * self.num_prefill + [Role.DECODE] * self.num_decode + [Role.MIXED] * self.num_mixed
                + [Role.COLOCATED] * self.num_colocated)


@dataclass(frozen=True)
class RouterConfig:
    mode: Mode
    model_identity: str
    kv_abi_hash: str
    policy: str = "slo"  # one of policies.POLICIES
    decode_choice: str = "policy"  # "p2c": the decode side by power-of-two choices on heavy/light (decode_choice.py)
    cost: CostModel = field(default_factory=CostModel)
    # each worker at its registered TP size (tp_pricing.py; `cost` is its pair at the role sizes);
    # None: every worker priced by `cost`
    pricing: TpPricing | None = None
    ttft_slo_s: float = 2.0  # default targets for requests that carry none
    tpot_slo_s: float = 0.1
    heartbeat_interval_s: float = 1.0
    missed_heartbeats: int = 3  # a worker silent this many intervals is retired
    retry_after_s: float = 1.0  # suggested Retry-After when capacity is exhausted
    pd: PdPolicy = field(default_factory=PdPolicy)  # per-request P/D decision (disaggregated mode); "always" here,
    # `pdserve serve` defaults to "margin" (ServeConfig)
    kv_index_max_entries: int = DEFAULT_MAX_ENTRIES  # cluster K/V index bound (router/kv/kv_index.py; LRU past it)
    kv_sharing: bool = False  # the prefix policy credits prefixes other workers hold (fetch_plan.py)

    @property
    def heartbeat_timeout_s(self) -> float:
        return self.heartbeat_interval_s * self.missed_heartbeats
