"""The router process's side of a cross-worker prefix fetch (issue 19, part 2), and its metrics.

Contract: `prepare(live, dest)` runs before the request's first message to the worker that will
prefill it (Generate, or Prefill on a prefill worker). It plans with `fetch_plan.plan_fetch` over
the cluster K/V index (the tenant-rooted keys of the prompt, each worker's held set), writes the
decision and its terms on the trace line, and when the fetch pays:
    FetchReserve -> destination answers FetchReserved (its blocks, what it already had), and at
    the same time FetchPin -> holder answers FetchPinned (the (segment, slot) of each prefix
    block, pinned where it is: device pool or host tier, read in place)
    FetchServe(plan, capability) -> holder, the plan and its capability naming exactly the pinned
    (segment, slot) pairs of the blocks moved; the holder's link lands, validates and publishes at
    the destination, which inserts the blocks into its prefix cache -> FetchDone (both sides)
and returns once the destination's FetchDone came, the fetch failed, the holder left the
registry (died, or re-registered under another epoch) or the deadline passed (one deadline for
the whole fetch, reserve to land: `MIN_DEADLINE_S` + 10x its prediction); in the last three
cases both are told FetchAbort (unpublished blocks and the holder's pins return) and the request simply
recomputes (its own prefix-cache lookup finds only what really landed). `prepare` never raises
for a fetch failure. `--no-kv-sharing` (enabled=False) plans nothing.
A fetch runs in a task of its own; the request that started it and those that joined it wait
on it. A waiter cancelled (its client left) leaves it to the others; when the last one leaves,
the fetch is cancelled and both sides are told FetchAbort at once (`fetch_failure: abandoned`,
`pdserve_kv_fetches_total{result="abandoned"}`), not left to their leases. The destination
still keeps aborted blocks until its transport's last granted write ended (docs/serving.md §5).
One fetch per (prefix, destination) in flight: while a fetch moves blocks to a destination, a
later request whose planned fetch ends on one of those blocks (the chain hash names its whole
prefix and tenant) waits for that fetch instead of starting its own, then prefills over what it
landed (`fetch_joined` on its trace line, `pdserve_kv_fetch_waits_total`). A request whose
planned fetch finds instead a running fetch to its destination of a shorter prefix of its own
chain (it moves the request's block `covered` - 1, not its last) joins that one when
`fetch_plan.plan_join` says waiting for it and then fetching the remainder, or recomputing it, is
cheaper than its own fetch of the whole prefix now: it waits, and fetches the remainder (the
destination's reservation counts what already landed as its own hit, so only the remainder
moves) or prefills it (`fetch_joined_blocks`, `fetch_rest` on its trace line); otherwise it runs
its own fetch. A joined fetch that failed leaves the request to recompute, as a waiter of the
whole prefix does.
Leases: both sides hold a fetch under a lease (workers/prefix_fetch/fetch.py, fetch_holder.py); `lease_ids`
names each running fetch on its destination and holder, and the router renews them with the
live requests' leases (router/process/frontend_upkeep.py `renewals`), so a fetch that takes
longer than one lease (a slow link, a busy holder) is bounded only by its own deadline here.
Rates (router/pricing/kv_rates.py): each holder's FetchDone measures the fetch link, each landed fetch's
wall time the per-fetch overhead, the workers' loads their host tiers' copy rate; `prepare` and
every FetchDone hand the router the cost model with them (`Router.kv_cost`, the prefix policy's
fetch and host-tier terms), and the fetch plan uses the same one.
Metrics: `pdserve_kv_fetch_bytes_total`, `pdserve_kv_fetch_seconds`, `pdserve_kv_fetches_total{result}`
(landed, failed, abandoned)
(the prefix-hit tokens a fetch brought are counted with the request's
cached tokens by router/process/serving_metrics.py, from the trace's `fetch_landed_blocks`).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from dataclasses import dataclass, field, replace

from prometheus_client import Counter, Histogram

from pdserve.router.kv.fetch_plan import (
    FETCH,
    RECOMPUTE,
    FetchTerms,
    plan_fetch,
    plan_join,
)
from pdserve.router.pricing.kv_rates import KvRates
from pdserve.workers import messages as m
from pdserve.workers.prefix_fetch.fetch_control import FETCH_SUFFIX

FETCH_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
MIN_DEADLINE_S = 2.0  # a fetch (reserve, pin, serve, land) gets this long plus 10x its prediction
POLL_S = 0.02

log = logging.getLogger(__name__)


@dataclass
class _Fetch:
    fetch_id: str
    dest: str
    holder: str
    reserved: asyncio.Future
    pinned: asyncio.Future  # the holder's FetchPinned
    landed: asyncio.Future  # the destination's FetchDone
    source_failed: bool = False
    started_s: float = field(default_factory=time.monotonic)


@dataclass
class _Running:
    """A fetch under way to one destination, as its waiters see it (the request that started it
    is one of them)."""

    landed: asyncio.Future  # the blocks it landed (0: it failed)
    done_at_s: float  # when it is predicted to land (monotonic)
    task: asyncio.Task | None = None  # the fetch, run apart from any one request's task
    waiters: int = 0


class FetchRunner:
    def __init__(self, backend, enabled: bool = True):
        self.backend, self.enabled = backend, enabled
        self.pending: dict[str, _Fetch] = {}
        # (destination, index key of a block a running fetch moves there) -> that fetch
        self._inflight: dict[tuple[str, int], _Running] = {}
        self.rates = KvRates()  # measured fetch link, per-fetch overhead, host tier copy rate
        self._ids = itertools.count(1)
        r = backend.metrics.registry
        self.fetch_bytes = Counter("pdserve_kv_fetch_bytes", "K/V bytes of published prefix fetches", registry=r)
        self.fetch_seconds = Histogram("pdserve_kv_fetch_seconds", "Prefix fetch wall time (router: plan to landed)",
                                       buckets=FETCH_BUCKETS_S, registry=r)
        self.fetches = Counter("pdserve_kv_fetches", "Prefix fetches by result", ["result"], registry=r)
        self.waits = Counter("pdserve_kv_fetch_waits", "Requests that waited on a running fetch of their prefix to "
                             "their prefill worker instead of starting their own", registry=r)

    # ---- planning -------------------------------------------------------------------------
    def cost(self):
        """The cost model with the measured placement rates, handed to the router's policy too."""
        b = self.backend
        loads = [load for load in b.loads.values() if load.host_capacity]
        self.rates.observe_host_copies(sum(l.host_copy_bytes for l in loads), sum(l.host_copy_s for l in loads))
        b.router.kv_cost = cost = self.rates.cost(b.router.link_cost(b.router.config.cost))
        return cost

    def terms(self, live, dest: str, keys: tuple[int, ...]) -> FetchTerms:
        """The fetch decision for `live` at `dest`; `keys`: its prompt's index keys."""
        b = self.backend
        self.cost()  # refresh the measured placement rates (and the policy's copy)
        req, cost = live.req, self._dest_cost(dest)
        held = {wid: b.router.kv_held(wid) for wid in b.registered}
        usable = (len(req.prompt_ids) - 1) // cost.block_size_tokens
        return plan_fetch(dest, keys, held, usable, cost, lambda w: self._same_host(w, dest))

    def _dest_cost(self, dest: str):
        """The model a fetch to `dest` is decided with: the prefill saved is dest's, at its TP size."""
        return self.rates.cost(self.backend.router.worker_cost(dest))

    def _same_host(self, a: str, b: str) -> bool:
        return self.backend.registered[a].host_id == self.backend.registered[b].host_id

    async def prepare(self, live, dest: str) -> None:
        if not self.enabled or dest not in self.backend.registered:
            return
        keys = self.backend._block_hashes(live.req.prompt_ids, live.req.params.tenant)
        terms = self.terms(live, dest, keys)
        live.note(**terms.trace_fields())
        if terms.decision != FETCH:
            return
        running = self._inflight.get((dest, keys[terms.remote_blocks - 1]))
        if running is not None:  # the fetch of this prefix to this worker is under way: wait for it
            self.waits.inc()
            landed = await self._await_landed(live, running)
            live.note(fetch_joined=True, fetch_landed_blocks=min(landed, terms.fetch_blocks))
            return
        earlier, rest = await self._join_shorter(live, dest, keys, terms)
        if rest is not None and rest.decision != FETCH:
            return  # the remainder is recomputed (or the joined fetch failed)
        await self._own(live, dest, keys, rest or terms, earlier)

    async def _join_shorter(self, live, dest: str, keys: tuple[int, ...],
                            terms: FetchTerms) -> tuple[int, FetchTerms | None]:
        """(blocks landed for this request, the remainder's terms) after waiting on a running fetch
        to `dest` of a shorter prefix of this chain when `plan_join` says so (module contract);
        (0, None) when there is none or its own fetch is cheaper; a failed one: the remainder to
        recompute."""
        shorter = range(terms.remote_blocks - 1, terms.local_blocks, -1)  # the longest running prefix first
        covered = next((n for n in shorter if (dest, keys[n - 1]) in self._inflight), 0)
        if not covered or terms.holder not in self.backend.registered:
            return 0, None
        running = self._inflight[(dest, keys[covered - 1])]
        wait_s = max(0.0, running.done_at_s - time.monotonic())
        rest = plan_join(terms, covered, wait_s, self._dest_cost(dest), self._same_host(dest, terms.holder))
        if rest is None:
            return 0, None
        self.waits.inc()
        landed = min(await self._await_landed(live, running), covered - terms.local_blocks)
        decision = rest.decision if landed else RECOMPUTE
        live.note(fetch_joined=True, fetch_joined_blocks=covered, fetch_rest=decision, fetch_landed_blocks=landed)
        return landed, rest if landed else replace(rest, decision=decision)

    async def _own(self, live, dest: str, keys: tuple[int, ...], terms: FetchTerms, earlier: int) -> None:
        """Run this request's fetch of `terms`, waiters of its blocks joining it; `earlier`: blocks
        a joined fetch already landed for it."""
        own = _Running(asyncio.get_running_loop().create_future(), time.monotonic() + terms.fetch_s)
        moved = keys[terms.local_blocks:terms.remote_blocks]
        for key in moved:
            self._inflight.setdefault((dest, key), own)
        own.task = asyncio.create_task(self._fetch(live, dest, terms, earlier))
        own.task.add_done_callback(functools.partial(self._ended, own, dest, moved))
        await self._await_landed(live, own)

    def _ended(self, own: _Running, dest: str, moved: tuple[int, ...], task: asyncio.Task) -> None:
        """The fetch's task ended (landed, failed, or cancelled by its last waiter leaving, even
        before it started): its blocks are no longer in flight, its waiters get what landed."""
        for key in moved:
            if self._inflight.get((dest, key)) is own:
                del self._inflight[(dest, key)]
        landed = 0
        if task.cancelled():
            self.fetches.labels("abandoned").inc()
        elif task.exception() is not None:
            log.error("prefix fetch to %s failed", dest, exc_info=task.exception())  # its waiters recompute
        else:
            landed = task.result()
        own.landed.set_result(landed)

    async def _await_landed(self, live, running: _Running) -> int:
        """The blocks `running` landed. A waiter cancelled (its client left) leaves the fetch to the
        others; the last one to leave abandons it, so both sides return its blocks now, not at
        their leases' expiry."""
        running.waiters += 1
        try:
            return await asyncio.shield(running.landed)
        finally:
            running.waiters -= 1
            if not running.waiters and not running.landed.done():
                live.note(fetch_failure="abandoned")
                running.task.cancel()

    async def _fetch(self, live, dest: str, terms: FetchTerms, earlier: int = 0) -> int:
        """Run one planned fetch, note and count it; the blocks it landed."""
        t0 = time.monotonic()
        landed = await self._run(live, dest, terms)
        seconds = time.monotonic() - t0
        live.note(fetch_landed_blocks=earlier + landed, fetch_s=round(seconds, 6))
        self.fetches.labels("landed" if landed else "failed").inc()
        if landed:
            self.fetch_seconds.observe(seconds)
            b = self.backend
            hosts = {b.registered[w].host_id for w in (dest, terms.holder) if w in b.registered}
            same_host = len(hosts) == 1
            base, nbytes = b.router.link_cost(b.router.config.cost), landed * b._block_size * b._bytes_per_token()
            overhead = self.rates.observe_fetch(base, nbytes, seconds, same_host)
            live.note(fetch_overhead_sample_s=None if overhead is None else round(overhead, 6))
            self.cost()
        return landed

    async def _run(self, live, dest: str, terms: FetchTerms) -> int:
        """Blocks landed at `dest` (0: the fetch failed and the request recomputes). One deadline
        bounds the whole fetch (reserve, pin, serve, land): `MIN_DEADLINE_S` + 10x its prediction."""
        loop = asyncio.get_running_loop()
        fetch_id = f"{live.engine_id}/fetch{next(self._ids)}"
        job = _Fetch(fetch_id, dest, terms.holder, loop.create_future(), loop.create_future(), loop.create_future())
        self.pending[fetch_id] = job
        deadline = time.monotonic() + MIN_DEADLINE_S + 10 * terms.fetch_s
        try:
            outcome = await self._steps(live, job, terms, deadline)
            if isinstance(outcome, int):
                return outcome
            live.note(fetch_failure=outcome)
            await self._abort(job)
            return 0
        except asyncio.CancelledError:  # its last waiter left: nobody waits for it any more
            await self._abort(job)
            raise
        finally:
            self.pending.pop(fetch_id, None)

    async def _steps(self, live, job: _Fetch, terms: FetchTerms, deadline: float) -> int | str:
        """Reserve and pin, serve, land: the blocks landed, or why the fetch failed."""
        holder = self.backend.registered.get(terms.holder)
        if holder is None:  # it left while this request waited on a joined fetch
            return "holder_lost"
        prefix = tuple(live.req.prompt_ids[: terms.remote_blocks * self.backend._block_size])
        await self._send(job.dest, m.FetchReserve(job.fetch_id, prefix, live.req.tenant, terms.holder, holder.epoch))
        await self._send(terms.holder, m.FetchPin(job.fetch_id, prefix, live.req.tenant, terms.remote_blocks))
        reserved = await self._wait(job.reserved, job, deadline)
        pinned = await self._wait(job.pinned, job, deadline)
        failure = _refused(reserved) or _refused(pinned)
        plan = None if failure else self._plan(live, job, reserved, pinned)
        if plan is None:  # refused, late, or a side left the registry meanwhile
            return failure or "holder_lost"
        await self._send(terms.holder, m.FetchServe(prefix, plan))
        done = await self._wait(job.landed, job, deadline)
        if isinstance(done, m.FetchDone) and done.published:
            return done.blocks
        return done if isinstance(done, str) else done.reason or "aborted"

    async def _abort(self, job: _Fetch) -> None:
        """Both sides return what they hold for the fetch (a worker holding nothing ignores it)."""
        for wid in (job.dest, job.holder):
            if wid in self.backend.registered:
                await self._send(wid, m.FetchAbort(job.fetch_id))

    async def _send(self, worker_id: str, msg) -> None:
        """To the worker's fetch socket (handled off its engine-step thread: workers/prefix_fetch/fetch_control.py),
        else, while that socket is not connected, to its main socket."""
        if not await self.backend._send(worker_id + FETCH_SUFFIX, msg):
            await self.backend._send(worker_id, msg)

    def _plan(self, live, job: _Fetch, reserved: m.FetchReserved, pinned: m.FetchPinned) -> m.TransferPlan | None:
        b = self.backend
        dest, holder = b.registered.get(job.dest), b.registered.get(job.holder)
        if dest is None or holder is None or dest.fetch_address is None:
            return None
        same_host = dest.host_id == holder.host_id and dest.shm_name is not None and b.transport != "tcp"
        plan = m.TransferPlan(job.fetch_id, 1, m.FIRST_ATTEMPT, live.req.tenant, job.dest, dest.epoch,
                              reserved.reservation_id, reserved.dest_blocks, reserved.num_visible_blocks,
                              "shm" if same_host else "tcp", tuple(dest.fetch_address), dest.shm_name, dest.num_blocks,
                              src_slots=tuple(pinned.src_slots[reserved.num_visible_blocks:]))
        segments = tuple(name for name in (holder.shm_name, holder.host_shm_name) if name)
        return b.capabilities.issue(plan, job.holder, holder.epoch, dest.abi_hash, same_host and holder.shm_name is not None,
                                    dest.bytes_per_token * dest.block_size, segments)

    async def _wait(self, future: asyncio.Future, job: _Fetch, deadline: float):
        """The future's result; else why not: "holder_lost" once the holder (or the destination)
        left the registry under the epoch the fetch started with, "source_failed" when the holder
        reported its side failed, "timeout" at the deadline."""
        b = self.backend
        epochs = {w: b.registered[w].epoch for w in (job.dest, job.holder) if w in b.registered}
        while not future.done():
            if any(w not in b.registered or b.registered[w].epoch != e for w, e in epochs.items()) or len(epochs) < 2:
                return "holder_lost"
            if job.source_failed:
                return "source_failed"
            if time.monotonic() > deadline:
                return "timeout"
            await asyncio.sleep(POLL_S)
        return future.result()

    def lease_ids(self) -> list[tuple[str, str]]:
        """(worker, fetch id) of every running fetch's lease: its destination's and its holder's."""
        return [(wid, job.fetch_id) for job in self.pending.values() for wid in (job.dest, job.holder)]

    # ---- worker messages ------------------------------------------------------------------
    def on_message(self, msg) -> None:
        job = self.pending.get(msg.fetch_id)
        if isinstance(msg, m.FetchDone) and msg.side == "source":
            self._on_source_done(msg, job)
            return
        if job is None:
            return
        future = job.reserved if isinstance(msg, m.FetchReserved) else job.pinned if isinstance(msg, m.FetchPinned) \
            else job.landed
        if not future.done():
            future.set_result(msg)

    def _on_source_done(self, msg: m.FetchDone, job: _Fetch | None) -> None:
        if msg.published:
            self.fetch_bytes.inc(msg.bytes)
            self.rates.observe_link(msg.bytes, msg.transfer_s)
            self.cost()
        elif job is not None:
            job.source_failed = True  # the destination is told to abort by the waiting fetch


def _refused(answer) -> str | None:
    """Why a FetchReserved / FetchPinned answer stops the fetch ("timeout", "holder_lost", its
    reason), or None when it was granted."""
    if isinstance(answer, str):
        return answer
    return None if answer.ok else answer.reason or "refused"
