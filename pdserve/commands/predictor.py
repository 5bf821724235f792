"""`pdserve predictor`: train, evaluate and synthesise traces for the output-length predictor.

    pdserve predictor synth --out TRACE.jsonl [--n 2000 --seed 0 --noise 0.1]
    pdserve predictor train TRACE.jsonl --out P.json [--model small --buckets 0,32,64,...]
    pdserve predictor eval P.json TRACE.jsonl [--model small]

`train` records in the manifest the model's checkpoint identity, its tokenizer identity, the
sampling settings the trace's outputs were generated under and the bucket bounds
(predictor/manifest.py), and prints held-out accuracy next to the majority baseline.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pdserve import argtypes


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("predictor", help="output-length predictor (TetriInfer buckets): synth, train, eval")
    sub = p.add_subparsers(dest="predictor_command", metavar="ACTION")
    s = sub.add_parser("synth", help="write a synthetic trace whose output lengths depend on the prompt")
    s.add_argument("--out", required=True, type=argtypes.output_file, metavar="TRACE.jsonl")
    s.add_argument("--n", type=argtypes.count, default=2000)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--noise", type=argtypes.share, default=0.1, help="fraction that runs one length range longer")
    s.set_defaults(func=run_synth)
    t = sub.add_parser("train", help="train a bucket classifier from a trace with recorded output lengths")
    t.add_argument("trace", metavar="TRACE.jsonl")
    t.add_argument("--out", required=True, type=argtypes.output_file, metavar="P.json")
    _model_args(t)
    t.add_argument("--buckets", default=None, metavar="0,32,64,...", help="bucket bounds (default: manifest.DEFAULT_BUCKETS)")
    t.add_argument("--holdout", type=_holdout, default=0.2, help="share of the trace held out to score (0 < H < 1)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--temperature", type=argtypes.nonnegative, default=0.0, help="the traced outputs' sampling temperature")
    t.add_argument("--top-p", type=argtypes.fraction, default=1.0, help="the traced outputs' top_p")
    t.set_defaults(func=run_train)
    e = sub.add_parser("eval", help="accuracy of a predictor on a trace, next to the majority baseline")
    e.add_argument("predictor", metavar="P.json")
    e.add_argument("trace", metavar="TRACE.jsonl")
    _model_args(e)
    e.set_defaults(func=run_eval)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def _holdout(text: str) -> float:
    """Some examples to train on and some to score: 0 scored every prediction against its own
    training line (accuracy 1.0), 1 trained on none (0.0)."""
    value = argtypes.finite(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1 (exclusive), got {text!r}")
    return value


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="small", help="tiny | small | checkpoint dir: the target model (default small)")


def _target(model: str):
    """(checkpoint identity, tokenizer, context limit) of the target model."""
    from pdserve.model.config import load_config
    from pdserve.model.default import resolve_model
    from pdserve.model.loader import checkpoint_hash
    from pdserve.model.tokenizer import load_tokenizer

    model_dir = resolve_model(model)
    return checkpoint_hash(model_dir), load_tokenizer(model_dir), load_config(model_dir).max_position_embeddings


def run_synth(args: argparse.Namespace) -> int:
    from pdserve.predictor.synth import synth_entries, write_trace

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_trace(args.out, synth_entries(args.n, args.seed, args.noise))
    print(f"wrote {args.n} requests to {args.out}")
    return 0


def run_train(args: argparse.Namespace) -> int:
    from pdserve.predictor.manifest import DEFAULT_BUCKETS, Manifest
    from pdserve.predictor.training import fit, read_examples

    try:
        buckets = DEFAULT_BUCKETS if args.buckets is None else tuple(int(b) for b in args.buckets.split(","))
        identity, tokenizer, max_len = _target(args.model)
        prompts, lengths = read_examples(args.trace, tokenizer)
        sampling = {"temperature": args.temperature, "top_p": args.top_p, "stop": "trace output_len"}
        manifest = Manifest(args.model, identity, tokenizer.identity_hash, sampling, max_len, buckets)
        predictor, score = fit(prompts, lengths, manifest, args.holdout, args.seed)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    trained = {"trace": Path(args.trace).name, "examples": len(prompts), "holdout": args.holdout, "seed": args.seed,
               "heldout_accuracy": score.accuracy, "baseline_accuracy": score.baseline_accuracy,
               "heldout_coverage": score.coverage}
    from dataclasses import replace

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    replace(predictor, manifest=replace(manifest, trained_on=trained)).save(args.out)
    print(json.dumps({"out": args.out, **trained}))
    return 0


def run_eval(args: argparse.Namespace) -> int:
    from pdserve.predictor.manifest import PredictorError, load
    from pdserve.predictor.training import evaluate, read_examples

    try:
        identity, tokenizer, _ = _target(args.model)
        predictor = load(args.predictor, identity, tokenizer.identity_hash)
        prompts, lengths = read_examples(args.trace, tokenizer)
    except (OSError, ValueError, PredictorError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    score = evaluate(predictor, prompts, lengths)
    print(json.dumps({"examples": score.n, "accuracy": score.accuracy, "baseline_accuracy": score.baseline_accuracy,
                      "coverage": score.coverage}))
    return 0
