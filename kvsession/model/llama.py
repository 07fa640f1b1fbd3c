"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3), readable top to bottom.

Inputs are packed: the new tokens of every sequence in this step, back to back, with their
absolute positions. KV goes in and out of the paged cache only through `attention()` and the
step's AttentionMetadata. Differences between the architectures are flags on ModelSpec:
q/k/v bias (Qwen2), per-head q/k RMSNorm (Qwen3), tied embeddings, rope scaling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvsession.attention import AttentionMetadata, attention
from kvsession.cache.kv_pool import KVPool
from kvsession.model.config import ModelSpec, RopeSpec


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As HF: normalise in float32, cast back, then scale.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


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


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
           contiguous: bool = True) -> torch.Tensor:
    """x @ w.T (+ b), x: [rows, in], w: [out, in].

    On CPU the product is written as (w @ x.T).T: for the skinny batches of decode, MKL's
    kernel for that form streams the weight at up to 3x the bandwidth of `F.linear`'s, and a
    single row is padded to two because MKL's 1-row kernel is the slow one (32000x512
    lm_head: 6.2 ms at 1 row with F.linear, 2.0 ms this way; measured in bench/). Decode is
    bound by reading weights, so this is the decode speed. Large batches (prefill) are
    compute-bound and keep F.linear."""
    rows = x.shape[0]
    if x.device.type != "cpu" or x.dim() != 2 or rows > 64:
        return F.linear(x, w, b)
    xs = x if rows > 1 else x.repeat(2, 1)
    y = torch.mm(w, xs.t()).t()[:rows]
    if contiguous:  # views and SDPA's fast path downstream need it; logits do not
        y = y.contiguous()
    return y if b is None else y + b


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor            # q, k, v projections fused: [(Hq + 2 Hkv) * D, hidden]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # Qwen3
    k_norm: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor        # gate and up fused: [2 * intermediate, hidden]
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


class LlamaModel:
    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], max_model_len: int):
        self.spec = spec
        # the paged attention op; an instance attribute so a measurement tool can wrap it
        # for one model (kvsession.numerics) without patching the module for everyone
        self.attention_fn = attention
        self.embed = weights["model.embed_tokens.weight"]
        self.lm_head = self.embed if spec.tie_word_embeddings else weights["lm_head.weight"]
        self.norm = weights["model.norm.weight"]
        self.layers = [self._layer(weights, f"model.layers.{i}.") for i in range(spec.num_layers)]
        weights.clear()  # the fused copies above replace them; free the originals
        positions = torch.arange(max_model_len, dtype=torch.float32)
        freqs = torch.outer(positions, rope_inv_freq(spec.rope, spec.head_dim))
        emb = torch.cat((freqs, freqs), dim=-1).to(self.embed.device)
        self.cos, self.sin = emb.cos(), emb.sin()  # float32 [max_model_len, head_dim]
        self.softmax_scale = spec.head_dim ** -0.5

    def _layer(self, w: dict[str, torch.Tensor], p: str) -> LayerWeights:
        spec = self.spec
        a, m = p + "self_attn.", p + "mlp."

        def cat(names):
            return torch.cat([w[n] for n in names]) if all(n in w for n in names) else None

        return LayerWeights(
            input_norm=w[p + "input_layernorm.weight"],
            qkv=cat([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]),
            qkv_bias=cat([a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]),
            q_norm=w.get(a + "q_norm.weight") if spec.qk_norm else None,
            k_norm=w.get(a + "k_norm.weight") if spec.qk_norm else None,
            o=w[a + "o_proj.weight"], o_bias=w.get(a + "o_proj.bias"),
            post_norm=w[p + "post_attention_layernorm.weight"],
            gate_up=cat([m + "gate_proj.weight", m + "up_proj.weight"]),
            gate_up_bias=cat([m + "gate_proj.bias", m + "up_proj.bias"]),
            down=w[m + "down_proj.weight"], down_bias=w.get(m + "down_proj.bias"),
        )

    @staticmethod
    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x * cos + rotate_half(x) * sin

    def attention_block(self, x: torch.Tensor, lw: LayerWeights, cos_sin: tuple,
                        kv: KVPool, layer_idx: int, meta: AttentionMetadata) -> torch.Tensor:
        spec, num_tokens = self.spec, x.shape[0]
        qkv = linear(x, lw.qkv, lw.qkv_bias)
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, spec.num_heads, spec.head_dim)
        k = k.view(num_tokens, spec.num_kv_heads, spec.head_dim)
        v = v.view(num_tokens, spec.num_kv_heads, spec.head_dim)
        if spec.qk_norm:
            q = rms_norm(q, lw.q_norm, spec.rms_norm_eps)
            k = rms_norm(k, lw.k_norm, spec.rms_norm_eps)
        q, k = self.rope(q, *cos_sin), self.rope(k, *cos_sin)
        o = self.attention_fn(q, k, v, kv.layer(layer_idx), meta)
        return linear(o.reshape(num_tokens, q_size), lw.o, lw.o_bias)

    def mlp(self, x: torch.Tensor, lw: LayerWeights) -> torch.Tensor:
        gate, up = linear(x, lw.gate_up, lw.gate_up_bias).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, lw.down, lw.down_bias)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVPool,
                meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] after the final norm; writes this step's K/V."""
        eps = self.spec.rms_norm_eps
        h = self.embed[input_ids]
        # rotary tables for this step's positions, [T, 1, head_dim], shared by all layers
        cos_sin = (self.cos[positions].to(h.dtype).unsqueeze(1),
                   self.sin[positions].to(h.dtype).unsqueeze(1))
        for i, lw in enumerate(self.layers):
            h = h + self.attention_block(rms_norm(h, lw.input_norm, eps), lw, cos_sin, kv, i,
                                         meta)
            if meta.on_layer_done is not None:
                meta.on_layer_done(i)
            h = h + self.mlp(rms_norm(h, lw.post_norm, eps), lw)
        return rms_norm(h, self.norm, eps)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [n, vocab] for the rows that sample."""
        return linear(hidden, self.lm_head, contiguous=False).float()
