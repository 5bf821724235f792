"""With the C prefill attention a prompt's K/V bits do not depend on how it was cut into chunks:
every row's attention is fixed by its position and keys (model/paged_prefill.py), the norms,
RoPE and SiLU are per row (model/glue.py) and the products are batch-invariant (numerics.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.engine.sequence import SamplingParams
from pdserve.model import paged_prefill

pytestmark = pytest.mark.skipif(not paged_prefill.available(), reason="no C compiler: SDPA prefill has no such property")


def _prompt_kv(eng, request_id: str, length: int) -> list[np.ndarray]:
    """Per layer, the raw K and V bytes of the prompt's positions: [2, length, H * D * itemsize]."""
    seq = eng.seqs[request_id]
    bs = eng.blocks.block_size
    blocks = seq.block_table[: -(-length // bs)]
    return [np.frombuffer(eng.pool.read_chunk(layer, blocks), dtype=np.uint8).reshape(2, len(blocks) * bs, -1)[:, :length]
            for layer in range(eng.abi.num_layers)]


@pytest.mark.parametrize("dtype,compute", [("float32", None), ("bfloat16", None), ("bfloat16", "float32")])
def test_a_prompts_kv_bits_do_not_depend_on_its_chunking(gqa_ckpt, engine_factory, dtype, compute):
    prompt = torch.randint(0, 128, (45,), generator=torch.Generator().manual_seed(9)).tolist()
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    runs = []
    for chunk in (7, 16, 256):  # 7 chunks, 3 chunks, one shot
        eng = engine_factory(gqa_ckpt, dtype=dtype, compute_dtype=compute, max_num_batched_tokens=chunk,
                             enable_prefix_cache=False)
        eng.add_request("a", prompt, params)
        while eng.seqs["a"].num_computed < len(prompt):
            eng.step()
        runs.append([kv.copy() for kv in _prompt_kv(eng, "a", len(prompt))])
        eng.abort("a")
    for other in runs[1:]:
        for mine, theirs in zip(runs[0], other):
            assert np.array_equal(mine, theirs)
