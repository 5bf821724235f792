"""Logprobs equal transformers' log_softmax of the raw logits; prompt logprobs survive chunking and
prefix hits; n > 1 sequences share the prompt's blocks, reproduce per seed, and fork the same
over a prefill -> decode handoff as colocated."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.sequence import SamplingParams, SeqMode
from tests.helpers.checkpoints import load_hf_model

TOL = 1e-4  # fp32: two BLAS paths differ by ~1e-6 here


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_log_probs(hf, ids: list[int]) -> torch.Tensor:
    """[S, V] log_softmax of transformers' logits at every position of `ids`."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def run(engine, rid: str, ids: list[int], params: SamplingParams) -> dict[int, list]:
    """Every output of one request, by sequence index."""
    engine.add_request(rid, ids, params)
    outs: dict[int, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.index, []).append(out)
    return outs


def tokens(outs: list) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def logprobs(outs: list) -> list:
    return [lp for o in outs for lp in o.logprobs]


@pytest.fixture(scope="module")
def hf(gqa_ckpt):
    return load_hf_model(gqa_ckpt)


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=12, ignore_eos=True, logprobs=5),
    SamplingParams(max_tokens=12, ignore_eos=True, logprobs=5, temperature=0.7, top_p=0.8, top_k=20, seed=9),
], ids=["greedy", "sampled"])
def test_output_logprobs_equal_transformers_raw_log_softmax(gqa_ckpt, engine_factory, hf, params):
    ids = prompt(37, 1)
    outs = run(engine_factory(gqa_ckpt), "r", ids, params)[0]
    out_ids = tokens(outs)
    ref = hf_log_probs(hf, ids + out_ids)[len(ids) - 1 : -1]  # [12, V]: the row that predicted each output
    for i, (tok, lp) in enumerate(zip(out_ids, logprobs(outs))):
        assert lp.token_id == tok
        assert abs(lp.logprob - ref[i, tok].item()) <= TOL
        top = torch.topk(ref[i], 5)
        assert list(lp.top_ids) == top.indices.tolist()
        assert max(abs(a - b) for a, b in zip(lp.top_logprobs, top.values.tolist())) <= TOL
        assert list(lp.top_logprobs) == sorted(lp.top_logprobs, reverse=True)


def test_prompt_logprobs_span_chunks_and_are_computed_despite_a_prefix_hit(gqa_ckpt, engine_factory, hf):
    eng = engine_factory(gqa_ckpt, max_num_batched_tokens=32)  # a 70-token prompt prefills in 3 chunks
    ids = prompt(70, 2)
    plain = run(eng, "warm", ids, SamplingParams(max_tokens=2, ignore_eos=True))[0]
    again = run(eng, "again", ids, SamplingParams(max_tokens=2, ignore_eos=True))[0]
    assert plain[0].num_cached_tokens == 0 and again[0].num_cached_tokens == 64  # the cache holds 4 full blocks
    params = SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=3, logprobs=0)
    scored = run(eng, "scored", ids, params)[0]
    assert scored[0].num_cached_tokens == 0  # the cached blocks have no logits: the prompt was computed
    assert tokens(scored) == tokens(plain)
    plp = scored[0].prompt_logprobs
    assert scored[1].prompt_logprobs is None and len(plp) == len(ids) - 1
    ref = hf_log_probs(hf, ids)
    for p, lp in enumerate(plp):  # the logits at position p score prompt token p + 1
        assert lp.token_id == ids[p + 1]
        assert abs(lp.logprob - ref[p, ids[p + 1]].item()) <= TOL
        assert list(lp.top_ids) == torch.topk(ref[p], 3).indices.tolist()
    repeat = run(eng, "repeat", ids, params)[0]
    assert repeat[0].prompt_logprobs == plp  # bitwise: same chunks, same rows


def test_n_sequences_share_the_prompt_and_reproduce_per_seed(gqa_ckpt, engine_factory):
    ids = prompt(37, 3)  # 2 full blocks and a partial one
    params = SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.0, seed=5, n=4, logprobs=1)
    eng = engine_factory(gqa_ckpt)
    eng.add_request("r", ids, params)
    first = eng.step()  # prefill + fork
    assert sorted(o.index for o in first) == [0, 1, 2, 3] and not any(o.finished for o in first)
    head = eng.seqs["r"].block_table
    assert [eng.blocks.refcount[b] for b in head[:2]] == [4, 4]  # full prompt blocks shared by reference
    partials = {eng.seqs[k].block_table[2] for k in ("r", "r#n1", "r#n2", "r#n3")}
    assert len(partials) == 4  # the partial block was copied for each forked sequence
    eng.check_integrity()
    outs: dict[int, list] = {o.index: [o] for o in first}
    while eng.has_unfinished():
        for out in eng.step():
            outs[out.index].append(out)
    finished = [o for per in outs.values() for o in per if o.finished]
    assert len(finished) == 1  # the request ends once, with its last sequence
    assert all(per[-1].finish_reason == "length" and len(tokens(per)) == 10 for per in outs.values())
    again = run(engine_factory(gqa_ckpt), "x", ids, params)
    assert {i: tokens(o) for i, o in outs.items()} == {i: tokens(o) for i, o in again.items()}
    assert len({tuple(tokens(o)) for o in outs.values()}) == 4  # independent draws
    single = run(engine_factory(gqa_ckpt), "one", ids, SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.0, seed=5))
    assert tokens(single[0]) == tokens(outs[0])  # sequence 0 keeps the request's seed
    other_seed = run(engine_factory(gqa_ckpt), "y", ids, SamplingParams(**{**params.__dict__, "seed": 6}))
    assert tokens(other_seed[1]) != tokens(outs[1])


def test_n_sequences_under_memory_pressure_give_the_same_tokens(gqa_ckpt, engine_factory):
    ids = prompt(37, 4)
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, seed=11, n=4)
    roomy = run(engine_factory(gqa_ckpt), "r", ids, params)
    eng = engine_factory(gqa_ckpt, num_blocks=9)  # 4 sequences of 61 tokens need 2 shared + 4 x 2 own blocks + 1
    eng.add_request("r", ids, params)
    outs: dict[int, list] = {}
    preempted = 0
    while eng.has_unfinished():
        for out in eng.step():
            outs.setdefault(out.index, []).append(out)
        preempted = max([preempted, *(s.num_preemptions for s in eng.seqs.values())])
        eng.check_integrity()
    assert preempted > 0
    assert {i: tokens(o) for i, o in outs.items()} == {i: tokens(o) for i, o in roomy.items()}


def handoff(src, dst, rid: str, ids: list[int], params: SamplingParams) -> tuple[list, dict[int, list]]:
    """Prefill on `src`, move the K/V, decode on `dst` -> (prefill outputs, decode outputs by index)."""
    src.add_request(rid, ids, params, mode=SeqMode.PREFILL_ONLY)
    first = []
    while src.has_unfinished():
        first += src.step()
    exp = src.export(rid)
    res = dst.reserve_import(rid, ids, params)
    for layer in range(src.abi.num_layers):
        dst.pool.write_chunk(layer, list(res.block_ids), src.pool.read_chunk(layer, list(exp.block_ids)))
    src.release_prefilled(rid)
    dst.commit_import(rid, ids, exp.first_token, params, exp.seed, first[-1].forks)
    rest: dict[int, list] = {}
    while dst.has_unfinished():
        for out in dst.step():
            rest.setdefault(out.index, []).append(out)
    return first, rest


def test_n_forked_over_one_imported_prompt_equals_colocated(gqa_ckpt, engine_factory):
    ids = prompt(45, 5)
    base = SamplingParams(max_tokens=9, ignore_eos=True, temperature=1.0, seed=21, n=3, logprobs=2, prompt_logprobs=1)
    probe = run(engine_factory(gqa_ckpt), "r", ids, base)
    # sequence 1 ends at its first token (a stop token id), so the decode worker forks fewer sequences
    params = SamplingParams(**{**base.__dict__, "stop_token_ids": (tokens(probe[1])[0],)})
    colocated = run(engine_factory(gqa_ckpt), "r", ids, params)
    first, rest = handoff(engine_factory(gqa_ckpt), engine_factory(gqa_ckpt), "r", ids, params)
    assert [o.index for o in first] == [1, 2, 0] and first[-1].prefilled
    assert first[0].finish_reason == "stop" and not first[0].finished
    going_on = [i for i in (0, 2) if colocated[i][0].finish_reason is None]
    assert first[-1].forks == tuple((i, tokens(colocated[i])[0]) for i in going_on)
    for o in first:  # the first token's logprobs come from the prefill worker, bitwise as colocated
        assert o.logprobs == colocated[o.index][0].logprobs and o.new_token_ids == colocated[o.index][0].new_token_ids
    # the prompt logprobs ride on the first output each side reports (colocated: sequence 0's)
    assert first[0].prompt_logprobs == colocated[0][0].prompt_logprobs and len(first[0].prompt_logprobs) == 44
    assert all(o.prompt_logprobs is None for o in first[1:])
    assert sorted(rest) == going_on and going_on
    for i in going_on:
        assert tokens(rest[i]) == tokens(colocated[i])[1:]
        assert logprobs(rest[i]) == logprobs(colocated[i])[1:]
        assert rest[i][-1].finish_reason == colocated[i][-1].finish_reason
    assert sum(o.finished for per in rest.values() for o in per) == 1


def test_abort_reaches_every_sequence_and_returns_the_blocks(gqa_ckpt, engine_factory):
    eng = engine_factory(gqa_ckpt)
    eng.add_request("r", prompt(40, 6), SamplingParams(max_tokens=50, ignore_eos=True, temperature=1.0, seed=1, n=3))
    eng.step()
    eng.step()
    assert {"r", "r#n1", "r#n2"} <= set(eng.seqs)
    assert eng.abort("r")
    eng.assert_no_leaks()
    with pytest.raises(Exception, match="cannot resume"):
        eng.add_request("z", [5, 6, 7], SamplingParams(n=2), resume_output_ids=(9,))


def test_a_resumed_request_does_not_score_its_prompt_again(gqa_ckpt, engine_factory):
    """Prompt logprobs travel with the first output token; a recompute that resumes after it
    (the router's fallback) takes the prefix hit and sends none."""
    eng = engine_factory(gqa_ckpt)
    ids = prompt(40, 7)
    run(eng, "warm", ids, SamplingParams(max_tokens=1, ignore_eos=True))
    params = SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    eng.add_request("r", ids, params, resume_output_ids=(9,))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert outs[0].num_cached_tokens == 32 and all(o.prompt_logprobs is None for o in outs)
    assert len(tokens(outs)) == 3
