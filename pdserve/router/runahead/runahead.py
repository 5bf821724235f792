"""KV-Runahead as the router process runs it: one long prompt prefilled by a chain of K workers.

Contract: `Runahead.start(backend, live, plan, transfer, grant)` runs inside the backend's start
of a disaggregated request, after the decode worker's reservation and the handoff plan exist.
When the prompt has at least `min_tokens` tokens (n = 1, no prompt logprobs, never after a
fallback) and K - 1 other live prefill workers exist, it
  1. orders the chain: the K - 1 least loaded other prefill workers, then the policy's prefill
     worker (it holds the route's staging hold and sends the complete K/V to the decode worker);
  2. cuts the prompt with the cached partition search (router/runahead/runahead_plan.py), each stage's
     chunks priced at its worker's registered TP size (`chunk_pricing`; cached per tuple of
     stage sizes) and its links at the handoff link's price as the P/D decision reads it
     (`Router.link_cost`: measured once transfers were published, router/pricing/link_rates.py;
     re-searched when that price moves, `ChainCaches.follow_link`);
  3. reserves each later stage's prefix (ReserveKv with `chain_start`, all at once) and answers
     False, leaving the ordinary single-worker prefill to the caller, if any refuses;
  4. sends every stage its Prefill: prompt up to its end, a plan (capability-signed, like any
     handoff) to the next stage's reservation, or the route's own plan for the last stage.
Every stage runs under the request's engine id; only the route's prefill and decode workers
are owners, so an inner stage's messages never count as the request's (its K/V lease is renewed
here, `renew_leases`, until the first token). The trace line records
`runahead_partition` and `runahead_workers`; `pdserve_runahead_prefills{outcome}` counts
chained, refused (a reservation failed: single-worker prefill) and fallback.
Failure: a stage's `WorkerError(runahead_failed)` (or any error of a chain worker) or the loss
of an inner chain worker before the first token aborts every stage and hands the request to the
decode-start fallback (router/process/recovery.py) with its K/V lost: the request is prefilled again by
one worker (a recompute under a fresh engine id), never answered from a broken chain.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace

from prometheus_client import Counter

from pdserve.engine.sequence import SamplingParams
from pdserve.router.pricing.cost import CostModel
from pdserve.router.pricing.tp_pricing import TpPricing, measured_tp
from pdserve.router.process import recovery
from pdserve.router.runahead.runahead_plan import ChainCaches, ChunkCost, LinkCost
from pdserve.workers import messages as m

FAILED = "runahead_failed"
RESERVE_TIMEOUT_S = 10.0


@dataclass
class Chain:
    engine_id: str
    workers: tuple[str, ...]  # stage order; the last is the route's prefill worker
    partition: tuple[int, ...]


@dataclass
class Runahead:
    k: int
    min_tokens: int
    chunk_tokens: int
    caches: ChainCaches  # searched partitions per tuple of stage TP sizes
    link_prior: CostModel  # whose transfer terms price a link before the router measured one
    registry: object = None  # the backend's metrics registry
    chains: dict[str, Chain] = field(default_factory=dict)  # request id -> its chain, until the first token
    disabled: set[str] = field(default_factory=set)  # requests that fell back: never chained again
    _waiting: dict[tuple[str, str], asyncio.Future] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.counter = Counter("pdserve_runahead_prefills", "KV-Runahead prefills by outcome (router/runahead/runahead.py)",
                               ["outcome"], registry=self.registry)

    def eligible(self, live) -> bool:
        p = live.req.params
        return (self.k >= 2 and len(live.req.prompt_ids) >= self.min_tokens and p.n == 1
                and p.prompt_logprobs is None and live.req.request_id not in self.disabled)

    # ---- start ------------------------------------------------------------------------------
    async def start(self, backend, live, plan, transfer: m.TransferPlan, grant: int) -> bool:
        """Start the chain; False: the caller sends the ordinary Prefill."""
        self._prune(backend)
        if not self.eligible(live):
            return False
        chain = self.plan_chain(backend, plan.prefill_id, len(live.req.prompt_ids))
        if chain is None:
            return False
        workers, partition = chain
        ends = [sum(partition[: i + 1]) for i in range(len(partition))]
        reserved = await self._reserve_links(backend, live, workers, ends)
        if reserved is None:
            self.counter.labels("refused").inc()
            for wid in workers[1:]:
                await backend._send(wid, m.Abort(live.engine_id, "runahead_refused"))
            return False
        self.chains[live.req.request_id] = Chain(live.engine_id, workers, partition)
        live.note(runahead_partition=list(partition), runahead_workers=list(workers))
        self.counter.labels("chained").inc()
        await self._send_stages(backend, live, workers, ends, reserved, transfer, grant)
        return True

    def plan_chain(self, backend, prefill_id: str, num_tokens: int) -> tuple[tuple[str, ...], tuple[int, ...]] | None:
        """(stage workers, partition) of a chain ending at `prefill_id`, each stage priced at its
        worker's registered TP size; None: too few other workers, or too few chunks."""
        others = _chain_workers(backend, prefill_id, self.k - 1)
        if not others:
            return None
        self.caches.follow_link(self.link(backend))
        workers = (*others, prefill_id)
        tps = tuple(backend.registered[wid].tp for wid in workers)
        partition = self.caches.partition(num_tokens, self.chunk_tokens, tps)
        return None if partition is None else (workers, partition)

    def link(self, backend) -> LinkCost:
        """A chain link's price now: the handoff link as the router prices the P/D decision's."""
        return LinkCost.of(backend.router.link_cost(self.link_prior), self.caches.num_layers)

    def _link_id(self, live, stage: int) -> str:
        return f"{live.transfer_id}/ra{stage}"

    async def _reserve_links(self, backend, live, workers, ends) -> list[m.Reserved] | None:
        """ReserveKv(chain_start) at every later stage; their answers, or None if one failed."""
        req, loop = live.req, asyncio.get_running_loop()
        futures = []
        for i in range(1, len(workers)):
            src = backend.registered[workers[i - 1]]
            key = (workers[i], self._link_id(live, i))
            self._waiting[key] = fut = loop.create_future()
            futures.append(fut)
            await backend._send(workers[i], m.ReserveKv(
                live.engine_id, key[1], live.generation, tuple(req.prompt_ids[: ends[i]]), self._params(live, i, len(workers)),
                workers[i - 1], src.epoch, m.FIRST_ATTEMPT, req.tenant, chain_start=ends[i - 1]))
        try:
            answers = await asyncio.wait_for(asyncio.gather(*futures), RESERVE_TIMEOUT_S)
        except asyncio.TimeoutError:
            answers = None
        finally:
            for i in range(1, len(workers)):
                self._waiting.pop((workers[i], self._link_id(live, i)), None)
        return answers if answers is not None and all(a.ok for a in answers) else None

    def _params(self, live, stage: int, num_stages: int) -> SamplingParams:
        """The last stage samples the request's first token; an inner stage's token is thrown
        away, so it samples greedily and can never end the request there."""
        if stage + 1 == num_stages:
            return live.req.params
        return SamplingParams(max_tokens=2, ignore_eos=True, tenant=live.req.params.tenant)

    async def _send_stages(self, backend, live, workers, ends, reserved, transfer, grant) -> None:
        req, k = live.req, len(workers)
        for i, wid in enumerate(workers):
            last = i + 1 == k
            onward = transfer if last else self._link_plan(backend, live, wid, workers[i + 1], reserved[i], i + 1)
            stage = m.ChainStage(i, k, ends[i - 1] if i else 0, self._link_id(live, i) if i else "")
            await backend._send(wid, m.Prefill(live.engine_id, tuple(req.prompt_ids[: ends[i]]), self._params(live, i, k),
                                               live.seed, onward, grant if last else 0, stage))

    def _link_plan(self, backend, live, src_id: str, dest_id: str, answer: m.Reserved, stage: int) -> m.TransferPlan:
        """The handoff plan of one chain link, signed like the route's own (frontend_start.start)."""
        dest, src = backend.registered[dest_id], backend.registered[src_id]
        same_host = dest.host_id == src.host_id and dest.shm_name is not None and backend.transport != "tcp"
        plan = m.TransferPlan(self._link_id(live, stage), live.generation, m.FIRST_ATTEMPT, live.req.tenant, dest_id,
                              dest.epoch, answer.reservation_id, answer.dest_blocks, answer.num_visible_blocks,
                              "shm" if same_host else "tcp", tuple(dest.handoff_address), dest.shm_name, dest.num_blocks)
        return backend.capabilities.issue(plan, src_id, src.epoch, dest.abi_hash, same_host and src.shm_name is not None,
                                          dest.bytes_per_token * dest.block_size)

    # ---- worker messages --------------------------------------------------------------------
    async def intercept(self, backend, msg) -> bool:
        """Chain messages the ordinary dispatch must not see; True when handled here."""
        if isinstance(msg, m.Reserved):
            fut = self._waiting.get((msg.worker_id, msg.transfer_id))
            if fut is not None and not fut.done():
                fut.set_result(msg)
            return fut is not None
        if isinstance(msg, m.WorkerError):
            live = backend.lookup(msg.request_id)
            chain = None if live is None else self.chains.get(live.req.request_id)
            if chain is None or chain.engine_id != msg.request_id or msg.worker_id not in chain.workers:
                return False
            await self.fall_back(backend, live, f"{msg.worker_id}:{msg.message}")
            return True
        return False

    async def on_worker_lost(self, backend, worker_id: str) -> None:
        """An inner chain worker is gone: its chains fall back now (the route's own workers are
        owners: the ordinary recovery moves those requests on)."""
        for rid, chain in list(self.chains.items()):
            live = backend.live.get(rid)
            if live is not None and worker_id in chain.workers[:-1] and live.engine_id == chain.engine_id:
                await self.fall_back(backend, live, f"worker_lost:{worker_id}")

    async def fall_back(self, backend, live, cause: str) -> None:
        chain = self.chains.pop(live.req.request_id, None)
        if chain is None or live.done or live.first_token_s is not None:
            return  # the first token is out: the chain had finished, recovery owns the rest
        self.disabled.add(live.req.request_id)
        self.counter.labels("fallback").inc()
        live.note(runahead_fallback=cause)
        for wid in chain.workers[:-1]:
            await backend._send(wid, m.Abort(chain.engine_id, FAILED))
        live.kv_failed = True  # the decode-start fallback: one worker prefills the prompt again
        await recovery.decide(backend, live, f"{FAILED}:{cause}")

    async def renew_leases(self, backend) -> None:
        """Inner chain workers are no owners, so the ordinary renewal misses their stages."""
        self._prune(backend)
        for chain in self.chains.values():
            for wid in chain.workers[:-1]:
                if wid in backend.registered:
                    await backend._send(wid, m.RenewLeases((chain.engine_id,)))

    def _prune(self, backend) -> None:
        for rid in [r for r, c in self.chains.items() if _settled(backend.live.get(r), c)]:
            del self.chains[rid]
        self.disabled.intersection_update(backend.live)


def _settled(live, chain: Chain) -> bool:
    return live is None or live.done or live.first_token_s is not None or live.engine_id != chain.engine_id


def _chain_workers(backend, exclude: str, count: int) -> tuple[str, ...]:
    """The `count` least loaded other routable prefill workers with a chain listener, or ()."""
    ready = [wid for wid, reg in backend.registered.items()
             if reg.role == "prefill" and wid != exclude and reg.handoff_address and wid in backend.loads
             and backend.loads[wid].role_state == "serving" and wid not in backend.away]
    ready.sort(key=lambda wid: (backend.loads[wid].pending_prompt_tokens, wid))
    return tuple(ready[:count]) if len(ready) >= count else ()


def chunk_pricing(pricing: TpPricing, profile: dict | None):
    """tp -> a chain stage's `ChunkCost` at that TP size, by the router's own formula (`TpPricing`,
    latency/tp_scaling.py): the prefill terms of `pricing.worker(tp)` (affine: no attention term);
    with a `pdserve profile` fit, its raw a + b*rows + c*pairs priced by the same scaling from the
    TP size it was measured at (at that size, the raw terms as measured)."""
    fit, pairs = pricing, profile is not None
    if pairs:
        a, b, c = (float(x) for x in profile["prefill_coef"])
        raw = replace(pricing.base, prefill_overhead_s=a, prefill_s_per_token=b, prefill_s_per_pair=c)
        fit = TpPricing(raw, pricing.scaling, measured_tp(profile))

    def at(tp: int) -> ChunkCost:
        cost = fit.worker(tp)
        return ChunkCost(cost.prefill_overhead_s, cost.prefill_s_per_token, cost.prefill_s_per_pair if pairs else 0.0)
    return at


def make_runahead(k: int, min_tokens: int, model_dir, engine, pricing: TpPricing, profile_path: str | None, registry,
                  cache_root=None) -> Runahead:
    """The router's chain runner for `--prefill-runahead k`. The partition search prices each
    stage's chunks at its worker's TP size (`chunk_pricing`): with the `pdserve profile` fit
    `--pd-profile FILE` names (its a + b*rows + c*pairs), else with the router's affine prefill
    cost (no attention term: the search balances rows); links at the router's handoff link price
    (its same-host transfer terms: the prior until transfers are measured, `Runahead.link`).
    Cache key: the checkpoint hash, k, the stages' TP sizes, the dtype (storage and compute) and
    the CPU kind; on disk under `$PDSERVE_CACHE` (~/.cache/pdserve)."""
    import json
    from pathlib import Path

    from pdserve.model.config import load_config
    from pdserve.model.cpu import cpu_report
    from pdserve.model.default import default_cache_root
    from pdserve.model.loader import checkpoint_hash
    from pdserve.router.runahead.runahead_plan import RunaheadKey

    mc = load_config(model_dir)
    dtype = engine.dtype if engine.compute_dtype in (None, engine.dtype) else f"{engine.dtype}-{engine.compute_dtype}"
    key = RunaheadKey(checkpoint_hash(model_dir), k, dtype, cpu_report()["kind"], (1,) * k)  # tps: per chain
    profile = None
    if profile_path and profile_path not in ("auto", "refit", "none"):
        profile = json.loads(Path(profile_path).read_text())
    prior = pricing.base  # the transfer terms: the same at every TP size
    root = Path(cache_root) if cache_root is not None else default_cache_root().parent
    caches = ChainCaches(key, root, chunk_pricing(pricing, profile), LinkCost.of(prior, mc.num_layers), mc.num_layers)
    return Runahead(k, min_tokens, engine.max_num_batched_tokens, caches, prior, registry)
