"""Device-to-device K/V moves between two processes on one GPU, through CUDA IPC.

Contract: the source process exports its pool once (`export_pool`: a picklable handle made by
torch's CUDA IPC reductions, cudaIpcGetMemHandle underneath); the destination maps it once
(`attach_pool`) and copies only the blocks a transfer granted (`copy_granted`: all layers, K and
V, gathered on the device into the destination's landing blocks, on the caller's stream). The
copy is complete, and its chunks DEVICE_VISIBLE, when the returned event has completed; the
source must keep its blocks until then (the handoff's publication ack already holds them).
The source exports its own pool tensor and must outlive every mapping of it.

This is the transport's data path only: frames, grants, capabilities and credits stay with the
handoff protocol (handoff/transports/pull.py is the host-memory analogue).
"""

from __future__ import annotations

import torch


def export_pool(pool_tensor: torch.Tensor) -> tuple:
    """A handle for `pool_tensor` [L, 2, N, B, H, D] that another process can attach (pickle it)."""
    from torch.multiprocessing.reductions import reduce_tensor
    if pool_tensor.device.type != "cuda":
        raise ValueError("CUDA IPC exports a pool on a CUDA device")
    return reduce_tensor(pool_tensor)


def attach_pool(handle: tuple) -> torch.Tensor:
    """The source's pool as a tensor of this process (the same device memory, mapped once)."""
    rebuild, args = handle
    return rebuild(*args)


def copy_granted(src: torch.Tensor, src_blocks: list[int], dst: torch.Tensor, dst_blocks: list[int],
                 granted: frozenset[int]) -> torch.cuda.Event:
    """Copy src[:, :, src_blocks] into dst[:, :, dst_blocks] (every layer, K and V) on the device;
    refuses a block the transfer did not grant. -> an event recorded after the copy."""
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"{len(src_blocks)} source blocks for {len(dst_blocks)} landing blocks")
    stray = [b for b in src_blocks if b not in granted]
    if stray:
        raise PermissionError(f"source blocks {stray[:5]} were not granted to this transfer")
    index = torch.tensor(src_blocks, dtype=torch.int64).to(src.device, non_blocking=True)
    landing = torch.tensor(dst_blocks, dtype=torch.int64).to(dst.device, non_blocking=True)
    dst.index_copy_(2, landing, src.index_select(2, index))
    done = torch.cuda.Event()
    done.record()
    return done
