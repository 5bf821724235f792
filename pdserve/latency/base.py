"""Latency models: how long one engine iteration takes, as a function of what it runs.

Contract shared by every model (all times in seconds, all counts in tokens):

- ``prefill_s(new, cached)``: one request's prefill alone, `new` rows after `cached` visible rows;
- ``prefill_batch_s(news, cacheds)``: one batched prefill of several requests;
- ``decode_step_s(batch, context)``: one decode iteration of `batch` sequences whose visible
  lengths (each including its current row) sum to `context`; ``decode_segment_s`` gives the
  first step and the per-step growth of a run of such iterations;
- ``mixed_step_s(chunk, pairs, kv, fraction, batch, context)``: one colocated iteration running a
  prefill chunk of `chunk` rows with `pairs` causal query-key pairs touching `kv` K/V tokens
  (cached + 2 * new, summed; `fraction` of its requests' prompts) next to a decode batch;
- ``pipeline_stages``: a prefill's result is ready after the full latency, while the instance
  takes its next prefill once the first stage frees, after ``prefill_stage_s(latency)``
  (latency / stages unless a model says which part of a prefill does not pipeline);
- ``kv_bytes_per_token`` (0: transfers are free) and ``kv_capacity_tokens`` (None: unbounded).

Kinds: ``constant`` (here; queueing-theory checks), ``roofline`` (analytic, `roofline.py`),
``profiled`` (fitted to `pdserve profile` measurements, `profiled.py`), ``aic`` (NVIDIA's
measured kernel data through aiconfigurator, `aic.py`) and ``distserve`` (DistServe's fitted A100
step times, `distserve_fit.py`). `load.py` reads the first three from JSON, `spec.py` resolves
``--latency-model`` to any of them. This module imports nothing of its siblings; they import it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

def causal_pairs(new_tokens: int, cached_tokens: int) -> int:
    """Query-key pairs of a prefill chunk: N*T0 + N(N+1)/2 (ledger `prefill_causal_pairs`)."""
    return new_tokens * cached_tokens + new_tokens * (new_tokens + 1) // 2


class LatencyModel(ABC):
    """Iteration cost of one serving instance (see the module contract)."""

    pipeline_stages: int = 1
    kv_bytes_per_token: int = 0
    kv_capacity_tokens: int | None = None

    @abstractmethod
    def prefill_batch_s(self, new_tokens: Sequence[int], cached_tokens: Sequence[int]) -> float: ...

    @abstractmethod
    def decode_step_s(self, batch: int, context_tokens: int) -> float: ...

    @abstractmethod
    def mixed_step_s(self, chunk_tokens: int, chunk_pairs: int, chunk_kv_tokens: int, chunk_fraction: float,
                     batch: int, context_tokens: int) -> float: ...

    @abstractmethod
    def to_dict(self) -> dict: ...

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        return self.prefill_batch_s((new_tokens,), (cached_tokens,))

    def prefill_stage_s(self, latency_s: float) -> float:
        """How long a prefill of `latency_s` holds the first pipeline stage (its stage interval)."""
        return latency_s / self.pipeline_stages

    def decode_segment_s(self, batch: int, context_tokens: int) -> tuple[float, float]:
        """(first step, growth per step) of a decode segment: d0 = step(B, C) and
        d1 = step(B, C + B) - d0 (the context grows by B per step)."""
        d0 = self.decode_step_s(batch, context_tokens)
        return d0, self.decode_step_s(batch, context_tokens + batch) - d0


@dataclass(frozen=True)
class ConstantLatency(LatencyModel):
    """Every prefill takes `prefill_ms` (a batch of k takes k times that); every decode step
    `decode_step_ms`, whatever its size. A colocated chunk costs its prompt fraction of a prefill."""

    prefill_ms: float
    decode_step_ms: float
    kv_bytes_per_token: int = 0
    kv_capacity_tokens: int | None = None

    def prefill_batch_s(self, new_tokens: Sequence[int], cached_tokens: Sequence[int]) -> float:
        return len(new_tokens) * self.prefill_ms * 1e-3

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        return self.decode_step_ms * 1e-3 if batch > 0 else 0.0

    def mixed_step_s(self, chunk_tokens: int, chunk_pairs: int, chunk_kv_tokens: int, chunk_fraction: float,
                     batch: int, context_tokens: int) -> float:
        return chunk_fraction * self.prefill_ms * 1e-3 + self.decode_step_s(batch, context_tokens)

    def to_dict(self) -> dict:
        out = {"kind": "constant", "prefill_ms": self.prefill_ms, "decode_step_ms": self.decode_step_ms}
        if self.kv_bytes_per_token:
            out["kv_bytes_per_token"] = self.kv_bytes_per_token
        if self.kv_capacity_tokens is not None:
            out["kv_capacity_tokens"] = self.kv_capacity_tokens
        return out
