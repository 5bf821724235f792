"""The in-process engine: add requests, step, abort; plus the two phase entry points.

One step is schedule -> run -> postprocess. Request life cycle (see sequence.py for states):
    add_request -> WAITING -> RUNNING (chunked prefill, then decode) -> FINISHED
Phase entry points for disaggregation:
    prefill worker: add_request(mode=PREFILL_ONLY) -> ... -> PREFILLED (first token sampled,
        K/V kept) -> export(request_id) -> [handoff moves the blocks] -> release_prefilled()
    decode worker:  can_reserve_import() / reserve_import() -> [handoff writes the blocks]
        -> commit_import() (now RUNNING, decoding) or cancel_import() (abort path)
n > 1 requests fork after the prompt (fork.py); log-probabilities come from the raw logits of
the rows that sampled a token or score a prompt position (logprobs.py).
Bad requests raise `InvalidRequest` before any state changes; other requests keep running.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch

from pdserve.engine.kv.block_manager import BlockManager, chain_hash
from pdserve.engine.config import EngineConfig
from pdserve.engine.errors import InvalidRequest
from pdserve.engine.kv.host_tier import HostTier
from pdserve.engine.fork import Groups, sequence_key, share_prompt, wants_fork
from pdserve.engine.handoff_side import HandoffSide
from pdserve.engine import logits_processors
from pdserve.engine.logprobs import TokenLogprobs, requested_logprobs, score_prompt_rows
from pdserve.engine.kv.kv_abi import CacheIdentity, KvAbi
from pdserve.engine.kv.kv_pool import TORCH_DTYPES, KvPool
from pdserve.engine.outputs import ImportReservation, PrefillProgress, RequestOutput, sequence_output
from pdserve.engine.runner import ModelRunner
from pdserve.engine import tp_group
from pdserve.engine.sampler import sample, sample_one, sequence_seed
from pdserve.engine.scheduler import Scheduler, SchedulerConfig
from pdserve.engine.sequence import SamplingParams, Sequence, SeqMode, SeqStatus
from pdserve.engine.step_log import StepLog, step_record
from pdserve.engine.stops import StopChecker
from pdserve.model.config import load_config
from pdserve.model.default import resolve_model
from pdserve.model.llama import LlamaModel
from pdserve.model.cpu import cpu_report
from pdserve.model.numerics import resolve_compute_dtype
from pdserve.model import paged_decode
from pdserve.model.loader import checkpoint_hash, load_state_dict
from pdserve.model.tokenizer import load_tokenizer


def check_device(config: EngineConfig) -> None:
    """Refuse, naming the reason, a device this engine cannot run on or a feature it has not there."""
    if config.device == "cpu":
        return
    if not config.device.startswith("cuda"):
        raise ValueError(f"unknown device {config.device!r}: 'cpu', 'cuda' or 'cuda:N'")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {config.device}: this torch sees no CUDA device")
    from pdserve.model import gpu
    if not gpu.triton_present():
        raise ValueError(f"--device {config.device} needs Triton (the GPU attention and invariant kernels)")
    for name, unsupported in (("tensor parallelism (tp > 1)", config.tp > 1), ("a host K/V tier", config.host_kv_bytes > 0)):
        if unsupported:
            raise ValueError(f"--device {config.device} does not support {name} yet")


def device_report(device: str) -> dict:
    """The GPU's name in reports and /workers; on the CPU, the threads the C kernels split a call
    over in this process (torch's count, or 1 where they cannot open an OpenMP region)."""
    if device == "cpu":
        return {"kernel_threads": torch.get_num_threads() if paged_decode.openmp() else 1}
    return {"device": f"{device} ({torch.cuda.get_device_name(torch.device(device))})"}


def new_seed() -> int:
    return int.from_bytes(os.urandom(8), "little") >> 1


class Engine(HandoffSide):
    def __init__(self, config: EngineConfig = EngineConfig()):
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        check_device(config)
        self.model_dir = resolve_model(config.model)
        self.model_config = load_config(self.model_dir)
        dtype = TORCH_DTYPES[config.dtype]
        compute = resolve_compute_dtype(config.dtype, config.compute_dtype)
        state = load_state_dict(self.model_dir, self.model_config, dtype)
        mc = self.model_config
        self.abi = KvAbi(mc.num_layers, mc.num_kv_heads, mc.head_dim, config.block_size, config.dtype)
        num_blocks = config.num_blocks or max(1, config.kv_cache_bytes // self.abi.bytes_per_block)
        shm_name = None if config.device != "cpu" else config.kv_shm_name or tp_group.private_pool_name(config.tp)
        self.pool = KvPool(self.abi, num_blocks, shm_name=shm_name, device=config.device,
                           resident="on_use")  # pages resident as blocks are first used, never faulted in a prefill (kv_pool.py)
        if config.tp == 1:
            self.model = LlamaModel(self.model_config, state, dtype, compute, config.batch_invariant, config.device)
        else:  # rank 0 of a tensor-parallel group; followers run the other shards (tp_group.py)
            self.model = tp_group.start_engine_group(config, self.model_dir, state, self.pool)
            self.pool.tp = config.tp
        self.tokenizer = load_tokenizer(self.model_dir)
        self.numerics = {**cpu_report(), **device_report(config.device), "compute_dtype": str(compute).removeprefix("torch."),
                         "products": self.model.products.describe()}  # `cpu` in reports and /workers
        self.identity = CacheIdentity(
            model_hash=checkpoint_hash(self.model_dir),
            tokenizer_hash=self.tokenizer.identity_hash if self.tokenizer else "none",
            abi_hash=self.abi.abi_hash,
            position_policy=f"rope:{mc.rope_theta}",
        )
        self.blocks = BlockManager(num_blocks, config.block_size, self.identity.identity_hash, config.enable_prefix_cache,
                                   config.max_tenant_roots)
        self.blocks.on_grow = self.pool.populate
        if config.host_kv_bytes >= self.abi.bytes_per_block:  # evicted prefix blocks go to host memory
            self.blocks.host = HostTier(self.pool, config.host_kv_bytes // self.abi.bytes_per_block)
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        sched = SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
                                config.prompt_priority,
                                config.prefill_length_buckets)
        self.scheduler = Scheduler(self.blocks, sched)
        self.runner = ModelRunner(self.model, self.pool, self._decode_graphs())
        eos = set(mc.eos_token_ids) | set(self.tokenizer.eos_token_ids if self.tokenizer else ())
        self.stops = StopChecker(self.tokenizer, frozenset(eos), self.max_model_len)
        self.seqs: dict[str, Sequence] = {}
        self.prefilled: dict[str, Sequence] = {}
        self.imports: dict[str, ImportReservation] = {}
        self.groups = Groups()  # the live sequences of n > 1 requests (fork.py)
        self._arrivals = itertools.count()
        self.step_log: StepLog | None = None  # when set, every step that ran is recorded (step_log.py)
        # block tables held outside the engine's requests (a worker's prefix fetches pin blocks)
        self.external_tables: Callable[[], list[list[int]]] = list

    def _decode_graphs(self):
        """CUDA graphs for decode-only steps on a GPU (engine/cuda_graphs.py); None on the CPU or eager."""
        if self.config.device == "cpu" or self.config.enforce_eager:
            return None
        from pdserve.engine.cuda_graphs import DecodeGraphs
        return DecodeGraphs(self.model, self.pool, self.config.max_num_seqs, -(-self.max_model_len // self.abi.block_size))

    # ---- requests -------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        params.validate()
        if not prompt_ids:
            raise InvalidRequest("prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidRequest(
                f"prompt has {len(prompt_ids)} tokens; the context holds {self.max_model_len} (prompt + at least one new token)"
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_ids if not isinstance(t, int) or t < 0 or t >= vocab]
        if bad:
            raise InvalidRequest(f"token ids out of range [0, {vocab}): {bad[:5]}")
        if any(t >= vocab for t in params.stop_token_ids):
            raise InvalidRequest(f"stop_token_ids must be in [0, {vocab})")

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        mode: SeqMode = SeqMode.NORMAL,
        seed: int | None = None,
        resume_output_ids: tuple[int, ...] = (),
    ) -> None:
        """Queue a request. `resume_output_ids` continues a request whose first outputs were
        produced elsewhere (recompute fallback): their K/V is recomputed here, sampling goes on
        at the next output index, so a seeded request yields the same tokens as uninterrupted."""
        self.validate(prompt_ids, params)
        if self._in_use(request_id):
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        if len(prompt_ids) + len(resume_output_ids) >= self.max_model_len:
            raise InvalidRequest("prompt plus resumed output fills the context")
        if resume_output_ids and params.n > 1:
            raise InvalidRequest("an n > 1 request cannot resume from one sequence's output")
        seed = seed if seed is not None else params.seed if params.seed is not None else new_seed()
        seq = Sequence(request_id, tuple(prompt_ids), params, seed, mode=mode, arrival=next(self._arrivals))
        seq.output_ids.extend(resume_output_ids)
        self.seqs[request_id] = seq
        self.stops.start(seq)
        for token in resume_output_ids:
            self.stops.skip_first(seq, token)
        self.scheduler.add(seq)

    def _in_use(self, request_id: str) -> bool:
        return request_id in self.seqs or request_id in self.prefilled or request_id in self.imports or request_id in self.groups

    def abort(self, request_id: str, keep_blocks: bool = False) -> bool:
        """Stop a request wherever it is (every sequence of an n > 1 request); its blocks go back
        to the pool. False if unknown. `keep_blocks` (a handoff still reads them): a prefill-only
        request stops computing but its blocks stay pinned as a source copy until
        `release_prefilled`. An import (a reserved handoff destination) is never freed here: the
        handoff endpoint that reserved it returns it through `cancel_import` once no write into
        its blocks is in flight (handoff/destination.py), so a late copy never lands in blocks
        another request owns."""
        if request_id in self.imports:
            return True
        if keep_blocks and self._pin(request_id):
            return True
        if request_id in self.groups:
            return any([self._abort_one(seq.request_id) for seq in self.groups.pop(request_id)])
        return self._abort_one(request_id)

    def _abort_one(self, request_id: str) -> bool:
        seq = self.seqs.pop(request_id, None) or self.prefilled.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.remove(seq)
        seq.finish("abort")
        self.stops.forget(request_id)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    # ---- one step -------------------------------------------------------------------------
    def step(self, layer_hook: Callable[[int, tuple[PrefillProgress, ...]], None] | None = None,
             lock=None) -> list[RequestOutput]:
        """schedule -> run -> postprocess. `layer_hook(layer, progress)` runs after each layer's K/V
        rows are in the pool; `progress` names every prompt this step prefills, with the prompt
        tokens whose K/V are final once the step is done and whether that completes the prompt.
        With `lock`, bookkeeping runs under it and the model forward runs outside it, so
        other threads (handoff links) can touch the block manager during the forward."""
        started = time.perf_counter()
        with lock or nullcontext():
            plan = self.scheduler.schedule()
            if plan.empty:
                return []
            progress = tuple(PrefillProgress(s.request_id, s.num_computed + rows, s.num_computed + rows == s.num_tokens)
                             for s, rows in plan.prefill)
            shape = self._shape(plan) if self.step_log is not None else None
        hook = None if layer_hook is None else (lambda layer: layer_hook(layer, progress))
        batch, logits = self.runner.run(plan, hook)
        with lock or nullcontext():
            outputs = self._apply(plan, batch, logits)
        if shape is not None:
            self.step_log.record(step_record(started, *shape))
        return outputs

    @staticmethod
    def _shape(plan) -> tuple[list[int], list[int], int, int]:
        """(prompt rows per prefilling request, their cached tokens, decode rows, visible context
        summed over the decode rows), before the step runs."""
        return ([rows for _, rows in plan.prefill], [s.num_computed for s, _ in plan.prefill],
                len(plan.decode), sum(s.num_computed + 1 for s in plan.decode))

    def _apply(self, plan, batch, logits) -> list[RequestOutput]:
        for seq, rows in plan.prefill:
            seq.num_computed += rows
        for seq in plan.decode:
            seq.num_computed += 1
        self._register_full_blocks([s for s in [*plan.decode, *(q for q, _ in plan.prefill)] if not s.finished])
        num_sampled = len(batch.sampled)
        score_prompt_rows(batch.prompt_rows, logits[num_sampled:])
        logits = logits[:num_sampled]  # [R, V]
        indices = [len(s.output_ids) for s in batch.sampled]
        processed = logits_processors.process(logits, batch.sampled, self.stops.eos_ids)  # [R, V]: min_tokens, penalty
        tokens = sample(processed, [s.params for s in batch.sampled], [s.seed for s in batch.sampled], indices)
        outputs = []
        for r, (seq, tok) in enumerate(zip(batch.sampled, tokens)):
            if seq.finished:  # aborted while the forward ran (other threads): no token
                continue
            if wants_fork(seq):
                outputs += self._fork(seq, logits[r], processed[r], tok)
            else:
                outputs.append(self._postprocess(seq, tok, requested_logprobs(seq.params.logprobs, logits[r : r + 1], [tok])))
        return outputs

    def kv_blocks(self, request_id: str) -> list[int]:
        """Block table of a running or prefilled request (its prompt K/V lives there)."""
        seq = self.seqs.get(request_id) or self.prefilled[request_id]
        return list(seq.block_table)

    def _register_full_blocks(self, seqs: list[Sequence]) -> None:
        bs = self.blocks.block_size
        for seq in seqs:
            full = seq.num_computed // bs
            if len(seq.block_hashes) >= full:
                continue
            tokens = seq.tokens
            for j in range(len(seq.block_hashes), full):
                block_tokens = tuple(tokens[j * bs : (j + 1) * bs])
                root = self.blocks.root_for(seq.params.tenant)
                parent = seq.block_hashes[-1] if seq.block_hashes else root
                h = chain_hash(root, parent, block_tokens)
                self.blocks.register(seq.block_table[j], h, block_tokens, parent if j else None)
                seq.block_hashes.append(h)

    def _postprocess(self, seq: Sequence, token: int, logprobs: tuple[TokenLogprobs, ...] = (),
                     forks: tuple[tuple[int, int], ...] | None = None) -> RequestOutput:
        """Append a sampled token and report it. `forks`: a prefill-only n > 1 request's sequences
        that go on; while any does, its K/V stays for export even if sequence 0 itself ended."""
        seq.output_ids.append(token)
        new_text, reason = self.stops.update(seq, token)
        prefilled, done = False, reason is not None
        if forks is not None and reason is None:
            forks = ((0, token), *forks)
        if seq.mode is SeqMode.PREFILL_ONLY and (reason is None or forks):
            if reason is None:
                new_text += self.stops.flush(seq)  # the decode worker continues after this text
            self.scheduler.running.remove(seq)
            seq.transition(SeqStatus.PREFILLED)
            self.prefilled[seq.request_id] = self.seqs.pop(seq.request_id)
            prefilled, done = True, False
        elif reason is not None:
            self.scheduler.remove(seq)
            seq.finish(reason)
            del self.seqs[seq.request_id]
            self.stops.forget(seq.request_id)
            done = self.groups.finish(seq)
        with_prompt = seq.index == 0 and len(seq.output_ids) == 1 and forks is None  # a prefill fork sends it first
        return sequence_output(seq, token, new_text, done, reason, prefilled, logprobs, forks or (), with_prompt)

    # ---- n > 1 (fork.py) ------------------------------------------------------------------
    def _fork(self, seq: Sequence, row, processed_row, token0: int) -> list[RequestOutput]:
        """row: [V] raw logits of the prompt's last position (logprobs read them), processed_row:
        the same after the request's logits processors (sampling reads it) -> the first token of each
        of the n sequences; sequence 0 (`seq`, which sampled `token0`) reports first, then the others."""
        n, params = seq.params.n, seq.params
        tokens = [token0] + [sample_one(processed_row, params, sequence_seed(seq.seed, i), 0) for i in range(1, n)]
        scored = requested_logprobs(params.logprobs, row.expand(n, -1), tokens)  # [n, V] rows: one per sequence
        lps = [(lp,) for lp in scored] if scored else [()] * n
        if seq.mode is SeqMode.PREFILL_ONLY:
            return self._fork_at_prefill(seq, tokens, lps)
        children = [self._new_child(seq, i) for i in range(1, n)]
        for member in (seq, *children):
            self.groups.add(member)
        return [self._postprocess(member, tokens[member.index], lps[member.index]) for member in (seq, *children)]

    def _new_child(self, parent: Sequence, index: int) -> Sequence:
        child = Sequence(sequence_key(parent.request_id, index), parent.prompt_ids, parent.params,
                         sequence_seed(parent.seed, index), parent.mode, parent.arrival, index=index,
                         group=parent.request_id)
        child.num_cached_tokens = parent.num_cached_tokens
        self.seqs[child.request_id] = child
        self.stops.start(child)
        if share_prompt(self.blocks, self.pool, parent, child, parent.num_computed):
            self.scheduler.running.append(child)
        else:
            self.scheduler.add(child)  # no block for its copy: it is recomputed like a preempted one
        return child

    def _fork_at_prefill(self, seq: Sequence, tokens: list[int], lps: list) -> list[RequestOutput]:
        """Report each first token; only sequence 0 keeps the K/V, which goes to the decode worker
        with the (index, token) of every sequence that did not end here. Sequence 0 reports last
        (its output says whether the request ended or was prefilled); the prompt logprobs ride
        on the first output, sequence 1's."""
        outputs, forks = [], []
        for i in range(1, len(tokens)):
            child = Sequence(sequence_key(seq.request_id, i), seq.prompt_ids, seq.params, 0, seq.mode, index=i,
                             group=seq.request_id, output_ids=[tokens[i]], prompt_logprobs=seq.prompt_logprobs)
            self.stops.start(child)
            text, reason = self.stops.update(child, tokens[i])
            text += self.stops.flush(child) if reason is None else ""
            self.stops.forget(child.request_id)
            outputs.append(sequence_output(child, tokens[i], text, False, reason, False, lps[i], (), i == 1))
            if reason is None:
                forks.append((i, tokens[i]))
        outputs.append(self._postprocess(seq, tokens[0], lps[0], tuple(forks)))
        return outputs

    # ---- conveniences ---------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        """Run prompts to completion; returns each request's final output, in order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{next(self._arrivals)}" for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]

    def close(self) -> None:
        """Stop tensor-parallel followers and free a pool this engine made for them (tp_group.py),
        and close the host tier this engine made (unlinking its shared segment, if it has one).
        The device pool stays its owner's to close (a worker unlinks it last)."""
        tp_group.close_engine_group(self)
        if self.blocks.host is not None:
            self.blocks.host.close()

    def check_integrity(self) -> None:
        tables = [s.block_table for s in self.seqs.values()] + [s.block_table for s in self.prefilled.values()]
        tables += [list(r.block_ids) for r in self.imports.values()] + self.external_tables()
        self.blocks.check_integrity(tables)

    def assert_no_leaks(self) -> None:
        """Nothing running, nothing held for export or import: the pool is back at baseline."""
        assert not self.seqs and not self.prefilled and not self.imports, "requests still held"
        self.blocks.assert_baseline()
