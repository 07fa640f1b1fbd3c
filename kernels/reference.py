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

from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def is_fp8(dtype: torch.dtype) -> bool:
    """The one answer to "is this an fp8 KV cache?" (a cache with per-token-head scales)."""
    return dtype == FP8_DTYPE


def raw_view(t: torch.Tensor) -> torch.Tensor:
    """A byte view of an fp8 tensor, bits unchanged (some copy kernels, and numpy, have no
    fp8); any other tensor as it is."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


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
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
             all_valid: bool = False) -> None:
    """Write key/value `[num_tokens, num_kv_heads, head_dim]` into their slots (quantizing
    to fp8 with per-token-head scales when the cache is fp8). Slots < 0 are skipped;
    `all_valid`: the caller knows there are none (saves a check per layer)."""
    if not all_valid:
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    if k_scale is None:  # index_copy_: row copies, cheaper than indexed assignment
        flat_k.index_copy_(0, slot_mapping, key.to(k_cache.dtype))
        flat_v.index_copy_(0, slot_mapping, value.to(v_cache.dtype))
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
                      workspace: Workspace | None = None,
                      memo: dict | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole cached context.

    q: `[num_tokens, num_heads, head_dim]`, sequences packed back to back; sequence i owns
    rows `query_start_loc[i]:query_start_loc[i+1]`, which are the last of its `seq_lens[i]`
    tokens (the ones before are a cached prefix or earlier chunks). The new tokens' K/V must
    already be stored. Returns `[num_tokens, num_heads, head_dim]`.

    Sequences with a single new token (decodes batched with prefills) go through
    `paged_attention` together, block by block; `memo` as there.
    """
    out = torch.empty_like(q)
    single = [i for i, n in enumerate(seq_lens)
              if n > 0 and query_start_loc[i + 1] - query_start_loc[i] == 1]
    if single:
        rows = torch.tensor([query_start_loc[i] for i in single], device=q.device)
        ids = torch.tensor(single, device=q.device)
        out[rows] = paged_attention(q[rows], k_cache, v_cache, block_tables[ids],
                                    torch.tensor([seq_lens[i] for i in single], device=q.device),
                                    softmax_scale, k_scale, v_scale, workspace, memo)
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        num_new = end - start
        if num_new == 0 or (num_new == 1 and seq_len > 0):
            continue
        first = _first_of_run(block_tables[i], seq_len, k_cache.shape[1], memo, i) \
            if k_scale is None and k_cache.dtype == q.dtype else None
        if first is not None:  # one run of blocks: the context is a view of the cache
            ki, vi = _run_view(k_cache, first, seq_len), _run_view(v_cache, first, seq_len)
        else:
            k = gather_kv(k_cache, k_scale, block_tables[i], seq_len, q.dtype, workspace, "k")
            v = gather_kv(v_cache, v_scale, block_tables[i], seq_len, q.dtype, workspace, "v")
            ki, vi = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        qi = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if num_new == seq_len:
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=softmax_scale,
                                               enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(qi, ki, vi, scale=softmax_scale, enable_gqa=True,
                                               attn_mask=_chunk_mask(num_new, seq_len, q.device,
                                                                     memo, i))
        out[start:end] = o[0].transpose(0, 1)
    return out


def _first_of_run(table_row: torch.Tensor, num_tokens: int, block_size: int,
                  memo: dict | None, i: int) -> int | None:
    """The first block id when the blocks holding a sequence's first num_tokens tokens are
    consecutive ids (one run, as a fresh prefill or a load from disk usually allocates
    them): its context is then a view of each layer's cache (_run_view), not a gather (a
    copy of the whole context per layer). Worked out once per step: every layer reads the
    same table."""
    key = ("prefill_run", i)
    if memo is not None and key in memo:
        return memo[key]
    runs = _runs(table_row[: -(-num_tokens // block_size)].tolist())
    first = runs[0][0] if runs is not None and len(runs) == 1 and runs[0][0] >= 0 else None
    if memo is not None:
        memo[key] = first
    return first


def _chunk_mask(num_new: int, seq_len: int, device, memo: dict | None, i: int
                ) -> torch.Tensor:
    """[num_new, seq_len] visibility of a chunk after a cached prefix: query j sits at
    position seq_len - num_new + j and sees keys <= it (built once per step)."""
    key = ("prefill_mask", i)
    if memo is not None and key in memo:
        return memo[key]
    qpos = torch.arange(seq_len - num_new, seq_len, device=device)
    mask = torch.arange(seq_len, device=device)[None, :] <= qpos[:, None]
    if memo is not None:
        memo[key] = mask
    return mask


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, softmax_scale: float,
                    k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None,
                    workspace: Workspace | None = None,
                    memo: dict | None = None) -> torch.Tensor:
    """Decode attention: one query token per sequence, `q` `[num_seqs, num_heads, head_dim]`,
    over `seq_lens[i]` cached tokens (its own K/V included). Rows with seq_len 0 (padding)
    return zeros.

    The cache is read block by block, never gathered whole: runs of consecutive block ids
    are attended in place (views of the cache), other blocks a few at a time through a
    small buffer, and the partial results are merged by log-sum-exp (an online softmax over
    the block table). Leading blocks that the whole batch shares (a pinned system prompt)
    are read once for every query (cascade). How the table is read (`plan_decode`) is
    worked out on the first call and kept in `memo`, a dict the layers of one step share.
    """
    num_seqs, num_heads, head_dim = q.shape
    if num_seqs == 0:
        return torch.empty_like(q)
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    in_place = in_place_ok(q.dtype, k_cache.dtype, k_scale)
    key = ("decode", in_place)  # a cache of another dtype (a shadow copy) plans apart
    plan = None if memo is None else memo.get(key)
    if plan is None:
        plan = plan_decode(block_tables, seq_lens, k_cache.shape[1], in_place,
                           k_cache.element_size() * num_kv_heads * head_dim)
        if memo is not None:
            memo[key] = plan
    # GQA: the query heads sharing a KV head become that head's "query rows", so each KV
    # head is read once: qg [B, Hkv, G, D]. Float32 throughout: gathered blocks are
    # dequantized to it, and blocks read in place are float32 already.
    qg = q.view(num_seqs, num_kv_heads, group, head_dim).float()
    kv = (k_cache, v_cache, k_scale, v_scale)
    parts = []
    if plan.shared:
        # every query row against the shared blocks: [1, Hkv, B*G, D]
        qs = qg.permute(1, 0, 2, 3).reshape(1, num_kv_heads, num_seqs * group, head_dim)
        ids = block_tables[0, :plan.shared]
        chunk = max(1, CHUNK_BYTES // (k_cache[0].numel() * k_cache.element_size()))
        o, lse = _merge([_attend(qs, k, v, softmax_scale, None) for k, v in _pieces(
            kv, plan.shared_runs, ids, plan.shared * k_cache.shape[1], chunk, workspace)])
        parts.append((o.reshape(num_kv_heads, num_seqs, group, head_dim).transpose(0, 1),
                      lse.reshape(num_kv_heads, num_seqs, group, 1).transpose(0, 1)))
    if max(plan.rest) > 0:
        parts.append(_attend_rest(qg, kv, block_tables, softmax_scale, plan, workspace))
    if not parts:  # nothing but padding
        return torch.zeros_like(q)
    o = _merge(parts)[0].reshape(num_seqs, num_heads, head_dim).to(q.dtype)
    if 0 in plan.lens:  # padded rows: zeros, whatever the merge made of "no key at all"
        o = torch.where((seq_lens > 0)[:, None, None], o, torch.zeros_like(o))
    return o


CASCADE_MIN_BLOCKS = 16  # below this a shared prefix is not worth a separate pass
# Blocks are attended in place, one attention call per run of consecutive block ids, when
# the runs are long enough: at least MIN_RUN_BLOCKS on average (or at most 2 runs); other
# sequences are gathered, all of them read together by one call per chunk. On an Intel
# 2-core machine a call cost about what gathering 4 blocks did and reading in place was ~2x
# faster than gathering then reading; on the AMD EPYC one a call on the engine thread costs
# ~50-100 us (what gathering ~100 blocks costs) and the gathered path read 8 sequences of
# 2,048 tokens in ~4.3 runs each in 32 ms a decode step against 47 ms in place
# (bench/decode_vs_hf.py). 64 keeps a sequence of up to 128 blocks in place only in 1-2 runs.
MIN_RUN_BLOCKS = 64
# K bytes per gathered chunk (as many again for V): a fragmented table is gathered this much
# at a time, so the buffer stays bounded at any context length. Smaller chunks cost more
# calls than they save (measured from 64 KiB to 16 MiB; 4 MiB was as fast as one gather).
CHUNK_BYTES = 4 * 1024 * 1024


@dataclass
class DecodePlan:
    """How a decode step reads the block table; the same for every layer of the step.

    lens: context length of each sequence. shared: leading blocks common to the batch,
    read once (0: no cascade); shared_runs: those blocks as (first block id, count) runs of
    consecutive ids, read in place, or None: gathered. Then the `rest[i]` tokens of
    sequence i: runs[i] lists their (first block id, count, tokens) runs when they are
    read in place, None when they are gathered; the `gathered` sequences are read
    together, `chunk_blocks` table columns at a time, `bias` (additive, -inf past each
    one's end, [len(gathered), 1, 1, max]; None when their ends are equal) masking the
    rest."""

    lens: list[int]
    shared: int
    shared_runs: list[tuple[int, int]] | None
    rest: list[int]
    runs: list[list[tuple[int, int, int]] | None]
    gathered: list[int]
    chunk_blocks: int
    bias: torch.Tensor | None = None
    gathered_rest: torch.Tensor | None = None  # rest of the gathered sequences (tensor)


def in_place_ok(q_dtype: torch.dtype, cache_dtype: torch.dtype,
                scale: torch.Tensor | None) -> bool:
    """Blocks can be attended in place when no conversion is needed (float32 cache and
    queries: what PyTorch's CPU flash kernel takes with strided K/V)."""
    return scale is None and q_dtype == cache_dtype == torch.float32 and _FLASH_CPU is not None


def _runs(ids: list[int]) -> list[tuple[int, int]] | None:
    """(first id, count) runs of consecutive ids; None when they are too short on average
    to be worth one attention call each."""
    runs: list[tuple[int, int]] = []
    limit = max(2, len(ids) // MIN_RUN_BLOCKS)
    for b in ids:
        if runs and b == runs[-1][0] + runs[-1][1]:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            if len(runs) == limit:
                return None
            runs.append((b, 1))
    return runs


def _with_tokens(runs: list[tuple[int, int]], num_tokens: int, block_size: int
                 ) -> list[tuple[int, int, int]]:
    """(first id, count, tokens) for runs covering num_tokens tokens."""
    out, done = [], 0
    for first, count in runs:
        n = min(count * block_size, num_tokens - done)
        out.append((first, count, n))
        done += n
    return out


def plan_decode(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                in_place: bool, token_bytes: int) -> DecodePlan:
    """The DecodePlan of one step (host work: once per step, not per layer). token_bytes:
    bytes of one token's K in one layer (sizes the gathered chunks)."""
    lens = seq_lens.tolist()
    shared = shared_prefix_blocks(block_tables, seq_lens, block_size)
    shared = shared if shared >= CASCADE_MIN_BLOCKS else 0
    rest = [max(n - shared * block_size, 0) for n in lens]
    rows = block_tables.tolist() if in_place else None
    shared_runs = _runs(rows[0][:shared]) if in_place and shared else None
    runs = [_runs(row[shared: shared + -(-r // block_size)]) if r else []
            for row, r in zip(rows, rest, strict=True)] if in_place else [None] * len(lens)
    runs = [None if rs is None else _with_tokens(rs, r, block_size)
            for rs, r in zip(runs, rest, strict=True)]
    gathered = [i for i, (r, n) in enumerate(zip(runs, rest, strict=True)) if r is None and n]
    width = max((rest[i] for i in gathered), default=0)
    chunk_blocks = max(1, CHUNK_BYTES // (max(len(gathered), 1) * block_size * token_bytes))
    plan = DecodePlan(lens, shared, shared_runs, rest, runs, gathered, chunk_blocks)
    if gathered:
        dev = block_tables.device
        plan.gathered_rest = torch.tensor([rest[i] for i in gathered], device=dev)
        if min(rest[i] for i in gathered) < width:
            hidden = torch.arange(width, device=dev)[None, :] >= plan.gathered_rest[:, None]
            plan.bias = torch.zeros(len(gathered), 1, 1, width, device=dev).masked_fill_(
                hidden[:, None, None], float("-inf"))
    return plan


def _run_view(cache: torch.Tensor, first: int, n: int) -> torch.Tensor:
    """Tokens [0, n) of the blocks from `first` on (consecutive ids) as a `[1, Hkv, n, D]`
    view of a layer's cache: one strided view, no copy."""
    _, bs, heads, dim = cache.shape
    return cache.as_strided((1, heads, n, dim), (0, dim, heads * dim, 1),
                            cache.storage_offset() + first * bs * heads * dim)


def _pieces(kv, runs, ids, num_tokens, chunk_blocks, workspace):
    """(K, V) `[1, Hkv, n, D]` pieces covering the first num_tokens tokens of the blocks
    `ids` (one table row): views of the cache for `runs`, else gathered chunks."""
    k_cache, v_cache, k_scale, v_scale = kv
    bs = k_cache.shape[1]
    if runs is not None:
        done = 0
        for first, count in runs:
            n = min(count * bs, num_tokens - done)
            yield _run_view(k_cache, first, n), _run_view(v_cache, first, n)
            done += n
        return
    for a in range(0, -(-num_tokens // bs), chunk_blocks):
        blocks = ids[a: a + chunk_blocks].clamp_min(0)
        n = min(blocks.numel() * bs, num_tokens - a * bs)
        k = gather_dequant(k_cache, k_scale, blocks, torch.float32, workspace, "k")
        v = gather_dequant(v_cache, v_scale, blocks, torch.float32, workspace, "v")
        yield (k.flatten(0, 1)[None, :n].transpose(1, 2),
               v.flatten(0, 1)[None, :n].transpose(1, 2))


def _attend_rest(qg, kv, block_tables, scale, plan, workspace):
    """Each sequence's own tokens (after the shared blocks): (o, lse) for the batch."""
    num_seqs, num_kv_heads, group, head_dim = qg.shape
    k_cache, v_cache = kv[0], kv[1]
    outs: list = [None] * num_seqs
    for i, (runs, r) in enumerate(zip(plan.runs, plan.rest, strict=True)):
        if r == 0:  # nothing after the shared blocks (or padding): no key at all
            outs[i] = (torch.zeros_like(qg[i:i + 1]),
                       torch.full((1, num_kv_heads, group, 1), float("-inf"), device=qg.device))
        elif runs is not None:  # in place: one call per run
            qi, parts = qg[i:i + 1], []
            for first, _, n in runs:
                parts.append(_attend(qi, _run_view(k_cache, first, n),
                                     _run_view(v_cache, first, n), scale, None))
            outs[i] = _merge(parts)
    if plan.gathered:
        o, lse = _attend_gathered(qg, kv, block_tables, scale, plan, workspace)
        if len(plan.gathered) == num_seqs:
            return o, lse
        for j, i in enumerate(plan.gathered):
            outs[i] = (o[j: j + 1], lse[j: j + 1])
    if num_seqs == 1:
        return outs[0]
    return torch.cat([o for o, _ in outs]), torch.cat([lse for _, lse in outs])


def _attend_gathered(qg, kv, block_tables, scale, plan, workspace):
    """The gathered sequences together, chunk by chunk ([n, chunk, Hkv, D] each)."""
    k_cache, v_cache, k_scale, v_scale = kv
    _, num_kv_heads, group, head_dim = qg.shape
    bs, shared, rows = k_cache.shape[1], plan.shared, plan.gathered
    if len(rows) < qg.shape[0]:
        ids = torch.tensor(rows, device=qg.device)
        qg, block_tables = qg[ids], block_tables[ids]
    width = max(plan.rest[i] for i in rows)
    parts = []
    for a in range(0, -(-width // bs), plan.chunk_blocks):
        cols = block_tables[:, shared + a: shared + a + plan.chunk_blocks].clamp_min(0)
        start = a * bs
        n = min(cols.shape[1] * bs, width - start)
        k, v = (gather_dequant(cache, sc, cols.flatten(), torch.float32, workspace, name)
                .view(len(rows), -1, num_kv_heads, head_dim)[:, :n].transpose(1, 2)
                for cache, sc, name in ((k_cache, k_scale, "k"), (v_cache, v_scale, "v")))
        bias = None if plan.bias is None else plan.bias[..., start: start + n]
        if bias is not None:
            # positions past a row's end hold whatever their slots do (-1 padding reads
            # block 0; a last block's unused slots: freed data, an fp8 byte that is NaN).
            # The bias hides them from the softmax, but a NaN key scores NaN through -inf
            # and 0 x a NaN value is NaN: they are zeroed (in the gathered copy, not the cache)
            for j, i in enumerate(rows):
                end = plan.rest[i] - start
                if end < n:
                    k[j, :, max(end, 0):].zero_()
                    v[j, :, max(end, 0):].zero_()
        o, lse = _attend(qg, k, v, scale, bias)
        if min(plan.rest[i] for i in rows) <= start:  # rows past their end see no key here
            lse = lse.masked_fill((plan.gathered_rest <= start)[:, None, None, None],
                                  float("-inf"))
        parts.append((o, lse))
    return _merge(parts)


def _merge(parts: list[tuple[torch.Tensor, torch.Tensor]]
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax results over disjoint key sets merged into the result over their union:
    weights exp(lse_i - lse). Rows that saw no key anywhere (all lse -inf) give 0, -inf."""
    if len(parts) == 1:
        return parts[0]
    lse = torch.stack([p[1] for p in parts])
    m = lse.amax(0)
    m = m.masked_fill(m == float("-inf"), 0.0)
    w = torch.exp(lse - m)
    total = w.sum(0)
    o = (torch.stack([p[0] for p in parts]) * w).sum(0) / total.clamp_min(
        torch.finfo(total.dtype).tiny)
    return o, m + torch.log(total)


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
# that merging partial results needs, and it reads strided K/V in place (a run of blocks is
# a strided view of the cache), where matmul on those views first copies them.
# A private op: when a PyTorch build lacks it, the matmul path below is used.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _attend(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention returning (output, log-sum-exp) so partial results can be merged.
    qg [B, H, G, D], k/v [B, H, L, D], bias (additive: 0 visible, -inf hidden)
    broadcastable to [B, H, G, L]; every row must see at least one key (the callers mark
    rows that see none)."""
    if _FLASH_CPU is not None and qg.device.type == "cpu" and qg.dtype == k.dtype \
            and qg.dtype in (torch.float32, torch.bfloat16, torch.float16):
        o, lse = _FLASH_CPU.default(qg, k, v, 0.0, False, attn_mask=bias, scale=scale)
        return o.float(), lse.unsqueeze(-1)
    s = torch.matmul(qg.float(), k.float().transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    o = torch.matmul(p, v.float()) / denom.clamp_min(torch.finfo(p.dtype).tiny)
    lse = torch.where(denom > 0, m + torch.log(denom.clamp_min(torch.finfo(p.dtype).tiny)),
                      torch.full_like(m, float("-inf")))
    return o, lse


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor,
                dst_ids: torch.Tensor) -> None:
    """dst[:, dst_ids] = src[:, src_ids] for caches whose dim 1 is the block id (all layers at
    once); used for copy-on-write and for moves between pools / staging buffers."""
    dst[:, dst_ids] = src[:, src_ids].to(dst.device)
