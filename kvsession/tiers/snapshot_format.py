"""The `.kvs` session snapshot format in one place: its layout constants, the typed schema
of its header and the bounds every field is checked against. The writer
(tiers/snapshot.py), the reader (tiers/snapshot_read.py), the session log (tiers/wal.py,
which stores the same sampling and history fields) and the KV segments (tiers/segments.py,
whose blocks are snapshot chunks) all take them from here.

Layout (little endian; docs/snapshot-format.md):

    MAGIC (8) | u32 format version
    block chunks: for each KV block, safetensors({name: [num_layers, block_size, ...]}),
        lz4-frame compressed (codec "lz4") or stored as is (codec "none")
    header: msgspec JSON of SnapshotHeader
    footer: u64 header length | u32 crc32(header) | END_MAGIC (8)

The reader decodes the header in stages (SnapshotFrame: scalars first, every
variable-length field raw), so the bounds below are checked before anything large is
built.
"""

from __future__ import annotations

import functools
import json
import struct
from typing import Annotated, Literal

import msgspec
import torch

MAGIC = b"KVSNAP\x00\x01"
END_MAGIC = b"KVSEND\x00\x01"
FORMAT_VERSION = 1
FOOTER = struct.Struct("<QI")
PREFIX_LEN = len(MAGIC) + 4
FOOTER_LEN = FOOTER.size + len(END_MAGIC)
# a header of 64 MiB holds millions of tokens; the reader refuses larger ones unread
MAX_HEADER_BYTES = 64 << 20
# session ids name files (`<id>.kvs`): validated where they enter, and in every header read
SESSION_ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
# `.<target name>.<pid>.<8 hex>.tmp`: a snapshot (or a session log or segment being
# rewritten) being written (see write_snapshot, tiers/commit.py)


class Chunk(msgspec.Struct, frozen=True):
    offset: Annotated[int, msgspec.Meta(ge=0)]
    length: Annotated[int, msgspec.Meta(ge=1)]
    raw_length: Annotated[int, msgspec.Meta(ge=1)]
    crc32: Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]
    codec: Literal["lz4", "none"] = "lz4"


class SnapshotHeader(msgspec.Struct, frozen=True):
    format_version: int
    session_id: str
    created_unix_s: float
    model_fingerprint: str
    tokenizer_digest: str
    template_digest: str
    kv_dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tensor_names: list[str]
    token_ids: list[int]          # tokens whose KV the chunks hold, in order
    messages: list[dict]
    sampling: dict
    system: str | None
    block_hashes: list[str]       # hex, one per full block
    chunks: list[Chunk]           # one per block (the last may be partial)
    # the session's history (kvsession/history.py): {"mode": "append"|"template", "log":
    # the token log, "pending": messages not rendered into it yet}; None in files written
    # before it existed (template mode)
    history: dict | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.chunks)


def snapshot_prefix(h: SnapshotHeader, tokens, bs: int) -> int:
    """How many of `tokens` the snapshot `h` holds the KV of: whole matching blocks from
    the first, and its partial last block when every token it holds matches."""
    covered = 0
    for i in range(h.num_blocks):
        lo, hi = i * bs, min((i + 1) * bs, len(h.token_ids))
        if hi > len(tokens) or list(h.token_ids[lo:hi]) != list(tokens[lo:hi]):
            break
        covered = hi
    return covered


# a message renders into tokens, except a few added after the last turn (tool results)
# or dropped by a template: at most this many beyond one per token. It bounds the dicts a
# header can make (a minimal message is 24 bytes of JSON but some 300 bytes of objects)
MAX_EXTRA_MESSAGES = 4096
MAX_SAMPLING_BYTES = 1 << 20  # a response_format's schema or grammar is in it
MAX_GEOMETRY = 1 << 16  # layers, KV heads, head dim (far above any model)
MAX_BLOCK_SIZE = 1024  # as EngineConfig allows
MAX_TOKEN_ID = 1 << 31
TOKEN_ID_BYTES = len(str(MAX_TOKEN_ID)) + 1  # the longest id and its comma
HASH_BYTES = 64 + 3  # a quoted hex sha256 and its comma
KV_TENSOR_SETS = ({"k", "v"}, {"k", "v", "k_scale", "v_scale"})

Geometry = Annotated[int, msgspec.Meta(ge=1, le=MAX_GEOMETRY)]
Digest = Annotated[str, msgspec.Meta(max_length=256)]
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=MAX_TOKEN_ID)]
HexHash = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]


class StoredIdentity(msgspec.Struct, frozen=True):
    """What a stored file says it was written for, typed and bounded: the engine's
    StorageIdentity as files record it. The session log records these fields (its
    Identity); snapshots and segments add the block geometry (StoredGeometry). Fields in
    this order: a log's identity digest is over their encoding."""

    model_fingerprint: Digest
    tokenizer_digest: Digest
    template_digest: Digest
    kv_dtype: Annotated[str, msgspec.Meta(max_length=32)]
    block_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCK_SIZE)]


class StoredGeometry(StoredIdentity, frozen=True):
    """StoredIdentity and the geometry of a block (snapshot headers, segment identities)."""

    num_layers: Geometry
    num_kv_heads: Geometry
    head_dim: Geometry


class SnapshotFrame(StoredGeometry, frozen=True):
    """Stage one of a header: its scalars, each within bounds; variable-length fields raw."""

    format_version: int
    session_id: Annotated[str, msgspec.Meta(pattern=f"^{SESSION_ID_PATTERN}$")]
    created_unix_s: Annotated[float, msgspec.Meta(ge=0.0, le=1e11)]
    tensor_names: msgspec.Raw
    token_ids: msgspec.Raw
    messages: msgspec.Raw
    sampling: msgspec.Raw
    system: msgspec.Raw
    block_hashes: msgspec.Raw
    chunks: msgspec.Raw
    history: msgspec.Raw = msgspec.Raw(b"null")


MAX_LOG_TOKENS = 1 << 22  # a session's token log (max_model_len is far below)


class HistoryState(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A session's history as snapshots and logs store it: the mode, the token log (append
    mode: what the session's next turn extends) and how many trailing messages are not
    rendered into it yet (added without a reply)."""

    mode: Literal["append", "template"]
    log: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_LOG_TOKENS)] = []
    pending: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)] = 0
    # the session's tools and chat_template_kwargs as JSON text ("" when none): what its
    # template renders with
    tools: Annotated[str, msgspec.Meta(max_length=1 << 20)] = ""
    template_kwargs: Annotated[str, msgspec.Meta(max_length=1 << 16)] = ""


class SamplingFields(msgspec.Struct):
    """The session's sampling defaults as a header stores them: exact types, each optional
    (the store validates the values through SamplingParams)."""

    max_tokens: int | msgspec.UnsetType = msgspec.UNSET
    temperature: float | msgspec.UnsetType = msgspec.UNSET
    top_p: float | msgspec.UnsetType = msgspec.UNSET
    top_k: int | msgspec.UnsetType = msgspec.UNSET
    seed: int | None | msgspec.UnsetType = msgspec.UNSET
    stop: str | list[str] | None | msgspec.UnsetType = msgspec.UNSET
    stop_token_ids: list[int] | None | msgspec.UnsetType = msgspec.UNSET
    ignore_eos: bool | msgspec.UnsetType = msgspec.UNSET
    logprobs: int | None | msgspec.UnsetType = msgspec.UNSET
    cache_salt: str | None | msgspec.UnsetType = msgspec.UNSET
    min_p: float | msgspec.UnsetType = msgspec.UNSET
    min_tokens: int | msgspec.UnsetType = msgspec.UNSET
    repetition_penalty: float | msgspec.UnsetType = msgspec.UNSET
    presence_penalty: float | msgspec.UnsetType = msgspec.UNSET
    frequency_penalty: float | msgspec.UnsetType = msgspec.UNSET
    logit_bias: list[tuple[int, float]] | None | msgspec.UnsetType = msgspec.UNSET
    # a StructuredOutput's fields (json_schema as canonical JSON text)
    structured: dict[str, str | bool | None] | None | msgspec.UnsetType = msgspec.UNSET


SAMPLING_FIELD_NAMES = SamplingFields.__struct_fields__


_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
              torch.float8_e4m3fn: "F8_E4M3"}


def block_prefix(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> bytes:
    """The bytes before the data of a block chunk holding tensors of these shapes (sorted by
    name): u64 header length and the JSON header, padded to 8 bytes."""
    return _block_prefix(tuple(sorted((n, tuple(s), d) for n, (s, d) in shapes.items())))


@functools.lru_cache(maxsize=64)  # every block of a pool has the same layout
def _block_prefix(shapes: tuple) -> bytes:
    header, offset = {}, 0
    for name, shape, dtype in shapes:
        n = torch.empty((), dtype=dtype).element_size()
        for x in shape:
            n *= x
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    return struct.pack("<Q", len(hb)) + hb
