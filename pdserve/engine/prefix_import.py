"""A prefill whose leading K/V is filled from elsewhere: one stage of a KV-Runahead chain.

Contract: `reserve_prefix(engine, id, prompt, start, params)` holds blocks for the first `start`
prompt tokens (prefix-cache hits first, as `reserve_import` does; the rest are filled by a chain
link) plus capacity for the blocks of tokens [start, len(prompt)), all under the request id.
`admit_prefix(engine, id, prompt, params, seed)` turns that reservation into a RUNNING
prefill-only sequence whose first `start` tokens count as computed: the scheduler then runs the
rest in its own aligned chunks (`start` is a multiple of the chunk budget), which are exactly the
chunks one worker would run over the whole prompt, so the K/V bits and the sampled token equal
single-worker chunked prefill. Admit only once the link's layer 0 is in the blocks; the caller
keeps later layers ahead of the forward (workers/runahead_side.py). Before admission the
reservation is an ordinary import (`engine.cancel_import` returns it, `check_integrity` counts
it); after it, the sequence owns the blocks and every ordinary abort or release frees them.
"""

from __future__ import annotations

from dataclasses import replace

from pdserve.engine.engine import Engine
from pdserve.engine.errors import InvalidRequest
from pdserve.engine.outputs import ImportReservation
from pdserve.engine.sequence import SamplingParams, Sequence, SeqMode, SeqStatus


def reserve_prefix(engine: Engine, request_id: str, prompt_ids: list[int], start: int,
                   params: SamplingParams) -> ImportReservation:
    """Blocks for prompt[:start] and capacity for prompt[start:]; raises InvalidRequest when the
    pool lacks them or `start` is off the block grid."""
    bs = engine.abi.block_size
    if not 0 < start < len(prompt_ids) or start % bs:
        raise InvalidRequest(f"a chain stage starts at a block boundary inside the prompt, got {start}")
    engine.validate(prompt_ids, params)
    own = replace(params, max_tokens=len(prompt_ids) - start, n=1)  # growth covers the stage's own rows
    if not engine.can_reserve_import(start, own.max_tokens):
        raise InvalidRequest("no K/V capacity for the chain stage")
    return engine.reserve_import(request_id, list(prompt_ids[:start]), own)


def admit_prefix(engine: Engine, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 seed: int) -> Sequence:
    """Start computing prompt[start:] over the reserved (now landed) prefix blocks."""
    res = engine.imports.pop(request_id)
    seq = Sequence(request_id, tuple(prompt_ids), params, seed, SeqMode.PREFILL_ONLY, next(engine._arrivals))  # noqa: SLF001
    seq.block_table = list(res.block_ids)
    seq.num_computed = len(res.block_ids) * engine.abi.block_size
    seq.transition(SeqStatus.RUNNING)
    engine.seqs[request_id] = seq
    engine.stops.start(seq)
    engine.scheduler.add(seq)
    return seq
