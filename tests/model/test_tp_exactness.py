"""Tensor parallelism (model/tp.py, engine/tp_group.py): fp32 logits within 1e-4 of transformers at
TP 2 and greedy tokens equal, on the exactness geometries whose head counts TP 2 divides; a TP size
that does not divide the heads is refused; the follower processes stop with the engine."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.runner import build_batch
from pdserve.engine.scheduler import StepPlan
from pdserve.engine.sequence import SamplingParams, Sequence
from pdserve.model import paged_decode
from pdserve.model.config import load_config
from pdserve.model.tp import TpShapeError, check_tp, shard_state
from tests.helpers.checkpoints import load_hf_model, make_random_checkpoint

GEOMETRIES = [
    # (family, heads, kv_heads, head_dim, tie, bias): test_model_parity's, those TP 2 divides
    ("llama", 4, 4, 32, False, False),
    ("llama", 4, 2, 32, True, False),
    ("llama", 8, 2, 32, False, True),
    ("qwen3", 4, 2, 48, False, False),
    ("qwen3", 8, 2, 32, True, True),
    ("llama", 4, 2, 64, False, False),  # hidden 640 below: row-parallel outputs wider than a 512-column tile
]


def tp_engine(ckpt, tp: int = 2, **overrides) -> Engine:
    cfg = dict(model=str(ckpt), dtype="float32", block_size=16, num_blocks=128, max_num_batched_tokens=256, tp=tp)
    cfg.update(overrides)
    return Engine(EngineConfig(**cfg))


def prefill_logits(engine: Engine, prompt: list[int]) -> torch.Tensor:
    """All-position logits [S, V] of a one-shot prefill through the paged engine path."""
    seq = Sequence("probe", tuple(prompt), SamplingParams(), seed=0)
    seq.block_table = engine.blocks.allocate(-(-len(prompt) // engine.abi.block_size))
    batch = build_batch(StepPlan(prefill=[(seq, len(prompt))]), engine.abi.block_size)
    logits = engine.model.forward(batch.token_ids, batch.positions, batch.meta, engine.pool.tensor, torch.arange(len(prompt)))
    engine.blocks.release(seq.block_table)
    return logits


@pytest.mark.parametrize("family,heads,kv_heads,head_dim,tie,bias", GEOMETRIES)
def test_tp2_prefill_logits_match_transformers(tmp_path, family, heads, kv_heads, head_dim, tie, bias):
    ckpt = make_random_checkpoint(
        tmp_path, hidden=640 if head_dim == 64 else 128, layers=2, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        intermediate=192, vocab=160, tie=tie, attention_bias=bias, seed=heads * 10 + kv_heads, family=family,
    )
    hf = load_hf_model(ckpt)
    engine = tp_engine(ckpt)
    try:
        prompt = torch.randint(0, 160, (45,), generator=torch.Generator().manual_seed(3)).tolist()
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        ours = prefill_logits(engine, prompt)
        assert ours.shape == ref.shape
        assert (ours - ref).abs().max().item() <= 1e-4
        assert engine.model.num_reduces == 2 * 2  # o_proj and down_proj of both layers, one all_reduce each
        engine.assert_no_leaks()
    finally:
        engine.close()


def test_tp2_greedy_tokens_match_transformers_generate(tmp_path, monkeypatch):
    """Batched greedy continuations (prefill chunks, then decode through the paged decode kernel
    over each rank's strided head slice, as TP 1 reads its pool: no padded groups are built)."""
    ckpt = make_random_checkpoint(tmp_path, hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256, vocab=128, seed=1)
    hf = load_hf_model(ckpt)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (3, 9, 16, 17, 23, 31, 40, 5, 64, 12)]
    engine = tp_engine(ckpt, max_num_batched_tokens=32)  # chunked prefill reads earlier chunks from the pool
    calls = []
    kernel = paged_decode.decode_attention
    monkeypatch.setattr(paged_decode, "decode_attention", lambda q, *rest: calls.append(q.shape) or kernel(q, *rest))
    try:
        in_place = paged_decode.available()  # a C compiler built the kernel (else padded groups + SDPA, at any TP)
        assert engine.runner.padded_groups == (not in_place)
        outs = engine.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
        if in_place:  # rank 0: 2 layers a decode step, over its 2 query heads
            assert len(calls) >= 2 * 23 and all(shape[1] == 2 for shape in calls)
        else:
            assert calls == []
        for prompt, out in zip(prompts, outs):
            with torch.no_grad():
                ref = hf.generate(
                    torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                    max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0,
                )[0, len(prompt):].tolist()
            assert list(out.output_ids) == ref
        engine.check_integrity()
        engine.assert_no_leaks()
    finally:
        engine.close()


def test_tp_size_must_divide_heads(tmp_path):
    ckpt = make_random_checkpoint(tmp_path, hidden=96, layers=1, heads=6, kv_heads=3, head_dim=16, intermediate=192, vocab=64)
    config = load_config(ckpt)
    check_tp(config, 3)
    with pytest.raises(TpShapeError, match="does not divide the model's 3 K/V heads"):
        check_tp(config, 2)
    with pytest.raises(TpShapeError, match="does not divide the model's 6 query heads"):
        check_tp(config, 4)
    with pytest.raises(TpShapeError):
        tp_engine(ckpt, tp=2)


def test_shards_concatenate_to_the_full_weights(tmp_path):
    ckpt = make_random_checkpoint(tmp_path, hidden=64, layers=1, heads=4, kv_heads=2, intermediate=128, vocab=64, attention_bias=True)
    config = load_config(ckpt)
    from pdserve.model.loader import load_state_dict

    state = load_state_dict(ckpt, config)
    shards = [shard_state(state, config, r, 2) for r in range(2)]
    for name, full in state.items():
        if "o_proj.weight" in name or "down_proj.weight" in name:
            assert torch.equal(torch.cat([s[name] for s in shards], dim=1), full)
        elif any(p in name for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
            assert torch.equal(torch.cat([s[name] for s in shards], dim=0), full)
        else:
            assert all(s[name] is full for s in shards)


_ORPHAN_SCRIPT = """
import sys, time
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
eng = Engine(EngineConfig(model=sys.argv[1], dtype="float32", num_blocks=32, tp=2))
print(*eng.model.follower_pids, flush=True)
time.sleep(600)
"""


def test_followers_exit_when_the_engine_process_is_killed(tmp_path):
    ckpt = make_random_checkpoint(tmp_path, hidden=64, layers=1, heads=4, kv_heads=2, intermediate=128, vocab=64)
    proc = subprocess.Popen([sys.executable, "-c", _ORPHAN_SCRIPT, str(ckpt)], stdout=subprocess.PIPE, text=True,
                            cwd=os.getcwd())
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 1 and _alive(pids[0])
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids)
    finally:
        proc.kill()


def _alive(pid: int) -> bool:
    """Running (not a zombie awaiting its reaper)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_waiting_layer_hook_holds_back_every_rank(tmp_path):
    """While rank 0's hook for layer 0 waits (a KV-Runahead stage waiting for its next prefix layer),
    rank 1 has not written layer 1's K/V yet (it waits in layer 0's down_proj all_reduce); once
    the forward returns, it has."""
    ckpt = make_random_checkpoint(tmp_path, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=64)
    engine = tp_engine(ckpt)
    try:
        prompt = list(range(3, 40))
        seq = Sequence("hook", tuple(prompt), SamplingParams(), seed=0)
        seq.block_table = engine.blocks.allocate(-(-len(prompt) // engine.abi.block_size))
        batch = build_batch(StepPlan(prefill=[(seq, len(prompt))]), engine.abi.block_size)
        rank1_layer1 = lambda: engine.pool.tensor[1, :, seq.block_table, :, 1]  # [2, n, B, D]: K/V head 1 = rank 1's
        seen = []

        def hook(layer: int) -> None:
            if layer == 0:
                time.sleep(0.5)
                seen.append(bool(rank1_layer1().abs().sum() == 0))

        engine.model.forward(batch.token_ids, batch.positions, batch.meta, engine.pool.tensor, batch.logits_rows, hook)
        assert seen == [True]
        assert rank1_layer1().abs().sum() > 0
        engine.blocks.release(seq.block_table)
        engine.assert_no_leaks()
    finally:
        engine.close()


@pytest.mark.timeout(180)
def test_a_dead_follower_fails_the_next_step_instead_of_hanging(tmp_path):
    """kill -9 of a follower: rank 0's next collective raises (the worker then exits and its
    supervisor starts it again), it does not wait forever."""
    ckpt = make_random_checkpoint(tmp_path, hidden=64, layers=1, heads=4, kv_heads=2, intermediate=128, vocab=64)
    engine = tp_engine(ckpt)
    (pid,) = engine.model.follower_pids
    os.kill(pid, 9)
    while _alive(pid):
        time.sleep(0.05)
    with pytest.raises(RuntimeError):
        engine.generate([[3, 4, 5]], SamplingParams(max_tokens=2, ignore_eos=True))
    segment = f"/dev/shm/{engine.pool.shm_name}"
    assert os.path.exists(segment)
    engine.close()  # tears the broken group down; the pool it made for the followers is unlinked
    assert not os.path.exists(segment)
