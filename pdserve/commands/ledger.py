"""`pdserve ledger`: the sizing sums users need directly (K/V bytes, handoff sets, phase cost).

Every subcommand prints a readable two-column table, or one JSON object with `--json`.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Mapping

from pdserve import argtypes


def emit(result: Mapping[str, Any], as_json: bool) -> None:
    """Print `result` as one JSON object or as an aligned key/value table."""
    if as_json:
        print(json.dumps(result, sort_keys=False))
        return
    width = max((len(k) for k in result), default=0)
    for key, value in result.items():
        shown = f"{value:.6g}" if isinstance(value, float) else value
        print(f"{key:<{width}}  {shown}")


def _geometry_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, required=True, help="transformer layers L")
    parser.add_argument("--kv-heads", type=int, required=True, help="K/V heads H_kv")
    parser.add_argument("--head-dim", type=int, required=True, help="head width d_h")
    parser.add_argument("--bytes", type=int, required=True, dest="dtype_bytes", help="bytes per scalar")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _kv_bytes(args: argparse.Namespace) -> int:
    from pdserve.ledger.kv import kv_bytes

    emit({"bytes": kv_bytes(args.tokens, args.layers, args.kv_heads, args.head_dim, args.dtype_bytes)}, args.json)
    return 0


def _handoff(args: argparse.Namespace) -> int:
    from pdserve.ledger.kv import logical_transfer_bytes, prefix_handoff_counts

    compute, transfer = prefix_handoff_counts(args.prompt_blocks, args.prefill_reuse, args.decode_visible)
    logical = logical_transfer_bytes(transfer, args.block_tokens, args.layers, args.kv_heads, args.head_dim, args.dtype_bytes)
    emit({"compute_blocks": compute, "transfer_blocks": transfer, "logical_bytes": logical}, args.json)
    return 0


def _phase_cost(args: argparse.Namespace) -> int:
    from pdserve.ledger.phase import BlockGeometry, slot_bounds

    geometry = BlockGeometry(
        args.layers, args.d_model, args.d_ff, args.q_heads, args.kv_heads, args.head_dim, args.dtype_bytes
    )
    lengths = [int(x) for x in args.decode_lengths.split(",") if x.strip()]
    bounds = slot_bounds(geometry, args.prefill_new, args.prefill_visible, lengths, args.flops, args.mem_bw)
    result = {
        "prefill_lb_s": bounds.prefill_lb_s,
        "decode_lb_s": bounds.decode_lb_s,
        "mixed_lb_s": bounds.mixed_lb_s,
        "dilation": bounds.dilation,
    }
    emit(result, args.json)
    return 0


def _guard(handler):
    """Turn ledger ValueErrors into a one-line message and exit status 2."""

    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except ValueError as exc:
            print(f"pdserve ledger: {exc}")
            return 2

    return run


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("ledger", help="K/V bytes, handoff sets and phase cost bounds")
    sub = parser.add_subparsers(dest="ledger_command", metavar="LEDGER")
    parser.set_defaults(func=lambda args: parser.print_help() or 2)

    kv = sub.add_parser("kv-bytes", help="logical K/V bytes for N tokens")
    _geometry_args(kv)
    kv.add_argument("--tokens", type=int, required=True, help="token rows N")
    kv.set_defaults(func=_guard(_kv_bytes))

    handoff = sub.add_parser("handoff", help="compute/transfer blocks and logical transfer bytes")
    _geometry_args(handoff)
    handoff.add_argument("--prompt-blocks", type=int, required=True, help="prompt blocks N")
    handoff.add_argument("--prefill-reuse", type=int, default=0, help="leading blocks reusable at prefill")
    handoff.add_argument("--decode-visible", type=int, default=0, help="leading blocks visible at decode")
    handoff.add_argument("--block-tokens", type=int, required=True, help="tokens per block")
    handoff.set_defaults(func=_guard(_handoff))

    phase = sub.add_parser("phase-cost", help="roofline lower bounds of prefill, decode and mixed slots")
    _geometry_args(phase)
    phase.add_argument("--d-model", type=int, required=True)
    phase.add_argument("--d-ff", type=int, required=True)
    phase.add_argument("--q-heads", type=int, required=True)
    phase.add_argument("--prefill-new", type=int, required=True, help="new prefill rows N_P")
    phase.add_argument("--prefill-visible", type=int, default=0, help="rows already visible T0")
    phase.add_argument("--decode-lengths", required=True, help="visible lengths s1,s2,... (current row included)")
    phase.add_argument("--flops", type=argtypes.positive, required=True, help="compute rate C in FLOP/s")
    phase.add_argument("--mem-bw", type=argtypes.positive, required=True, help="state-byte rate R in B/s")
    phase.set_defaults(func=_guard(_phase_cost))
