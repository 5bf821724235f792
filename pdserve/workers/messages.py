"""Typed messages between the router and worker processes, with their one serializer.

Contract: everything that crosses the router <-> worker boundary is one of these frozen msgspec
Structs, tagged by class name and encoded with msgpack. Every worker -> router message carries
(worker_id, epoch) so the router can reject messages from a retired epoch.

Request life cycle over these messages (disaggregated):
    router -> D: ReserveKv          D -> router: Reserved (blocks held before any prefill)
    router -> P: Prefill(+plan)     P -> router: Tokens(first token, prefilled)   [TTFT]
    P -> D over the handoff link: manifest, chunks, seal; D publishes
    D -> router: TransferDone       P -> router: TransferDone (source side, then releases)
    router -> D: StartDecode(first token, seed)  D -> router: Tokens ... finished
Colocated: router -> W: Generate;  W -> router: Tokens ... finished.
Recompute fallback: router -> W: Generate(resume_output_ids=[tokens already streamed]).
Prefix fetch (before the request's own messages): router -> W: FetchReserve -> FetchReserved and,
at once, router -> holder H: FetchPin -> FetchPinned (H pins the prefix's blocks where they are:
device blocks and host-tier slots, read in place); router -> H: FetchServe(plan naming those
(segment, slot) pairs, bound into its capability); H -> W over a handoff link; both send FetchDone.
Prefix cache: each Heartbeat carries the block events since the previous one (`kv`, a numbered
KvReport: engine/kv/kv_events.py); a gap in the numbers makes the router send ResyncKv, answered
by the next Heartbeat with the whole key set marked as a resync (router/kv/kv_index.py).
"""

from __future__ import annotations

import msgspec

from pdserve.engine.kv.kv_events import KvReport
from pdserve.engine.outputs import TokenLogprobs
from pdserve.engine.sequence import SamplingParams
from pdserve.engine.tp_tally import CollectiveReport

FIRST_ATTEMPT = 1  # transfer attempts count from 1 within a generation (the ledger's manifest check)


class TransferPlan(msgspec.Struct, frozen=True):
    """Where a prefill worker sends a request's K/V: the destination's reservation and link."""

    transfer_id: str
    generation: int
    attempt: int
    tenant: str
    dest_worker: str
    dest_epoch: int
    reservation_id: str
    dest_blocks: tuple[int, ...]  # all prompt blocks at the destination, in order
    num_visible_blocks: int  # leading blocks already exact at the destination (not moved)
    transport: str  # "shm" | "tcp"
    dest_address: tuple[str, int]  # handoff listener (host, port)
    dest_shm_name: str | None = None
    dest_num_blocks: int = 0
    capability: bytes | None = None  # the router's signed permission for this transfer (handoff/trust/capability.py)
    src_slots: tuple[tuple[int, int], ...] = ()  # prefix fetch: the holder's (segment, slot) per transferred block


# ---- router -> worker ---------------------------------------------------------------------
class Generate(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    seed: int
    resume_output_ids: tuple[int, ...] = ()
    grant_seq: int = 0  # router hold applied by accepting this message


class ChainStage(msgspec.Struct, frozen=True):
    """KV-Runahead (workers/runahead_side.py): this Prefill is stage `index` of `num_stages`; its
    prompt is the chain's prompt up to the stage's end, and for index > 0 the K/V of its first
    `start` tokens arrives over the chain link `upstream_transfer_id` (reserved by a ReserveKv
    with `chain_start`). The plan sends the stage's whole K/V onward: to the next stage, or (last
    stage) to the decode worker."""

    index: int
    num_stages: int
    start: int = 0
    upstream_transfer_id: str = ""


class Prefill(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    seed: int
    plan: TransferPlan
    grant_seq: int = 0
    chain: ChainStage | None = None  # a KV-Runahead stage; None: an ordinary single-worker prefill


class ReserveKv(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    transfer_id: str
    generation: int
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    source_worker: str
    source_epoch: int
    attempt: int = FIRST_ATTEMPT
    tenant: str = "default"
    grant_seq: int = 0
    chain_start: int = 0  # > 0: a KV-Runahead stage's prefix (prompt[:chain_start]) lands here, on a prefill worker
    reserve_tokens: int = 0  # output tokens the decode reservation covers (reserve dynamic); 0: max_tokens


class StartDecode(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    first_token: int
    seed: int
    forks: tuple[tuple[int, int], ...] = ()  # n > 1: (index, first token) of each sequence to decode


class Abort(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    reason: str = "abort"
    ack: bool = False  # answer with ControlAck("abort", request_id) once handled (the rollback's drain)


class ChangeRole(msgspec.Struct, frozen=True, tag=True):
    """Drain, then serve as `role` under `epoch` (> the current one) and register again
    (workers/roles.py). The router sends it once it routes nothing new to the worker."""

    role: str
    epoch: int


class CapabilityKey(msgspec.Struct, frozen=True, tag=True):
    """The router's new capability public key (a revocation): capabilities of older key epochs
    stop verifying at once (handoff/trust/capability.py `Verifier.install`)."""

    public_key_hex: str
    key_epoch: int


class RouteEpoch(msgspec.Struct, frozen=True, tag=True):
    """The router retired every route epoch below `route_epoch` (a rollback): capabilities issued
    under an older one stop verifying at once (handoff/trust/capability.py `Verifier.advance_route`)."""

    route_epoch: int


class Shutdown(msgspec.Struct, frozen=True, tag=True):
    pass


class ResyncKv(msgspec.Struct, frozen=True, tag=True):
    """The router's K/V index missed some of this worker's block events: send the whole prefix
    cache key set (the next Heartbeat's `kv`, marked as a resync)."""

    reason: str = "gap"


class FetchReserve(msgspec.Struct, frozen=True, tag=True):
    """Cross-worker prefix fetch, at the destination: hold blocks for the whole blocks of
    `prompt_ids` this worker lacks, to be read from `holder` (workers/prefix_fetch/fetch.py)."""

    fetch_id: str
    prompt_ids: tuple[int, ...]  # the prefix to hold, whole blocks
    tenant: str
    holder: str
    holder_epoch: int


class FetchPin(msgspec.Struct, frozen=True, tag=True):
    """Cross-worker prefix fetch, at the holder: pin the leading `num_blocks` blocks of
    `prompt_ids` where they are (device blocks; host-tier slots, read in place) under a lease."""

    fetch_id: str
    prompt_ids: tuple[int, ...]
    tenant: str
    num_blocks: int


class FetchServe(msgspec.Struct, frozen=True, tag=True):
    """Cross-worker prefix fetch, at the holder: send the cached prefix blocks the plan names."""

    prompt_ids: tuple[int, ...]
    plan: TransferPlan  # transfer_id is the fetch id


class FetchAbort(msgspec.Struct, frozen=True, tag=True):
    fetch_id: str


class RenewLeases(msgspec.Struct, frozen=True, tag=True):
    """The router still wants these requests: extend their K/V leases (handoff/leases.py)."""

    request_ids: tuple[str, ...]


# ---- worker -> router ---------------------------------------------------------------------
class Register(msgspec.Struct, frozen=True, tag=True):
    worker_id: str
    epoch: int
    host_id: str
    role: str
    pid: int
    num_blocks: int
    block_size: int
    model_hash: str
    abi_hash: str
    bytes_per_token: int
    max_model_len: int
    prefix_identity: str = ""
    cpu: dict = msgspec.field(default_factory=dict)  # the engine's numerics report (model/cpu.py)
    handoff_address: tuple[str, int] | None = None
    shm_name: str | None = None
    fetch_address: tuple[str, int] | None = None  # the prefix-fetch listener (workers/prefix_fetch/fetch.py)
    tp: int = 1  # tensor-parallel ranks of this worker (engine/tp_group.py)
    host_shm_name: str | None = None  # the host tier's segment (engine/kv/host_tier.py): prefix fetches read it in place


class Load(msgspec.Struct, frozen=True):
    pending_prompt_tokens: int
    active_decode: int
    num_running: int
    free_blocks: int
    reserved_blocks: int
    applied_grant_seq: int = 0
    num_blocks: int = 0
    integrity_ok: bool = True  # the engine's pool check passed at this report
    leases_expired: int = 0  # K/V reclaimed because the router stopped renewing (since start)
    local_prefills: int = 0  # decode worker: Generate requests still prefilling here (workers/local_prefill.py)
    local_prefill_tokens: int = 0  # their prompt tokens not yet computed
    role_state: str = "serving"  # "serving" | "draining": a role change is under way (workers/roles.py)
    num_preemptions: int = 0  # engine preemptions since start, every cause (engine/scheduler.py)
    num_priority_preemptions: int = 0  # of which a waiting prompt displaced a decode (engine/prompt_priority.py)
    cached_blocks: int = 0  # unreferenced blocks still in the prefix cache (evictable)
    host_blocks: int = 0  # host tier (engine/kv/host_tier.py): blocks it holds, of `host_capacity`
    host_capacity: int = 0  # 0: no host tier
    host_hits: int = 0  # blocks promoted back on a hit (since the worker started)
    host_evictions: int = 0  # blocks the host tier itself evicted (since start)
    host_copy_bytes: int = 0  # host tier <-> pool copies timed (a calibration at start, then promotions)
    host_copy_s: float = 0.0  # their seconds: the router's measured host -> pool rate (router/pricing/kv_rates.py)
    host_pinned: int = 0  # host slots a live fetch pins (read in place by a peer)
    host_inplace_reads: int = 0  # host-tier blocks peers' fetches read in place (since start)
    tenant_roots: int = 0  # tenants whose chain root the engine keeps (at most its --max-tenant-roots)
    handoff_records: int = 0  # transfer records the worker's handoff endpoints hold: live ones, not history
    # TP > 1: rank 0's collective seconds, steps and rows per phase since the previous report
    # (engine/tp_tally.py; router/pricing/live_collectives.py prices them); None at TP 1 and from older senders
    collectives: CollectiveReport | None = None


class Heartbeat(msgspec.Struct, frozen=True, tag=True):
    worker_id: str
    epoch: int
    load: Load
    kv: KvReport | None = None  # prefix cache events since the previous heartbeat (engine/kv/kv_events.py)


class TokenItem(msgspec.Struct, frozen=True, omit_defaults=True):  # fields left at their defaults (no logprobs, n = 1) are not sent
    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    prefilled: bool = False
    index: int = 0  # which of an n > 1 request's sequences; `finished` is the request's, `finish_reason` this sequence's
    logprobs: tuple[TokenLogprobs, ...] = ()  # per token, only when the request asked for logprobs
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None  # prompt positions 1.., once, from the prefill
    forks: tuple[tuple[int, int], ...] = ()  # prefilled n > 1 request: the sequences the decode worker forks
    hold_grown_blocks: int = 0  # reserve dynamic: blocks taken past the request's hold so far (workers/hold_watch.py)
    preemptions: int = 0  # times the decode worker preempted the request (recompute) so far


class Tokens(msgspec.Struct, frozen=True, tag=True):
    worker_id: str
    epoch: int
    items: tuple[TokenItem, ...]


class Reserved(msgspec.Struct, frozen=True, tag=True):
    worker_id: str
    epoch: int
    request_id: str
    transfer_id: str
    ok: bool
    reason: str | None = None
    dest_blocks: tuple[int, ...] = ()
    num_visible_blocks: int = 0
    reservation_id: str = ""


class TransferDone(msgspec.Struct, frozen=True, tag=True):
    worker_id: str
    epoch: int
    request_id: str
    transfer_id: str
    generation: int
    side: str  # "source" | "destination"
    published: bool
    reason: str | None = None
    logical_bytes: int = 0
    physical_bytes: int = 0
    transfer_s: float = 0.0
    exposed_s: float = 0.0
    resends: int = 0  # chunk resends within the transfer (source side)
    # source side: where it went and whether it started after the prefill (a serialized transfer's
    # seconds are the link's alone: the router prices the link from them, router/pricing/link_rates.py)
    dest_worker: str = ""
    serialized: bool = False


class FetchReserved(msgspec.Struct, frozen=True, tag=True):
    worker_id: str
    epoch: int
    fetch_id: str
    ok: bool
    reason: str | None = None
    dest_blocks: tuple[int, ...] = ()
    num_visible_blocks: int = 0
    reservation_id: str = ""


class FetchPinned(msgspec.Struct, frozen=True, tag=True):
    """The holder's pins for a fetch: (segment, slot) per block, segment 0 its device pool and 1
    its host tier (Register.shm_name, Register.host_shm_name), or why not (`reason`)."""

    worker_id: str
    epoch: int
    fetch_id: str
    ok: bool
    reason: str | None = None
    src_slots: tuple[tuple[int, int], ...] = ()


class FetchDone(msgspec.Struct, frozen=True, tag=True):
    """One side of a fetch ended: published (destination: `blocks` inserted into its prefix
    cache) or not (`reason`); the source side reports the manifest's bytes and its seconds."""

    worker_id: str
    epoch: int
    fetch_id: str
    side: str  # "source" | "destination"
    published: bool
    reason: str | None = None
    blocks: int = 0
    bytes: int = 0
    physical_bytes: int = 0
    transfer_s: float = 0.0


class ControlAck(msgspec.Struct, frozen=True, tag=True):
    """A control message took effect on the worker: `kind` "route_epoch" | "capability_key" (subject:
    the epoch the worker's verifier now holds) or "abort" (subject: the request id); `at_s` is the
    worker's wall clock when it did (the rollback reports these times)."""

    worker_id: str
    epoch: int
    kind: str
    subject: str
    at_s: float


class WorkerError(msgspec.Struct, frozen=True, tag=True):
    worker_id: str
    epoch: int
    request_id: str
    message: str
    code: str = "internal_error"


ToWorker = (Generate | Prefill | ReserveKv | StartDecode | Abort | Shutdown | RenewLeases | ChangeRole | CapabilityKey | RouteEpoch | ResyncKv
            | FetchReserve | FetchPin | FetchServe | FetchAbort)
ToRouter = (Register | Heartbeat | Tokens | Reserved | TransferDone | WorkerError | FetchReserved | FetchPinned
            | FetchDone | ControlAck)

# The largest worker -> router message. The router's control socket refuses longer ones
# (ZMQ_MAXMSGSIZE, router/process/control_auth.py) even from a peer still in its CURVE handshake,
# which could otherwise make the router buffer any size it declares (1 GiB grew it by 1 GiB).
# Room for a prefix-cache resync of ~1.5M blocks (~40 B an event) or the prompt logprobs of
# ~190k positions at k = 20 (~340 B a position); a worker keeps every message under it
# (`bounded`, workers/heartbeat.py).
MAX_TO_ROUTER_BYTES = 64 << 20

_encoder = msgspec.msgpack.Encoder()
_to_worker = msgspec.msgpack.Decoder(ToWorker)
_to_router = msgspec.msgpack.Decoder(ToRouter)


def encode(msg: ToWorker | ToRouter) -> bytes:
    return _encoder.encode(msg)


def decode_to_worker(data: bytes) -> ToWorker:
    return _to_worker.decode(data)


def decode_to_router(data: bytes) -> ToRouter:
    return _to_router.decode(data)


def bounded(msg: ToRouter, limit: int = MAX_TO_ROUTER_BYTES) -> list[bytes]:
    """`msg` encoded, within `limit`: one body, or for a Tokens batch over it one per item, and
    for an item over it alone a `message_too_large` WorkerError that fails its request instead
    (only Tokens can outgrow the bound: prompt logprobs)."""
    whole = encode(msg)
    if len(whole) <= limit or not isinstance(msg, Tokens):
        return [whole]
    bodies = [encode(Tokens(msg.worker_id, msg.epoch, (item,))) for item in msg.items]
    return [body if len(body) <= limit else encode(WorkerError(
        msg.worker_id, msg.epoch, item.request_id, f"its output is over the control plane's {limit} B message bound",
        "message_too_large")) for item, body in zip(msg.items, bodies)]
