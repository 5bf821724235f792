"""Analytic roofline latency of one TP x PP instance, built on the ledger's work vectors.

Contract: an iteration is a sequence of kernels, and each kernel is bounded by its own roofline
(docs/planner.md, "Kernels, not one fused step"):

    step_overhead + comm
      + max(F_linear / (tp * C_eff), W_block / (tp * R_eff))            the GEMMs, weights read once
      + sum over attention classes of max(F_attn / (tp * C_eff), KV / (tp * R_eff))

The attention classes of one iteration are its prefill chunk (compute-bound: query-key pairs)
and its decode rows (memory-bound: the K/V they read); they are separate kernels, so a decode
batch's K/V read is not hidden under a chunk's GEMM compute, nor a batch's row compute under its
weight read. F, W and the K/V bytes are exactly `pdserve.ledger.phase` (`linear_flops`,
`attention_flops`, `BlockGeometry.weight_bytes`, `kv_bytes_per_token`); where the GEMMs and the
attention are on the same side of their ridge (a long prompt: both compute; a decode step: both
memory) an iteration equals `lower_bound_s` of the ledger's work plus overhead and
communication, and it is never below it. TP adds two ring all-reduces of the activations per
layer, 2(tp-1)/tp * rows*d*b bytes each plus a collective latency, always on NVLink in one
direction (half the datasheet's bidirectional figure): a stage's TP group sits in one node. PP
adds (pp-1) point-to-point activation hops; stages fill nodes gpus_per_node // tp at a time, and
only the hops between nodes cross the inter-node NIC (`hop_links`).

A profile with measured kernel terms (`kernel_costs.py`, the A100's) replaces the GEMM roofline
by its four GEMM kernels per layer on the measured curve, the all-reduces by the measured table,
and adds the layer's elementwise kernels, which every TP rank runs whole (`rows_s`). A profile
with an `attention` block times each layer's attention kernel on its measured curve, the
context fit for a prefill chunk and the generation fit for decode rows (`attention_s`); without
one, attention keeps the flat efficiencies.

Pipeline parallelism (docs/planner.md, "Pipeline parallelism and its costs"): an instance keeps pp
micro-batches in flight, one per stage; a cycle (every micro-batch advances one stage) lasts pp
times the slowest stage's step, and every sequence gets one token per cycle.

- prefill: a prompt traverses every stage (full latency, plus pp - 1 hops) and frees the first
  stage after its share of the layers plus the whole step overhead (`prefill_stage_s`): the
  driver that schedules each prompt is the first stage's process, so its per-prompt overhead
  runs there, before that stage's layers, and does not pipeline (as in decode, below);
  back-to-back equal prefills fill the pipe at that interval;
- decode: the batch B splits into pp micro-batches of ceil(B/pp); each stage re-reads its
  weights for each of them, so a cycle costs the full-stack time of one micro-batch (PP adds
  K/V memory, not decode speed), plus the scheduler's step overhead once per micro-batch
  ((pp - 1) more than without PP: the driver schedules micro-batches one after another);
- colocated (chunked prefill beside decode): the prefill chunk cannot be spread over the
  micro-batches, so one micro-batch carries the whole chunk with its ceil(B/pp) decodes and
  the others wait on it: the cycle is the full-stack time of that heaviest micro-batch (the
  bubble), plus the per-micro-batch overhead. Without this, PP looked like free compute.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from pdserve.ledger.phase import attention_flops, linear_flops
from pdserve.latency.geometry import ModelSpec, load_model_spec
from pdserve.latency.hardware import HardwareProfile, load_hardware
from pdserve.latency.kernel_costs import layer_gemms
from pdserve.latency.base import LatencyModel


@dataclass(frozen=True)
class RooflineLatency(LatencyModel):
    """Roofline iteration cost of `model` on a tp x pp instance of `hardware`."""

    model: ModelSpec
    hardware: HardwareProfile
    tp: int = 1
    pp: int = 1
    _coef: tuple = field(init=False, repr=False, compare=False)
    _rows_memo: dict = field(init=False, repr=False, compare=False)
    _attn: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1:
            raise ValueError("tp and pp must be >= 1")
        g, hw = self.model.geometry, self.hardware
        act_bytes_per_row = g.d_model * g.dtype_bytes
        tp_bytes_per_row = 2 * g.layers * 2 * (self.tp - 1) / self.tp * act_bytes_per_row
        near, far = self.hop_links
        hops_per_row = act_bytes_per_row * (near / hw.nvlink_send_bytes_per_s + far / hw.internode_bytes_per_s)
        tp_per_row = 0.0 if hw.allreduce is not None else tp_bytes_per_row / hw.nvlink_send_bytes_per_s
        tp_fixed = 2 * g.layers * hw.collective_latency_s if self.tp > 1 and hw.allreduce is None else 0.0
        coef = (
            linear_flops(g, 1) / (self.tp * hw.effective_flops_per_s),  # s per new row (compute)
            attention_flops(g, 1) / (self.tp * hw.effective_flops_per_s),  # s per causal pair
            g.weight_bytes / (self.tp * hw.effective_bytes_per_s),  # s to read the weights once
            g.kv_bytes_per_token / (self.tp * hw.effective_bytes_per_s),  # s per K/V token touched
            tp_per_row + hops_per_row,  # s of comm per row
            hw.step_overhead_s + tp_fixed + (self.pp - 1) * hw.collective_latency_s,
        )
        object.__setattr__(self, "_coef", coef)
        object.__setattr__(self, "_rows_memo", {})
        # attention_s's per-layer, per-rank constants (the simulator's hottest call): F_attn(1), K/V bytes
        # per token, the layers x ranks they are spread over
        object.__setattr__(self, "_attn", (attention_flops(g, 1), g.kv_bytes_per_token, g.layers * self.tp))

    @property
    def hop_links(self) -> tuple[int, int]:
        """(NVLink hops, inter-node hops) between the pp stages: a stage's tp GPUs sit in one
        node (`gpus_per_node // tp` stages to a node, DistServe's placement), so only the hops
        between nodes cross the NIC; TP's all-reduces always stay on NVLink."""
        per_node = max(1, self.hardware.gpus_per_node // self.tp)
        far = (self.pp - 1) // per_node
        return self.pp - 1 - far, far

    def rows_s(self, rows: int) -> float:
        """The part of an iteration that depends only on its new rows: step overhead, the GEMM
        kernels, TP's all-reduces and PP's activation hops (memoised per row count)."""
        memo = self._rows_memo
        value = memo.get(rows)
        if value is None:
            value = memo[rows] = self._rows_s(rows)
        return value

    def _rows_s(self, rows: int) -> float:
        row_f, _, weight_b, _, comm, fixed = self._coef
        g, hw = self.model.geometry, self.hardware
        if hw.gemm is None:
            linear = row_f * rows
            gemms = linear if linear > weight_b else weight_b
        else:
            gemms = g.layers * sum(hw.gemm.seconds(rows, n, k, g.dtype_bytes) for n, k in layer_gemms(g, self.tp))
        if hw.allreduce is not None:
            gemms += 2 * g.layers * hw.allreduce.seconds(rows * g.d_model * g.dtype_bytes, self.tp)
        if hw.elementwise is not None:
            gemms += g.layers * hw.elementwise.seconds(rows, g.d_model, g.dtype_bytes)
        return fixed + comm * rows + gemms

    @property
    def pipeline_stages(self) -> int:  # type: ignore[override]
        return self.pp

    @property
    def kv_bytes_per_token(self) -> int:  # type: ignore[override]
        return self.model.kv_bytes_per_token

    @property
    def kv_capacity_tokens(self) -> int:  # type: ignore[override]
        """Tokens of K/V that fit beside one sharded model copy (0 when weights do not fit)."""
        free = self.tp * self.pp * self.hardware.usable_memory_bytes - self.model.total_weight_bytes
        return max(0, int(free // self.model.kv_bytes_per_token))

    def iteration_s(self, rows: int, pairs: float, kv_tokens: float, phase: str = "context") -> float:
        """Full-stack time of one iteration with `rows` new rows (the GEMMs) and one attention
        class (`phase`: "context" for prompt rows, "generation" for decode rows) of `pairs`
        query-key pairs touching `kv_tokens` K/V tokens (read or written)."""
        return self.rows_s(rows) + self.attention_s(pairs, kv_tokens, phase)

    def attention_s(self, pairs: float, kv_tokens: float, phase: str = "generation") -> float:
        """One attention class in an iteration (its own kernels, its own roofline): each layer's
        kernel on the profile's measured `phase` curve, else the flat efficiencies."""
        _, pair_f, _, kv_b, _, _ = self._coef
        curves = self.hardware.attention
        if curves is None:
            attn, kv = pair_f * pairs, kv_b * kv_tokens
            return attn if attn > kv else kv
        if pairs <= 0 and kv_tokens <= 0:
            return 0.0  # no rows of this class: no kernel
        flops_per_pair, kv_bytes, spread = self._attn
        curve = curves.context if phase == "context" else curves.generation
        flops = flops_per_pair * pairs / spread  # one layer, one rank's heads
        nbytes = kv_bytes * kv_tokens / spread
        return self.model.geometry.layers * curve.kernel_s(flops, nbytes)

    def prefill_batch_s(self, new_tokens: Sequence[int], cached_tokens: Sequence[int]) -> float:
        rows = sum(new_tokens)
        pairs = sum(n * c + n * (n + 1) // 2 for n, c in zip(new_tokens, cached_tokens))
        kv_tokens = sum(c + 2 * n for n, c in zip(new_tokens, cached_tokens))
        return self.iteration_s(rows, pairs, kv_tokens)

    def prefill_stage_s(self, latency_s: float) -> float:
        """The first stage's hold on a prefill: the step overhead plus 1/pp of the rest."""
        if self.pp == 1:
            return latency_s
        overhead = min(self.hardware.step_overhead_s, latency_s)
        return overhead + (latency_s - overhead) / self.pp

    @property
    def pipeline_overhead_s(self) -> float:
        """Scheduler overhead of the pp - 1 extra micro-batches in one pipeline cycle."""
        return (self.pp - 1) * self.hardware.step_overhead_s

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        if batch <= 0:
            return 0.0
        micro = -(-batch // self.pp)
        ctx = context_tokens * micro / batch
        return self.iteration_s(micro, ctx, ctx + micro, "generation") + self.pipeline_overhead_s

    def decode_segment_s(self, batch: int, context_tokens: int) -> tuple[float, float]:
        """Both decode_step_s values of a segment in one call (the simulator's hot path)."""
        micro = -(-batch // self.pp)
        ctx = context_tokens * micro / batch
        base = self.rows_s(micro) + self.pipeline_overhead_s
        d0 = base + self.attention_s(ctx, ctx + micro)
        return d0, base + self.attention_s(ctx + micro, ctx + 2 * micro) - d0

    def mixed_step_s(self, chunk_tokens: int, chunk_pairs: int, chunk_kv_tokens: int, chunk_fraction: float,
                     batch: int, context_tokens: int) -> float:
        # the GEMMs run over chunk + decode rows together; the chunk's and the decodes' attention
        # are two classes of kernels, each on its own roofline
        if self.pp == 1:
            return (self.iteration_s(chunk_tokens + batch, chunk_pairs, chunk_kv_tokens)
                    + self.attention_s(context_tokens, context_tokens + batch))
        # the heaviest micro-batch (the chunk and its share of the decodes) paces the cycle
        micro = -(-batch // self.pp) if batch > 0 else 0
        share = micro / batch if batch > 0 else 0.0
        return (self.iteration_s(chunk_tokens + micro, chunk_pairs, chunk_kv_tokens)
                + self.attention_s(context_tokens * share, (context_tokens + batch) * share) + self.pipeline_overhead_s)

    def to_dict(self) -> dict:
        return {"kind": "roofline", "model": self.model.name, "hardware": self.hardware.name, "tp": self.tp, "pp": self.pp}


def roofline_from_dict(d: dict) -> RooflineLatency:
    """{"kind": "roofline", "model": ..., "hardware": ..., "tp": 1, "pp": 1}."""
    return RooflineLatency(
        model=load_model_spec(str(d["model"])),
        hardware=load_hardware(str(d["hardware"])),
        tp=int(d.get("tp", 1)),
        pp=int(d.get("pp", 1)),
    )
