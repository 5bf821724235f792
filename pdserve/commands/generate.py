"""`pdserve generate`: run one prompt through the in-process engine."""

from __future__ import annotations

import argparse
import json
import sys

from pdserve.engine.config import EngineConfig


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate from one prompt with the in-process engine")
    p.add_argument("--model", default=EngineConfig.model, help="tiny | small | path to a HF checkpoint dir")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs a tokenizer)")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids, e.g. 1,2,3")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=EngineConfig.dtype)
    p.add_argument("--compute-dtype", choices=["float32", "bfloat16"], default=None,
                   help="activation/matmul dtype (default: --dtype)")
    p.add_argument("--device", default=EngineConfig.device, metavar="cpu|cuda[:N]",
                   help="where weights, the K/V pool and activations live (cuda: the Triton kernels of model/gpu/)")
    p.add_argument("--no-batch-invariant", action="store_true",
                   help="let products pick the library's fastest kernel per batch size (on cuda: cuBLAS)")
    p.add_argument("--enforce-eager", action="store_true", help="on a GPU: no CUDA graphs for decode steps")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pdserve.engine.engine import Engine
    from pdserve.engine.errors import InvalidRequest
    from pdserve.engine.sequence import SamplingParams
    from pdserve.model.errors import CheckpointError
    from pdserve.model.numerics import BatchInvarianceError

    try:
        engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, compute_dtype=args.compute_dtype,
                                     device=args.device, batch_invariant=not args.no_batch_invariant,
                                     enforce_eager=args.enforce_eager))
        prompt_ids = _prompt_ids(args, engine)
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos,
        )
        out = engine.generate([prompt_ids], params)[0]
    except (InvalidRequest, CheckpointError, ValueError, BatchInvarianceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        record = {"token_ids": list(out.output_ids), "text": out.text, "finish_reason": out.finish_reason, "prompt_tokens": len(prompt_ids),
                  "cpu": engine.numerics}
        print(json.dumps(record))
    else:
        print(out.text if engine.tokenizer else " ".join(map(str, out.output_ids)))
        print(f"[{len(out.output_ids)} tokens, finish_reason={out.finish_reason}, prompt_tokens={len(prompt_ids)}]", file=sys.stderr)
    return 0


def _prompt_ids(args: argparse.Namespace, engine) -> list[int]:
    if args.prompt_ids is not None:
        try:
            return [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError as exc:
            raise ValueError(f"--prompt-ids must be comma-separated integers: {exc}") from exc
    if engine.tokenizer is None:
        raise ValueError("this checkpoint has no tokenizer.json; pass --prompt-ids")
    return engine.tokenizer.encode(args.prompt)
