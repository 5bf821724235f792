"""What one request asks of a worker, given the prefix blocks that worker already holds.

Shared by the policies (on arrays of per-slot hits), the plan builder and the reference
implementation (on ints), so all three agree on tokens and blocks:

    usable prefill hit = min(hit, (prompt - 1) // B)   the last prompt token is always computed,
                                                       since its logits give the first output token
    compute tokens at P = prompt - usable_hit * B       (>= 1)
    new blocks at P     = ceil(prompt / B) - usable_hit
    transfer tokens     = prompt - hit_D * B            (0 when D already sees the whole prompt)
    transfer bytes      = transfer tokens * bytes per token (integers: exact in either grouping)
    decode reservation  = ceil((prompt + expected output) / B) - hit_D
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np

from pdserve.router.messages import RouteRequest

Num = TypeVar("Num", int, np.ndarray)


def usable_prefill_hit(request: RouteRequest, hit_blocks: Num, block_size: int) -> Num:
    return _at_most(hit_blocks, (request.prompt_tokens - 1) // block_size)


def visible_decode_hit(request: RouteRequest, hit_blocks: Num, block_size: int) -> Num:
    return _at_most(hit_blocks, request.prompt_tokens // block_size)


def _at_most(values: Num, limit: int) -> Num:
    return np.minimum(values, limit) if isinstance(values, np.ndarray) else min(values, limit)


def compute_tokens(request: RouteRequest, usable_hit: Num, block_size: int) -> Num:
    return request.prompt_tokens - usable_hit * block_size


def prefill_blocks(request: RouteRequest, usable_hit: Num, block_size: int) -> Num:
    return -(-request.prompt_tokens // block_size) - usable_hit


def transfer_tokens(request: RouteRequest, decode_hit: Num, block_size: int) -> Num:
    return request.prompt_tokens - decode_hit * block_size


def transfer_bytes(request: RouteRequest, decode_hit: Num, block_size: int, bytes_per_token: int) -> Num:
    """`transfer_tokens * bytes_per_token`, regrouped so an array of hits costs two operations."""
    return request.prompt_tokens * bytes_per_token - decode_hit * (block_size * bytes_per_token)


def always_transfers(request: RouteRequest, block_size: int) -> bool:
    """No visible decode hit covers the whole prompt, so every transfer moves bytes: a leading hit
    is at most len(block_hashes) blocks and a visible one at most prompt // B blocks."""
    most_hit = min(len(request.block_hashes), request.prompt_tokens // block_size)
    return most_hit * block_size < request.prompt_tokens


def decode_blocks(request: RouteRequest, decode_hit: Num, block_size: int) -> Num:
    total_tokens = request.prompt_tokens + request.expected_output_tokens
    return -(-total_tokens // block_size) - decode_hit


def colocated_blocks(request: RouteRequest, usable_hit: Num, block_size: int) -> Num:
    """A colocated worker allocates prompt and growth in one pool, minus what it reuses."""
    return decode_blocks(request, usable_hit, block_size)
