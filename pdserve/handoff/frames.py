"""Typed wire messages of the handoff protocol and their one serializer (msgpack, tagged union).

Contract: everything that crosses a process or host boundary is one of these frozen Structs.
Source -> destination: `ManifestFrame` (opens the transfer), `ChunkFrame` (one chunk has been
placed, or its payload follows on a byte stream), `SealFrame` (the checksum of every chunk),
`AbortFrame`. Destination -> source: `ChunkAck` (visible, or refused with a reason),
`PublishAck` (published or refused), `AbortFrame`.
Every frame names its transfer id and generation so late frames can be fenced.
Link-level frames (never seen by the protocol): `StagingHello` (shm sender -> receiver: my
credit window), `StagingOffer` (receiver -> sender: the staging segment of that size) and
`SourcePoolHello` (pull sender -> receiver: my pool's segment, sent with the first chunk) and
`SourceBlockGrant` (pull sender -> receiver: the source blocks of the current transfer it may read).
"""

from __future__ import annotations

import msgspec

from pdserve.handoff.manifest import HandoffManifest, IdentityFence


class ManifestFrame(msgspec.Struct, frozen=True, tag=True):
    manifest: HandoffManifest
    capability: bytes | None = None  # the router's signed permission (handoff/trust/capability.py), on a link's first manifest


class ChunkFrame(msgspec.Struct, frozen=True, tag=True):
    transfer_id: str
    fence: IdentityFence
    chunk_id: str
    layer: int
    nbytes: int
    checksum: int
    resend: int = 0  # 0 for the first send; n for the n-th retry of the same chunk
    offset: int = 0  # the chunk's credit range in the window = where it waits in shm staging
    src_blocks: tuple[int, ...] = ()  # pull links only: source blocks the destination copies from


class SealFrame(msgspec.Struct, frozen=True, tag=True):
    transfer_id: str
    fence: IdentityFence
    checksums: dict[str, int]


class ChunkAck(msgspec.Struct, frozen=True, tag=True):
    transfer_id: str
    generation: int
    chunk_id: str
    visible: bool
    reason: str | None = None


class PublishAck(msgspec.Struct, frozen=True, tag=True):
    transfer_id: str
    generation: int
    request_id: str
    published: bool
    reason: str | None = None


class AbortFrame(msgspec.Struct, frozen=True, tag=True):
    transfer_id: str
    generation: int
    reason: str


class StagingHello(msgspec.Struct, frozen=True, tag=True):
    window_bytes: int


class StagingOffer(msgspec.Struct, frozen=True, tag=True):
    shm_name: str
    nbytes: int


class SourcePoolHello(msgspec.Struct, frozen=True, tag=True):
    shm_name: str  # the source's K/V pool segment, which a pull receiver maps read-only
    num_blocks: int
    extra: tuple[tuple[str, int], ...] = ()  # further segments (name, slots): a holder's host tier (segments.py)


class SourceBlockGrant(msgspec.Struct, frozen=True, tag=True):
    transfer_id: str
    blocks: tuple[int, ...]  # source blocks of this transfer the pull receiver may now copy from


Frame = (ManifestFrame | ChunkFrame | SealFrame | ChunkAck | PublishAck | AbortFrame | StagingHello | StagingOffer
         | SourcePoolHello | SourceBlockGrant)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Frame)


def encode_frame(frame: Frame) -> bytes:
    return _encoder.encode(frame)


def decode_frame(data: bytes | memoryview) -> Frame:
    return _decoder.decode(data)
