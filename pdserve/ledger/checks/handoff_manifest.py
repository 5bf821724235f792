"""Check: the immutable handoff manifest and its compute/transfer sets (spec 0x01A).

The fixture stops at UNPUBLISHED: it reconciles identity, geometry, the two block sets and the
logical transfer bytes, and says nothing about transport or publication.
"""

from __future__ import annotations

from typing import Any

from pdserve.ledger.checks.common import expect_equal, get, integer, ledger_errors, require, require_synthetic
from pdserve.ledger.kv import handoff_sets, logical_transfer_bytes

IDENTITY_INTS = ("generation", "attempt", "source_epoch", "destination_epoch")
IDENTITY_STRS = ("tenant", "request", "reservation", "prompt_digest")
MODEL_FIELDS = ("checkpoint", "tokenizer", "position", "mask")


def _check_identity(fx: dict) -> None:
    for name in IDENTITY_STRS:
        require(bool(get(fx, f"identity.{name}", str)), f"identity.{name} is empty")
    for name in IDENTITY_INTS:
        integer(fx, f"identity.{name}", minimum=0)
    require(get(fx, "identity.attempt") >= 1, "identity.attempt must count from 1")
    for name in MODEL_FIELDS:
        require(bool(get(fx, f"model.{name}", str)), f"model.{name} is empty")
    require(get(fx, "transfer.source", str) != get(fx, "transfer.destination", str), "source and destination are the same worker")
    state = get(fx, "transfer.state", str)
    require(state == "UNPUBLISHED", f"manifest state {state!r}: this check covers only an unpublished reservation")


def _check_prefix(label: str, prompt: list, subset: list) -> None:
    require(subset == prompt[: len(subset)], f"{label} {subset} is not a leading prefix of the prompt")


def check(fx: dict) -> dict[str, Any]:
    require_synthetic(fx)
    _check_identity(fx)
    abi = {k: integer(fx, f"tensor_abi.{k}", minimum=1) for k in ("layers", "kv_heads", "head_dim", "dtype_bytes", "block_tokens")}
    prompt = get(fx, "prompt_blocks", list)
    reuse, visible = get(fx, "prefill_reusable", list), get(fx, "decode_visible", list)
    start, end = get(fx, "identity.token_interval", list)
    expect_equal("token interval length", end - start, len(prompt) * abi["block_tokens"])
    with ledger_errors():
        sets = handoff_sets(prompt, reuse, visible)
    _check_prefix("prefill_reusable", prompt, reuse)
    _check_prefix("decode_visible", prompt, visible)
    logical = logical_transfer_bytes(
        len(sets.transfer_blocks), abi["block_tokens"], abi["layers"], abi["kv_heads"], abi["head_dim"], abi["dtype_bytes"]
    )
    derived = {
        "compute_blocks": list(sets.compute_blocks),
        "transfer_blocks": list(sets.transfer_blocks),
        "compute_count": len(sets.compute_blocks),
        "transfer_count": len(sets.transfer_blocks),
        "logical_bytes": logical,
    }
    for key, value in derived.items():
        expect_equal(key, value, get(fx, f"expected.{key}"))
    return derived

