"""The single attention entry point of the model: explicit metadata in, backend dispatch.

The model calls `attention(q, k, v, layer_kv, meta)` once per layer. It stores the new K/V
in their cache slots, then attends over the paged cache. No globals: everything a backend
needs is in `AttentionMetadata`, built by the runner for one step and valid for that step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvsession.cache.kv_pool import LayerKV
from kvsession.config import AttentionBackend
from kvsession.kernels import cpu_decode, reference


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
    query_start_loc_tensor: torch.Tensor | None = None  # device int64 (Triton kernels)
    max_query_len: int = 0
    on_layer_done: object = None  # called with each layer index once its KV is written
    all_slots_valid: bool = False  # no slot is -1 (skips a check per layer)
    # per-step scratch the layers share: how the torch backend reads the block tables is
    # worked out by the first layer (reference.plan_decode) and reused by the others
    memo: dict = field(default_factory=dict)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_kv: LayerKV,
              meta: AttentionMetadata) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim].
    Mutates the layer's cache slots of this step's tokens; returns [num_tokens, heads, dim]."""
    if meta.backend == AttentionBackend.TRITON:
        return _triton_attention(q, k, v, layer_kv, meta)
    if meta.decode_only and meta.backend == AttentionBackend.CPU and \
            cpu_decode.applies(q, layer_kv.k, layer_kv.v, layer_kv.k_scale):
        return _cpu_decode(q, k, v, layer_kv, meta)  # the kernel stores the new K/V too
    reference.store_kv(k, v, layer_kv.k, layer_kv.v, meta.slot_mapping,
                       layer_kv.k_scale, layer_kv.v_scale, meta.all_slots_valid)
    if meta.decode_only:
        return reference.paged_attention(q, layer_kv.k, layer_kv.v, meta.block_tables,
                                         meta.seq_lens_tensor, meta.softmax_scale,
                                         layer_kv.k_scale, layer_kv.v_scale, meta.workspace,
                                         meta.memo)
    return reference.prefill_attention(q, layer_kv.k, layer_kv.v, meta.block_tables,
                                       meta.query_start_loc, meta.seq_lens,
                                       meta.softmax_scale, layer_kv.k_scale, layer_kv.v_scale,
                                       meta.workspace, meta.memo)


def _cpu_decode(q, k, v, layer_kv: LayerKV, meta: AttentionMetadata) -> torch.Tensor:
    """The CPU kernel stores the step's K/V rows (one per sequence) at their slots, then
    attends: as in the batch-1 step's op, no separate index_copy_ per layer."""
    shared = meta.memo.get("cpu_shared")
    if shared is None:  # once per step: the layers share the table
        shared = meta.memo["cpu_shared"] = reference.shared_prefix_blocks(
            meta.block_tables, meta.seq_lens_tensor, layer_kv.k.shape[1])
    dtype = layer_kv.k.dtype
    return cpu_decode.paged_attention(cpu_decode.load(dtype=dtype), q, layer_kv.k, layer_kv.v,
                                      meta.block_tables, meta.seq_lens_tensor,
                                      meta.softmax_scale, shared,
                                      cpu_decode.store_rows(k, v, meta.slot_mapping, dtype))


def _triton_attention(q, k, v, layer_kv: LayerKV, meta: AttentionMetadata) -> torch.Tensor:
    from kvsession.kernels.paged_attention import paged_attention
    from kvsession.kernels.prefill_attention import prefill_attention
    from kvsession.kernels.store_kv import store_kv

    # k and v are views into different buffers (rotated q/k, fused qkv): the kernel wants
    # them with equal strides, which one stacked copy gives (whatever the token count)
    k, v = torch.stack((k, v)).unbind(0)
    store_kv(k, v, layer_kv.k, layer_kv.v, meta.slot_mapping, layer_kv.k_scale,
             layer_kv.v_scale)
    q = q.contiguous()
    if meta.decode_only:
        return paged_attention(q, layer_kv.k, layer_kv.v, meta.block_tables,
                               meta.seq_lens_tensor, meta.softmax_scale, layer_kv.k_scale,
                               layer_kv.v_scale)
    return prefill_attention(q, layer_kv.k, layer_kv.v, meta.block_tables,
                             meta.query_start_loc_tensor, meta.seq_lens_tensor,
                             meta.softmax_scale, layer_kv.k_scale, layer_kv.v_scale,
                             meta.max_query_len)


def resolve_backend(requested: AttentionBackend, device: torch.device,
                    block_size: int) -> AttentionBackend:
    """auto -> the Triton kernels on CUDA (when triton is installed and the block size
    suits them); on CPU the torch reference with decode attention by the C++ kernel ("cpu")
    when it builds here, else the torch reference alone. An explicit "triton" on CPU runs
    the kernels under Triton's interpreter (TRITON_INTERPRET=1, set here if no kernel
    module has been compiled for the GPU yet)."""
    import importlib.util
    import os
    import sys

    from kvsession.errors import ConfigError

    if requested == AttentionBackend.TORCH:
        return requested
    if requested == AttentionBackend.CPU or (requested == AttentionBackend.AUTO
                                             and device.type == "cpu"):
        if device.type != "cpu":
            raise ConfigError(f"attention_backend='cpu' runs on the CPU, not on {device}")
        if cpu_decode.load() is not None:
            return AttentionBackend.CPU
        if requested == AttentionBackend.CPU:
            raise ConfigError("attention_backend='cpu' needs its kernel built with a C++ "
                              "compiler ($CXX, g++, c++ or clang++; the log says why it "
                              "failed); 'torch' runs without one")
        return AttentionBackend.TORCH
    have_triton = importlib.util.find_spec("triton") is not None
    fits = block_size >= 16
    if requested == AttentionBackend.AUTO:
        ok = device.type == "cuda" and have_triton and fits
        return AttentionBackend.TRITON if ok else AttentionBackend.TORCH
    if not have_triton:
        raise ConfigError("attention_backend='triton' needs the triton package "
                          "(pip install 'kvsession[cuda]'); accepted: ['auto', 'torch']")
    if not fits:
        raise ConfigError(f"attention_backend='triton' needs block_size >= 16, got {block_size}")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        if any(m.startswith("kvsession.kernels.") and m != "kvsession.kernels.reference"
               and m != "kvsession.kernels.checks" for m in sys.modules):
            raise ConfigError("attention_backend='triton' on CPU needs TRITON_INTERPRET=1 "
                              "set before the kernels are first imported")
        os.environ["TRITON_INTERPRET"] = "1"
    return requested
