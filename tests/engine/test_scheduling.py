"""Chunked prefill, prefix cache, preemption and the two phase entry points keep tokens exact."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.errors import InvalidRequest
from pdserve.engine.sequence import SamplingParams, SeqMode

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
# (storage dtype, compute dtype): the numerics modes whose exactness claims are tested
NUMERICS = [("float32", None), ("bfloat16", None), ("bfloat16", "float32")]


def prompts(n: int, lengths=(5, 16, 17, 33, 50, 7, 64, 29)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, 128, (lengths[i % len(lengths)],), generator=gen).tolist() for i in range(n)]


def run(engine, ps, params=GREEDY) -> list[tuple[int, ...]]:
    return [o.output_ids for o in engine.generate(ps, params)]


@pytest.mark.parametrize("chunk", [1, 7, 16])
def test_chunked_prefill_equals_one_shot(gqa_ckpt, engine_factory, chunk):
    ps = prompts(4)
    whole = run(engine_factory(gqa_ckpt, max_num_batched_tokens=4096, enable_prefix_cache=False), ps)
    chunked = run(engine_factory(gqa_ckpt, max_num_batched_tokens=chunk, enable_prefix_cache=False), ps)
    assert chunked == whole


def test_prefix_cache_hit_gives_cold_tokens(gqa_ckpt, engine_factory):
    base = prompts(1, lengths=(40,))[0]
    shared = [base + [3, 4, 5], base + [9, 9]]
    cold = run(engine_factory(gqa_ckpt, enable_prefix_cache=False), shared)
    eng = engine_factory(gqa_ckpt)
    first = eng.generate([shared[0]], GREEDY)[0]
    second = eng.generate([shared[1]], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 32  # two full 16-token blocks of the shared 40-token base
    assert [first.output_ids, second.output_ids] == cold
    again = eng.generate([shared[0]], GREEDY)[0]  # whole prompt cached: last block recomputed
    assert again.num_cached_tokens == 32 and again.output_ids == cold[0]


def test_prefix_hit_rechecks_token_ids(gqa_ckpt, engine_factory):
    eng = engine_factory(gqa_ckpt)
    p = prompts(1, lengths=(33,))[0]
    eng.generate([p], GREEDY)
    hashes = eng.blocks.hashes_for(p)
    tampered = list(p)
    tampered[0] = (tampered[0] + 1) % 128
    # same hashes, other tokens: the stored ids do not match, so no hit
    assert eng.blocks.match_prefix(hashes, tampered) == 0
    assert eng.blocks.match_prefix(hashes, p) == 2


def test_lru_eviction_reuses_unreferenced_cached_blocks(gqa_ckpt, engine_factory):
    eng = engine_factory(gqa_ckpt, num_blocks=8)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    ps = prompts(6, lengths=(50, 60, 45))
    ps[3] = ps[0][:40] + [1, 2, 3]  # a later hit on blocks that survived eviction pressure
    cold = run(engine_factory(gqa_ckpt, enable_prefix_cache=False), ps, params)
    warm = [eng.generate([p], params)[0].output_ids for p in ps]  # one at a time: cache fills up
    assert warm == cold
    assert eng.blocks.num_evictions > 0


def test_preemption_and_recompute_give_same_tokens(gqa_ckpt, engine_factory):
    ps = prompts(6)
    roomy = run(engine_factory(gqa_ckpt, enable_prefix_cache=False), ps)
    tight = engine_factory(gqa_ckpt, num_blocks=14, enable_prefix_cache=False)
    outs = run(tight, ps)
    assert outs == roomy
    assert not tight.scheduler.waiting and not tight.scheduler.running


def test_preemption_happens_under_pressure(gqa_ckpt, engine_factory):
    eng = engine_factory(gqa_ckpt, num_blocks=10, enable_prefix_cache=False)
    ps = prompts(4, lengths=(30,))
    for i, p in enumerate(ps):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=40, ignore_eos=True))
    preempted = 0
    while eng.has_unfinished():
        plan_before = sum(s.num_preemptions for s in eng.seqs.values())
        eng.step()
        eng.check_integrity()
        preempted = max(preempted, plan_before)
    assert preempted > 0


@pytest.mark.parametrize("dtype,compute", NUMERICS)
def test_prefill_only_then_import_equals_uninterrupted(gqa_ckpt, engine_factory, dtype, compute):
    ps = prompts(5)
    params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.8, top_p=0.9, seed=123)
    mode = dict(dtype=dtype, compute_dtype=compute)
    reference = run(engine_factory(gqa_ckpt, **mode), ps, params)
    src = engine_factory(gqa_ckpt, **mode)
    dst = engine_factory(gqa_ckpt, **mode)
    for i, p in enumerate(ps):
        src.add_request(f"r{i}", p, params, mode=SeqMode.PREFILL_ONLY)
    while src.has_unfinished():
        src.step()
    for i, p in enumerate(ps):
        exp = src.export(f"r{i}")
        res = dst.reserve_import(f"r{i}", p, params)
        for layer in range(src.abi.num_layers):
            dst.pool.write_chunk(layer, list(res.block_ids), src.pool.read_chunk(layer, list(exp.block_ids)))
        dst.commit_import(f"r{i}", p, exp.first_token, params, exp.seed)
        src.release_prefilled(f"r{i}")
    final = {}
    while dst.has_unfinished():
        for out in dst.step():
            if out.finished:
                final[out.request_id] = out.output_ids
    assert [final[f"r{i}"] for i in range(len(ps))] == reference


def test_seeded_sampling_ignores_batch_mates(gqa_ckpt, engine_factory):
    p = prompts(1)[0]
    params = SamplingParams(max_tokens=16, temperature=1.0, top_k=50, seed=42, ignore_eos=True)
    alone = run(engine_factory(gqa_ckpt), [p], params)[0]
    mates = [SamplingParams(max_tokens=16, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    crowd = engine_factory(gqa_ckpt).generate([p] + prompts(3), [params] + mates)
    assert crowd[0].output_ids == alone
    other_seed = run(engine_factory(gqa_ckpt), [p], SamplingParams(max_tokens=16, temperature=1.0, top_k=50, seed=43, ignore_eos=True))[0]
    assert other_seed != alone


def test_stop_token_and_max_tokens(gqa_ckpt, engine_factory):
    eng = engine_factory(gqa_ckpt)
    p = prompts(1)[0]
    ref = eng.generate([p], GREEDY)[0].output_ids
    stop_tok = ref[5]
    first = ref.index(stop_tok)
    out = eng.generate([p], SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=(stop_tok,)))[0]
    assert out.output_ids == ref[: first + 1] and out.finish_reason == "stop"
    assert eng.generate([p], SamplingParams(max_tokens=3, ignore_eos=True))[0].output_ids == ref[:3]


@pytest.mark.parametrize(
    "prompt,params,message",
    [
        ([], SamplingParams(), "empty"),
        ([1] * 600, SamplingParams(), "context"),
        ([1, 2], SamplingParams(max_tokens=0), "max_tokens"),
        ([1, 2], SamplingParams(max_tokens=-3), "max_tokens"),
        ([1, 2], SamplingParams(top_p=0.0), "top_p"),
        ([1, 2], SamplingParams(top_p=1.5), "top_p"),
        ([1, 2], SamplingParams(temperature=-1.0), "temperature"),
        ([1, 999], SamplingParams(), "out of range"),
    ],
)
def test_bad_requests_rejected_while_others_run(gqa_ckpt, engine_factory, prompt, params, message):
    eng = engine_factory(gqa_ckpt)
    good = prompts(1)[0]
    eng.add_request("good", good, GREEDY)
    eng.step()
    with pytest.raises(InvalidRequest, match=message):
        eng.add_request("bad", prompt, params)
    eng.check_integrity()
    final = None
    while eng.has_unfinished():
        for out in eng.step():
            final = out
    assert final.request_id == "good" and len(final.output_ids) == 24


def test_abort_frees_blocks_in_every_state(gqa_ckpt, engine_factory):
    eng = engine_factory(gqa_ckpt, max_num_batched_tokens=8)
    p = prompts(1, lengths=(40,))[0]
    eng.add_request("waiting", p, GREEDY)
    eng.add_request("running", p, GREEDY)
    eng.step()  # "waiting" is mid-prefill (8-token budget), "running" still waits
    assert eng.abort("waiting") and eng.abort("running")
    eng.add_request("pf", p, GREEDY, mode=SeqMode.PREFILL_ONLY)
    while eng.has_unfinished():
        eng.step()
    assert eng.abort("pf")
    eng.reserve_import("imp", p, GREEDY)
    held = eng.blocks.num_free
    assert eng.abort("imp") and "imp" in eng.imports and eng.blocks.num_free == held  # the endpoint frees it
    eng.cancel_import("imp")
    assert not eng.abort("unknown")


def test_abort_keeping_blocks_pins_a_prefill_until_release(gqa_ckpt, engine_factory):
    """An aborted prefill whose handoff still reads its blocks stops computing, keeps them, and
    returns them only on release_prefilled (the worker's quiescence step)."""
    eng = engine_factory(gqa_ckpt, max_num_batched_tokens=8)
    p = prompts(1, lengths=(40,))[0]
    free = eng.blocks.num_free
    eng.add_request("mid", p, GREEDY, mode=SeqMode.PREFILL_ONLY)
    eng.step()  # mid-prefill: 8 of 40 tokens
    held = list(eng.kv_blocks("mid"))
    assert held and eng.abort("mid", keep_blocks=True)
    assert not eng.has_unfinished() and eng.kv_blocks("mid") == held and eng.blocks.num_free == free - len(held)
    eng.check_integrity()
    eng.release_prefilled("mid")
    assert eng.blocks.num_free == free
    eng.add_request("colocated", p, GREEDY)
    eng.step()
    assert not eng.abort("unknown", keep_blocks=True) and eng.abort("colocated", keep_blocks=True)  # nothing to pin
    assert eng.blocks.num_free == free
    eng.assert_no_leaks()


@pytest.mark.parametrize("dtype,compute", NUMERICS)
def test_tokens_do_not_depend_on_batch_mates(gqa_ckpt, engine_factory, dtype, compute):
    """Aligned chunks, batch-invariant matmuls and decode K/V padding that depends only on a
    row's own length: a request's tokens are the same alone or in any crowd (exactness across
    colocated and disaggregated serving rests on this)."""
    p = prompts(1, lengths=(45,))[0]
    params = SamplingParams(max_tokens=40, temperature=0.9, seed=3, ignore_eos=True)
    mode = dict(dtype=dtype, compute_dtype=compute, max_num_batched_tokens=32)
    alone = run(engine_factory(gqa_ckpt, **mode), [p], params)[0]
    mates = prompts(7, lengths=(5, 140, 17, 90, 33, 61, 200))
    crowd = engine_factory(gqa_ckpt, **mode).generate(
        mates[:3] + [p] + mates[3:], [SamplingParams(max_tokens=30 + i, ignore_eos=True) for i in range(3)] + [params]
        + [SamplingParams(max_tokens=25, ignore_eos=True)] * 4)
    assert crowd[3].output_ids == alone


def test_queued_prompt_work_leaves_out_what_the_prefix_cache_holds(gqa_ckpt, engine_factory):
    """The worker reports `num_pending_prompt_tokens` and the router prices its queue from it (the
    P/D decision's route delta, the policies' queue terms). A queued follow-up turn whose history is
    cached here was counted as its whole prompt: in the P/D decision study the prefill worker's
    queue of follow-ups was priced at 3-4x its real drain time."""
    eng = engine_factory(gqa_ckpt)
    history = prompts(1, lengths=(40,))[0]
    eng.generate([history], GREEDY)  # two full 16-token blocks of it now cached
    follow_up = history + [3, 4, 5, 6, 7]  # 45 tokens, 32 of them cached
    eng.add_request("turn2", follow_up, GREEDY)
    eng.add_request("cold", prompts(1, lengths=(33,))[0][::-1], GREEDY)  # nothing cached
    assert eng.scheduler.num_pending_prompt_tokens == (45 - 32) + 33
    whole = eng.blocks.match_prefix(eng.blocks.hashes_for(history), history)
    assert whole == 2
    while eng.has_unfinished():
        eng.step()
    assert eng.scheduler.num_pending_prompt_tokens == 0 and not eng.scheduler._cached_when_queued
