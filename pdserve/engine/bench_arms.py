"""The in-process arms of `bench-engine`: pdserve's engine and transformers, timed one call at a time.

Contract: every arm offers the same three timings so `benchmark.py` can interleave them (on a
shared machine, load changes by the second; timing arm A's repeats, then arm B's, would compare
two different machines):
- `prefill_s(prompt)`: seconds to compute a fresh prompt and sample its first token;
- `start_decode(prompts)`: `len(prompts)` sequences decoding with the prompts' tokens of context;
- `decode_s(steps)`: seconds for `steps` decode steps of those sequences; `stop_decode()` ends them.
Decode speed does not depend on the K/V values, so pdserve imports its contexts (the decode
worker's entry point) and transformers starts from a cache of random K/V: neither prefills
32 x 512 tokens just to measure decode.
"""

from __future__ import annotations

import time

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sequence import SamplingParams


def import_contexts(engine: Engine, prompts: list[list[int]], max_steps: int, tag: str = "d") -> None:
    """Start one decoding sequence per prompt with the prompt's tokens of K/V already in the pool
    (reserve_import + commit_import, as a decode worker does after a handoff)."""
    params = SamplingParams(max_tokens=max_steps + 2, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        rid = f"{tag}{len(engine.seqs)}-{i}"
        engine.reserve_import(rid, prompt, params)
        engine.commit_import(rid, prompt, prompt[-1], params, seed=i)


class PdserveArm:
    def __init__(self, config: EngineConfig, max_steps: int):
        self.engine = Engine(config)
        self.max_steps = max_steps  # decode steps any one start_decode() will be asked for
        self.name = "pdserve" if config.batch_invariant else "pdserve_no_invariance"
        self._count = 0

    def _rid(self, tag: str) -> str:
        self._count += 1
        return f"{tag}{self._count}"

    def prefill_s(self, prompt: list[int]) -> float:
        self.engine.add_request(self._rid("p"), prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        t0 = time.perf_counter()
        while self.engine.has_unfinished():
            self.engine.step()
        return time.perf_counter() - t0

    def start_decode(self, prompts: list[list[int]]) -> None:
        import_contexts(self.engine, prompts, self.max_steps, tag=self._rid("d"))
        self.engine.step()  # warm-up step

    def decode_s(self, steps: int) -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            self.engine.step()
        return time.perf_counter() - t0

    def stop_decode(self) -> None:
        for rid in list(self.engine.seqs):
            self.engine.abort(rid)
        self.engine.assert_no_leaks()


class TransformersArm:
    """transformers' LlamaForCausalLM with its own DynamicCache, in the same dtype."""

    name = "transformers"

    def __init__(self, model_dir: str, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM

        self.dtype = dtype
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        self._past = self._next = None

    @torch.inference_mode()
    def prefill_s(self, prompt: list[int]) -> float:
        t0 = time.perf_counter()
        self.model(torch.tensor([prompt]), use_cache=True).logits[:, -1].argmax(-1)
        return time.perf_counter() - t0

    def _cache(self, batch: int, length: int):
        from transformers import DynamicCache

        cfg = self.model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        cache = DynamicCache()
        for layer in range(cfg.num_hidden_layers):
            k = torch.randn(batch, cfg.num_key_value_heads, length, head_dim, dtype=self.dtype)  # [Bd, H_kv, C, D]
            cache.update(k, torch.randn_like(k), layer)
        return cache

    @torch.inference_mode()
    def start_decode(self, prompts: list[list[int]]) -> None:
        self._past = self._cache(len(prompts), len(prompts[0]))
        self._next = torch.tensor([[p[-1]] for p in prompts])  # [Bd, 1]
        self._step()  # warm-up step

    def _step(self) -> None:
        out = self.model(self._next, past_key_values=self._past, use_cache=True)
        self._past, self._next = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)

    @torch.inference_mode()
    def decode_s(self, steps: int) -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            self._step()
        return time.perf_counter() - t0

    def stop_decode(self) -> None:
        self._past = self._next = None
