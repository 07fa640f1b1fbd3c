"""The single attention entry point of the model: explicit metadata in, backend dispatch.

The model calls `attention(q, k, v, layer_kv, meta)` once per layer. It stores the new K/V
in their cache slots, then attends over the paged cache. No globals: everything a backend
needs is in `AttentionMetadata`, built by the runner for one step and valid for that step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvsession.cache.kv_pool import LayerKV
from kvsession.config import AttentionBackend
from kvsession.kernels import reference


@dataclass(frozen=True)
class AttentionMetadata:
    """One step's batch layout. Tokens of all sequences are packed back to back.

    slot_mapping: [num_tokens] cache slot of each new token (-1: do not store).
    block_tables: [num_seqs, max_blocks] block ids per sequence (-1 padded).
    query_start_loc: num_seqs + 1 offsets of each sequence's tokens in the packed batch.
    seq_lens: per sequence, context length after this step (cached + new tokens).
    seq_lens_tensor: seq_lens as a device tensor (decode kernels read it).
    decode_only: every sequence has exactly one new token (the vectorised decode path).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: list[int]
    seq_lens: list[int]
    seq_lens_tensor: torch.Tensor
    decode_only: bool
    softmax_scale: float
    backend: AttentionBackend = AttentionBackend.TORCH
    workspace: reference.Workspace | None = None  # the runner's reusable gather buffers


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_kv: LayerKV,
              meta: AttentionMetadata) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim].
    Mutates the layer's cache slots of this step's tokens; returns [num_tokens, heads, dim]."""
    reference.store_kv(k, v, layer_kv.k, layer_kv.v, meta.slot_mapping,
                       layer_kv.k_scale, layer_kv.v_scale)
    if meta.decode_only:
        return reference.paged_attention(q, layer_kv.k, layer_kv.v, meta.block_tables,
                                         meta.seq_lens_tensor, meta.softmax_scale,
                                         layer_kv.k_scale, layer_kv.v_scale, meta.workspace)
    return reference.prefill_attention(q, layer_kv.k, layer_kv.v, meta.block_tables,
                                       meta.query_start_loc, meta.seq_lens,
                                       meta.softmax_scale, layer_kv.k_scale, layer_kv.v_scale,
                                       meta.workspace)
