"""A recompute replays a request's output positions as decode rows, so its K/V and its later
tokens are bitwise those of the uninterrupted run, in every numerics mode (bf16 included)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.engine.scheduler import StepPlan
from pdserve.engine.sequence import SamplingParams, SeqStatus

NUMERICS = [("float32", None), ("bfloat16", None), ("bfloat16", "float32")]
PARAMS = SamplingParams(max_tokens=48, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)


def prompt(length: int, seed: int = 5) -> list[int]:
    return torch.randint(0, 128, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def force_preempt(eng, request_id: str) -> None:
    """Test-only fault: take a running request's blocks away, as memory pressure would."""
    seq = eng.seqs[request_id]
    assert seq.status is SeqStatus.RUNNING
    eng.scheduler._preempt(seq, StepPlan())


def step_until(eng, request_id: str, outputs: int) -> None:
    while len(eng.seqs[request_id].output_ids) < outputs:
        eng.step()
        eng.check_integrity()


def kv_bytes(eng, request_id: str) -> list[np.ndarray]:
    """Per layer, the K and V of every computed position: [2, positions, H, D] as raw bits."""
    seq = eng.seqs[request_id]
    bs, n = eng.blocks.block_size, seq.num_computed
    blocks = seq.block_table[: -(-n // bs)]
    out = []
    for layer in range(eng.abi.num_layers):
        raw = np.frombuffer(eng.pool.read_chunk(layer, blocks), dtype=np.uint8)
        out.append(raw.reshape(2, len(blocks) * bs, -1)[:, :n].copy())
    return out


def assert_same_run(eng, ref, request_id: str) -> None:
    """Same outputs and the same K/V bits at every computed position; then both released."""
    assert eng.seqs[request_id].output_ids == ref.seqs[request_id].output_ids
    for mine, theirs in zip(kv_bytes(eng, request_id), kv_bytes(ref, request_id)):
        assert np.array_equal(mine, theirs)
    for e in (ref, eng):
        e.abort(request_id)


@pytest.mark.parametrize("dtype,compute", NUMERICS)
@pytest.mark.parametrize("chunk", [16, 256])
def test_recompute_is_bitwise_the_uninterrupted_run(gqa_ckpt, engine_factory, dtype, compute, chunk):
    mode = dict(dtype=dtype, compute_dtype=compute, max_num_batched_tokens=chunk, enable_prefix_cache=False)
    p = prompt(37)
    ref = engine_factory(gqa_ckpt, **mode)
    ref.add_request("a", p, PARAMS)
    step_until(ref, "a", 40)
    eng = engine_factory(gqa_ckpt, **mode)
    eng.add_request("a", p, PARAMS)
    step_until(eng, "a", 9)
    force_preempt(eng, "a")  # 9 outputs, 8 of them with K/V: all recomputed
    step_until(eng, "a", 10)
    assert eng.seqs["a"].num_preemptions == 1
    step_until(eng, "a", 25)
    force_preempt(eng, "a")  # and again, deeper into the output
    step_until(eng, "a", 40)
    assert_same_run(eng, ref, "a")


def test_recompute_steps_prefill_the_prompt_then_replay_the_outputs(gqa_ckpt, engine_factory):
    """The prompt is cut on its own chunk grid and never past its end; the outputs follow as
    one decode row per position, each seeing the keys up to itself, the last one sampled."""
    eng = engine_factory(gqa_ckpt, max_num_batched_tokens=16, enable_prefix_cache=False)
    eng.add_request("a", prompt(37), PARAMS)
    step_until(eng, "a", 12)
    force_preempt(eng, "a")
    seen = []
    run = eng.runner.run

    def recording_run(plan, hook=None):  # test wrapper: observe each step's plan and batch
        batch, logits = run(plan, hook)
        seen.append(([(s.num_computed, rows) for s, rows in plan.prefill], batch))
        return batch, logits

    eng.runner.run = recording_run
    while not eng.seqs["a"].is_decoding:
        eng.step()
    assert [shape for shape, _ in seen] == [[(0, 16)], [(16, 16)], [(32, 5)], [(37, 12)]]
    replay = seen[-1][1]
    assert replay.meta.prefills == () and replay.meta.decode.num_rows == 12
    assert replay.positions.tolist() == list(range(37, 49))
    assert replay.token_ids.tolist() == list(eng.seqs["a"].output_ids[:12])
    assert replay.meta.decode.context_lens.tolist() == list(range(38, 50))
    assert replay.sampled == [eng.seqs["a"]] and replay.logits_rows.tolist() == [11]
    assert all(b.sampled == [] for _, b in seen[:2]) and seen[2][1].sampled == []
    eng.abort("a")


@pytest.mark.parametrize("dtype,compute", NUMERICS)
def test_a_resumed_request_continues_bitwise(gqa_ckpt, engine_factory, dtype, compute):
    """The decode-start fallback resumes from the tokens already streamed: same K/V, same rest."""
    mode = dict(dtype=dtype, compute_dtype=compute, max_num_batched_tokens=16, enable_prefix_cache=False)
    p = prompt(29, seed=9)
    ref = engine_factory(gqa_ckpt, **mode)
    ref.add_request("a", p, PARAMS)
    step_until(ref, "a", 30)
    streamed = tuple(ref.seqs["a"].output_ids[:11])
    eng = engine_factory(gqa_ckpt, **mode)
    eng.add_request("a", p, PARAMS, seed=ref.seqs["a"].seed, resume_output_ids=streamed)
    step_until(eng, "a", 30)
    assert_same_run(eng, ref, "a")
