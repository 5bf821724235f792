"""K/V handoff over links: serialized per-link transfers, request-level or layer-wise.

Contract: each decode instance has one ingress link of `bytes_per_s`, shared FCFS (in order of
prefill completion) by every transfer into it, so transfers contend. A request moves
`kv_tokens * bytes_per_token` logical bytes (ledger `payload_time_s`) split evenly over
`layers`. Request-level: v = max(prefill done, link free) + x. Layer-wise (spec 0x08I): layer l
is ready at start + (l+1) p and v_l = max(r_l, v_{l-1}) + x/L with v_{-1} = link free, whose
closed form for uniform layers is max(free + x, start + p + x, done + x/L) (tests check it
against the ledger's `splitwise.layer_visibility_s` recurrence). Layer-wise is never
later than request-level. Exposed transfer = v - done.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.ledger.kv import payload_time_s

OVERLAP_MODES = ("request", "layer")


@dataclass(frozen=True)
class LinkSpec:
    """Per-decode-instance ingress link; `bytes_per_s=inf` makes transfers free."""

    bytes_per_s: float = float("inf")
    overlap: str = "request"
    layers: int = 1

    def __post_init__(self) -> None:
        if self.overlap not in OVERLAP_MODES:
            raise ValueError(f"transfer overlap must be one of {OVERLAP_MODES}")
        if self.bytes_per_s <= 0 or self.layers < 1:
            raise ValueError("link bandwidth and layer count must be positive")


def transfer_s(payload_bytes: int, link: LinkSpec) -> float:
    """Payload time of one whole-request transfer on an idle link."""
    if payload_bytes <= 0 or link.bytes_per_s == float("inf"):
        return 0.0
    return payload_time_s(payload_bytes, link.bytes_per_s)


def visible_at_s(start_s: float, done_s: float, link_free_s: float, payload_s: float, link: LinkSpec) -> float:
    """When the decode side can see the whole K/V of a prefill that ran [start_s, done_s]."""
    if link.overlap == "request" or link.layers == 1:
        return max(done_s, link_free_s) + payload_s
    per_layer_compute = (done_s - start_s) / link.layers
    return max(link_free_s + payload_s, start_s + per_layer_compute + payload_s, done_s + payload_s / link.layers)


class IngressLinks:
    """One ingress link per decode instance, each serving its transfers in the order they are
    sent (prefill completion order); remembers the exposed transfer over all of them."""

    def __init__(self, link: LinkSpec, kv_bytes_per_token: int, instances: int) -> None:
        self.link, self.bytes_per_token = link, kv_bytes_per_token
        self.free = [0.0] * instances
        self.payload_s: dict[int, float] = {}  # by prompt length
        self.exposed_s, self.moved = 0.0, 0

    def send(self, start_s: float, done_s: float, prompt_tokens: int, instance: int) -> float:
        """When decode instance `instance` sees the K/V of a prefill that ran [start_s, done_s]."""
        payload = self.payload_s.get(prompt_tokens)
        if payload is None:
            payload = self.payload_s[prompt_tokens] = transfer_s(prompt_tokens * self.bytes_per_token, self.link)
        visible = visible_at_s(start_s, done_s, self.free[instance], payload, self.link) if payload else done_s
        if payload:
            self.free[instance] = visible
        self.exposed_s, self.moved = self.exposed_s + visible - done_s, self.moved + 1
        return visible

    @property
    def mean_exposed_s(self) -> float:
        return self.exposed_s / self.moved if self.moved else 0.0

