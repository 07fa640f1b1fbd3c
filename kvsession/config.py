"""Engine configuration: a frozen, validated dataclass built from `LLM(...)` arguments.

Validation happens here, before any memory is taken; every failure is a ConfigError that
names the argument and the accepted values. Runtime facts (the model spec, the number of
blocks actually allocated, the resolved device) live elsewhere (`RuntimeInfo` in llm.py).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from kvsession.errors import ConfigError


class RemotePrefillMode(enum.Enum):
    AUTO = "auto"
    ALWAYS = "always"
    NEVER = "never"


class AttentionBackend(enum.Enum):
    AUTO = "auto"
    TORCH = "torch"
    TRITON = "triton"


COMPUTE_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
KV_DTYPES = {
    **COMPUTE_DTYPES,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
}
_SIZE_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
               "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_num_bytes(value: int | str, name: str) -> int:
    """'6GiB' / '512MiB' / 1024 -> bytes. Raises ConfigError naming `name` otherwise."""
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be bytes (int) or a size string like '6GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{name} must be >= 0 bytes, got {value}")
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
        if m and m.group(2).lower() in _SIZE_UNITS:
            return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    raise ConfigError(
        f"{name} must be bytes (int) or a size string like '6GiB' or '512MiB', got {value!r}")


def _choice(value: str, name: str, choices) -> str:
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not supported; accepted: {sorted(choices)}")
    return value


@dataclass(frozen=True)
class EngineConfig:
    """Everything `LLM(...)` was asked for, resolved and validated (no runtime facts)."""

    model: Path
    device: torch.device
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    max_model_len: int | None
    block_size: int
    kv_cache_memory_bytes: int | None
    gpu_memory_utilization: float
    host_cache_memory_bytes: int
    session_dir: Path | None
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool
    max_pinned_fraction: float
    spill_after_s: float | None
    prefill_workers: tuple[str, ...]
    remote_prefill: RemotePrefillMode
    remote_prefill_timeout_s: float
    attention_backend: AttentionBackend
    seed: int

    @staticmethod
    def from_args(
        model, device="auto", dtype="auto", kv_cache_dtype="auto", max_model_len=None,
        block_size=16, kv_cache_memory=None, gpu_memory_utilization=0.90,
        host_cache_memory="4GiB", session_dir=None, max_num_seqs=64,
        max_num_batched_tokens=2048, enable_prefix_caching=True, max_pinned_fraction=0.5,
        spill_after_s=None, prefill_worker=None, remote_prefill="auto",
        remote_prefill_timeout_s=30.0, attention_backend="auto", seed=0,
    ) -> EngineConfig:
        if not isinstance(model, (str, Path)):
            raise ConfigError(f"model must be a checkpoint directory path, got {model!r}")
        model_path = Path(model).expanduser()
        if not model_path.is_dir():
            raise ConfigError(f"model={str(model)!r} is not a directory")
        if not (model_path / "config.json").is_file():
            raise ConfigError(f"model={str(model)!r} has no config.json (not a HF checkpoint)")

        _choice(device if isinstance(device, str) else "", "device",
                {"auto", "cpu", "cuda"} | {f"cuda:{i}" for i in range(16)})
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device={device!r} but CUDA is not available; use 'cpu' or 'auto'")

        _choice(dtype, "dtype", {"auto", *COMPUTE_DTYPES})
        compute = (torch.bfloat16 if dev.type == "cuda" else torch.float32) \
            if dtype == "auto" else COMPUTE_DTYPES[dtype]
        _choice(kv_cache_dtype, "kv_cache_dtype", {"auto", *KV_DTYPES})
        if kv_cache_dtype == "auto":
            kv = torch.float8_e4m3fn if dev.type == "cuda" else compute
        else:
            kv = KV_DTYPES[kv_cache_dtype]

        if max_model_len is not None and (not isinstance(max_model_len, int) or max_model_len < 2):
            raise ConfigError(f"max_model_len must be None or an int >= 2, got {max_model_len!r}")
        if (not isinstance(block_size, int) or block_size < 1
                or block_size & (block_size - 1) or block_size > 1024):
            raise ConfigError(
                f"block_size must be a power of two between 1 and 1024, got {block_size!r}")
        kv_bytes = None if kv_cache_memory is None else parse_num_bytes(
            kv_cache_memory, "kv_cache_memory")
        if kv_bytes is not None and kv_bytes == 0:
            raise ConfigError("kv_cache_memory must be > 0")
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
        host_bytes = parse_num_bytes(host_cache_memory, "host_cache_memory")
        for name, v in (("max_num_seqs", max_num_seqs),
                        ("max_num_batched_tokens", max_num_batched_tokens)):
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {v!r}")
        if not 0.0 <= max_pinned_fraction <= 1.0:
            raise ConfigError(
                f"max_pinned_fraction must be in [0, 1], got {max_pinned_fraction!r}")
        if spill_after_s is not None and not spill_after_s >= 0:
            raise ConfigError(f"spill_after_s must be None or >= 0, got {spill_after_s!r}")
        workers = (prefill_worker,) if isinstance(prefill_worker, str) else tuple(
            prefill_worker or ())
        for w in workers:
            if not isinstance(w, str) or not re.fullmatch(r"tcp://[^:/]+:\d+", w):
                raise ConfigError(f"prefill_worker must look like 'tcp://host:port', got {w!r}")
        _choice(remote_prefill, "remote_prefill", {m.value for m in RemotePrefillMode})
        if not remote_prefill_timeout_s > 0:
            raise ConfigError(
                f"remote_prefill_timeout_s must be > 0, got {remote_prefill_timeout_s!r}")
        _choice(attention_backend, "attention_backend", {b.value for b in AttentionBackend})
        if not isinstance(seed, int):
            raise ConfigError(f"seed must be an int, got {seed!r}")
        return EngineConfig(
            model=model_path, device=dev, dtype=compute, kv_cache_dtype=kv,
            max_model_len=max_model_len, block_size=block_size, kv_cache_memory_bytes=kv_bytes,
            gpu_memory_utilization=float(gpu_memory_utilization),
            host_cache_memory_bytes=host_bytes,
            session_dir=None if session_dir is None else Path(session_dir).expanduser(),
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=bool(enable_prefix_caching),
            max_pinned_fraction=float(max_pinned_fraction), spill_after_s=spill_after_s,
            prefill_workers=workers, remote_prefill=RemotePrefillMode(remote_prefill),
            remote_prefill_timeout_s=float(remote_prefill_timeout_s),
            attention_backend=AttentionBackend(attention_backend), seed=seed,
        )

    @property
    def kv_cache_dtype_name(self) -> str:
        return "fp8_e4m3" if self.kv_cache_dtype == torch.float8_e4m3fn else str(
            self.kv_cache_dtype).removeprefix("torch.")
