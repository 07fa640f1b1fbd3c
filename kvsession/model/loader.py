"""Read a checkpoint's safetensors (single file or sharded index) into named tensors.

Tensors are memory-mapped by safetensors, checked against the shapes the spec implies,
cast to the compute dtype and moved to the device. Every problem is a ModelLoadError that
names the file or tensor.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from kvsession.errors import ModelLoadError
from kvsession.model.config import ModelSpec

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def checkpoint_files(model_dir: Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index} is malformed: {e!r}") from None
        if not isinstance(weight_map, dict) or not all(
                isinstance(v, str) for v in weight_map.values()):
            raise ModelLoadError(f"{index} is malformed: weight_map must map tensor names to "
                                 f"file names")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    elif (model_dir / "model.safetensors").is_file():
        files = [model_dir / "model.safetensors"]
    else:
        raise ModelLoadError(
            f"missing file: no model.safetensors or model.safetensors.index.json in {model_dir}")
    for f in files:
        if not f.is_file():
            raise ModelLoadError(f"missing file: {f} (listed in the safetensors index)")
    return files


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor name the model needs -> its shape (HF naming)."""
    h, hd = spec.hidden_size, spec.head_dim
    q_out, kv_out = spec.num_heads * hd, spec.num_kv_heads * hd
    shapes = {"model.embed_tokens.weight": (spec.vocab_size, h), "model.norm.weight": (h,)}
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q_out, h),
            p + "self_attn.k_proj.weight": (kv_out, h),
            p + "self_attn.v_proj.weight": (kv_out, h),
            p + "self_attn.o_proj.weight": (h, q_out),
            p + "mlp.gate_proj.weight": (spec.intermediate_size, h),
            p + "mlp.up_proj.weight": (spec.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, spec.intermediate_size),
        }
        if spec.qkv_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q_out,),
                       p + "self_attn.k_proj.bias": (kv_out,),
                       p + "self_attn.v_proj.bias": (kv_out,)}
        if spec.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if spec.mlp_bias:
            shapes |= {p + "mlp.gate_proj.bias": (spec.intermediate_size,),
                       p + "mlp.up_proj.bias": (spec.intermediate_size,),
                       p + "mlp.down_proj.bias": (h,)}
        if spec.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
    return shapes


def load_weights(model_dir: Path, spec: ModelSpec, dtype: torch.dtype,
                 device: torch.device) -> dict[str, torch.Tensor]:
    """All tensors the spec needs, verified, in `dtype` on `device`. Extra tensors (e.g. a
    redundant lm_head with tied embeddings, rotary buffers) are ignored."""
    wanted = expected_shapes(spec)
    out: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(model_dir):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name not in wanted:
                        continue
                    t = f.get_tensor(name)
                    if tuple(t.shape) != wanted[name]:
                        raise ModelLoadError(
                            f"tensor {name!r} in {path.name} has shape {tuple(t.shape)}, "
                            f"expected {wanted[name]}")
                    if t.dtype not in FLOAT_DTYPES:  # quantized: cast, its values are garbage
                        raise ModelLoadError(
                            f"tensor {name!r} in {path.name} is {t.dtype}: kvsession loads "
                            f"float weights (float32, bfloat16, float16), not quantized ones")
                    # unconverted, this is a view of the file's mapping: the model copies
                    # every tensor it keeps (LlamaModel._own), so that no view keeps the
                    # whole file resident for as long as the model lives
                    out[name] = t.to(device=device, dtype=dtype)
        except ModelLoadError:
            raise
        except Exception as e:  # safetensors raises its own error types for bad files
            raise ModelLoadError(f"cannot read {path}: {e}") from None
    missing = [n for n in wanted if n not in out]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ModelLoadError(f"missing tensor(s) {missing[:3]}{more} in {model_dir}")
    return out


def weights_digest(model_dir: Path, num_samples: int = 64, sample_bytes: int = 4096) -> str:
    """sha256 over every safetensors header (names, dtypes, shapes, offsets), each file's
    size and `num_samples` evenly spaced chunks of its tensor bytes: cheap on a 16 GB
    checkpoint (a few hundred KiB read), yet different for two checkpoints of the same
    shape with different weights. Used in the model fingerprint."""
    h = hashlib.sha256()
    for path in checkpoint_files(model_dir):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise ModelLoadError(f"{path} is truncated")
            (n,) = struct.unpack("<Q", head)
            h.update(f.read(min(n, 100_000_000)))
            start = 8 + n
            span = max(size - start - sample_bytes, 0)
            for i in range(num_samples):
                f.seek(start + span * i // max(num_samples - 1, 1))
                h.update(f.read(sample_bytes))
    return h.hexdigest()
