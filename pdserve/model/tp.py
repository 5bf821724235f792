"""Tensor parallelism inside one forward pass: Megatron-style sharding of a Llama-family model.

Contract: `TpLlamaModel(rank, tp, ...)` holds rank `rank`'s shard of the weights and runs the same
forward as `LlamaModel`, given the same step rows on every rank, inside a torch.distributed
process group of `tp` ranks (gloo on CPU; `all_reduce` is the only collective it issues):

- column-parallel (split by output rows, no communication): q|k|v by heads (rank r owns query
  heads [r*H_q/tp, (r+1)*H_q/tp) and K/V heads [r*H_kv/tp, (r+1)*H_kv/tp), so the G query heads
  that share a K/V head stay on one rank), gate|up by intermediate rows;
- row-parallel (split by input columns): o_proj and down_proj; each rank's partial product is
  summed over the ranks by one all_reduce, and o_proj's bias is added once, after the sum;
- replicated: embedding, norms, RoPE tables and the LM head (the simplest choice: logits need no
  gather, every rank computes the same full logits and only the leader uses them).

The K/V pool passed to `forward` is the worker's LOGICAL pool [L, 2, N, B, H_kv, D] (shared
memory); this rank reads and writes only its K/V heads, a strided view [..., H_kv/tp, D] of it, so
the pool's bytes are laid out exactly as a TP 1 pool's and a handoff moves them unchanged. A
decode step reads that view in place through the paged decode kernel (its heads are D apart), as
TP 1 reads the whole pool: a K/V head's attention is the same arithmetic at any TP size.

Numerics: the column-parallel products compute every output element over the whole hidden
size, as TP 1 does; the row-parallel ones sum each output in two stages (the rank's slice, then
over ranks), a different order from TP 1's single product, so from the first o_proj on values
differ from TP 1 by rounding (fp32: ~1e-7 relative). Layer 0's K/V do not pass through a
row-parallel sum. `reduce_s` accumulates the wall time spent in all_reduce calls.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from pdserve.model.attention import AttnMetadata
from pdserve.model.config import ModelConfig, TpShapeError, check_tp  # noqa: F401 (re-exported)
from pdserve.model.llama import LlamaModel
from pdserve.model.numerics import Weight, linear


def kv_head_range(config: ModelConfig, rank: int, tp: int) -> tuple[int, int]:
    """[first, end) of the K/V heads rank `rank` owns."""
    per = config.num_kv_heads // tp
    return rank * per, (rank + 1) * per


def shard_state(state: dict[str, torch.Tensor], config: ModelConfig, rank: int, tp: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s slices of a full checkpoint state (views where possible); others unchanged."""
    check_tp(config, tp)
    d = config.head_dim
    q_rows = config.num_heads // tp * d
    kv_rows = config.num_kv_heads // tp * d
    ff_rows = config.intermediate_size // tp
    rows = {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows, "gate_proj": ff_rows, "up_proj": ff_rows}
    cols = {"o_proj": q_rows, "down_proj": ff_rows}
    out = {}
    for name, t in state.items():
        proj, kind = name.rsplit(".", 2)[-2:] if name.count(".") >= 2 else ("", "")
        if proj in rows:  # weight [N, d] or bias [N]: output rows
            n = rows[proj]
            out[name] = t[rank * n:(rank + 1) * n]
        elif proj in cols and kind == "weight":  # [d, K]: input columns; a bias stays whole
            n = cols[proj]
            out[name] = t[:, rank * n:(rank + 1) * n]
        else:
            out[name] = t
    return out


class TpLlamaModel(LlamaModel):
    """One rank's shard of the model; see the module docstring."""

    def __init__(self, config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype,
                 compute_dtype: torch.dtype | None = None, batch_invariant: bool = True,
                 rank: int = 0, tp: int = 1, group: dist.ProcessGroup | None = None):
        """`state`: the FULL checkpoint state; it is sliced here. `group`: the TP group (None = the
        default group)."""
        super().__init__(config, shard_state(state, config, rank, tp), dtype, compute_dtype, batch_invariant)
        self.rank, self.tp, self.group = rank, tp, group
        self.num_heads, self.num_kv_heads = config.num_heads // tp, config.num_kv_heads // tp
        self.heads = kv_head_range(config, rank, tp)
        self.reduce_s = 0.0  # wall time inside all_reduce since construction
        self.num_reduces = 0

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata, kv: torch.Tensor,
                logits_rows: torch.Tensor, layer_hook=None) -> torch.Tensor:
        """As `LlamaModel.forward`; `kv` is the logical pool [L, 2, N, B, H_kv, D] (or this rank's
        shard [L, 2, N, B, H_kv / tp, D] already). Every rank of the group must call it with the
        same rows. -> logits [R, V] fp32 (the same on every rank)."""
        if kv.shape[4] != self.num_kv_heads:
            kv = kv[:, :, :, :, self.heads[0]:self.heads[1]]  # [L, 2, N, B, H_kv/tp, D], strided
        return super().forward(token_ids, positions, meta, kv, logits_rows, layer_hook)

    def _row_linear(self, x: torch.Tensor, w: Weight, bias: torch.Tensor | None) -> torch.Tensor:
        y = linear(x, w, None, self.skinny)  # [T, d]: this rank's partial sum
        if self.tp > 1:
            # gloo reduces a tensor's storage as if it were dense: a tiled product's view over its
            # padded column blocks (row stride > d when d is not a multiple of the tile) must be
            # made dense first, or the sum lands on the wrong elements
            y = y.contiguous()
            t0 = time.perf_counter()
            dist.all_reduce(y, group=self.group)
            self.reduce_s += time.perf_counter() - t0
            self.num_reduces += 1
        return y if bias is None else y + bias
