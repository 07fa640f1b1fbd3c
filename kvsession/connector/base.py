"""Remote prefill: the control-plane messages and the two small interfaces, one per side.

Caller side (`PrefillConnector`): the engine asks a worker to compute the KV of a
sequence's first `num_tokens` tokens and write it into the caller's blocks
`block_ids[first_block:]` (blocks before `first_block` are the caller's own prefix hits and
are never sent). The engine thread calls `submit` and `poll`; nothing else mutates the
connector. Blocks of a request stay referenced by the engine until `poll` reports the
request done, or reports it failed *and fenced* (no remote write can touch them any more).

Worker side (`PrefillService`, implemented by the worker application `kvsession.worker`):
accepts a handshake, then prefill requests, and writes the KV with its data plane (NIXL)
before answering.

Messages are msgspec msgpack structs (tagged union): no pickle, nothing executable.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import msgspec

from kvsession.cache.hashing import CacheIdentity

PROTOCOL_VERSION = 1


class TensorDesc(msgspec.Struct, frozen=True):
    """One registered KV tensor of the caller: [num_layers, num_blocks, *block], block id in
    dim 1, contiguous."""

    name: str
    addr: int
    num_layers: int
    num_blocks: int
    block_bytes: int
    mem_type: str = "DRAM"  # NIXL memory type: "DRAM" (host) or "VRAM" (GPU)
    device_id: int = 0


class Hello(msgspec.Struct, tag=True):
    compat: str
    agent_name: str
    agent_metadata: bytes
    tensors: list[TensorDesc]


class HelloOk(msgspec.Struct, tag=True):
    agent_name: str


class Refused(msgspec.Struct, tag=True):
    reason: str


class PrefillRequest(msgspec.Struct, tag=True):
    req_id: int
    token_ids: list[int]  # exactly the tokens whose KV is wanted
    first_block: int
    block_ids: list[int]  # the caller's blocks for blocks first_block.. of the sequence
    cache_salt: str | None = None


class PrefillDone(msgspec.Struct, tag=True):
    req_id: int
    num_bytes: int
    seconds: float


class PrefillFailed(msgspec.Struct, tag=True):
    req_id: int
    reason: str


class Ping(msgspec.Struct, tag=True):
    t: float


class Pong(msgspec.Struct, tag=True):
    t: float


class Bye(msgspec.Struct, tag=True):
    pass


Message = Hello | HelloOk | Refused | PrefillRequest | PrefillDone | PrefillFailed | Ping | \
    Pong | Bye
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    """Raises msgspec.DecodeError / ValidationError on anything malformed."""
    return _decoder.decode(data)


def compat_hash(identity: CacheIdentity) -> str:
    """Both sides must agree on this before any KV moves: the cache identity (model, kv
    dtype, block size, layout) and the protocol version."""
    return identity.digest(PROTOCOL_VERSION)


@dataclass(frozen=True)
class Completion:
    """What `PrefillConnector.poll` reports about one request.

    kind: "done" (the KV is in the caller's blocks), "failed" (prefill it locally; `fenced`
    says whether its blocks may be reused now), or "fenced" (a request that failed earlier
    can no longer be written to: release its quarantined blocks)."""

    seq_id: int
    kind: str
    reason: str = ""
    fenced: bool = True
    num_bytes: int = 0
    seconds: float = 0.0


class PrefillConnector(abc.ABC):
    """Caller side. Used only from the engine thread."""

    @abc.abstractmethod
    def healthy(self) -> bool:
        """At least one worker has completed the handshake and answers heartbeats."""

    @abc.abstractmethod
    def submit(self, seq_id: int, token_ids: list[int], first_block: int,
               block_ids: list[int], affinity: bytes, cache_salt: str | None) -> bool:
        """Ask a worker (chosen by `affinity`, e.g. the first block hash) to write the KV of
        `token_ids` into `block_ids` (blocks first_block..). False: no worker can take it
        (prefill locally; nothing was sent)."""

    @abc.abstractmethod
    def poll(self, timeout_s: float = 0.0) -> list[Completion]:
        """Drive progress, heartbeats and timeouts; return what completed."""

    @abc.abstractmethod
    def close(self) -> None:
        """Say goodbye to the workers and release every registration."""


class PrefillService(abc.ABC):
    """Worker side."""

    @abc.abstractmethod
    def handshake(self, caller: str, hello: Hello) -> HelloOk | Refused:
        """Accept a caller (register its agent) or refuse it with a reason."""

    @abc.abstractmethod
    def prefill(self, caller: str, request: PrefillRequest) -> PrefillDone | PrefillFailed:
        """Compute the KV and write it into the caller's blocks; answer only when every
        write has completed."""

    @abc.abstractmethod
    def disconnect(self, caller: str) -> None:
        """Forget a caller (its agent metadata and any state)."""
