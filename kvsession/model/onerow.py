"""A one-token forward in code that inductor generates for this CPU.

A batch-1 decode step multiplies one row by every weight of the model: it is as fast as it
streams the weights. MKL's and oneDNN's one-row kernels do not stream at the DRAM's rate on
every CPU (on the AMD EPYC bench machine oneDNN read the bench model's projections at
~17 GB/s and MKL at ~10, where a `sum` over a buffer reads at ~30-55 GB/s), and between
the products ~15 small ops per layer (norms, rotary, SiLU-mul, residuals) each cost a
dispatch. `torch.compile` (the inductor CPU backend) turns each region below into one C++
function of vectorised loops: a product `(w * x).sum(-1)` over the contiguous `[out, in]`
rows is one pass over the weight (the rows split over the threads), and the elementwise
work is fused into the loops around it. On the AMD machine that read the same projections
at ~30 GB/s, the rate of the `sum` measured beside it.

A bfloat16 model's products (every projection bf16 rows) and an int8 model's are ops of
their C++ kernels (kernels/bf16_rows, kernels/q8_matmul: a vdpbf16ps or vpdpbusd per
64 weight bytes, where inductor's loop would widen each weight to float32 first), so that
the regions below fuse only the elementwise work around them: a Qwen3-0.6B-shaped bfloat16
step took ~45 ms with the same kernels between eager ops (~40 small ops a layer) and
~31-34 ms as one region on the bench VM; int8 ~28.8 -> ~24.6 ms.

A batch-1 decode step on a float32 or bfloat16 cache where the engine reads decode
attention with the C++ kernel (attention_backend "cpu", the default on CPU when it builds)
runs as one region
from the token id to its logits (`decode_logits_kernel`): the embedding and rotary rows,
every layer's norm, q/k/v product, rotary, o product, MLP and residuals, the final norm,
the output head, and for each layer the kernel called as an op that stores the new K/V and
attends over the block list, whose length is the one dynamic dimension. With
attention compiled instead (the "torch" backend), each layer is one region (`decode_layer`,
the attention read token-major). Other
one-token steps (an fp8 or bfloat16 cache, which the model's paged attention op reads) run
two regions per layer: before attention (input norm, fused q/k/v product, per-head q/k
norms, rotary) and after it (o product, residual, post norm, gate/up product, SiLU-mul, down
product, residual). One-row logits run the output head as a region. A decode step of 2-16
sequences of a bfloat16 or int8 model (whose products are the kernels' ops, which take up
to 16 rows) runs a region per layer (`decode_batch_layer`, every length unbacked: one graph
for all batch sizes and table widths). Used on CPU models
(float32 "both" rows, bfloat16 rows, int8) large enough to be measured
(linear.MEASURE_MIN_BYTES: smaller weights stay in the caches, where every kernel is fast):
a float32 model's only where a one-token step through them measured faster than through
its Linear kernels (MKL's or oneDNN's products; LlamaModel.warm_up times both), a bfloat16
or int8 model's always (its Linear kernels are the same C++ products, unfused).

Why these details:
- `cpp.dynamic_threads`: the generated loops ask OpenMP for the thread count at each call,
  so the engine's ThreadGovernor (engine/runner.py) still chooses it per step; by default
  inductor bakes the count at compile time into the code.
- `dynamic=False` for the weight regions: the shapes are fixed per model, and specialised
  loops streamed ~1.5x faster than shape-generic ones here.
- Each model compiles its own copies of the functions (`compile_region`): dynamo keeps one
  cache per code object with a small limit on its entries, past which it silently runs the
  function eagerly, and `(w * x).sum(-1)` run eagerly would materialise a weight-sized
  temporary. A model's regions have one shape each, so each copy compiles once.
- Compiling takes seconds (once per process; inductor caches the generated code on disk).
  If it fails (no C++ compiler, say), the model keeps the Linear kernels.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvsession.kernels import bf16_rows, cpu_decode, q8_matmul  # define the kernels' ops
from kvsession.kernels.cpp_build import OpKind
from kvsession.model.linear import MEASURE_MIN_BYTES, Linear, weight_bytes
from kvsession.model.region_store import RegionStore, StoredRegion

log = logging.getLogger("kvsession")

COMPILE_OPTIONS = {"cpp.dynamic_threads": True}
# For the regions of products: inductor inlines a pointwise result into the loop that
# reads it unless the result reads more than this many buffers, so a norm's output (h,
# the norm weight, the sum of squares) was recomputed for every weight row of the product
# after it, and the gate/up product ran ~1.3x slower than on a stored input (AMD bench
# machine). Not for decode_layer's compiled attention, whose large intermediates are best
# left fused.
DENSE_OPTIONS = COMPILE_OPTIONS | {"realize_cpu_acc_reads_threshold": 2}


def row_product(x: torch.Tensor, w, b: torch.Tensor | None) -> torch.Tensor:
    """x [n, in] times w [out, in] (+ b): [n, out], one pass over w's rows. bfloat16 rows
    through the kernel's op (kernels/bf16_rows: one vdpbf16ps per 32 weights, where the
    generated loop widens each weight to float32 first); an int8 weight, w = (q, scale) as
    q8_matmul.quantize makes it, through the int8 kernel's op (both ops take 1 to
    KERNEL_MAX_ROWS rows); float32 rows as a generated loop, one row only (n = 1)."""
    if isinstance(w, tuple):
        y = torch.ops.kvsession.q8_matmul(x, *w)
    elif w.dtype == torch.bfloat16:
        y = torch.ops.kvsession.bf16_rows_matmul(x, w)
    else:
        y = (w * x[0]).sum(-1).unsqueeze(0)
    return y if b is None else y + b


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rms_norm(x, w.shape, w, eps)


def pre_attention(h, norm, qkv_w, qkv_b, q_norm, k_norm, cos, sin_signed, eps: float,
                  heads: int, kv_heads: int):
    """h [n, hidden] -> q [n, heads, D], k and v [n, kv_heads, D], rotated as the model's
    qkv_rows does (cos and sin_signed [n, 1, D] of each row's position)."""
    qkv = row_product(_norm(h, norm, eps), qkv_w, qkv_b)
    qkv = qkv.view(h.shape[0], heads + 2 * kv_heads, qkv.shape[-1] // (heads + 2 * kv_heads))
    qk, v = qkv[:, : heads + kv_heads], qkv[:, heads + kv_heads:]
    if q_norm is not None:
        qk = torch.cat((_norm(qk[:, :heads], q_norm, eps), _norm(qk[:, heads:], k_norm, eps)),
                       dim=1)
    # HF's x * cos + rotate_half(x) * sin, as LlamaModel.rope writes it (its roll as a
    # cat of the halves: roll's decomposition asks whether the tensor is empty, which a
    # batch's unbacked row count cannot answer)
    half = qk.shape[-1] // 2
    qk = qk * cos + torch.cat((qk[..., half:], qk[..., :half]), dim=-1) * sin_signed
    return qk[:, :heads], qk[:, heads:], v


def post_attention(h, o, o_w, o_b, norm, gate_up_w, gate_up_b, down_w, down_b, eps: float):
    """h [n, hidden] plus the o product of the attention output o [n, heads * D], then plus
    the MLP of that: the residual stream after the layer."""
    h = h + row_product(o, o_w, o_b)
    gate_up = row_product(_norm(h, norm, eps), gate_up_w, gate_up_b)
    half = gate_up.shape[-1] // 2
    return h + row_product(F.silu(gate_up[:, :half]) * gate_up[:, half:], down_w, down_b)


def layer(attend_fn, h, norm, qkv_w, qkv_b, q_norm, k_norm, cos, sin_signed, eps: float,
          heads: int, kv_heads: int, k_cache, v_cache, slot, block_ids, num_tokens,
          scale: float, o_w, o_b, post_norm, gate_up_w, gate_up_b, down_w, down_b,
          eps_post: float):
    """One layer of a decode step of n sequences: pre_attention, then `attend_fn` stores the
    new K/V at `slot` of the layer's cache ([num_blocks, block_size, kv_heads, D]) and
    attends over each sequence's context (a batch-1 step's `block_ids` [n_blocks] and
    `num_tokens` (0-dim); a batch's block tables [n, max_blocks] and lengths [n]), then
    post_attention."""
    q, k, v = pre_attention(h, norm, qkv_w, qkv_b, q_norm, k_norm, cos, sin_signed, eps,
                            heads, kv_heads)
    o = attend_fn(q, k, v, k_cache, v_cache, slot, block_ids, num_tokens, scale)
    return post_attention(h, o.reshape(h.shape[0], -1), o_w, o_b, post_norm, gate_up_w, gate_up_b,
                          down_w, down_b, eps_post)


def decode_layer(*args):
    """`layer` in one region, the attention compiled too (`store_attend`)."""
    return layer(store_attend, *args)


def decode_layers_kernel(h, layers, caches, cos, sin_signed, eps: float, heads: int,
                         kv_heads: int, slot, block_ids, num_tokens, scale: float,
                         final_norm):
    """Every layer of a batch-1 decode step (`layers`: each layer's (pre, post) tensors as
    LayerArgs holds them; `caches`: each layer's (k, v) cache) in one region, then the final
    norm: the residual stream after it. The attention is read by the C++ kernel
    (kernels/cpu_decode), called from the region as an op that also stores the new K/V: at
    2,048 tokens it read the cache ~1.5-2x faster than the compiled `attend` on the AMD
    bench machine, and as fast at 128. One region for the whole step: ~1 ms of per-call
    overhead less than one per layer there."""
    for (pre, post), (k_cache, v_cache) in zip(layers, caches, strict=True):
        h = layer(kernel_store_attend, h, *pre, cos, sin_signed, eps, heads, kv_heads,
                  k_cache, v_cache, slot, block_ids, num_tokens, scale, *post)
    return _norm(h, final_norm, eps)


class TokenTables(NamedTuple):
    """What a whole-step region reads a token's inputs from: the model's embedding [vocab,
    hidden] (or an int8 model's, as (q, scale)) and its rotary tables cos and sin_signed
    [max_model_len, head_dim] (as LlamaModel.forward indexes them)."""

    embed: torch.Tensor | tuple
    cos: torch.Tensor
    sin_signed: torch.Tensor


def decode_logits_kernel(token, position, embed, cos_table, sin_table, layers, caches,
                         eps: float, heads: int, kv_heads: int, slot, block_ids, num_tokens,
                         scale: float, final_norm, head_w, head_b):
    """A whole batch-1 decode step in one region: token [1]'s embedding row and position
    [1]'s rotary rows, every layer and the final norm (decode_layers_kernel), then the
    output head. (hidden [1, hidden] after the final norm, float32 logits [1, vocab]).
    Why one region from the token id to the logits: as three calls (the embedding and
    rotary rows in eager ops, the layers, the head) a step took ~0.25-0.3 ms longer on the
    AMD bench machine (3.23-3.33 vs 2.98-3.04 ms at 66-79 GB/s, ~8%; the same logits to the
    bit): each call's Python, guards and OpenMP start, with the memory idle meanwhile."""
    h, cos, sin_signed = token_inputs(token, position, embed, cos_table, sin_table,
                                      final_norm.dtype)
    hidden = decode_layers_kernel(h, layers, caches, cos, sin_signed, eps, heads, kv_heads,
                                  slot, block_ids, num_tokens, scale, final_norm)
    return hidden, head(hidden, head_w, head_b)


def token_inputs(token, position, embed, cos_table, sin_table, dtype: torch.dtype):
    """The embedding rows of tokens [n] (an int8 table (q, scale) dequantized to the
    model's `dtype`) and the rotary rows cos and sin_signed [n, 1, D] of positions [n], in
    the model's dtype as LlamaModel.forward rounds them."""
    h = embed.index_select(0, token) if isinstance(embed, torch.Tensor) else \
        q8_matmul.dequantize(embed[0].index_select(0, token), embed[1].index_select(0, token),
                             dtype)
    cos = cos_table.index_select(0, position).unsqueeze(1).to(h.dtype)
    sin_signed = sin_table.index_select(0, position).unsqueeze(1).to(h.dtype)
    return h, cos, sin_signed


def decode_batch_layer(h, norm, qkv_w, qkv_b, q_norm, k_norm, cos, sin_signed, eps: float,
                       heads: int, kv_heads: int, k_cache, v_cache, slots, block_tables,
                       seq_lens, scale: float, o_w, o_b, post_norm, gate_up_w, gate_up_b,
                       down_w, down_b, eps_post: float):
    """One layer of a decode step of n sequences (2 to the products' KERNEL_MAX_ROWS) in one
    region: `layer` with h [n, hidden], cos and sin_signed [n, 1, D], the attention read by
    the kernel's op over `block_tables` [n, max_blocks] and `seq_lens` [n] (blocks every
    sequence shares read once: kernels/cpu_decode_op.cpp), the new K/V stored at `slots`
    [n]. Every length is unbacked (one graph for every batch and table width): the row
    counts are told equal here, for the broadcasts between them.

    Why a region for batches too: between the same C++ products, the eager step ran ~40
    small ops a layer, ~22% of a Qwen3-0.6B-shaped bfloat16 step of 8 sequences on the AVX2
    bench VM (py-spy), where llama.cpp's graph has none of that overhead. Why a region per
    layer, not the whole step as for one sequence: the whole step took ~50 s to compile
    (28 layers of shape-generic code), where one layer's graph serves every layer, and the
    ~28 calls' overhead is <1% of a step of 8."""
    torch._check(cos.shape[0] == h.shape[0])
    torch._check(sin_signed.shape[0] == h.shape[0])
    return layer(batch_store_attend, h, norm, qkv_w, qkv_b, q_norm, k_norm, cos, sin_signed,
                 eps, heads, kv_heads, k_cache, v_cache, slots, block_tables, seq_lens, scale,
                 o_w, o_b, post_norm, gate_up_w, gate_up_b, down_w, down_b, eps_post)


def kernel_store_attend(q, k, v, k_cache, v_cache, slot, block_ids, num_tokens,
                        scale: float):
    """batch_store_attend for one sequence: its block list [n_blocks] and 0-dim length as
    a table of one row."""
    return batch_store_attend(q, k, v, k_cache, v_cache, slot, block_ids[None],
                              num_tokens.view(1), scale)


def batch_store_attend(q, k, v, k_cache, v_cache, slots, block_tables, seq_lens,
                       scale: float):
    """The decode kernel's op: each sequence's new K/V stored at its slot, then attention
    over its table row."""
    return torch.ops.kvsession.cpu_decode_store_attention(
        q, k, v, k_cache, v_cache, slots, block_tables, seq_lens, scale)


def store_attend(q, k, v, k_cache, v_cache, slot, block_ids, num_tokens, scale: float):
    """k and v [1, kv_heads, D] stored at `slot`, then `attend`. (In one graph with other
    layers, inductor copied each later layer's whole cache for these writes: this runs one
    layer per region.)"""
    k_cache.flatten(0, 1).index_copy_(0, slot, k)
    v_cache.flatten(0, 1).index_copy_(0, slot, v)
    return attend(q, k_cache, v_cache, block_ids, num_tokens, scale)


def attend(q, k_cache, v_cache, block_ids, num_tokens, scale: float):
    """What the paged reference computes for one query token q [1, heads, D], read
    token-major: each token's K (then V) row of all heads is one contiguous read, and the
    slots past the end of the last block are masked out of scores and values (they may
    hold anything: zeros, freed data). [kv_heads, group, D]."""
    kv_heads = k_cache.shape[2]
    keys, values = k_cache[block_ids], v_cache[block_ids]  # [blocks, block_size, kv_heads, D]
    slots = torch.arange(keys.shape[0] * keys.shape[1], device=keys.device)
    valid = (slots < num_tokens).view(keys.shape[0], keys.shape[1], 1, 1)
    qg = q[0].view(kv_heads, q.shape[1] // kv_heads, -1)  # the query heads sharing a KV head
    scores = torch.where(valid, (keys[:, :, :, None, :] * qg).sum(-1) * scale, float("-inf"))
    p = torch.exp(scores - scores.amax((0, 1)))  # [blocks, block_size, kv_heads, group]
    # per block, then over the blocks: the second sum is a vertical reduction over rows of
    # kv_heads * group * D contiguous values (one sum over all tokens ran ~1.3x slower)
    o = torch.where(valid[..., None], p[..., None] * values[:, :, :, None, :], 0.0).sum(1)
    return o.sum(0) / p.sum((0, 1))[..., None]


def head(hidden, w, b):
    """hidden [n, hidden] (after the final norm) -> float32 logits [n, vocab]."""
    return row_product(hidden, w, b).float()


def compile_region(fn, dynamic: bool | None = False,
                   options: dict = DENSE_OPTIONS) -> StoredRegion:
    """`fn` compiled from a copy of its code object (a cache of its own in dynamo), by
    dynamo in this process until a RegionStore is attached (model/region_store.py)."""
    return StoredRegion(fn, dynamic, options)


@dataclass(frozen=True)
class LayerArgs:
    """One layer's tensors in the order the regions take them."""

    pre: tuple
    post: tuple


class OneRowKernels:
    """The compiled regions of one model and the tensors they read (the Linears' rows)."""

    def __init__(self, layers: list[LayerArgs], head_args: tuple, final_norm: torch.Tensor,
                 batch_rows: int = 0):
        """batch_rows: the most sequences a decode step's batch region takes (0: none; the
        products' ops take up to KERNEL_MAX_ROWS rows: bfloat16 and int8 models)."""
        self.layers, self.head_args, self.final_norm = layers, head_args, final_norm
        self.batch_rows = batch_rows
        self.layer_pairs = [(lw.pre, lw.post) for lw in layers]  # decode_layers_kernel's
        self.pre, self.post, self.head = (compile_region(f) for f in
                                          (pre_attention, post_attention, head))
        self.store: RegionStore | None = None
        self.select_attention(kernel=False)
        self.decode_compiles = True  # until warm_up finds otherwise
        self._caches: tuple | None = None  # (the KVPool, its layers' (k, v) views)

    def reads_cache(self, layer_kv) -> bool:
        """Whether the decode step's region serves decode steps on this layer's cache:
        float32, or bfloat16 where the kernel's op reads attention; no fp8 scales (other
        caches go through the model's paged attention op between the regions); and it
        compiled."""
        dtype = layer_kv.k.dtype
        return self.decode_compiles and layer_kv.k_scale is None \
            and layer_kv.k.device.type == "cpu" and (
                dtype == torch.float32 or dtype == torch.bfloat16 and self.kernel_attention)

    def decode_logits(self, token, position, tables: TokenTables, spec, kv, slot,
                      block_ids, num_tokens, scale: float, on_layer_done=None):
        """A batch-1 decode step from token [1] at position [1] to its logits, in one region
        (decode_logits_kernel; after select_attention(kernel=True)): (the hidden state after
        the final norm [1, hidden], float32 logits [1, vocab]). Arguments as decode_step's;
        `on_layer_done(i)` for every layer after the step, in order (one token's K/V leaves
        nothing to overlap). Under inference mode."""
        block_ids, token, position, slot, num_tokens = _step_indices(
            block_ids, token, position, slot, num_tokens)
        out = self.decode(token, position, *tables, self.layer_pairs, self._layer_caches(kv),
                          spec.rms_norm_eps, spec.num_heads, spec.num_kv_heads, slot,
                          block_ids, num_tokens, scale, self.final_norm, *self.head_args)
        if on_layer_done is not None:
            for i in range(len(self.layers)):
                on_layer_done(i)
        return out

    def _layer_caches(self, kv) -> list:
        """Each layer's (k, v) cache of `kv`. A pool's tensors are allocated once: its
        per-layer views are built once too (~1% of a batch-1 step)."""
        if self._caches is None or self._caches[0] is not kv:
            self._caches = (kv, [(kv.layer(i).k, kv.layer(i).v)
                                 for i in range(len(self.layers))])
        return self._caches[1]

    def serves_batch(self, num_seqs: int, layer_kv) -> bool:
        """Whether the batch region serves a decode step of `num_seqs` sequences on this
        layer's cache (after select_attention(kernel=True))."""
        return self.kernel_attention and 2 <= num_seqs <= self.batch_rows \
            and self.reads_cache(layer_kv)

    def decode_batch_logits(self, tokens, positions, tables: TokenTables, spec, kv, slots,
                            block_tables, seq_lens, scale: float, on_layer_done=None):
        """A decode step of n sequences (`serves_batch`), a region per layer
        (decode_batch_layer), the token and rotary rows, the final norm and the output head
        around them: tokens, positions, slots and seq_lens [n] int64, block_tables [n,
        max_blocks]; (hidden [n, hidden], float32 logits [n, vocab]). `on_layer_done(i)`
        once layer i's K/V is written. Under inference mode."""
        eps = spec.rms_norm_eps
        h, cos, sin_signed = token_inputs(tokens, positions, tables.embed, tables.cos,
                                          tables.sin_signed, self.final_norm.dtype)
        # every length marked unbacked: one graph for all batch sizes and table widths
        cos, sin_signed, slots, block_tables, seq_lens = (
            _unbacked(_inference(t), dims) for t, dims in (
                (cos, (0,)), (sin_signed, (0,)), (slots, (0,)), (block_tables, (0, 1)),
                (seq_lens, (0,))))
        for i, (args, (k_cache, v_cache)) in enumerate(zip(self.layers, self._layer_caches(kv),
                                                            strict=True)):
            h = self.batch(_unbacked(h, (0,)), *args.pre, cos, sin_signed, eps,
                           spec.num_heads, spec.num_kv_heads, k_cache, v_cache, slots,
                           block_tables, seq_lens, scale, *args.post)
            if on_layer_done is not None:
                on_layer_done(i)
        hidden = _norm(h, self.final_norm, eps)
        return hidden, head(hidden, *self.head_args)

    def decode_step(self, h, cos_sin: tuple, spec, kv, slot, block_ids, num_tokens,
                    scale: float, on_layer_done=None):
        """Every layer of a batch-1 decode step, a region per layer (decode_layer; after
        select_attention(kernel=False)), then the final norm: the residual stream after it.
        `block_ids` [n_blocks] int64, `num_tokens` a 0-dim tensor; `on_layer_done(i)` once
        layer i's K/V is written. Under inference mode."""
        block_ids, slot, num_tokens = _step_indices(block_ids, slot, num_tokens)
        eps, heads, kv_heads = spec.rms_norm_eps, spec.num_heads, spec.num_kv_heads
        for i, args in enumerate(self.layers):
            layer_kv = kv.layer(i)
            h = self.decode(h, *args.pre, *cos_sin, eps, heads, kv_heads, layer_kv.k,
                            layer_kv.v, slot, block_ids, num_tokens, scale, *args.post)
            if on_layer_done is not None:
                on_layer_done(i)
        return _norm(h, self.final_norm, eps)

    def logits(self, hidden):
        """float32 logits [1, vocab] of one row (after the final norm). Under inference mode."""
        return self.head(_inference(hidden), *self.head_args)

    def select_attention(self, kernel: bool) -> None:
        """A decode step's attention: the C++ kernel's op, the whole step in one region
        (decode_logits_kernel, run by decode_logits; where the engine's backend reads
        decode attention with kernels/cpu_decode), or compiled code, one region per layer
        (decode_layer, run by decode_step). The block list's length varies (marked unbacked
        per step); the rest is static. Before warm_up."""
        self.kernel_attention = kernel
        if kernel:
            cpu_decode.register_op()  # the op's implementation: C++ where it builds
        self.decode = compile_region(decode_logits_kernel, dynamic=None) if kernel else \
            compile_region(decode_layer, dynamic=None, options=COMPILE_OPTIONS)
        self.decode.attach(self.store)
        # batches of decodes: only beside the kernel's attention (the op reads each
        # sequence's own block table), only where the products are ops (batch_rows)
        self.batch = compile_region(decode_batch_layer, dynamic=None) \
            if kernel and self.batch_rows else None
        if self.batch is not None:
            self.batch.attach(self.store)

    def attach_store(self, store: RegionStore | None) -> None:
        """Compile the regions ahead of time through `store` (loading what an earlier
        process stored: model/region_store.py); None: in this process only. Before
        warm_up."""
        self.store = store
        for region in (self.pre, self.post, self.head, self.decode, self.batch):
            if region is not None:
                region.attach(store)

    def warm_up(self, spec, kv, scale: float, tables: TokenTables) -> bool:
        """Compile what the engine will run, before its first step needs it; False if that
        failed (said in the log: the model then keeps its Linear kernels). Dynamo guards on
        the thread count, so each region is run at each count the engine's ThreadGovernor
        may choose (all threads, one; a region compiled ahead of time through the attached
        store serves both, and the second pass only runs it); the decode step for `kv`'s
        cache (the whole-step region, reading the model's `tables`, or the decode layer), on
        a step that writes and reads its first two blocks, or else the two regions (also
        where the decode step fails to compile). Inputs as a step's (distinct cos and sin:
        dynamo also guards on aliasing). Only while no block holds anything: at start-up."""
        decodes = writes = self.reads_cache(kv.layer(0)) and kv.num_blocks >= 2
        before = torch.get_num_threads()
        try:
            with torch.inference_mode():
                dtype = self.final_norm.dtype  # the model's
                h = torch.zeros(1, spec.hidden_size, dtype=dtype)
                rope = (torch.zeros(1, 1, spec.head_dim, dtype=dtype),
                        torch.zeros(1, 1, spec.head_dim, dtype=dtype))
                for threads in sorted({before, 1}, reverse=True):
                    torch.set_num_threads(threads)
                    self.logits(h)
                    if decodes:
                        try:
                            n = kv.block_size + 1
                            step = (spec, kv, torch.tensor([n - 1]), torch.tensor([0, 1]),
                                    torch.tensor(n), scale)
                            if self.kernel_attention:
                                self.decode_logits(torch.zeros(1, dtype=torch.long),
                                                   torch.tensor([n - 1]), tables, *step)
                            else:
                                self.decode_step(h, rope, *step)
                        except Exception as e:  # noqa: BLE001 - the two regions serve
                            self.decode_compiles = decodes = False
                            log.warning("decode steps run the one-token regions around the "
                                        "attention op: compiling the decode layer failed "
                                        "(%s: %s)", type(e).__name__, e)
                    if decodes and self.batch is not None:
                        self._warm_batch(spec, kv, scale, tables)
                    if not decodes:
                        self.pre(h, *self.layers[0].pre, *rope, spec.rms_norm_eps,
                                 spec.num_heads, spec.num_kv_heads)
                        self.post(h, torch.zeros(1, spec.num_heads * spec.head_dim,
                                                 dtype=dtype), *self.layers[0].post)
        except Exception as e:  # noqa: BLE001 - any compiler failure: keep the Linears
            log.warning("one-token decode stays on the Linear kernels: compiling its regions "
                        "failed (%s: %s)", type(e).__name__, e)
            return False
        finally:
            torch.set_num_threads(before)
            if writes:
                kv.reset_blocks(2)
        return True

    def _warm_batch(self, spec, kv, scale: float, tables: TokenTables) -> None:
        """The batch region compiled on a step of two sequences that share block 0 and
        write block 1 (warm_up's blocks); where it fails, batches keep the eager step
        (said in the log)."""
        n = kv.block_size + 1
        try:
            self.decode_batch_logits(torch.zeros(2, dtype=torch.long),
                                     torch.tensor([n - 1, n - 2]), tables, spec, kv,
                                     torch.tensor([n - 1, n - 2]), torch.tensor([[0, 1]] * 2),
                                     torch.tensor([n, n - 1]), scale)
        except Exception as e:  # noqa: BLE001 - the eager step serves batches
            self.batch, self.batch_rows = None, 0
            log.warning("decode steps of several sequences run eagerly: compiling their "
                        "region failed (%s: %s)", type(e).__name__, e)

    @staticmethod
    def for_model(model) -> OneRowKernels | None:
        """Regions for `model` (a LlamaModel; nothing compiled before their first call), or
        None when its one-row weights are not all float32 rows, bfloat16 rows or int8
        weights on the CPU (or their kernel's op has no C++ implementation here: through
        Python it would cost more than the regions save)."""
        lins = model.projections()
        if all(lin.int8 is not None and lin.int8[0].device.type == "cpu" for lin in lins):
            if q8_matmul.load() is None or q8_matmul.register_op() != OpKind.NATIVE:
                return None
        else:
            dtype = lins[0].rows.dtype if lins[0].rows is not None else None
            if dtype not in (torch.float32, torch.bfloat16) or any(
                    lin.rows is None or lin.rows.dtype != dtype
                    or lin.rows.device.type != "cpu" for lin in lins):
                return None
            if dtype == torch.bfloat16 and (bf16_rows.load() is None
                                            or bf16_rows.register_op() != OpKind.NATIVE):
                return None
        eps = model.spec.rms_norm_eps
        # float32 rows are a generated loop for one row; the ops take up to 16
        batch_rows = 0 if lins[0].int8 is None and lins[0].rows.dtype == torch.float32 \
            else min(bf16_rows.KERNEL_MAX_ROWS, q8_matmul.KERNEL_MAX_ROWS)
        return OneRowKernels([LayerArgs(
            pre=(lw.input_norm, *_wb(lw.qkv), lw.q_norm, lw.k_norm),
            post=(*_wb(lw.o), lw.post_norm, *_wb(lw.gate_up), *_wb(lw.down), eps))
            for lw in model.layers], _wb(model.lm_head), model.norm, batch_rows)

    @staticmethod
    def build(model) -> OneRowKernels | None:
        """`for_model(model)`, nothing compiled yet, where its weights reach
        linear.MEASURE_MIN_BYTES (smaller weights stay in the caches, where every kernel is
        fast), else None: a candidate, which the model compiles (`warm_up`; a float32
        model keeps it only if a one-token step measured faster through it:
        LlamaModel.warm_up)."""
        kernels = OneRowKernels.for_model(model)
        if kernels is None or weight_bytes(model.projections()) < MEASURE_MIN_BYTES:
            return None
        return kernels


def _step_indices(block_ids: torch.Tensor, *others: torch.Tensor) -> tuple:
    """A decode step's index tensors as the compiled regions take them: as inference
    tensors (dynamo guards on a tensor's dispatch keys: a step's come from outside inference
    mode, the warm-up's from inside; as inference tensors both match), and `block_ids`'s
    length marked unbacked (one compiled graph for every length, 1 included: no 0/1
    specialisation)."""
    return (_unbacked(_inference(block_ids), (0,)), *(_inference(t) for t in others))


def _unbacked(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """`t` with dimensions `dims` marked unbacked (a length that varies per call: one
    compiled graph for every length, 1 included, no 0/1 specialisation)."""
    for d in dims:
        torch._dynamo.decorators.mark_unbacked(t, d)
    return t


def _inference(t: torch.Tensor) -> torch.Tensor:
    """`t` as an inference tensor (a copy if it is not one; call under inference mode)."""
    return t if t.is_inference() else t.clone()


def _wb(lin: Linear) -> tuple:
    """(weight, bias) as row_product takes them: the rows, or an int8 weight's (q, scale)."""
    return (lin.rows if lin.int8 is None else lin.int8), lin.bias
