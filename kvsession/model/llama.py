"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3), readable top to bottom.

Inputs are packed: the new tokens of every sequence in this step, back to back, with their
absolute positions. KV goes in and out of the paged cache only through `attention()` and the
step's AttentionMetadata. Differences between the architectures are flags on ModelSpec:
q/k/v bias (Qwen2), per-head q/k RMSNorm (Qwen3), tied embeddings, rope scaling.
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvsession.attention import AttentionMetadata, attention
from kvsession.cache.kv_pool import KVPool
from kvsession.config import AttentionBackend, EngineConfig, Quantization, WeightLayout
from kvsession.kernels import bf16_rows
from kvsession.model.config import ModelSpec, RopeSpec
from kvsession.model.linear import Linear, RowsBuffer, measure_one_row, round_times
from kvsession.model.onerow import OneRowKernels, TokenTables
from kvsession.model.region_store import RegionStore
from kvsession.notebook import progress

log = logging.getLogger("kvsession")

MEASURE_ROUNDS = 7  # interleaved rounds of warm_up's timing (compiled regions vs Linear kernels)
# A layer's token-wise work (norms, projections, rotary, MLP) runs over at most this many
# rows at a time; attention over all of them (forward's docstring says why)
ROW_CHUNK = 512


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As HF: normalise in float32, cast back, then scale (torch.rms_norm computes the same
    # float32 values in fewer dispatches)
    if x.dtype == torch.float32:
        return torch.rms_norm(x, weight.shape, weight, eps)
    return weight * torch.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def rope_inv_freq(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] for the default, linear and llama3 rope types."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float()
                                     / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear                  # q, k, v projections fused: out = (Hq + 2 Hkv) * D
    q_norm: torch.Tensor | None  # Qwen3
    k_norm: torch.Tensor | None
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear              # gate and up fused: out = 2 * intermediate
    down: Linear


def _own(t: torch.Tensor) -> torch.Tensor:
    """`t` in memory of its own: a tensor kept as loaded may be a view of the checkpoint
    file's mapping (loader.load_weights does not copy what needs no conversion), which would
    keep the whole file resident. The projections need no such copy: fusing, packing and
    quantizing write new memory."""
    return t.clone() if t.device.type == "cpu" else t


def weight_format(cfg: EngineConfig) -> str:
    """The projections' format (model/linear.py) for what LLM(...) asked: one copy, as
    rows for a bfloat16 model on a CPU where kernels/bf16_rows has vector products
    (AVX512-BF16, or AVX2 and FMA), else oneDNN's packed layout; both with the dual
    layout."""
    if cfg.quantization is Quantization.INT8:
        return "int8"
    if cfg.cpu_weight_layout is WeightLayout.DUAL:
        return "both"
    native_bf16 = cfg.dtype == torch.bfloat16 and cfg.device.type == "cpu" \
        and bf16_rows.native()
    return "rows" if native_bf16 else "onednn"


class LlamaModel:
    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], max_model_len: int,
                 weight_format: str = "onednn"):
        """weight_format: how the projections keep their weights on CPU (model/linear.py;
        `weight_format(cfg)` chooses for LLM): "onednn" by default (one copy; a tied output
        head keeps the checkpoint's rows, which the embedding shares); "rows" (one copy,
        every projection the checkpoint's rows: a bfloat16 model where bf16_rows.native());
        "both" adds the rows for batch-1 decode at twice the weight memory
        (LLM(cpu_weight_layout="dual")); "int8" quantizes."""
        self.spec, self.weight_format = spec, weight_format
        # the paged attention op; an instance attribute so a measurement tool can wrap it
        # for one model (kvsession.numerics) without patching the module for everyone
        self.attention_fn = attention
        self.norm = _own(weights["model.norm.weight"])
        embed = weights["model.embed_tokens.weight"]
        tied = spec.tie_word_embeddings
        # a packed head would leave the embedding a second copy: a tied one keeps the rows
        head_format = "rows" if tied and weight_format == "onednn" else weight_format
        # the one-row weights in one buffer, in the order a decode step reads them: the
        # layers', then the head's (built in that order)
        self.rows_buffer = self._rows_buffer(weights, head_format)
        bar = progress(spec.num_layers, "loading weights", "layer")  # in a notebook only
        self.layers = []
        for i in range(spec.num_layers):
            self.layers.append(self._layer(weights, f"model.layers.{i}."))
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        self.lm_head = Linear(embed if tied else weights["lm_head.weight"], fmt=head_format,
                              rows_buffer=self.rows_buffer)
        # where tokens are looked up: int8 in int8 (the head's rows, or an int8 table of its
        # own); a tied head's float rows rather than a second copy; else the embedding as
        # loaded, in memory of its own
        self.embed_int8: Linear | None = None
        if weight_format == "int8":
            self.embed = None
            self.embed_int8 = self.lm_head if tied else Linear(embed, fmt="int8")
        elif tied and self.lm_head.fmt in ("float", "both", "rows"):
            self.embed = self.lm_head.weight
        else:
            self.embed = _own(embed)
        weights.clear()  # the fused copies above replace them; free the originals
        # a batch-1 decode step's kernel, by measurement on this CPU (model/linear.py)
        measure_one_row(self.projections())
        # a one-token step compiled (model/onerow.py): a candidate until warm_up measured it
        # faster than the Linear kernels on this machine
        self.one_row = OneRowKernels.build(self) if weight_format in ("both", "rows", "int8") \
            else None
        positions = torch.arange(max_model_len, dtype=torch.float32)
        freqs = torch.outer(positions, rope_inv_freq(spec.rope, spec.head_dim))
        dev = self.norm.device
        # HF's rotary tables [max_model_len, head_dim], cos = cat(c, c) and sin = cat(s, s);
        # sin is stored as cat(-s, s) so that rotate_half(x) * sin = roll(x) * sin_signed
        sin = freqs.sin()
        self.cos = torch.cat((freqs, freqs), dim=-1).cos().to(dev)
        self.sin_signed = torch.cat((-sin, sin), dim=-1).to(dev)
        self.softmax_scale = spec.head_dim ** -0.5

    def weight_bytes(self) -> int:
        """Bytes the weights hold resident: every projection's layouts (a packed copy, the
        rows, int8 values and scales, biases), the norms, and the embedding when it is not
        the head's own rows. What `cpu_weight_layout` and `quantization` trade."""
        seen: set[int] = set()

        def size(t: torch.Tensor | None) -> int:
            if t is None or id(t) in seen:
                return 0
            seen.add(id(t))
            return t.numel() * t.element_size()

        total = 0
        for lin in self.projections():
            total += sum(size(t) for t in (lin.weight_t, lin.rows, lin.packed, lin.bias,
                                           *(lin.int8 or ())))
        if self.embed_int8 is not None and self.embed_int8 is not self.lm_head:
            total += sum(size(t) for t in self.embed_int8.int8)
        embed_shared = self.embed is None or self.lm_head.rows is not None and \
            self.embed.data_ptr() == self.lm_head.rows.data_ptr()
        norms = [self.norm] + [t for lw in self.layers
                               for t in (lw.input_norm, lw.post_norm, lw.q_norm, lw.k_norm)]
        return total + sum(size(t) for t in norms) + (0 if embed_shared else size(self.embed))

    def _rows_buffer(self, weights: dict[str, torch.Tensor], head_format: str
                     ) -> RowsBuffer | None:
        """The RowsBuffer the model's Linears write their rows into (linear.RowsBuffer),
        sized for the projections that keep rows ("rows" and "both": every one; a tied head
        kept as rows beside oneDNN's layers: the head alone); None where none does, or off
        the CPU."""
        head = weights["model.embed_tokens.weight" if self.spec.tie_word_embeddings
                       else "lm_head.weight"]
        if head.device.type != "cpu":
            return None
        takes = [head] if head_format in ("rows", "both") else []
        if self.weight_format in ("rows", "both"):
            takes += [t for name, t in weights.items() if name.endswith("_proj.weight")]
        return RowsBuffer([t.numel() for t in takes], head.dtype) if takes else None

    def projections(self) -> list[Linear]:
        """Every projection of the model: the output head, then each layer's."""
        return [self.lm_head] + [lin for lw in self.layers
                                 for lin in (lw.qkv, lw.o, lw.gate_up, lw.down)]

    def _layer(self, w: dict[str, torch.Tensor], p: str) -> LayerWeights:
        spec = self.spec
        a, m = p + "self_attn.", p + "mlp."

        def linear(names, bias_names):  # popped: each original is freed once copied
            bias = torch.cat([w.pop(n) for n in bias_names]) if all(n in w for n in bias_names) \
                else None
            return Linear([w.pop(n) for n in names], bias, fmt=self.weight_format,
                          rows_buffer=self.rows_buffer)

        return LayerWeights(
            input_norm=_own(w[p + "input_layernorm.weight"]),
            qkv=linear([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"],
                       [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]),
            q_norm=_own(w[a + "q_norm.weight"]) if spec.qk_norm else None,
            k_norm=_own(w[a + "k_norm.weight"]) if spec.qk_norm else None,
            o=linear([a + "o_proj.weight"], [a + "o_proj.bias"]),
            post_norm=_own(w[p + "post_attention_layernorm.weight"]),
            gate_up=linear([m + "gate_proj.weight", m + "up_proj.weight"],
                           [m + "gate_proj.bias", m + "up_proj.bias"]),
            down=linear([m + "down_proj.weight"], [m + "down_proj.bias"]),
        )

    @staticmethod
    def rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        # HF's x * cos + rotate_half(x) * sin, with rotate_half(x) * sin written as
        # roll(x) * sin_signed: three ops instead of six (equal up to float rounding)
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)

    def qkv_rows(self, h: torch.Tensor, lw: LayerWeights, cos_sin: tuple
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [n, heads, D], k and v [n, kv_heads, D] of the layer input h [n, hidden]: the
        input norm, the fused q/k/v product, per-head q/k norms (Qwen3), rotary."""
        spec, num_tokens = self.spec, h.shape[0]
        heads, kv_heads, eps = spec.num_heads, spec.num_kv_heads, spec.rms_norm_eps
        qkv = lw.qkv(rms_norm(h, lw.input_norm, eps)).view(
            num_tokens, heads + 2 * kv_heads, spec.head_dim)
        qk, v = qkv[:, : heads + kv_heads], qkv[:, heads + kv_heads:]
        if spec.qk_norm:
            qk = torch.cat((rms_norm(qk[:, :heads], lw.q_norm, eps),
                            rms_norm(qk[:, heads:], lw.k_norm, eps)), dim=1)
        qk = self.rope(qk, *cos_sin)  # q and k rotated together
        return qk[:, :heads], qk[:, heads:], v

    def qkv(self, h: torch.Tensor, lw: LayerWeights, cos_sin: tuple,
            rows: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`qkv_rows` of every row of h, chunk by chunk (`rows`: [start, end) ranges), into
        one buffer each where there are several chunks."""
        if len(rows) == 1:
            return self.qkv_rows(h, lw, cos_sin)
        spec, num_tokens = self.spec, h.shape[0]
        q = h.new_empty(num_tokens, spec.num_heads, spec.head_dim)
        k = h.new_empty(num_tokens, spec.num_kv_heads, spec.head_dim)
        v = torch.empty_like(k)
        cos, sin_signed = cos_sin
        for s, e in rows:
            q[s:e], k[s:e], v[s:e] = self.qkv_rows(h[s:e], lw, (cos[s:e], sin_signed[s:e]))
        return q, k, v

    def mlp(self, x: torch.Tensor, lw: LayerWeights) -> torch.Tensor:
        gate_up = lw.gate_up(x)
        half = gate_up.shape[-1] // 2
        h = F.silu(gate_up[:, :half])
        return lw.down(h.mul_(gate_up[:, half:]))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVPool,
                meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] after the final norm; writes this step's K/V.

        A layer's token-wise work (norms, q/k/v, rotary, o product, MLP) runs ROW_CHUNK rows
        at a time, its attention over all of them at once. Why: a 2,048-token prefill
        allocates ~90 MB of activations a layer in whole-prompt tensors (the gate/up product
        alone 23 MB on the bench model), and glibc served them from per-thread heaps of 64
        MB that it mapped and unmapped several times a prefill, each new mapping faulted in
        4 KiB at a time: 15,000-24,000 page faults a prefill on the AMD bench VM (~7 us
        each). In 512-row chunks: 4,000-7,000, and the prefill's median time 490-500 ms
        against 610-670 (best 470-485 against 480-525), the chunk's activations warm in the
        caches besides."""
        if self._one_region(input_ids, kv, meta):
            return self._decode_region(input_ids, positions, kv, meta)[0]
        if self._batch_region(input_ids, kv, meta):
            return self._decode_batch(input_ids, positions, kv, meta)[0]
        eps = self.spec.rms_norm_eps
        h = self.embed.index_select(0, input_ids) if self.embed_int8 is None \
            else self.embed_int8.lookup(input_ids)
        # rotary tables for this step's positions, [T, 1, head_dim], shared by all layers
        cos_sin = (self.cos.index_select(0, positions).to(h.dtype).unsqueeze(1),
                   self.sin_signed.index_select(0, positions).to(h.dtype).unsqueeze(1))
        if self.one_row is not None and h.shape[0] == 1:
            return self._forward_one_row(h, cos_sin, kv, meta)
        num_tokens = h.shape[0]
        # in chunks on CPU (glibc's heaps, above); one chunk elsewhere
        chunk = ROW_CHUNK if h.device.type == "cpu" else max(num_tokens, 1)
        rows = [(s, min(s + chunk, num_tokens)) for s in range(0, num_tokens, chunk)]
        width = self.spec.num_heads * self.spec.head_dim
        for i, lw in enumerate(self.layers):
            q, k, v = self.qkv(h, lw, cos_sin, rows)
            o = self.attention_fn(q, k, v, kv.layer(i), meta).reshape(num_tokens, width)
            if meta.on_layer_done is not None:
                meta.on_layer_done(i)
            for s, e in rows:  # row-wise from here on: each chunk's residual stream in place
                hs = h[s:e]
                hs += lw.o(o[s:e])
                hs += self.mlp(rms_norm(hs, lw.post_norm, eps), lw)
        return rms_norm(h, self.norm, eps)

    @torch.inference_mode()
    def step_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVPool,
                    meta: AttentionMetadata, rows: list[int]) -> torch.Tensor:
        """forward(), then logits() of the hidden states `rows` (the rows that sample):
        float32 [len(rows), vocab]. Where the one-token path reads attention with the
        kernel, a batch-1 decode step runs as one compiled region from the token id to the
        logits (model/onerow.py decode_logits_kernel), and a decode step of a batch of a
        bfloat16 or int8 model as a compiled region per layer (decode_batch_layer)."""
        if rows == [0] and self._one_region(input_ids, kv, meta):
            return self._decode_region(input_ids, positions, kv, meta)[1]
        if len(rows) == input_ids.shape[0] and self._batch_region(input_ids, kv, meta):
            return self._decode_batch(input_ids, positions, kv, meta)[1]
        hidden = self.forward(input_ids, positions, kv, meta)
        if len(rows) < hidden.shape[0]:  # a decode step samples every row: no copy
            hidden = hidden[rows]
        return self.logits(hidden)

    def _one_region(self, input_ids: torch.Tensor, kv: KVPool, meta: AttentionMetadata
                    ) -> bool:
        """Whether this step is a batch-1 decode step the whole-step region serves."""
        k = self.one_row
        return k is not None and input_ids.shape[0] == 1 and meta.decode_only \
            and k.kernel_attention and k.reads_cache(kv.layer(0))

    def _decode_region(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVPool,
                       meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [1, hidden] after the final norm, float32 logits [1, vocab]) of a
        `_one_region` step. (forward() of such a step computes the logits too, and drops
        them: no step of the engine's does that but one whose row does not sample.)"""
        return self.one_row.decode_logits(
            input_ids, positions, self.token_tables(), self.spec, kv, *self._one_sequence(
                kv, meta), self.softmax_scale, meta.on_layer_done)

    def _batch_region(self, input_ids: torch.Tensor, kv: KVPool, meta: AttentionMetadata
                      ) -> bool:
        """Whether this step is a decode step of several sequences the batch region
        serves."""
        return self.one_row is not None and meta.decode_only and \
            self.one_row.serves_batch(input_ids.shape[0], kv.layer(0))

    def _decode_batch(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVPool,
                      meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [n, hidden] after the final norm, float32 logits [n, vocab]) of a
        `_batch_region` step."""
        return self.one_row.decode_batch_logits(
            input_ids, positions, self.token_tables(), self.spec, kv, meta.slot_mapping,
            meta.block_tables, meta.seq_lens_tensor, self.softmax_scale, meta.on_layer_done)

    @staticmethod
    def _one_sequence(kv: KVPool, meta: AttentionMetadata) -> tuple:
        """A batch-1 step's (slot [1], block ids [n_blocks], context length as a 0-dim
        tensor), as the one-token regions take them."""
        num_blocks = -(-meta.seq_lens[0] // kv.block_size)
        return (meta.slot_mapping, meta.block_tables[0, :num_blocks],
                meta.seq_lens_tensor[0])

    def token_tables(self) -> TokenTables:
        """The tables a token's inputs are read from (embedding, rotary)."""
        embed = self.embed if self.embed_int8 is None else self.embed_int8.int8
        return TokenTables(embed, self.cos, self.sin_signed)

    def _forward_one_row(self, h: torch.Tensor, cos_sin: tuple, kv: KVPool,
                         meta: AttentionMetadata) -> torch.Tensor:
        """forward() of one token through the compiled regions (model/onerow.py), where
        the whole-step region does not serve it: a decode step's layers a region per layer
        where the cache allows it, else the regions around the same attention op as
        forward's layers."""
        spec, k = self.spec, self.one_row
        # (a decode step on a cache it reads with the kernel went to _decode_region)
        if meta.decode_only and k.reads_cache(kv.layer(0)):
            return k.decode_step(h, cos_sin, spec, kv, *self._one_sequence(kv, meta),
                                 self.softmax_scale, meta.on_layer_done)
        for i, args in enumerate(k.layers):
            q, key, v = k.pre(h, *args.pre, *cos_sin, spec.rms_norm_eps, spec.num_heads,
                              spec.num_kv_heads)
            o = self.attention_fn(q, key, v, kv.layer(i), meta)
            if meta.on_layer_done is not None:
                meta.on_layer_done(i)
            h = k.post(h, o.reshape(1, spec.num_heads * spec.head_dim), *args.post)
        return rms_norm(h, self.norm, spec.rms_norm_eps)

    def warm_up(self, kv: KVPool, backend: AttentionBackend = AttentionBackend.TORCH,
                store: RegionStore | None = None) -> None:
        """Compile what a one-token step on `kv` runs before the first step needs it (the
        one-token regions; their decode layer reads attention with kernels/cpu_decode on
        the CPU backend), through `store` when given (loaded where an earlier process
        compiled them: model/region_store.py). A float32 model (the dual layout's rows)
        keeps them only if a decode step through them measured faster than through the
        Linear kernels (`_one_token_times`): there the Linear kernels' products are MKL's or
        oneDNN's, and either side can win on a given CPU. A bfloat16 or int8 model keeps
        them without timing: its Linear kernels run the same C++ products
        (kernels/bf16_rows, kernels/q8_matmul) between ~40 eager ops a layer that the
        regions fuse (a Qwen3-0.6B-shaped bfloat16 step ~45 ms through the Linear kernels,
        ~31-34 ms through the regions on the AMD bench VM), and the timing took ~0.7 s of
        that model's ~3 s load. Nothing for models without them. At start-up, while no
        block holds anything."""
        kernels = self.one_row
        if kernels is None:
            return
        kernels.select_attention(backend == AttentionBackend.CPU)
        kernels.attach_store(store)
        # in a notebook: a first compile of a shape takes ~15-30 s with nothing else shown
        bar = progress(1, "compiling the one-token step (read back after the first time)")
        try:
            compiled = kernels.warm_up(self.spec, kv, self.softmax_scale, self.token_tables())
        finally:
            if bar is not None:
                bar.update(1)
                bar.close()
        if not compiled:
            self.one_row = None  # did not compile (the log says why)
            return
        loaded = "" if store is None else \
            f" ({store.loaded} regions loaded from {store.directory}, {store.compiled} " \
            f"compiled into it)"
        if self.weight_format != "both":
            log.info("one-token step: compiled regions around the %s kernels%s",
                     self.weight_format, loaded)
            return
        t_regions, t_linear = self._one_token_times(kv, backend)
        faster = t_regions < t_linear
        log.info("one-token step: %.4g ms through the compiled regions, %.4g ms through the "
                 "Linear kernels: %s%s", t_regions * 1e3, t_linear * 1e3,
                 "compiled" if faster else "Linear kernels", loaded)
        self.one_row = kernels if faster else None

    def _one_token_times(self, kv: KVPool, backend: AttentionBackend) -> tuple[float, float]:
        """The median time of one decode step (forward and logits of a token at position
        block_size, in blocks 0 and 1 of `kv`) through the one-token regions and through
        the Linear kernels, over MEASURE_ROUNDS interleaved rounds; both blocks zeroed after.

        Why the whole step, both ways: the regions fuse the norms, rotary, residuals and
        (with the decode layer) attention, which the Linear path runs as separate ops. Timing
        the regions' dense work against the Linear kernels' products alone was within the
        noise on the AMD bench machine and chose the Linear kernels at one start in two,
        where a decode step through them was ~20% slower for the model's whole life."""
        regions, bs = self.one_row, kv.block_size

        def step(kernels: OneRowKernels | None):
            def run():
                self.one_row = kernels
                meta = AttentionMetadata(
                    slot_mapping=torch.tensor([bs]), block_tables=torch.tensor([[0, 1]]),
                    query_start_loc=[0, 1], seq_lens=[bs + 1],
                    seq_lens_tensor=torch.tensor([bs + 1]), decode_only=True,
                    softmax_scale=self.softmax_scale, backend=backend,
                    query_start_loc_tensor=torch.tensor([0, 1]), max_query_len=1,
                    all_slots_valid=True)
                self.step_logits(torch.zeros(1, dtype=torch.long), torch.tensor([bs]), kv,
                                 meta, [0])
            return run

        try:
            t_regions, t_linear = (statistics.median(t) for t in round_times(
                [step(regions), step(None)], MEASURE_ROUNDS))
        finally:
            self.one_row = regions
            kv.reset_blocks(2)
        return t_regions, t_linear

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [n, vocab] for the rows that sample."""
        if self.one_row is not None and hidden.shape[0] == 1:
            return self.one_row.logits(hidden)
        return self.lm_head(hidden).float()
