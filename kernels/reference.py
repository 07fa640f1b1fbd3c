"""Torch reference twins of the attention kernels: readable, per-sequence, no custom ops.

Cache layout (one layer): K and V are `[num_blocks, block_size, num_kv_heads, head_dim]`;
with an fp8 cache, `k_scale`/`v_scale` are `[num_blocks, block_size, num_kv_heads]` float16
(one scale per token per KV head, stored beside the block it describes). A token at
position p of a sequence lives in slot `block_table[p // block_size] * block_size +
p % block_size`. Slot -1 and block id -1 mean padding and are ignored.

This is the code path the engine uses on CPU. Functions only write the cache tensors passed
as outputs (`store_kv`); every other input is left untouched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def is_fp8(dtype: torch.dtype) -> bool:
    """The one answer to "is this an fp8 KV cache?" (a cache with per-token-head scales)."""
    return dtype == FP8_DTYPE
MIN_SCALE = 1e-12  # guards an all-zero token/head against a zero scale


class Workspace:
    """Reusable scratch buffers for gathers. A fresh multi-MiB tensor costs a page fault per
    4 KiB on first touch (large allocations go straight back to the OS when freed), which
    made a decode step's KV gathers 10x slower than the copy itself. One Workspace per model
    runner; buffers grow to the largest request and are reused by every layer and step."""

    def __init__(self, pin_memory: bool = False):
        self._bufs: dict[str, torch.Tensor] = {}
        self.pin_memory = pin_memory  # page-locked CPU buffers (DMA to and from a GPU)

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A `shape` view of buffer `name` with like's dtype and device; valid until the
        next get of the same name."""
        numel = 1
        for n in shape:
            numel *= n
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype \
                or buf.device != like.device:
            buf = self._bufs[name] = torch.empty(max(numel, 1), dtype=like.dtype,
                                                 device=like.device,
                                                 pin_memory=self.pin_memory)
        return buf[:numel].view(shape)


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, workspace: Workspace | None,
                  name: str) -> torch.Tensor:
    """cache[blocks] along dim 0, into a workspace buffer when one is given."""
    if workspace is None:
        return cache.index_select(0, blocks)
    out = workspace.get(name, (blocks.numel(), *cache.shape[1:]), cache)
    return torch.index_select(cache, 0, blocks, out=out)


def gather_dequant(cache: torch.Tensor, scale: torch.Tensor | None, blocks: torch.Tensor,
                   dtype: torch.dtype, workspace: Workspace | None, name: str) -> torch.Tensor:
    """The listed blocks `[n, block_size, heads, dim]`, dequantized to `dtype`."""
    x = gather_blocks(cache, blocks, workspace, name)
    s = None if scale is None else scale.index_select(0, blocks)
    return dequantize(x, s, dtype)


def quantize_fp8(x: torch.Tensor, scale_dtype: torch.dtype = torch.float16
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., head_dim] -> (fp8 values, scale [...] in `scale_dtype`), scale = absmax / 448
    over the finite values of each row (one row = one token's head).

    Values are divided by the *stored* scale (after its rounding to `scale_dtype`), so
    dequantization reproduces exactly what was quantized. Non-finite values cannot poison
    the scale (it ignores them, and it is per token, so other tokens never see them): NaN is
    stored as 0 and +-Inf saturates to +-448 * scale."""
    xf = x.float()
    finite = torch.isfinite(xf)
    absmax = torch.where(finite, xf, torch.zeros_like(xf)).abs().amax(dim=-1)
    tiny = 2.0**-24 if scale_dtype == torch.float16 else MIN_SCALE  # fp16: min subnormal
    # beyond the scale dtype's range (absmax > 2.9e7 for float16) values saturate at +-448
    scale = (absmax / FP8_MAX).clamp(tiny, torch.finfo(scale_dtype).max).to(scale_dtype)
    scaled = xf / scale.float().unsqueeze(-1)
    scaled = torch.nan_to_num(scaled, nan=0.0).clamp(-FP8_MAX, FP8_MAX)
    return scaled.to(torch.float8_e4m3fn), scale


def dequantize(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if scale is None:
        return x.to(dtype)
    return (x.float() * scale.unsqueeze(-1)).to(dtype)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Write key/value `[num_tokens, num_kv_heads, head_dim]` into their slots (quantizing
    to fp8 with per-token-head scales when the cache is fp8). Slots < 0 are skipped."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    if k_scale is None:
        flat_k[slot_mapping] = key.to(k_cache.dtype)
        flat_v[slot_mapping] = value.to(v_cache.dtype)
        return
    qk, sk = quantize_fp8(key, k_scale.dtype)
    qv, sv = quantize_fp8(value, v_scale.dtype)
    flat_k[slot_mapping] = qk
    flat_v[slot_mapping] = qv
    k_scale.view(-1, k_scale.shape[-1])[slot_mapping] = sk
    v_scale.view(-1, v_scale.shape[-1])[slot_mapping] = sv


def gather_kv(cache: torch.Tensor, scale: torch.Tensor | None, block_table: torch.Tensor,
              num_tokens: int, dtype: torch.dtype, workspace: Workspace | None = None,
              name: str = "kv") -> torch.Tensor:
    """The first `num_tokens` tokens of one sequence, `[num_tokens, num_kv_heads, head_dim]`."""
    block_size = cache.shape[1]
    blocks = block_table[: -(-num_tokens // block_size)].clamp_min(0)
    return gather_dequant(cache, scale, blocks, dtype, workspace, name).flatten(0, 1)[:num_tokens]


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, query_start_loc: list[int],
                      seq_lens: list[int], softmax_scale: float,
                      k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None,
                      workspace: Workspace | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole cached context.

    q: `[num_tokens, num_heads, head_dim]`, sequences packed back to back; sequence i owns
    rows `query_start_loc[i]:query_start_loc[i+1]`, which are the last of its `seq_lens[i]`
    tokens (the ones before are a cached prefix or earlier chunks). The new tokens' K/V must
    already be stored. Returns `[num_tokens, num_heads, head_dim]`.
    """
    out = torch.empty_like(q)
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        num_new = end - start
        if num_new == 0:
            continue
        k = gather_kv(k_cache, k_scale, block_tables[i], seq_len, q.dtype, workspace, "k")
        v = gather_kv(v_cache, v_scale, block_tables[i], seq_len, q.dtype, workspace, "v")
        qi = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        ki, vi = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        if num_new == seq_len:
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=softmax_scale,
                                               enable_gqa=True)
        else:
            # query j sits at absolute position seq_len - num_new + j and sees keys <= it.
            qpos = torch.arange(seq_len - num_new, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= qpos[:, None]
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=softmax_scale,
                                               enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1)
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, softmax_scale: float,
                    k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None,
                    workspace: Workspace | None = None) -> torch.Tensor:
    """Decode attention: one query token per sequence, `q` `[num_seqs, num_heads, head_dim]`,
    over `seq_lens[i]` cached tokens (its own K/V included). Rows with seq_len 0 (padding)
    return zeros. Vectorised over the batch: blocks are gathered to `[num_seqs, max_len]`
    and positions past each length are masked."""
    num_seqs, num_heads, head_dim = q.shape
    if num_seqs == 0:
        return torch.empty_like(q)
    block_size = k_cache.shape[1]
    shared = shared_prefix_blocks(block_tables, seq_lens, block_size)
    if shared >= CASCADE_MIN_BLOCKS:
        return _cascade(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, k_scale,
                        v_scale, workspace, shared)
    max_len = int(seq_lens.max())
    tables = block_tables[:, : -(-max_len // block_size)].clamp_min(0)
    flat = tables.flatten()  # index_select: a plain gather, far cheaper than cache[tables]

    def gather(cache, scale, name):
        x = gather_dequant(cache, scale, flat, q.dtype, workspace, name)
        x = x.view(num_seqs, -1, *cache.shape[2:])
        return x[:, :max_len].transpose(1, 2)  # [B, Hkv, L, D]

    k, v = gather(k_cache, k_scale, "k"), gather(v_cache, v_scale, "v")
    valid = torch.arange(max_len, device=q.device)[None, :] < seq_lens[:, None]
    mask = valid[:, None, None, :] | (seq_lens[:, None, None, None] == 0)  # no all-masked rows
    # GQA: the query heads sharing a KV head become that head's "query rows", so each KV
    # head is read once (2-3x faster on CPU than enable_gqa's head expansion).
    num_kv_heads = k.shape[1]
    qg = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=softmax_scale)
    o = o.reshape(num_seqs, num_heads, head_dim)
    return torch.where((seq_lens > 0)[:, None, None], o, torch.zeros_like(o))


CASCADE_MIN_BLOCKS = 16  # below this a shared prefix is not worth a separate pass


def shared_prefix_blocks(block_tables: torch.Tensor, seq_lens: torch.Tensor,
                         block_size: int) -> int:
    """Leading blocks that every sequence of the batch has, physically the same (a pinned
    system prompt, a forked history): full blocks only."""
    if block_tables.shape[0] < 2:
        return 0
    same = (block_tables == block_tables[:1]).all(dim=0)
    leading = int(same.long().cumprod(0).sum())
    return min(leading, int(seq_lens.min()) // block_size)


# PyTorch's CPU flash-attention kernel (what SDPA runs on CPU) also returns the log-sum-exp
# that merging partial results needs; it reads strided K/V in place, where matmul on the
# gathered [B, L, H, D] -> [B, H, L, D] views first copies them (3x slower per decode step).
# A private op: when a PyTorch build lacks it, the matmul path below is used.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _attend(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention returning (output, log-sum-exp) so partial results can be merged.
    qg [B, H, G, D], k/v [B, H, L, D], mask (bool, True = visible) broadcastable to
    [B, H, G, L]. A row with no visible key gives output 0 and log-sum-exp -inf."""
    if _FLASH_CPU is not None and qg.device.type == "cpu" and qg.dtype == torch.float32:
        bias = None if mask is None else torch.zeros(mask.shape, dtype=qg.dtype).masked_fill_(
            ~mask, float("-inf"))
        o, lse = _FLASH_CPU.default(qg, k, v, 0.0, False, attn_mask=bias, scale=scale)
        lse = lse.unsqueeze(-1)
        if mask is not None:  # the kernel reports 0, not -inf, for a fully masked row
            lse = torch.where(mask.any(dim=-1, keepdim=True), lse, float("-inf"))
        return o, lse
    s = torch.matmul(qg, k.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    o = torch.matmul(p, v) / denom.clamp_min(torch.finfo(p.dtype).tiny)
    lse = torch.where(denom > 0, m + torch.log(denom.clamp_min(torch.finfo(p.dtype).tiny)),
                      torch.full_like(m, float("-inf")))
    return o, lse


def _cascade(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale,
             workspace, shared: int) -> torch.Tensor:
    """Decode attention in two parts merged by log-sum-exp: the batch's shared prefix,
    gathered and read once for every query, then each sequence's own suffix. With a pinned
    system prompt under many sessions this halves the bytes a decode step moves."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    dtype = torch.float32

    def gather(cache, scale_t, ids, name):
        return gather_dequant(cache, scale_t, ids, dtype, workspace, name)

    # shared part: [Hkv, B*G, D] x [Hkv, Ls, D]
    ids = block_tables[0, :shared].clamp_min(0)
    ks = gather(k_cache, k_scale, ids, "k").flatten(0, 1).transpose(0, 1)
    vs = gather(v_cache, v_scale, ids, "v").flatten(0, 1).transpose(0, 1)
    qh = q.to(dtype).view(num_seqs, num_kv_heads, group, head_dim)
    qs = qh.permute(1, 0, 2, 3).reshape(num_kv_heads, num_seqs * group, head_dim)
    o1, lse1 = (x[0] for x in _attend(qs[None], ks[None], vs[None], scale, None))
    o1 = o1.view(num_kv_heads, num_seqs, group, head_dim).permute(1, 0, 2, 3)
    lse1 = lse1.view(num_kv_heads, num_seqs, group, 1).permute(1, 0, 2, 3)
    # suffixes: [B, Hkv, G, D] x [B, Hkv, Lmax, D]
    rest = seq_lens - shared * block_size
    max_rest = int(rest.max())
    if max_rest == 0:
        return o1.reshape(num_seqs, num_heads, head_dim).to(q.dtype)
    tables = block_tables[:, shared: shared + -(-max_rest // block_size)].clamp_min(0)
    flat = tables.flatten()
    kr = gather(k_cache, k_scale, flat, "k").view(num_seqs, -1, num_kv_heads, head_dim)
    vr = gather(v_cache, v_scale, flat, "v").view(num_seqs, -1, num_kv_heads, head_dim)
    kr, vr = kr[:, :max_rest].transpose(1, 2), vr[:, :max_rest].transpose(1, 2)
    mask = (torch.arange(max_rest, device=q.device)[None, :] < rest[:, None])[:, None, None]
    o2, lse2 = _attend(qh, kr, vr, scale, mask)
    lse = torch.logaddexp(lse1, lse2)
    o = o1 * torch.exp(lse1 - lse) + o2 * torch.exp(lse2 - lse)
    return o.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor,
                dst_ids: torch.Tensor) -> None:
    """dst[:, dst_ids] = src[:, src_ids] for caches whose dim 1 is the block id (all layers at
    once); used for copy-on-write and for moves between pools / staging buffers."""
    dst[:, dst_ids] = src[:, src_ids].to(dst.device)
