"""One preallocated paged K/V pool per worker, laid out as its `KvAbi` declares.

Contract: the pool owns bytes only; which blocks belong to whom is the `BlockManager`'s job.
The storage may live in ordinary memory or in a named POSIX shared-memory segment, so a
same-host peer can copy K/V straight into reserved destination blocks (the shm transport).

    tensor: [L, 2, N, B, H_kv, D]   (see kv_abi.AXIS_ORDER)

When a block's pages become resident (`resident`): "on_use" (the engine's pools) makes the pages
of blocks [0, n) resident when `populate(n)` is called, which the engine's block manager does as it
first hands those blocks out (it hands never-used blocks out in ascending order), in extents of
POPULATE_EXTENT blocks, one `madvise(MADV_POPULATE_WRITE)` per layer's K and V slab: the kernel
maps and zeroes them in one pass, as `MAP_POPULATE` would, so no page faults inside a prefill's
K/V writes (each 4 KiB page's first write faulting there measured ~30 ms of CPU per fresh
512-token prefill of the 107M checkpoint on a KVM guest, docs/engine_speed.md §8), and the pool's
resident memory is the blocks the engine has used, not its size. "all": every page resident at
creation (where the kernel has no MADV_POPULATE_WRITE, "on_use" does this). "lazy": pages fault in
on first touch. A new segment or anonymous mapping reads as zeros either way.

A pool on a CUDA device (`device="cuda[:N]"`) is one device allocation, zeroed; it has no shared
segment and no raw host view, and its chunk I/O stages through host memory (the TCP handoff and
host copies read and write bytes there).

Chunk I/O works on raw bytes so transports never need to know torch dtypes: a chunk is the
K and V slabs of one layer for a list of blocks, serialized as [2, len(blocks), B, H_kv, D].
"""

from __future__ import annotations

import ctypes
import mmap
from multiprocessing import shared_memory

import numpy as np
import torch

from pdserve.engine.kv.kv_abi import KvAbi
from pdserve.shm import AttachedSegment, attach

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# numpy has no bfloat16: raw byte views use an integer type of the same width.
NUMPY_VIEW_DTYPES = {"float32": np.int32, "bfloat16": np.int16, "float16": np.int16}
RESIDENT = ("on_use", "all", "lazy")
POPULATE_EXTENT = 64  # blocks made resident at a time by "on_use" (the 107M checkpoint: 12 MiB)
MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault pages in writable without writing them
_PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)


def populate_write(address: int, length: int) -> bool:
    """Make the pages over [address, address + length) resident and writable (their bytes
    unchanged); False where the kernel cannot (before 5.14)."""
    start = address - address % _PAGE
    end = -(-(address + length) // _PAGE) * _PAGE
    return _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_POPULATE_WRITE) == 0


class KvPool:
    """Paged K/V storage for `num_blocks` blocks of `abi` geometry."""

    def __init__(self, abi: KvAbi, num_blocks: int, shm_name: str | None = None, create: bool = True,
                 resident: str = "lazy", device: str = "cpu"):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if resident not in RESIDENT:
            raise ValueError(f"resident must be one of {RESIDENT}, got {resident!r}")
        self.populated = 0  # with "on_use": blocks [0, populated) have resident pages
        self.device = torch.device(device)
        self.abi = abi
        self.num_blocks = num_blocks
        self.tp = 1  # tensor-parallel ranks sharing this pool, each over its K/V heads (engine/tp_group.py)
        self.shape = (abi.num_layers, 2, num_blocks, abi.block_size, abi.num_kv_heads, abi.head_dim)
        self.nbytes = int(np.prod(self.shape)) * abi.dtype_bytes
        self._shm: shared_memory.SharedMemory | AttachedSegment | None = None
        self._owned = create
        view_dtype = NUMPY_VIEW_DTYPES[abi.dtype]
        self._mapping: mmap.mmap | None = None
        self.scratch_slot: int | None = None
        if self.device.type != "cpu":
            if shm_name is not None:
                raise ValueError("a K/V pool on a GPU cannot live in a POSIX shared-memory segment")
            self._raw = None  # type: ignore[assignment]
            # one block past the last is the scratch block: padding rows of a replayed decode graph write there
            full = self.shape[:2] + (num_blocks + 1,) + self.shape[3:]
            self.tensor = torch.zeros(full, dtype=TORCH_DTYPES[abi.dtype], device=self.device)
            self.scratch_slot = num_blocks * abi.block_size
            self.resident, self.populated = "all", num_blocks
            return
        if shm_name is None:  # zeroed pages, mapped on first touch
            self._mapping = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            raw = np.frombuffer(self._mapping, dtype=view_dtype, count=self.nbytes // abi.dtype_bytes)
            raw = raw.reshape(self.shape)
        else:
            # created here, or attached: not owned, the creator unlinks it (pdserve/shm.py keeps the tracker out)
            self._shm = shared_memory.SharedMemory(name=shm_name, create=True, size=self.nbytes) if create \
                else attach(shm_name)
            raw = np.ndarray(self.shape, dtype=view_dtype, buffer=self._shm.buf)
        self._raw = raw  # [L, 2, N, B, H, D] integer view of the same bytes
        self.tensor = torch.from_numpy(raw).view(TORCH_DTYPES[abi.dtype])  # [L, 2, N, B, H, D]
        self.resident = resident if create else "lazy"  # an attached pool's pages are its creator's to populate
        if self.resident == "all" or (self.resident == "on_use" and not self._populate_blocks(0, 0)):
            self._populate_all()

    def populate(self, num_blocks: int) -> None:
        """With "on_use": make the pages of blocks [0, num_blocks) resident, a whole extent at a time,
        before anything writes them (the block manager calls this as it first hands blocks out)."""
        if self.resident != "on_use" or num_blocks <= self.populated:
            return
        end = min(self.num_blocks, -(-num_blocks // POPULATE_EXTENT) * POPULATE_EXTENT)
        if not self._populate_blocks(self.populated, end):
            raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_WRITE) failed on the K/V pool")
        self.populated = end

    def _populate_blocks(self, start: int, end: int) -> bool:
        """Pages of blocks [start, end) in every layer's K and V slab; (0, 0) probes the kernel."""
        slab, base = self.abi.slab_bytes, self._raw.ctypes.data
        if start == end:
            return populate_write(base, 1)
        return all(populate_write(base + (lkv * self.num_blocks + start) * slab, (end - start) * slab)
                   for lkv in range(self.shape[0] * 2))

    def _populate_all(self) -> None:
        if not populate_write(self._raw.ctypes.data, self.nbytes):
            self._raw.reshape(-1)[::_PAGE // self._raw.itemsize] = 0  # nothing is written yet: zeros stay zeros
        self.populated = self.num_blocks

    @property
    def shm_name(self) -> str | None:
        return None if self._shm is None else self._shm.name

    def chunk_nbytes(self, num_blocks: int) -> int:
        return 2 * num_blocks * self.abi.slab_bytes

    def read_chunk(self, layer: int, block_ids: list[int]) -> bytes:
        """K and V of `layer` for `block_ids`, as bytes shaped [2, len(block_ids), B, H, D]."""
        if self._raw is None:  # a GPU pool: gather on the device, one copy to the host
            return self._host_view(self.tensor[layer][:, block_ids]).tobytes()
        return self._raw[layer][:, block_ids].tobytes()

    def _host_view(self, t: torch.Tensor) -> np.ndarray:
        return t.contiguous().cpu().view(torch.uint8).numpy().view(NUMPY_VIEW_DTYPES[self.abi.dtype])

    def read_chunk_into(self, layer: int, block_ids: list[int], out: memoryview) -> None:
        """Same bytes as `read_chunk`, written into a caller's buffer without an extra copy."""
        if self._raw is None:
            out[:] = memoryview(self.read_chunk(layer, block_ids)).cast("B")
            return
        dst = np.frombuffer(out, dtype=self._raw.dtype).reshape((2, len(block_ids)) + self.shape[3:])
        np.take(self._raw[layer], block_ids, axis=1, out=dst)

    def write_chunk(self, layer: int, block_ids: list[int], data: bytes | memoryview) -> None:
        """Inverse of `read_chunk`: place a chunk's bytes into `block_ids` of `layer`."""
        src = np.frombuffer(data, dtype=NUMPY_VIEW_DTYPES[self.abi.dtype])
        expected = 2 * len(block_ids) * self.abi.slab_elems
        if src.size != expected:
            raise ValueError(f"chunk holds {src.size} scalars, expected {expected} for {len(block_ids)} blocks")
        if self._raw is None:
            staged = torch.from_numpy(src.copy()).view(self.tensor.dtype).reshape((2, len(block_ids)) + self.shape[3:])
            self.tensor[layer][:, block_ids] = staged.to(self.device)
            return
        self._raw[layer][:, block_ids] = src.reshape((2, len(block_ids)) + self.shape[3:])

    def copy_blocks(self, src_ids: list[int], dst_ids: list[int]) -> None:
        """Copy whole blocks (all layers, K and V) inside this pool."""
        if self._raw is None:
            self.tensor[:, :, dst_ids] = self.tensor[:, :, src_ids]
            return
        self._raw[:, :, dst_ids] = self._raw[:, :, src_ids]

    def close(self, unlink: bool = False) -> None:
        if self._shm is None:
            return
        self.tensor = None  # type: ignore[assignment]
        self._raw = None  # type: ignore[assignment]
        self._shm.close()
        if unlink and self._owned:
            self._shm.unlink()
        self._shm = None
