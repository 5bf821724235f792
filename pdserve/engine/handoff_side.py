"""The engine's two handoff entry points, as a mixin of `Engine` (engine.py owns the state).

Prefill side: a PREFILL_ONLY request is pinned once its first token is sampled (PREFILLED, K/V
kept), `export` names its blocks, `release_prefilled` drops the source copy after the
destination acknowledged publication. Decode side: `reserve_import` holds blocks for the
incoming prompt K/V plus decode growth (reusing prefix-cache hits, always leaving at least the
last block to move), then either `commit_import` admits the request as RUNNING over the
imported blocks or `cancel_import` returns everything to the pool.
"""

from __future__ import annotations

from pdserve.engine.errors import InvalidRequest
from pdserve.engine.fork import sequence_key, share_prompt
from pdserve.engine.outputs import ImportReservation, KvExport
from pdserve.engine.sampler import sequence_seed
from pdserve.engine.sequence import SamplingParams, Sequence, SeqMode, SeqStatus
from pdserve.ledger.kv import fork_blocks


class HandoffSide:
    """Needs from the engine: seqs, prefilled, imports, blocks, pool, abi, scheduler, stops,
    groups, max_model_len, _arrivals, validate, _in_use, _register_full_blocks."""

    # ---- prefill side of a handoff --------------------------------------------------------
    def export(self, request_id: str) -> KvExport:
        seq = self.prefilled[request_id]
        n = len(seq.prompt_ids)
        return KvExport(
            request_id=request_id,
            prompt_ids=seq.prompt_ids,
            first_token=seq.output_ids[0],
            seed=seq.seed,
            block_ids=tuple(seq.block_table[: -(-n // self.abi.block_size)]),
            block_hashes=tuple(seq.block_hashes[: n // self.abi.block_size]),
            num_tokens=n,
        )

    def _pin(self, request_id: str) -> bool:
        if request_id in self.prefilled:
            return True
        seq = self.seqs.get(request_id)
        if seq is None or seq.mode is not SeqMode.PREFILL_ONLY or seq not in self.scheduler.running:
            return False
        self.scheduler.running.remove(seq)
        seq.transition(SeqStatus.PREFILLED)
        self.prefilled[request_id] = self.seqs.pop(request_id)
        return True

    def release_prefilled(self, request_id: str) -> None:
        """Drop the source copy (after the destination acknowledged publication)."""
        seq = self.prefilled.pop(request_id)
        self.scheduler.release_blocks(seq)
        seq.finish("handed_off")
        self.stops.forget(request_id)

    # ---- decode side of a handoff ---------------------------------------------------------
    def _import_needs(self, num_prompt_tokens: int, max_tokens: int, n: int = 1) -> tuple[int, int, int]:
        return fork_blocks(num_prompt_tokens, max_tokens, n, self.abi.block_size, self.max_model_len)

    def can_reserve_import(self, num_prompt_tokens: int, max_tokens: int, n: int = 1) -> bool:
        prompt_blocks, growth, _ = self._import_needs(num_prompt_tokens, max_tokens, n)
        return self.blocks.can_reserve(prompt_blocks + growth)

    def reserve_import(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> ImportReservation:
        """Hold destination blocks for an incoming prompt K/V plus its decode growth."""
        self.validate(prompt_ids, params)
        if self._in_use(request_id):
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        prompt_blocks, growth, _ = self._import_needs(len(prompt_ids), params.max_tokens, params.n)
        if not self.blocks.can_reserve(prompt_blocks + growth):
            raise InvalidRequest(f"no K/V capacity for {prompt_blocks + growth} blocks")  # caller checks first
        hashes = self.blocks.hashes_for(prompt_ids, params.tenant)
        # like local admission, at least the last block moves: the transfer set is never empty
        visible = self.blocks.acquire_prefix(hashes, prompt_ids, limit=(len(prompt_ids) - 1) // self.abi.block_size)
        fresh = self.blocks.allocate(prompt_blocks - len(visible))
        self.blocks.reserve(request_id, growth)
        res = ImportReservation(request_id, tuple(visible + fresh), len(visible), growth)
        self.imports[request_id] = res
        return res

    def cancel_import(self, request_id: str) -> None:
        res = self.imports.pop(request_id)
        self.blocks.release(list(res.block_ids))
        self.blocks.release_reservation(request_id)

    def commit_import(self, request_id: str, prompt_ids: list[int], first_token: int, params: SamplingParams, seed: int,
                      forks: tuple[tuple[int, int], ...] = ()) -> None:
        """Admit a published handoff: decode continues from the imported blocks. `forks` (n > 1):
        the (index, first token) of each sequence to continue, all over the one imported prompt."""
        res = self.imports.pop(request_id)
        entries = forks or ((0, first_token),)
        arrival = next(self._arrivals)
        head = self._imported(request_id, prompt_ids, params, seed, arrival, entries[0])
        head.block_table = list(res.block_ids)
        head.transition(SeqStatus.RUNNING)
        self._register_full_blocks([head])
        members = [head]
        if params.n > 1:
            # the import's growth capacity is split: each continuing sequence reserves its own
            self.blocks.release_reservation(request_id)
            for entry in entries[1:]:
                child = self._imported(request_id, prompt_ids, params, seed, arrival, entry)
                if not share_prompt(self.blocks, self.pool, head, child, len(prompt_ids)):
                    raise InvalidRequest("no block for a forked sequence's copy")  # the reservation covered it
                members.append(child)
            growth = self._import_needs(len(prompt_ids), params.max_tokens)[2]
            for member in members:
                self.groups.add(member)
                self.blocks.reserve(member.request_id, min(growth, self.blocks.num_free - self.blocks.num_reserved))
        for member in members:
            self.seqs[member.request_id] = member
            self.stops.start(member)
            self.stops.skip_first(member, member.output_ids[0])
            self.scheduler.add(member)

    @staticmethod
    def _imported(request_id: str, prompt_ids: list[int], params: SamplingParams, seed: int, arrival: int,
                  entry: tuple[int, int]) -> Sequence:
        """Sequence `index` of an imported request, its first token sampled by the prefill worker."""
        index, token = entry
        seq = Sequence(sequence_key(request_id, index), tuple(prompt_ids), params, sequence_seed(seed, index),
                       SeqMode.IMPORTED, arrival, index=index, group=request_id if params.n > 1 else "")
        seq.num_computed = len(prompt_ids)
        seq.output_ids.append(token)
        return seq
