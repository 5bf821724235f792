"""Why a handoff step was refused: one enum of reasons and one exception that carries it.

Contract: every refusal in the handoff protocol raises `HandoffError` with a `RejectReason`, so
callers and tests branch on `.reason`, never on message text. Reasons are grouped by the fence
they belong to (identity, tensor ABI, coverage, bytes, ordering, ownership, transport,
capabilities). Every `capability_*` reason is a denial by the memory owner's capability check
(handoff/trust/capability.py) and is counted in `pdserve_capability_denials_total{reason}`.
"""

from __future__ import annotations

from enum import Enum


class RejectReason(str, Enum):
    # identity fence
    WRONG_TENANT = "wrong_tenant"
    WRONG_REQUEST = "wrong_request"
    WRONG_GENERATION = "wrong_generation"
    WRONG_ATTEMPT = "wrong_attempt"
    WRONG_SOURCE_EPOCH = "wrong_source_epoch"
    WRONG_DESTINATION_EPOCH = "wrong_destination_epoch"
    WRONG_RESERVATION = "wrong_reservation"
    WRONG_TRANSFER = "wrong_transfer"
    WRONG_PROMPT = "wrong_prompt"
    # model and tensor identity
    WRONG_ABI = "wrong_abi"
    WRONG_MODEL = "wrong_model"
    WRONG_TOKENIZER = "wrong_tokenizer"
    WRONG_ADAPTER = "wrong_adapter"
    WRONG_POSITION_POLICY = "wrong_position_policy"
    WRONG_MASK_POLICY = "wrong_mask_policy"
    # chunk coverage and bytes
    UNKNOWN_CHUNK = "unknown_chunk"
    MISSING_CHUNK = "missing_chunk"
    INCOMPLETE_COVERAGE = "incomplete_coverage"
    CHUNK_CONFLICT = "chunk_conflict"
    BAD_CHECKSUM = "bad_checksum"
    BAD_SIZE = "bad_size"
    NOT_VISIBLE = "not_visible"
    NOT_SEALED = "not_sealed"
    MANIFEST_MISSING = "manifest_missing"
    # ordering and resources
    PRODUCER_NOT_READY = "producer_not_ready"
    CREDIT_OVERRUN = "credit_overrun"
    CREDIT_EARLY_RETURN = "credit_early_return"
    CREDIT_UNKNOWN = "credit_unknown"
    RESERVATION_EXHAUSTED = "reservation_exhausted"
    ILLEGAL_TRANSITION = "illegal_transition"
    # ownership
    STALE_GENERATION = "stale_generation"
    ALREADY_PUBLISHED = "already_published"
    TXN_ABORTED = "txn_aborted"
    NOT_PUBLISHED = "not_published"
    RELEASE_BEFORE_PUBLISH = "release_before_publish"
    RELEASE_NOT_ALLOWED = "release_not_allowed"
    # transport and recovery
    TRANSPORT_FAILURE = "transport_failure"
    TIMEOUT = "timeout"
    RETRIES_EXHAUSTED = "retries_exhausted"
    SUPERSEDED = "superseded"
    CANCELLED = "cancelled"
    # transfer capabilities (handoff/trust/capability.py): denied before any memory is touched
    CAPABILITY_MISSING = "capability_missing"
    CAPABILITY_MALFORMED = "capability_malformed"
    CAPABILITY_FORGED = "capability_forged"
    CAPABILITY_REVOKED = "capability_revoked"
    CAPABILITY_STALE_ROUTE = "capability_stale_route"  # issued under a route epoch a rollback retired
    CAPABILITY_EXPIRED = "capability_expired"
    CAPABILITY_MISMATCH = "capability_mismatch"
    CAPABILITY_REGION = "capability_region"
    CAPABILITY_BYTES = "capability_bytes"
    CAPABILITY_SOURCE = "capability_source"  # source slots other than the capability's (segment, slot) pairs
    CAPABILITY_REPLAYED = "capability_replayed"
    CAPABILITY_REPLAY_FULL = "capability_replay_full"


CAPABILITY_DENIALS = tuple(r for r in RejectReason if r.value.startswith("capability_"))
# a first manifest whose capability is not shown to be the issuer's (`Verifier.unauthenticated`):
# its peer is nobody the router sent, so a listener turns that link away before it may claim the
# transfer and leaves the transaction to its real source (workers/handoff_io.py)
UNAUTHENTICATED = (RejectReason.CAPABILITY_MISSING, RejectReason.CAPABILITY_MALFORMED, RejectReason.CAPABILITY_FORGED)


class HandoffError(Exception):
    """A refused handoff step; `.reason` says which fence refused it."""

    def __init__(self, reason: RejectReason, detail: str = ""):
        super().__init__(f"{reason.value}: {detail}" if detail else reason.value)
        self.reason = reason
        self.detail = detail
