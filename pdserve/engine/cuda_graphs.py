"""Decode steps on a GPU replayed as CUDA graphs, one per batch-size bucket.

Why: a small-batch decode step on a GPU is launch-bound. Each layer costs a dozen kernel launches
and the Python that issues them (Triton's launcher alone is tens of microseconds a call), so the
step's time hardly depends on the model's size; a captured graph replays every launch of the
forward pass in one call.

Contract: `DecodeGraphs.takes(batch)` is true for a step whose rows are all decode rows, each
sampled, with no prompt-logprob rows, at most the largest bucket, and block tables no wider than
the model's context allows. `run(batch)` copies the step's inputs into static buffers, pads the
rows to the smallest bucket that holds them and replays that bucket's graph (captured on first
use). Padding rows repeat row 0's query inputs but write their K/V into the pool's scratch slot
(`KvPool.scratch_slot`, outside every block the block manager hands out) and are dropped from the
logits, so no real block is touched by them. The kernels are the eager step's (model/gpu/), each
row's bits independent of the rows beside it, so in the batch-invariant mode a replayed step gives
the eager step's tokens bit for bit.
"""

from __future__ import annotations

import torch

from pdserve.engine.kv.kv_pool import KvPool
from pdserve.model.attention import AttnMetadata
from pdserve.model.llama import LlamaModel

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class DecodeGraphs:
    """Captured decode forwards over static input buffers, for one model and pool."""

    def __init__(self, model: LlamaModel, pool: KvPool, max_rows: int, max_blocks: int):
        from pdserve.model.gpu.attention import TileMap
        self.model, self.pool = model, pool
        self.buckets = tuple(b for b in BUCKETS if b < max_rows) + (max_rows,)
        dev, top = pool.tensor.device, self.buckets[-1]
        self.width = max_blocks
        i64 = dict(dtype=torch.int64, device=dev)
        self.tokens, self.positions, self.slots = (torch.zeros(top, **i64) for _ in range(3))  # [top]
        self.tables = torch.zeros((top, max_blocks), dtype=torch.int32, device=dev)  # [top, M]
        self.tile_pos = torch.zeros(top, dtype=torch.int32, device=dev)
        ramp = torch.arange(top, dtype=torch.int32, device=dev)
        self.rows = torch.arange(top, **i64)
        self._maps = {b: TileMap(self.tables[:b], ramp[:b], ramp[:b], torch.ones_like(ramp[:b]), self.tile_pos[:b], b)
                      for b in self.buckets}
        # host staging: one pinned block per dtype, copied over in one call each
        self._host64 = torch.zeros((3, top), dtype=torch.int64).pin_memory()
        self._host32 = torch.zeros((top, max_blocks + 1), dtype=torch.int32).pin_memory()
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._mempool = torch.cuda.graph_pool_handle()

    def takes(self, batch) -> bool:
        meta = batch.meta
        rows = batch.token_ids.shape[0]
        return (not meta.prefills and meta.decode is not None and meta.decode.num_rows == rows
                and 0 < rows <= self.buckets[-1] and batch.logits_rows.shape[0] == rows and not batch.prompt_rows
                and meta.decode.block_tables.shape[1] <= self.width)

    def run(self, batch) -> torch.Tensor:
        """-> logits [R, V] fp32 (a view of the graph's output: read it before the next step)."""
        rows = batch.token_ids.shape[0]
        bucket = next(b for b in self.buckets if b >= rows)
        self._stage(batch, rows, bucket)
        if bucket not in self._graphs:
            self._graphs[bucket] = self._capture(bucket)
            self._stage(batch, rows, bucket)  # capture's warm-up ran over the same buffers
        graph, logits = self._graphs[bucket]
        graph.replay()
        return logits[:rows]

    def _stage(self, batch, rows: int, bucket: int) -> None:
        h64, h32 = self._host64, self._host32
        decode = batch.meta.decode
        h64[0, :rows], h64[1, :rows], h64[2, :rows] = batch.token_ids, batch.positions, batch.meta.slot_mapping
        h64[:2, rows:bucket] = h64[:2, :1]  # padding rows: row 0's token and position ...
        h64[2, rows:bucket] = self.pool.scratch_slot  # ... their K/V into the scratch slot
        width = decode.block_tables.shape[1]
        h32[:rows, :width] = decode.block_tables
        h32[:rows, width:self.width] = 0
        h32[rows:bucket, :self.width] = h32[:1, :self.width]
        h32[:rows, self.width] = decode.context_lens - 1  # each row's position
        h32[rows:bucket, self.width] = h32[0, self.width]
        self.tokens[:bucket].copy_(h64[0, :bucket], non_blocking=True)
        self.positions[:bucket].copy_(h64[1, :bucket], non_blocking=True)
        self.slots[:bucket].copy_(h64[2, :bucket], non_blocking=True)
        self.tables[:bucket].copy_(h32[:bucket, :self.width], non_blocking=True)
        self.tile_pos[:bucket].copy_(h32[:bucket, self.width], non_blocking=True)
        torch.cuda.current_stream().synchronize()  # the pinned buffers are rewritten by the next step

    def _forward(self, bucket: int) -> torch.Tensor:
        meta = AttnMetadata(slot_mapping=self.slots[:bucket], decode=None, prefills=(), tiles=self._maps[bucket])
        return self.model.forward(self.tokens[:bucket], self.positions[:bucket], meta, self.pool.tensor,
                                  self.rows[:bucket])

    def _capture(self, bucket: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        self.slots[:bucket].fill_(self.pool.scratch_slot)  # warm-up and capture write only the scratch slot
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # Triton compiles, cuBLAS picks its kernels: none of it inside the capture
                self._forward(bucket)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):
            logits = self._forward(bucket)
        return graph, logits
