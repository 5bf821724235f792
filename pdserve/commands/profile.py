"""`pdserve profile`: time our engine on this machine and save a fitted latency model JSON.

The JSON (kind "profiled") is what `pdserve simulate --latency-model` and
`pdserve plan --latency-model` read. `--quick` measures a handful of points on the tiny model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from pdserve import argtypes


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("profile", help="measure the engine and fit a latency model (JSON)")
    p.add_argument("--model", default=None, help="tiny | small | checkpoint dir (default small; tiny with --quick)")
    p.add_argument("--out", required=True, type=argtypes.output_file, metavar="FILE.json", help="where to write the fitted model")
    p.add_argument("--threads", type=_positive, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--quick", action="store_true", help="a few points only (tests)")
    p.add_argument("--tp", type=_positive, default=1, metavar="N",
                   help="time a TP N engine (N one-thread ranks; recorded as meta.tp, which the router's "
                        "cost model prices TP N workers with as measured: router/pricing/tp_pricing.py)")
    p.add_argument("--collectives-tp", type=_ints, metavar="N,M",
                   help="also time gloo's all_reduce and the step broadcast at these TP sizes, recorded as the "
                        "profile's `collectives` (default: --tp when it is > 1; latency/tp_collectives.py)")
    p.add_argument("--repeats", type=_positive, help="timings per point (median after one warm-up)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="engine dtype; profile with the dtype you will serve with")
    p.add_argument("--compute-dtype", choices=["bfloat16", "float32"], default=None,
                   help="activation/matmul dtype (as `pdserve serve --compute-dtype`)")
    p.add_argument("--no-batch-invariant", action="store_true", help="as `pdserve serve --no-batch-invariant`")
    p.add_argument("--max-num-batched-tokens", type=_positive, default=None, metavar="N",
                   help="prefill in chunks of N tokens, as a server with this step budget does (default: one step)")
    p.add_argument("--kv-cache-mb", type=_positive, default=256,
                   help="K/V pool per serving worker the capacity is computed for (as `pdserve serve --kv-cache-mb`)")
    p.add_argument("--block-size", type=_positive, default=None, metavar="N",
                   help="tokens per K/V block, as `pdserve serve --block-size` (default 16)")
    p.add_argument("--prompt-lens", type=_ints, help="prefill points, e.g. 128,512,1024,2048")
    p.add_argument("--batches", type=_ints, help="decode batch sizes, e.g. 1,4,16")
    p.add_argument("--contexts", type=_ints, help="decode context lengths, e.g. 128,1024")
    p.set_defaults(func=run_profile_command)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def check_plan(plan) -> None:
    """What the measurement needs, checked before minutes of it: a checkpoint that loads and that
    --tp divides, points within its positions, a fit's two prefill and two decode points, a pool
    this machine holds and no more threads than its CPUs (100000 crashed torch)."""
    from pdserve.engine.kv.kv_abi import KvAbi
    from pdserve.latency.engine_profile import DECODE_STEPS
    from pdserve.model.config import check_tp, load_config
    from pdserve.model.default import resolve_model

    model = load_config(resolve_model(plan.model))
    check_tp(model, plan.tp)
    longest = max(max(plan.prompt_lens), max(plan.contexts) + DECODE_STEPS + 4)
    if longest > model.max_position_embeddings:
        raise ValueError(f"a point of {longest} tokens (--prompt-lens, --contexts + {DECODE_STEPS + 4}) is longer than "
                         f"the model's {model.max_position_embeddings} positions")
    if len(set(plan.prompt_lens)) < 2 or len(set(plan.batches)) * len(set(plan.contexts)) < 2:
        raise ValueError("a profile fit needs at least two prefill points (--prompt-lens) and two decode points "
                         "(--batches x --contexts)")
    cpus = len(os.sched_getaffinity(0))
    if (plan.threads or 1) > cpus:
        raise ValueError(f"--threads {plan.threads} is more than the {cpus} CPUs this process may run on")
    blocks = max(plan.batches) * (longest // plan.block_size + 2) + 64
    pool = blocks * KvAbi(model.num_layers, model.num_kv_heads, model.head_dim, plan.block_size, plan.dtype).bytes_per_block
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if pool > memory // 2:
        raise ValueError(f"--batches {max(plan.batches)} at {longest} tokens needs a {pool >> 20} MiB K/V pool; this "
                         f"machine has {memory >> 20} MiB")


def run_profile_command(args: argparse.Namespace) -> int:
    import dataclasses

    from pdserve.latency.engine_profile import ProfilePlan, run_profile

    plan = ProfilePlan.quick(args.model or "tiny", args.threads, dtype=args.dtype) if args.quick else ProfilePlan(
        model=args.model or "small", threads=args.threads, dtype=args.dtype)
    overrides = {"repeats": args.repeats, "prompt_lens": args.prompt_lens, "batches": args.batches,
                 "contexts": args.contexts, "chunk_tokens": args.max_num_batched_tokens,
                 "compute_dtype": args.compute_dtype, "kv_cache_mb": args.kv_cache_mb, "tp": args.tp,
                 "block_size": args.block_size}
    plan = dataclasses.replace(plan, batch_invariant=not args.no_batch_invariant,
                               **{k: v for k, v in overrides.items() if v is not None})
    try:
        check_plan(plan)
    except ValueError as exc:  # CheckpointError and TpShapeError are ValueErrors
        print(f"error: {exc}", file=sys.stderr)
        return 2
    model = run_profile(plan)
    out = model.to_dict()
    sizes = args.collectives_tp or ((plan.tp,) if plan.tp > 1 else ())
    if sizes:
        from pdserve.latency.tp_collectives import profile_section

        out["collectives"] = profile_section(plan.model, plan.dtype, plan.compute_dtype, tuple(sizes))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({"out": args.out, "prefill_coef": model.prefill_coef, "decode_coef": model.decode_coef}))
    return 0
