"""A K/V move between two processes on one GPU through CUDA IPC (handoff/transports/cuda_ipc.py): the
destination maps the source's pool once and copies only granted blocks, bit for bit; an ungranted
block is refused. Skipped, with the reason, where no CUDA device is present."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from pdserve.handoff.transports.cuda_ipc import attach_pool, copy_granted

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here (CI is CPU-only): "
                                "scripts/gpu_check.sh runs this on a lent GPU")

SHAPE = (3, 2, 40, 16, 2, 64)  # [L, 2, N, B, H, D]


def source(conn) -> None:
    from pdserve.handoff.transports.cuda_ipc import export_pool
    pool = torch.randn(SHAPE, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).cuda()
    torch.cuda.synchronize()
    conn.send(export_pool(pool))
    conn.recv()  # the destination is done with the mapping
    conn.close()


def test_a_granted_copy_between_processes_is_bitwise_and_grant_bound():
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    child = ctx.Process(target=source, args=(theirs,))
    child.start()
    try:
        src = attach_pool(mine.recv())
        expect = torch.randn(SHAPE, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
        dst = torch.zeros(SHAPE, dtype=torch.bfloat16, device="cuda")
        granted = frozenset({3, 7, 8, 20})
        copy_granted(src, [3, 7, 8, 20], dst, [0, 1, 2, 39], granted).synchronize()
        got = dst.cpu()
        assert torch.equal(got[:, :, [0, 1, 2, 39]], expect[:, :, [3, 7, 8, 20]])
        assert not got[:, :, 3:39].any()  # nothing else landed
        with pytest.raises(PermissionError, match=r"\[5\]"):
            copy_granted(src, [3, 5], dst, [4, 5], granted)
        del src
        torch.cuda.synchronize()
    finally:
        mine.send("done")
        child.join(30)
    assert child.exitcode == 0
