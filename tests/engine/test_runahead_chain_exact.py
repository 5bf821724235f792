"""KV-Runahead exactness in process: a chain of engines, each computing its partition of one
prompt over the prefix K/V its predecessor forwards layer by layer, leaves K/V bytes and a first
token bitwise equal to one engine's chunked prefill of the whole prompt (fp32, batch-invariant)."""

from __future__ import annotations

import threading

import pytest

from pdserve.engine.prefix_import import admit_prefix, reserve_prefix
from pdserve.engine.sequence import SamplingParams, SeqMode
from pdserve.handoff.gate import LayerGate

CHUNK = 64
STAGE = SamplingParams(max_tokens=2, ignore_eos=True)  # an inner stage must never end at its token
PARAMS = SamplingParams(max_tokens=4)


def _prompt(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 127 + 1 for i in range(n)]


def _run_until_prefilled(eng, request_id: str, layer_hook=None) -> int:
    while request_id not in eng.prefilled:
        for out in eng.step(layer_hook=layer_hook):
            assert not out.finished
    return eng.prefilled[request_id].output_ids[0]


def _kv(eng, request_id: str, num_tokens: int) -> list[bytes]:
    blocks = eng.kv_blocks(request_id)[: -(-num_tokens // eng.abi.block_size)]
    return [eng.pool.read_chunk(layer, blocks) for layer in range(eng.abi.num_layers)]


def _chain(engines, prompt: list[int], partition: tuple[int, ...]) -> int:
    """Run the chain with one thread per engine; returns the last stage's first token."""
    ends = [sum(partition[: i + 1]) for i in range(len(partition))]
    gates = [LayerGate(engines[0].abi.num_layers) for _ in partition]  # gates[i]: prefix of stage i landed
    tokens, errors = {}, []

    def forward_layers(i: int):
        """Stage i's hook: once its last chunk passed a layer, copy that layer's prefix onward."""
        if i + 1 == len(partition):
            return lambda layer, progress: None
        src, dst = engines[i], engines[i + 1]
        nblocks = ends[i] // src.abi.block_size
        dst_blocks = list(dst.imports["r"].block_ids[:nblocks])  # reserved before any stage runs

        def hook(layer, progress):
            if any(p.completes for p in progress):
                dst.pool.write_chunk(layer, dst_blocks, src.pool.read_chunk(layer, src.kv_blocks("r")[:nblocks]))
                gates[i + 1].mark_ready(layer)
        return hook

    def stage(i: int):
        eng, p = engines[i], (PARAMS if i + 1 == len(partition) else STAGE)
        onward = hooks[i]
        try:
            if i == 0:
                eng.add_request("r", prompt[: ends[0]], p, mode=SeqMode.PREFILL_ONLY, seed=5)
                tokens[i] = _run_until_prefilled(eng, "r", onward)
                return
            while not gates[i].is_ready(0):
                gates[i].wait_for_more(gates[i].version, 1.0)
            admit_prefix(eng, "r", prompt[: ends[i]], p, 5)

            def hook(layer, progress):
                onward(layer, progress)
                nxt = layer + 1
                while nxt < eng.abi.num_layers and not gates[i].is_ready(nxt):
                    gates[i].wait_for_more(gates[i].version, 1.0)
            tokens[i] = _run_until_prefilled(eng, "r", hook)
        except Exception as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    for i in range(1, len(partition)):
        reserve_prefix(engines[i], "r", prompt[: ends[i]], ends[i - 1], PARAMS if i + 1 == len(partition) else STAGE)
    hooks = [forward_layers(i) for i in range(len(partition))]
    threads = [threading.Thread(target=stage, args=(i,)) for i in range(len(partition))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return tokens[len(partition) - 1]


@pytest.mark.parametrize("length,partition", [(200, (128, 72)), (200, (64, 64, 72)), (256, (192, 64))])
def test_chain_kv_and_token_bitwise_equal_single_chunked_prefill(engine_factory, gqa_ckpt, length, partition):
    prompt = _prompt(length, length + len(partition))
    single = engine_factory(gqa_ckpt, max_num_batched_tokens=CHUNK)
    single.add_request("r", prompt, PARAMS, mode=SeqMode.PREFILL_ONLY, seed=5)
    want_token = _run_until_prefilled(single, "r")
    want_kv = _kv(single, "r", length)

    engines = [engine_factory(gqa_ckpt, max_num_batched_tokens=CHUNK) for _ in partition]
    got_token = _chain(engines, prompt, partition)
    assert got_token == want_token
    assert _kv(engines[-1], "r", length) == want_kv  # every layer, K and V, byte for byte
    first = _kv(engines[0], "r", partition[0])
    assert first == [_kv_prefix(single, layer, partition[0]) for layer in range(single.abi.num_layers)]
    for eng in (single, *engines):
        eng.release_prefilled("r")


def _kv_prefix(eng, layer: int, tokens: int) -> bytes:
    return eng.pool.read_chunk(layer, eng.kv_blocks("r")[: tokens // eng.abi.block_size])


def test_reserve_prefix_refuses_a_start_off_the_block_grid(engine_factory, gqa_ckpt):
    eng = engine_factory(gqa_ckpt, max_num_batched_tokens=CHUNK)
    from pdserve.engine.errors import InvalidRequest

    with pytest.raises(InvalidRequest):
        reserve_prefix(eng, "r", _prompt(100, 1), 40, PARAMS)
    res = reserve_prefix(eng, "r", _prompt(100, 1), 64, PARAMS)
    assert len(res.block_ids) == 4 and eng.blocks.reserved["r"] == 3  # 64 prefix tokens; blocks for 64..99
    eng.cancel_import("r")
