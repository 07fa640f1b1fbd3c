"""HF config.json -> ModelSpec, for both layouts found in the wild.

Classic hub layout: `rope_theta` / `rope_scaling` at the top level, `torch_dtype`.
Current transformers layout: `rope_parameters` (with `rope_theta` inside), `dtype`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvsession.errors import ModelLoadError, UnsupportedArchitectureError

if TYPE_CHECKING:
    import torch

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelSpec:
    """The geometry and options of one Llama-family model; no tensors."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeSpec
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    hidden_act: str
    checkpoint_dtype: str | None

    def to_dict(self) -> dict:
        """A JSON-able dict (used for the model fingerprint and snapshot headers)."""
        d = dict(self.__dict__)
        d["rope"] = dict(self.rope.__dict__)
        return d


def checkpoint_dtype(model_dir: Path, known: dict[str, torch.dtype]) -> torch.dtype | None:
    """The dtype the checkpoint's config.json names (`dtype`, or the older `torch_dtype`) when
    it is one of `known` ({name: dtype}); None otherwise (a missing or unreadable config is
    reported where the model loads). transformers' `torch_dtype="auto"` reads the same."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    name = dtype_name(cfg) if isinstance(cfg, dict) else None
    return known.get(name) if isinstance(name, str) else None


def dtype_name(cfg: dict):
    """The dtype a config.json names: `dtype` (current transformers) or `torch_dtype`."""
    return cfg.get("dtype") or cfg.get("torch_dtype")


def read_json(path: Path) -> dict:
    """A checkpoint's JSON object file; ModelLoadError when missing or malformed."""
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"missing file: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


def _rope_spec(cfg: dict) -> RopeSpec:
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params:  # current layout (its theta may sit outside it)
        theta, scaling = params.get("rope_theta", cfg.get("rope_theta", 10000.0)), params
    else:  # classic layout
        theta, scaling = cfg.get("rope_theta", 10000.0), cfg.get("rope_scaling") or {}
    if not isinstance(scaling, dict):
        raise ModelLoadError(f"config.json: rope scaling must be an object, got {scaling!r:.80}")
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported rope type {rope_type!r}; supported: {list(SUPPORTED_ROPE_TYPES)}")
    kwargs = {}
    if rope_type in ("linear", "llama3"):
        kwargs["factor"] = float(scaling["factor"])
    if rope_type == "llama3":
        kwargs.update(
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))
    return RopeSpec(theta=float(theta), rope_type=rope_type, **kwargs)


def load_model_spec(model_dir: Path) -> ModelSpec:
    cfg = read_json(Path(model_dir) / "config.json")
    quant = cfg.get("quantization_config")
    if quant:  # its weights are scaled integers or fp8: read as floats they are garbage
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise ModelLoadError(f"quantized checkpoints are not supported (quantization_config: "
                             f"{method!r}); use the float (float32, bfloat16, float16) weights")
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {archs or cfg.get('model_type')!r}; "
            f"supported: {list(SUPPORTED_ARCHITECTURES)}")
    try:
        hidden = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
        head_dim = int(cfg.get("head_dim") or hidden // num_heads)
        spec = ModelSpec(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            rope=_rope_spec(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            o_bias=arch != "Qwen2ForCausalLM" and bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=_sliding_window(arch, cfg),
            hidden_act=cfg.get("hidden_act", "silu"),
            checkpoint_dtype=dtype_name(cfg),
        )
    except KeyError as e:
        raise ModelLoadError(f"config.json is missing required field {e.args[0]!r}") from None
    except (TypeError, ValueError, ZeroDivisionError, AttributeError) as e:
        raise ModelLoadError(f"config.json has a malformed field: {e}") from None
    if spec.hidden_act != "silu":
        raise ModelLoadError(f"unsupported hidden_act {spec.hidden_act!r}; supported: ['silu']")
    if min(hidden, num_heads, num_kv_heads, head_dim, spec.num_layers, spec.vocab_size,
           spec.intermediate_size) <= 0:
        raise ModelLoadError("config.json: sizes (hidden_size, num_attention_heads, "
                             "num_key_value_heads, head_dim, num_hidden_layers, vocab_size, "
                             "intermediate_size) must be positive")
    if num_heads % num_kv_heads:
        raise ModelLoadError(
            f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads="
            f"{num_kv_heads}")
    return spec


def _sliding_window(arch: str, cfg: dict) -> int | None:
    """The attention window the checkpoint's layers apply, as transformers builds them; None
    when no layer has one."""
    if arch.startswith("Qwen"):
        # Qwen2/3 configs carry sliding_window but apply it only with use_sliding_window, and
        # then only on the layers layer_types names (by default those from max_window_layers
        # on): with none of those, attention is full everywhere.
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
        if window is None:
            return None
        layers = int(cfg.get("num_hidden_layers", 0))
        layer_types = cfg.get("layer_types") or [
            "sliding_attention" if i >= int(cfg.get("max_window_layers", 28))
            else "full_attention" for i in range(layers)]
        return int(window) if "sliding_attention" in layer_types else None
    # MistralConfig's default when the key is absent (transformers applies it)
    window = cfg.get("sliding_window", 4096 if arch.startswith("Mistral") else None)
    return None if window is None else int(window)


def check_sliding_window(spec: ModelSpec, max_model_len: int) -> None:
    """A window only changes attention for sequences longer than it. We do not implement
    windowed attention, so a model whose window is shorter than max_model_len is refused
    instead of being silently run with full attention."""
    if spec.sliding_window is not None and spec.sliding_window < max_model_len:
        raise ModelLoadError(
            f"{spec.architecture} uses sliding_window={spec.sliding_window}, which kvsession "
            f"does not implement; pass max_model_len <= {spec.sliding_window} (asked for "
            f"{max_model_len}) so the window never applies")
