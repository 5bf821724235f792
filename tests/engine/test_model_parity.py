"""Logits and greedy tokens equal Hugging Face transformers on random checkpoints (fp32), Llama and Qwen3."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.scheduler import StepPlan
from pdserve.engine.sequence import SamplingParams, Sequence
from tests.engine.conftest import make_engine
from tests.helpers.checkpoints import load_hf_model, make_random_checkpoint

GEOMETRIES = [
    # (family, heads, kv_heads, head_dim, tie, bias)
    ("llama", 4, 4, 32, False, False),  # GQA ratio 1 (MHA)
    ("llama", 4, 2, 32, True, False),  # ratio 2, tied head
    ("llama", 8, 2, 32, False, True),  # ratio 4, q/k/v/o bias
    ("llama", 4, 1, 64, True, True),  # ratio 4, head_dim 64 != hidden / heads
    ("llama", 2, 1, 64, False, False),  # ratio 2, head_dim 64
    ("qwen3", 4, 2, 48, False, False),  # per-head q/k norm; H_q * D = 192 != hidden 128
    ("qwen3", 8, 2, 32, True, True),  # ratio 4, tied head, q/k/v/o bias
]


def prefill_logits(engine, prompt: list[int]) -> torch.Tensor:
    """All-position logits [S, V] of a one-shot prefill through the paged engine path."""
    seq = Sequence("probe", tuple(prompt), SamplingParams(), seed=0)
    seq.block_table = engine.blocks.allocate(-(-len(prompt) // engine.abi.block_size))
    plan = StepPlan(prefill=[(seq, len(prompt))])
    from pdserve.engine.runner import build_batch

    batch = build_batch(plan, engine.abi.block_size)
    rows = torch.arange(len(prompt))
    logits = engine.model.forward(batch.token_ids, batch.positions, batch.meta, engine.pool.tensor, rows)
    engine.blocks.release(seq.block_table)
    return logits


@pytest.mark.parametrize("family,heads,kv_heads,head_dim,tie,bias", GEOMETRIES)
def test_prefill_logits_match_transformers(tmp_path, family, heads, kv_heads, head_dim, tie, bias):
    ckpt = make_random_checkpoint(
        tmp_path, hidden=128, layers=2, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        intermediate=192, vocab=160, tie=tie, attention_bias=bias, seed=heads * 10 + kv_heads, family=family,
    )
    hf = load_hf_model(ckpt)
    engine = make_engine(ckpt)
    prompt = torch.randint(0, 160, (45,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    ours = prefill_logits(engine, prompt)
    assert ours.shape == ref.shape
    # two fp32 paths (our fixed-shape tiles and paged attention, transformers' own products) sum in
    # orders each BLAS picks per CPU: rounding differences scale with the logits' size (~1e-7 of
    # it measured; the bound leaves 40x), a wrong formula is off by far more
    assert (ours - ref).abs().max().item() <= 1e-5 * ref.abs().max().item() + 1e-5
    engine.assert_no_leaks()


def test_greedy_tokens_match_transformers_generate(gqa_ckpt, engine_factory):
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (3, 9, 16, 17, 23, 31, 40, 5, 64, 12)]
    check_greedy_tokens(gqa_ckpt, engine_factory, prompts)


def test_qwen3_greedy_tokens_match_transformers_generate(tmp_path, engine_factory):
    ckpt = make_random_checkpoint(tmp_path, hidden=128, layers=2, heads=4, kv_heads=2, head_dim=48,
                                  intermediate=256, vocab=128, seed=5, family="qwen3")
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (4, 16, 17, 33, 9)]
    check_greedy_tokens(ckpt, engine_factory, prompts)


def check_greedy_tokens(ckpt, engine_factory, prompts: list[list[int]]) -> None:
    """Our batched greedy continuations (32 tokens each) equal transformers' generate, one by one."""
    hf = load_hf_model(ckpt)
    engine = engine_factory(ckpt)
    outs = engine.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0,
            )[0, len(prompt):].tolist()
        assert list(out.output_ids) == ref
        assert out.finish_reason == "length"
