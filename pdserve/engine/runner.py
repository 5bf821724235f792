"""Turns a `StepPlan` into flat tensors, runs the model once, returns logits per sampled row.

Contract: rows are laid out decode-first (one per decoding sequence, then the replay rows of
recomputed sequences), then each prefill chunk. A recompute (after a preemption or a fallback)
prefills the prompt on its usual chunk grid and then *replays* the positions that hold outputs
as decode rows, one row per position, each seeing the keys up to its own position: these are
the rows that computed them the first time, so where decode is batch-invariant the recomputed
K/V and the next token are bitwise those of the uninterrupted run (prefill attention sums in
another order than decode, so prefilling those positions would not be). A sequence is sampled
when this step computes its last known token (every decode row; a prefill chunk only when it
completes the prompt; a replay only at its last output). After the R
sampled rows come the rows whose logits give prompt logprobs (`prompt_rows`: requests that asked
for them, prompt positions not yet scored). The runner never changes sequence state: the engine
applies results after the model returns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from pdserve.engine.kv.kv_pool import KvPool
from pdserve.engine.scheduler import StepPlan, needs_prompt_logits
from pdserve.engine.sequence import Sequence
from pdserve.model.attention import AttnMetadata, DecodeBatch, DecodeGroup, PrefillSlice
from pdserve.model import paged_decode
from pdserve.model.llama import LlamaModel


@dataclass(frozen=True)
class StepBatch:
    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttnMetadata
    logits_rows: torch.Tensor  # [R + Q] int64: R sampled rows, then Q prompt-logprob rows
    sampled: list[Sequence]  # R sequences, in logits_rows order
    prompt_rows: tuple[tuple[Sequence, int, int], ...] = ()  # (sequence, first prompt position, rows), in order


def build_batch(plan: StepPlan, block_size: int, dtype: torch.dtype = torch.float32, padded_groups: bool = True) -> StepBatch:
    """`padded_groups`: also build the padded decode groups the gather + SDPA fallback reads
    (not needed when the in-place kernel serves the pool, see model/paged_decode.py)."""
    tokens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    sampled: list[Sequence] = []
    logits_rows: list[int] = []
    replays = [(s, rows) for s, rows in plan.prefill if is_replay(s)]
    chunks = [(s, rows) for s, rows in plan.prefill if not is_replay(s)]
    decode_rows = [(seq, seq.num_computed) for seq in plan.decode]
    decode_rows += [(seq, pos) for seq, rows in replays for pos in range(seq.num_computed, seq.num_computed + rows)]
    for seq, pos in decode_rows:
        tokens.append(_token_at(seq, pos))
        positions.append(pos)
        slots.append(seq.block_table[pos // block_size] * block_size + pos % block_size)
        if pos == seq.num_tokens - 1:
            logits_rows.append(len(tokens) - 1)
            sampled.append(seq)
    decode = _decode_batch(decode_rows, block_size, dtype, padded_groups)
    prefills = []
    for seq, rows in chunks:
        start, all_tokens = seq.num_computed, seq.tokens
        prefills.append(_prefill_slice(seq, len(tokens), rows, block_size))
        for pos in range(start, start + rows):
            tokens.append(all_tokens[pos])
            positions.append(pos)
            slots.append(seq.block_table[pos // block_size] * block_size + pos % block_size)
        if start + rows == seq.num_tokens:
            logits_rows.append(len(tokens) - 1)
            sampled.append(seq)
    prompt_rows = _prompt_logprob_rows(chunks, logits_rows, len(decode_rows))
    meta = AttnMetadata(slot_mapping=torch.tensor(slots, dtype=torch.int64), decode=decode, prefills=tuple(prefills))
    return StepBatch(
        token_ids=torch.tensor(tokens, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        meta=meta,
        logits_rows=torch.tensor(logits_rows, dtype=torch.int64),
        sampled=sampled,
        prompt_rows=prompt_rows,
    )


def _token_at(seq: Sequence, pos: int) -> int:
    prompt = len(seq.prompt_ids)
    return seq.output_ids[pos - prompt] if pos >= prompt else seq.prompt_ids[pos]


def is_replay(seq: Sequence) -> bool:
    """A scheduled chunk of positions that hold outputs: a recompute, replayed as decode rows
    (the scheduler ends a recompute's prompt chunks at the prompt's end, so no chunk spans both)."""
    return seq.num_computed >= len(seq.prompt_ids)


def _prompt_logprob_rows(chunks: list[tuple[Sequence, int]], logits_rows: list[int], q_start: int) -> tuple[tuple[Sequence, int, int], ...]:
    """Append the flat rows of prompt positions still to be scored; `q_start` is the first
    prefill row. Position p's logits score prompt token p + 1, so positions run up to P - 2."""
    out = []
    for seq, rows in chunks:
        start = seq.num_computed
        if needs_prompt_logits(seq):
            first = max(start, len(seq.prompt_logprobs))
            end = min(start + rows, len(seq.prompt_ids) - 1)
            if end > first:
                logits_rows.extend(range(q_start + first - start, q_start + end - start))
                out.append((seq, first, end - first))
        q_start += rows
    return tuple(out)


def _prefill_slice(seq: Sequence, q_start: int, rows: int, block_size: int) -> PrefillSlice:
    ctx = seq.num_computed + rows
    table = torch.tensor(seq.block_table[: -(-ctx // block_size)], dtype=torch.int64)
    return PrefillSlice(q_start=q_start, q_len=rows, ctx_len=ctx, block_table=table)


DECODE_BUCKET_BLOCKS = 8  # decode K/V is read padded to a multiple of this many blocks


def _decode_batch(rows: list[tuple[Sequence, int]], block_size: int, dtype: torch.dtype, padded_groups: bool) -> DecodeBatch | None:
    """Every decode row's block table and length (a row at position p sees p + 1 keys); with
    `padded_groups`, rows grouped by padded K/V length too (a function of a row's own length)."""
    if not rows:
        return None
    lens = [pos + 1 for _, pos in rows]
    buckets: dict[int, list[int]] = {}
    for i, n in enumerate(lens if padded_groups else ()):
        blocks = -(-n // block_size)
        width = -(-blocks // DECODE_BUCKET_BLOCKS) * DECODE_BUCKET_BLOCKS
        buckets.setdefault(width, []).append(i)
    groups = tuple(_decode_group([rows[i][0] for i in idx], [lens[i] for i in idx], idx, width, block_size, dtype)
                   for width, idx in buckets.items())
    width = -(-max(lens) // block_size)
    tables_rows = [seq.block_table[: -(-n // block_size)] for (seq, _), n in zip(rows, lens)]
    tables = torch.tensor([r + [0] * (width - len(r)) for r in tables_rows], dtype=torch.int64)  # [Bd, M], padded with 0
    return DecodeBatch(num_rows=len(rows), groups=groups, block_tables=tables,
                       context_lens=torch.tensor(lens, dtype=torch.int64))


def _decode_group(seqs: list[Sequence], ctx: list[int], rows: list[int], width: int, block_size: int, dtype: torch.dtype) -> DecodeGroup:
    tables = torch.zeros((len(seqs), width), dtype=torch.int64)  # [g, M]
    for i, (seq, c) in enumerate(zip(seqs, ctx)):
        n = -(-c // block_size)
        tables[i, :n] = torch.tensor(seq.block_table[:n], dtype=torch.int64)
    lens = torch.tensor(ctx, dtype=torch.int64).unsqueeze(1)  # [g, 1]
    visible = torch.arange(width * block_size).unsqueeze(0) < lens  # [g, M*B]
    # additive mask in the compute dtype: SDPA's CPU kernel is faster with it than with a bool mask
    key_mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
    return DecodeGroup(torch.tensor(rows, dtype=torch.int64), tables, key_mask[:, None, None, :])


def to_device(batch: StepBatch, device: torch.device) -> StepBatch:
    """The step's tensors on a CUDA device, with the tile map its attention kernel reads
    (model/gpu/attention.py: every row, decode or prefill, in one launch per layer)."""
    from pdserve.model.gpu.attention import tile_map
    meta = batch.meta
    decode = meta.decode
    tables = decode.block_tables.tolist() if decode is not None else []
    lens = decode.context_lens.tolist() if decode is not None else []
    chunks = [(c.block_table.tolist(), c.q_start, c.q_len, c.ctx_len) for c in meta.prefills]
    move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
    meta = replace(meta, slot_mapping=move(meta.slot_mapping), tiles=tile_map(tables, lens, chunks, device))
    return replace(batch, token_ids=move(batch.token_ids), positions=move(batch.positions), meta=meta,
                   logits_rows=move(batch.logits_rows))


class ModelRunner:
    def __init__(self, model: LlamaModel, pool: KvPool, graphs=None):
        """`graphs`: an engine/cuda_graphs.DecodeGraphs replaying decode-only steps (GPU), or None."""
        self.model = model
        self.pool = pool
        self.graphs = graphs
        self.device = pool.tensor.device
        # the CPU's padded decode groups are for the gather + SDPA fallback; a GPU pool is read in place
        self.padded_groups = self.device.type == "cpu" and not paged_decode.eligible(pool.tensor[0, 0])  # [N, B, H_kv, D]

    def run(self, plan: StepPlan, layer_hook: Callable[[int], None] | None = None) -> tuple[StepBatch, torch.Tensor]:
        """-> (batch, logits [R, V] fp32, on the pool's device)."""
        batch = build_batch(plan, self.pool.abi.block_size, self.model.dtype, self.padded_groups)
        if self.graphs is not None and self.graphs.takes(batch):
            logits = self.graphs.run(batch)
            for layer in range(len(self.model.layers)) if layer_hook is not None else ():
                layer_hook(layer)  # every layer's K/V rows are in the pool once the replay is done
            return batch, logits
        if self.device.type != "cpu":
            batch = to_device(batch, self.device)
        logits = self.model.forward(
            batch.token_ids, batch.positions, batch.meta, self.pool.tensor, batch.logits_rows, layer_hook
        )
        return batch, logits
