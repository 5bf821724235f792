"""The engine on a CUDA device (`EngineConfig.device`): logits and greedy tokens equal transformers
run on the same GPU over the parity geometries; in the invariant mode a request's tokens do not
depend on its batch mates or chunking, and a prefill -> decode handoff between two GPU engines
(chunks staged through host memory) gives the colocated tokens bit for bit; seeded sampling
repeats on the device. Skipped, with the reason, where no CUDA device or no Triton is present."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.runner import build_batch, to_device
from pdserve.engine.scheduler import StepPlan
from pdserve.engine.sequence import SamplingParams, SeqMode, Sequence
from pdserve.model import gpu
from tests.engine.test_model_parity import GEOMETRIES
from tests.helpers.checkpoints import load_hf_model, make_random_checkpoint

pytestmark = pytest.mark.skipif(not gpu.available(), reason="no CUDA device with Triton here (CI is CPU-only): "
                                "scripts/gpu_check.sh runs these on a lent GPU")


def cuda_engine(ckpt, **overrides) -> Engine:
    cfg = dict(model=str(ckpt), dtype="float32", block_size=16, num_blocks=256, max_num_batched_tokens=256, device="cuda")
    cfg.update(overrides)
    return Engine(EngineConfig(**cfg))


def prefill_logits(engine: Engine, prompt: list[int]) -> torch.Tensor:
    seq = Sequence("probe", tuple(prompt), SamplingParams(), seed=0)
    seq.block_table = engine.blocks.allocate(-(-len(prompt) // engine.abi.block_size))
    batch = to_device(build_batch(StepPlan(prefill=[(seq, len(prompt))]), engine.abi.block_size, engine.model.dtype,
                                  padded_groups=False), engine.pool.device)
    rows = torch.arange(len(prompt), device=engine.pool.device)
    logits = engine.model.forward(batch.token_ids, batch.positions, batch.meta, engine.pool.tensor, rows)
    engine.blocks.release(seq.block_table)
    return logits.cpu()


@pytest.mark.parametrize("family,heads,kv_heads,head_dim,tie,bias", GEOMETRIES)
@pytest.mark.parametrize("invariant", [True, False])
def test_fp32_logits_and_greedy_tokens_match_transformers_on_the_gpu(tmp_path, family, heads, kv_heads, head_dim, tie,
                                                                      bias, invariant):
    ckpt = make_random_checkpoint(tmp_path, hidden=128, layers=2, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                  intermediate=192, vocab=160, tie=tie, attention_bias=bias,
                                  seed=heads * 10 + kv_heads, family=family)
    hf = load_hf_model(ckpt).cuda()
    engine = cuda_engine(ckpt, batch_invariant=invariant)
    prompt = torch.randint(0, 160, (45,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt], device="cuda")).logits[0].float().cpu()
    ours = prefill_logits(engine, prompt)
    assert (ours - ref).abs().max().item() < 1e-3
    out = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0].output_ids
    with torch.no_grad():
        hf_ids = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=12, do_sample=False,
                             min_new_tokens=12)[0, len(prompt):].tolist()
    assert list(out) == hf_ids
    engine.assert_no_leaks()


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory):
    return make_random_checkpoint(tmp_path_factory.mktemp("bf16"), hidden=256, layers=3, heads=8, kv_heads=2,
                                  intermediate=512, vocab=300, seed=5)


def prompts(n: int = 10) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, 300, (int(k),), generator=gen).tolist() for k in torch.randint(3, 90, (n,), generator=gen)]


def test_invariant_bf16_tokens_ignore_batch_mates_and_chunking(bf16_ckpt):
    greedy = SamplingParams(max_tokens=20, ignore_eos=True)
    engine = cuda_engine(bf16_ckpt, dtype="bfloat16")
    together = [o.output_ids for o in engine.generate(prompts(), greedy)]
    assert [engine.generate([p], greedy)[0].output_ids for p in prompts()] == together
    chunked = cuda_engine(bf16_ckpt, dtype="bfloat16", max_num_batched_tokens=7, enable_prefix_cache=False)
    assert [o.output_ids for o in chunked.generate(prompts(), greedy)] == together
    engine.assert_no_leaks()
    chunked.assert_no_leaks()


def test_replayed_decode_graphs_give_the_eager_tokens(bf16_ckpt):
    """Decode steps replayed as CUDA graphs (padded to a bucket, padding rows writing the scratch
    slot) give the eager engine's tokens bit for bit in the invariant mode, greedy and seeded, and
    leave every block as the eager run does."""
    graphed, eager = cuda_engine(bf16_ckpt, dtype="bfloat16"), cuda_engine(bf16_ckpt, dtype="bfloat16", enforce_eager=True)
    assert graphed.runner.graphs is not None and eager.runner.graphs is None
    for params in (SamplingParams(max_tokens=20, ignore_eos=True),
                   SamplingParams(max_tokens=20, ignore_eos=True, temperature=1.0, seed=9)):
        want = [o.output_ids for o in eager.generate(prompts(7), params)]  # 7 rows: padded to the bucket of 8
        assert [o.output_ids for o in graphed.generate(prompts(7), params)] == want
    assert graphed.runner.graphs._graphs, "no decode step was replayed"
    for e in (graphed, eager):
        e.assert_no_leaks()


def test_seeded_sampling_repeats_on_the_device(bf16_ckpt):
    engine = cuda_engine(bf16_ckpt, dtype="bfloat16")
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.9, top_p=0.95, seed=1234)
    alone = engine.generate([prompts()[0]], params)[0].output_ids
    among = engine.generate(prompts()[:4], params)[0].output_ids
    assert alone == among
    engine.assert_no_leaks()


def test_a_handoff_between_two_gpu_engines_gives_the_colocated_tokens(bf16_ckpt):
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, seed=77)
    src, dst = cuda_engine(bf16_ckpt, dtype="bfloat16"), cuda_engine(bf16_ckpt, dtype="bfloat16")
    colocated = cuda_engine(bf16_ckpt, dtype="bfloat16")
    for i, ids in enumerate(prompts(4)):
        want = colocated.generate([ids], params)[0].output_ids
        rid = f"r{i}"
        src.add_request(rid, ids, params, mode=SeqMode.PREFILL_ONLY)
        while src.has_unfinished():
            src.step()
        exp = src.export(rid)
        res = dst.reserve_import(rid, ids, params)
        for layer in range(src.abi.num_layers):
            chunk = src.pool.read_chunk(layer, list(exp.block_ids))
            dst.pool.write_chunk(layer, list(res.block_ids), chunk)
            assert dst.pool.read_chunk(layer, list(res.block_ids)) == chunk  # bitwise K/V across the handoff
        src.release_prefilled(rid)
        dst.commit_import(rid, ids, exp.first_token, params, exp.seed)
        got = [exp.first_token]
        while dst.has_unfinished():
            got += [t for o in dst.step() for t in o.new_token_ids]
        assert got == list(want), i
    for e in (src, dst, colocated):
        e.assert_no_leaks()
