"""The router's cost model: seconds for queueing, prefill, decode steps and K/V transfer.

Every estimate is a plain affine formula so it can be fitted from measurements later (least
squares over engine/transfer benchmarks) and so it evaluates identically on Python floats and
numpy arrays: the vectorised policies and the scalar reference compute bit-identical clocks.

Defaults describe a 7B-class fp16 model on one modern GPU and are placeholders until fitted:
    prefill: 5 ms fixed + 0.1 ms per prompt token     (~10k prompt tokens/s)
    decode step: 10 ms + 0.2 ms per sequence in the batch
    transfer: 1 ms setup + bytes / bandwidth, 20 GB/s same host, 5 GB/s (~40 Gb/s) cross host
    K/V bytes per token: 512 KiB (32 layers * 2 * 32 heads * 128 dims * 2 bytes)
    prefix fetch (issue 19): a transfer over the measured fetch link rate (none: the path rates)
        + a fixed per-fetch overhead (the router's round trips; 0 until measured)
    host tier -> device pool copy (a host-tier hit's promotion): 10 GB/s until measured
The transfer terms are the prior until the first measurement: the serving router prices the
handoff link from the transfers its workers report (router/pricing/link_rates.py, `with_link`),
and replaces the fetch and host-copy terms with live measurements (router/pricing/kv_rates.py)
when its prefill terms are measured too (`fitted`); everything else stays as configured.

Tensor parallelism (router/pricing/tp_pricing.py): one model prices a pair of workers, the prefill terms
at the prefill worker's TP size and the decode terms at the decode worker's (`scaled`; the router
holds one per pair of sizes, TpPricing); a prefill that runs on the decode worker (the P/D
decision's local route) is priced by `at_decode_worker`, whose prefill terms are scaled by
`decode_worker_prefill_factor` with `decode_worker_prefill_fixed_s` added to its fixed term and
`decode_worker_prefill_s_per_token` to its per-token term (a TP step's collectives; 1, 0, 0 when
both run the same TP size).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TypeVar

import numpy as np

from pdserve.engine.kv.kv_abi import KvAbi

Num = TypeVar("Num")  # float or numpy array; the formulas below work on both


def prefill_line(overhead_s: Num, s_per_token: Num, compute_tokens: Num) -> Num:
    """A prefill's seconds: its fixed cost plus its computed tokens at the per-token rate (scalars,
    or [P] arrays of each prefill slot's own terms: `snapshot.prefill_coefficients`)."""
    return overhead_s + compute_tokens * s_per_token


def transfer_line(overhead_s: Num, transfer_bytes: Num, bytes_per_s: Num) -> Num:
    """A K/V transfer's seconds over one path: its setup plus its bytes at the path's rate (the
    handoff's `transfer_s`, and each KV-Runahead chain link's per-layer hop)."""
    return overhead_s + transfer_bytes / bytes_per_s


@dataclass(frozen=True)
class CostModel:
    prefill_s_per_token: float = 1.0e-4
    prefill_overhead_s: float = 5.0e-3
    decode_step_base_s: float = 1.0e-2
    decode_step_s_per_seq: float = 2.0e-4
    same_host_bytes_per_s: float = 20.0e9
    cross_host_bytes_per_s: float = 5.0e9
    transfer_overhead_s: float = 1.0e-3
    kv_bytes_per_token: int = 32 * 2 * 32 * 128 * 2
    block_size_tokens: int = 16
    # a profile's per-context-token decode cost and the context `decode_step_s_per_seq` assumes
    # (`decode_step_at`); zero: a sequence costs the same whatever its context
    decode_step_s_per_context_token: float = 0.0
    decode_reference_tokens: int = 0
    # a profile's per-causal-pair prefill cost and the prompt chunk `prefill_s_per_token` assumes
    # (`prefill_chunk_s`); zero: a prompt token costs the same whatever the context before it
    prefill_s_per_pair: float = 0.0
    prefill_reference_tokens: int = 0
    # K/V placement (fetch_s, promote_s): measured by the serving router (router/pricing/kv_rates.py)
    fetch_bytes_per_s: float = 0.0  # a prefix fetch's link rate; 0: the transfer path rates
    fetch_overhead_s: float = 0.0  # fixed seconds per fetch beyond transfer_s (reserve/serve/done round trips)
    host_copy_bytes_per_s: float = 10.0e9  # host tier -> device pool (a host-tier hit is copied back first)
    fitted: bool = False  # prefill and decode terms measured on this machine (from_profile), not placeholders
    # a prefill on a decode worker over one on a prefill worker (their TP sizes differ; tp_pricing.py)
    decode_worker_prefill_factor: float = 1.0
    decode_worker_prefill_fixed_s: float = 0.0
    decode_worker_prefill_s_per_token: float = 0.0

    def __post_init__(self) -> None:
        rates = (self.same_host_bytes_per_s, self.cross_host_bytes_per_s, self.block_size_tokens)
        if min(rates) <= 0 or self.kv_bytes_per_token <= 0:
            raise ValueError("CostModel bandwidths, block size and bytes per token must be positive")
        if self.same_host_bytes_per_s < self.cross_host_bytes_per_s:
            # the policies' per-host decomposition relies on a same-host path never being slower
            raise ValueError("same-host bandwidth must be at least the cross-host bandwidth")
        if self.fetch_bytes_per_s < 0 or self.fetch_overhead_s < 0 or self.host_copy_bytes_per_s <= 0:
            raise ValueError("fetch rate and overhead must be >= 0 and the host copy rate positive")
        if self.decode_worker_prefill_factor <= 0:
            raise ValueError("decode_worker_prefill_factor must be positive")
        rates = np.array([[self.same_host_bytes_per_s], [self.cross_host_bytes_per_s]])  # [2, 1]
        rates.flags.writeable = False
        object.__setattr__(self, "_path_rates", rates)  # derived, not a field: eq, hash and repr ignore it
        coefficients = np.array(  # the layout kernels.fastest_pair reads (its prefill terms come per slot)
            [self.transfer_overhead_s, self.same_host_bytes_per_s, self.cross_host_bytes_per_s]
        )
        coefficients.flags.writeable = False
        object.__setattr__(self, "kernel_coefficients", coefficients)

    @classmethod
    def from_abi(cls, abi: KvAbi, **overrides: float) -> CostModel:
        """A cost model whose byte and block sizes come from the cluster's K/V ABI."""
        base = cls(kv_bytes_per_token=abi.bytes_per_token, block_size_tokens=abi.block_size)
        return replace(base, **overrides)

    @classmethod
    def from_profile(cls, abi: KvAbi, profile: dict, reference_tokens: int) -> CostModel:
        """The cost model of a `pdserve profile` fit (its JSON: prefill_s = a + b*rows + c*causal
        pairs, decode_step_s = a + b*batch + c*context tokens), made affine at `reference_tokens`
        (the serving chunk): a prompt's causal pairs n(n+1)/2 cost c*(reference+1)/2 per token,
        and each sequence in a decode batch carries a context of that many tokens."""
        a_p, b_p, c_p = (float(x) for x in profile["prefill_coef"])
        a_d, b_d, c_d = (float(x) for x in profile["decode_coef"])
        return cls.from_abi(abi, fitted=True, prefill_overhead_s=a_p, prefill_s_per_token=b_p + c_p * (reference_tokens + 1) / 2,
                            decode_step_base_s=a_d, decode_step_s_per_seq=b_d + c_d * reference_tokens,
                            decode_step_s_per_context_token=c_d, decode_reference_tokens=reference_tokens,
                            prefill_s_per_pair=c_p, prefill_reference_tokens=reference_tokens)

    def scaled(self, prefill: float, decode: float) -> CostModel:
        """This model with every prefill term times `prefill` and every decode term times `decode`
        (a worker whose steps take that much longer than the ones these terms describe)."""
        if prefill <= 0 or decode <= 0:
            raise ValueError(f"time factors must be positive, got {prefill}, {decode}")
        if prefill == 1.0 and decode == 1.0:
            return self
        return replace(self, prefill_overhead_s=self.prefill_overhead_s * prefill,
                       prefill_s_per_token=self.prefill_s_per_token * prefill, prefill_s_per_pair=self.prefill_s_per_pair * prefill,
                       decode_step_base_s=self.decode_step_base_s * decode, decode_step_s_per_seq=self.decode_step_s_per_seq * decode,
                       decode_step_s_per_context_token=self.decode_step_s_per_context_token * decode)

    def at_decode_worker(self) -> CostModel:
        """The model of a prefill that runs on a decode worker (its prefill terms at the decode
        role's TP size); this model itself when the roles' sizes price alike."""
        extra = (self.decode_worker_prefill_fixed_s, self.decode_worker_prefill_s_per_token)
        if self.decode_worker_prefill_factor == 1.0 and extra == (0.0, 0.0):
            return self
        found = self.__dict__.get("_at_decode_worker")  # built once: a route asks several times
        if found is None:
            scaled = self.scaled(self.decode_worker_prefill_factor, 1.0)
            found = replace(scaled, prefill_overhead_s=scaled.prefill_overhead_s + extra[0],
                            prefill_s_per_token=scaled.prefill_s_per_token + extra[1], decode_worker_prefill_factor=1.0,
                            decode_worker_prefill_fixed_s=0.0, decode_worker_prefill_s_per_token=0.0)
            object.__setattr__(self, "_at_decode_worker", found)  # derived, not a field: eq, hash and repr ignore it
        return found

    def with_link(self, same_host_bytes_per_s: float, cross_host_bytes_per_s: float, overhead_s: float) -> CostModel:
        """This model with the handoff link priced as measured (link_rates.py); its step terms are
        this model's, so `steps_of` names the model they came from (a snapshot's load terms for it
        serve this one too)."""
        priced = replace(self, same_host_bytes_per_s=same_host_bytes_per_s, cross_host_bytes_per_s=cross_host_bytes_per_s,
                         transfer_overhead_s=overhead_s)
        object.__setattr__(priced, "_steps_of", self.steps_of)  # derived, not a field: eq, hash and repr ignore it
        return priced

    @property
    def steps_of(self) -> CostModel:
        """The model whose step terms this one carries: itself unless `with_link` made it."""
        return self.__dict__.get("_steps_of", self)

    def queue_s(self, pending_prompt_tokens: Num) -> Num:
        """Time for a prefill worker to drain the prompt tokens already queued on it."""
        return pending_prompt_tokens * self.prefill_s_per_token

    def prefill_s(self, compute_tokens: Num) -> Num:
        return prefill_line(self.prefill_overhead_s, self.prefill_s_per_token, compute_tokens)

    def prefill_chunk_s(self, chunk_tokens: int, context_tokens: int) -> float:
        """One prefill step of `chunk_tokens` rows after `context_tokens` already in the sequence's
        K/V (the profile's own form: each row attends to the context and the rows before it, so a
        later chunk of a long prompt costs more; `prefill_s` prices every row at the reference)."""
        pairs_per_row = context_tokens + (chunk_tokens + 1) / 2 - (self.prefill_reference_tokens + 1) / 2
        return float(self.prefill_s(chunk_tokens)) + self.prefill_s_per_pair * chunk_tokens * pairs_per_row

    def chunked_prefill_s(self, compute_tokens: int, cached_tokens: int, chunk_tokens: int) -> list[float]:
        """The steps of a prefill of `compute_tokens` rows after `cached_tokens` of prefix, cut as
        the engine cuts them: chunks end on multiples of `chunk_tokens` (the worker's step budget)
        counted from the prompt's start, so a prefix that ends mid-chunk leaves a short first chunk;
        `prefill_chunk_s` of each."""
        chunk, steps, done = max(1, chunk_tokens), [], 0
        while done < compute_tokens:
            rows = min(chunk - (cached_tokens + done) % chunk, compute_tokens - done)
            steps.append(self.prefill_chunk_s(rows, cached_tokens + done))
            done += rows
        return steps

    def decode_step_s(self, batch: Num) -> Num:
        return self.decode_step_base_s + batch * self.decode_step_s_per_seq

    def decode_step_at(self, batch: float, context_tokens: float) -> float:
        """A decode step of `batch` sequences of `context_tokens` each (the profile's own form;
        `decode_step_s` assumes the reference context)."""
        per_seq = self.decode_step_s_per_seq + self.decode_step_s_per_context_token * (
            context_tokens - self.decode_reference_tokens)
        return self.decode_step_base_s + batch * per_seq

    def admission_delay_s(self, active_batch: Num) -> Num:
        """A new sequence joins a running decode batch at the next step boundary: one step."""
        return (active_batch > 0) * self.decode_step_s(active_batch)

    def transfer_s(self, transfer_bytes: Num, same_host: Num) -> Num:
        """Seconds to move K/V between workers; zero bytes cost nothing (no transfer is set up)."""
        bandwidth = same_host * self.same_host_bytes_per_s + (1 - same_host) * self.cross_host_bytes_per_s
        return (transfer_bytes > 0) * transfer_line(self.transfer_overhead_s, transfer_bytes, bandwidth)

    def transfer_s_paths(self, transfer_bytes: Num) -> tuple[Num, Num]:
        """(same-host, cross-host) `transfer_s`, bit-identical to the two calls, sharing one test."""
        moved = transfer_bytes > 0
        return (
            moved * transfer_line(self.transfer_overhead_s, transfer_bytes, self.same_host_bytes_per_s),
            moved * transfer_line(self.transfer_overhead_s, transfer_bytes, self.cross_host_bytes_per_s),
        )

    def transfer_s_stacked(self, transfer_bytes: np.ndarray) -> np.ndarray:
        """[2, n]: rows (same-host, cross-host) of `transfer_s_paths` for byte counts that are all
        positive (the zero test would multiply by 1), both paths in one broadcast pass."""
        return transfer_line(self.transfer_overhead_s, transfer_bytes, self._path_rates)

    def fetch_s(self, fetch_bytes: Num, same_host: Num) -> Num:
        """Seconds to fetch a prefix from another worker: `transfer_s` over the path, at the
        measured fetch link rate when there is one (never faster across hosts than the cross-host
        rate), plus the fixed per-fetch overhead; zero bytes cost nothing (no fetch is made)."""
        same_bps, cross_bps = self.same_host_bytes_per_s, self.cross_host_bytes_per_s
        if self.fetch_bytes_per_s > 0:
            same_bps, cross_bps = self.fetch_bytes_per_s, min(cross_bps, self.fetch_bytes_per_s)
        bandwidth = same_host * same_bps + (1 - same_host) * cross_bps
        return (fetch_bytes > 0) * transfer_line(self.transfer_overhead_s + self.fetch_overhead_s, fetch_bytes, bandwidth)

    def promote_s(self, host_blocks: Num) -> Num:
        """Seconds to copy `host_blocks` host-tier blocks back into the device pool (a host-tier
        hit is a hit at this price, not a free one)."""
        return host_blocks * (self.block_size_tokens * self.kv_bytes_per_token / self.host_copy_bytes_per_s)
