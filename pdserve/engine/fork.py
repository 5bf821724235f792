"""n > 1: one prompt, n output sequences that share its K/V blocks.

Contract:
- A request with `params.n > 1` is prefilled once, as sequence 0 (engine key = the request id).
  The step that completes the prompt samples n first tokens from that one logits row, sequence i
  with seed `sampler.sequence_seed(seed, i)` at output position 0; every later token of sequence
  i uses the same seed, so each sequence is reproducible and independent of where it runs.
- Forked sequences (engine key `<request id>#n<i>`) share the prompt's full blocks by reference
  count; the last, partial prompt block is copied at the fork (copy-on-write done eagerly: it is
  the only prompt block a sequence writes into). When no block is free for that copy, the
  sequence waits and is recomputed like a preempted one (its full blocks come back from the
  prefix cache), so a fork never fails for memory.
- On a prefill worker nothing is forked: the n first tokens are reported, and those whose
  sequence did not finish at the first token travel as `forks` ((index, token), ...) with the
  handoff's first token; the decode worker forks those over the one imported prompt, having
  reserved ledger/kv.py's `fork_blocks` (what the router's decode hold counts too).
- `Groups` tracks each request's live sequences by the caller's id: the request finishes when its
  last sequence does, and an abort reaches every sequence.
"""

from __future__ import annotations

from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.kv.kv_pool import KvPool
from pdserve.engine.sequence import Sequence, SeqStatus


def sequence_key(request_id: str, index: int) -> str:
    """The engine key of sequence `index` of a request (sequence 0 keeps the request id)."""
    return request_id if index == 0 else f"{request_id}#n{index}"


def wants_fork(seq: Sequence) -> bool:
    """This sample is the first of an n > 1 request's prompt: n tokens are drawn here."""
    return seq.params.n > 1 and seq.index == 0 and not seq.output_ids


class Groups:
    """The live sequences of every n > 1 request, by the caller's request id."""

    def __init__(self) -> None:
        self.members: dict[str, dict[int, Sequence]] = {}

    def add(self, seq: Sequence) -> None:
        self.members.setdefault(seq.caller_id, {})[seq.index] = seq

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.members

    def finish(self, seq: Sequence) -> bool:
        """`seq` ended; True when its request has no live sequence left."""
        group = self.members.get(seq.caller_id)
        if group is None:
            return True
        group.pop(seq.index, None)
        if group:
            return False
        del self.members[seq.caller_id]
        return True

    def pop(self, request_id: str) -> list[Sequence]:
        return list(self.members.pop(request_id, {}).values())


def share_prompt(blocks: BlockManager, pool: KvPool, parent: Sequence, child: Sequence, num_tokens: int) -> bool:
    """Give `child` the parent's K/V for its first `num_tokens` tokens: full blocks by reference,
    the partial last block as a copy. False (child untouched) when no block is free for the copy."""
    bs = blocks.block_size
    full, partial = num_tokens // bs, num_tokens % bs
    if partial and not blocks.can_allocate(1, owner=child.request_id):
        return False
    shared = parent.block_table[:full]
    blocks.share(shared)
    table = list(shared)
    if partial:
        copy = blocks.allocate(1, owner=child.request_id)
        pool.copy_blocks([parent.block_table[full]], copy)
        table += copy
    child.block_table = table
    child.block_hashes = list(parent.block_hashes[:full])
    child.num_computed = num_tokens
    child.transition(SeqStatus.RUNNING)
    return True
