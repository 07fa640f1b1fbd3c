"""Engine configuration: a frozen, validated dataclass built from `LLM(...)` arguments.

Validation happens here, before any memory is taken; every failure is a ConfigError that
names the argument and the accepted values. Runtime facts (the model spec, the number of
blocks actually allocated, the resolved device) live elsewhere (`RuntimeInfo` in sizing.py).
"""

from __future__ import annotations

import enum
import inspect
import logging
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvsession.cache.eviction import EvictionPolicy
from kvsession.errors import ConfigError
from kvsession.kernels import bf16_rows
from kvsession.kernels.cpp_build import cache_root
from kvsession.kernels.reference import is_fp8
from kvsession.model.config import checkpoint_dtype
from kvsession.model.hub import fetch, is_hub_id
from kvsession.tiers.object_store import check_options, check_url, is_url, open_store
from kvsession.tiers.session_mirror import local_root
from kvsession.validation import (
    SEED_RANGE,
    check_bool,
    check_float,
    check_int,
    check_str,
    reject_unknown,
)

logger = logging.getLogger("kvsession")


class RemotePrefillMode(enum.Enum):
    """Which prompts a prefill worker computes: AUTO, when the cost model's gain is
    positive; ALWAYS, whenever a worker can take it; REQUIRED, every one (as ALWAYS), and
    one that no worker prefills (none healthy, a timeout, a worker dying) fails with
    RemotePrefillError instead of being prefilled locally; NEVER. Prompts with less than a
    block of new tokens, and requests asking for prompt_logprobs, stay local in every mode."""

    AUTO = "auto"
    ALWAYS = "always"
    REQUIRED = "required"
    NEVER = "never"


class Durability(enum.Enum):
    """When a session's turn is on disk (with a session_dir): TURN, before send() returns
    (a write-ahead log record, fsynced; KV written behind); CLOSE, at close or spill."""

    TURN = "turn"
    CLOSE = "close"


class AttentionBackend(enum.Enum):
    AUTO = "auto"
    TORCH = "torch"
    TRITON = "triton"
    CPU = "cpu"  # the torch reference, decode attention by the C++ kernel (cpu_decode)


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
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
        if m and m.group(2).lower() in _SIZE_UNITS:
            n = float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
            if math.isfinite(n):
                return int(n)
    raise ConfigError(
        f"{name} must be bytes (int) or a size string like '6GiB' or '512MiB', got {value!r}")


def _choice(value: str, name: str, choices) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(f"{name}={value!r} is not supported; accepted: {sorted(choices)}")
    return value


def _path(value, name: str, allow_none: bool = False) -> Path | None:
    if value is None and allow_none:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"{name} must be {'None or ' if allow_none else ''}a directory path "
                          f"(str or Path), got {value!r}")
    return Path(value).expanduser()


def _auth_key_file(value) -> Path | None:
    """The caller's key file for authenticated prefill workers: it must exist and parse
    (docs/security.md)."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"prefill_auth_key_file must be None or the path of a caller key "
                          f"file, got {value!r}")
    from kvsession.connector.base import load_keys

    path = Path(value).expanduser()
    try:
        load_keys(path, "caller")
    except ConfigError as e:
        raise ConfigError(f"prefill_auth_key_file: {e}") from None
    return path


class WeightLayout(enum.Enum):
    """How the CPU keeps the projections' weights (model/linear.py has the measurements)."""

    SINGLE = "single"  # one copy: oneDNN's packed layout (a tied head: the checkpoint's rows)
    # also the checkpoint's rows for batch-1 decode (compiled one-row steps where they are
    # faster): twice the weight memory, for ~1.2-1.6x batch-1 float32 decode on some CPUs
    DUAL = "dual"


class Quantization(enum.Enum):
    """Weights quantized at load from a float checkpoint (model/linear.py)."""

    NONE = None
    INT8 = "int8"  # weight-only int8, a float scale per 32 inputs (llama.cpp's Q8_0 layout)


class GenerationConfigMode(enum.Enum):
    """Where requests' unset sampling fields come from (kvsession/generation_defaults.py)."""

    AUTO = "auto"  # the checkpoint's generation_config.json
    NONE = "none"  # SamplingParams' own defaults


def _durability(value) -> Durability:
    """How sessions persist in session_dir; without one nothing persists, whichever is set
    (so the default, "turn", is valid either way). None reads as the default."""
    if value is None:
        return Durability.TURN
    _choice(value, "durability", {d.value for d in Durability})
    return Durability(value)


@dataclass(frozen=True)
class PrefillCaps:
    """How long prompts share a step with short ones (vLLM's names; validated by
    EngineConfig, applied by the scheduler: engine/scheduler.py). A prompt is long while
    more than `long_prefill_token_threshold` of its tokens are left to compute."""

    max_num_partial_prefills: int  # prompts in the middle of their prefill at once
    max_long_partial_prefills: int  # long ones among them
    long_prefill_token_threshold: int  # a long prompt's chunk before the step's top-up


class SpeculativeMethod(enum.Enum):
    NGRAM = "ngram"  # drafts copied from earlier in the sequence (prompt lookup)


# the most draft tokens a sequence proposes in one step: each is computed in the verifying
# pass whether or not it is accepted, and on the 2-core CPU a verifying pass with 16 drafts
# already costs ~2x a decode step of a 0.5B model
MAX_SPECULATIVE_TOKENS = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    """`LLM(speculative_config={...})` (vLLM's names), validated by EngineConfig, used by
    the drafter (engine/drafts.py). Drafts of up to `num_speculative_tokens` are the tokens
    that followed the latest earlier occurrence of the sequence's last n tokens, n from
    `prompt_lookup_max` down to `prompt_lookup_min`."""

    method: SpeculativeMethod
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int


def _speculative(value) -> SpeculativeConfig | None:
    """LLM(speculative_config=None | {"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_max": n, "prompt_lookup_min": m})."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConfigError(f"speculative_config must be a dict or None, got {value!r}")
    known = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")
    reject_unknown("speculative_config", {k: v for k, v in value.items() if k not in known},
                   known)
    _choice(value.get("method"), "speculative_config.method",
            {m.value for m in SpeculativeMethod})
    k = check_int("speculative_config.num_speculative_tokens",
                  value.get("num_speculative_tokens"), min_value=1,
                  max_value=MAX_SPECULATIVE_TOKENS)
    hi = check_int("speculative_config.prompt_lookup_max", value.get("prompt_lookup_max", 4),
                   min_value=1, max_value=64)
    lo = check_int("speculative_config.prompt_lookup_min",
                   value.get("prompt_lookup_min", min(2, hi)), min_value=1, max_value=hi)
    return SpeculativeConfig(SpeculativeMethod(value["method"]), k, hi, lo)


@dataclass(frozen=True)
class ObjectStoreConfig:
    """LLM(object_store=..., object_store_options=..., object_store_memory=...)."""

    url: str
    # the store's and its client's options: they may hold credentials, so they are never
    # printed (repr) nor compared
    options: dict = field(repr=False, compare=False)
    memory_bytes: int  # the most this process keeps written there


# what the object store keeps of one model's blocks by default (every process's: the
# oldest are deleted beyond it; tiers/object_store.py)
OBJECT_STORE_MEMORY_DEFAULT = "16GiB"


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
    prefill_auth_key_file: Path | None = None  # the caller's CURVE key file
    eviction_policy: EvictionPolicy = EvictionPolicy.COST
    durability: Durability = Durability.TURN
    chat_template: str | None = None  # a template replacing the checkpoint's (its text)
    # whose sampling defaults requests start from (generation_defaults.py)
    generation_config: GenerationConfigMode = GenerationConfigMode.AUTO
    cpu_weight_layout: WeightLayout = WeightLayout.SINGLE
    quantization: Quantization = Quantization.NONE
    # the disk tier's cache blocks (tiers/disk_cache.py) under session_dir; None: none
    disk_cache_memory_bytes: int | None = None
    # how long prompts share a step with short ones (engine/scheduler.py); None: uncapped
    prefill_caps: PrefillCaps | None = None
    # drafts verified in one forward pass (engine/drafts.py); None: no speculation
    speculative: SpeculativeConfig | None = None
    # KV blocks in an object store (tiers/object_store.py); None: none
    object_store: ObjectStoreConfig | None = None
    # session_dir given as an object-store URL: sessions' logs and snapshots mirrored there
    # (tiers/session_mirror.py), session_dir then being its local directory; None: none
    session_store: ObjectStoreConfig | None = None

    @staticmethod
    def from_args(
        model, *, device="auto", dtype="auto", kv_cache_dtype="auto", max_model_len=None,
        block_size=16, kv_cache_memory=None, gpu_memory_utilization=0.90,
        host_cache_memory="4GiB", session_dir=None, max_num_seqs=64,
        max_num_batched_tokens=2048, enable_prefix_caching=True, max_pinned_fraction=0.5,
        spill_after_s=None, prefill_worker=None, remote_prefill="auto",
        remote_prefill_timeout_s=30.0, attention_backend="auto", seed=0,
        prefill_auth_key_file=None,
        eviction_policy="cost", durability="turn", chat_template=None, revision=None,
        download_dir=None, generation_config="auto", cpu_weight_layout="single",
        quantization=None, disk_cache_memory=None, max_num_partial_prefills=4,
        max_long_partial_prefills=1, long_prefill_token_threshold=None,
        speculative_config=None, object_store=None, object_store_options=None,
        object_store_memory=None, **unknown,
    ) -> EngineConfig:
        """The arguments of `LLM(...)`, validated; `**unknown` only exists so that a misspelt
        keyword is a ConfigError with a suggestion rather than a bare TypeError."""
        reject_unknown("LLM()", unknown, ENGINE_ARG_NAMES)
        session_store = local_session_dir = None
        if is_url(session_dir):  # sessions in an object store, through a local directory
            session_store = ObjectStoreConfig(check_url(session_dir, "session_dir"),
                                              check_options(object_store_options), 0)
            # (refused options fail here, before the model loads or a directory is made)
            open_store(session_store.url, session_store.options, "session_dir")
            local_session_dir = local_root(session_dir, cache_root(), session_store.options)
        check_str("revision", revision, allow_none=True)
        download = _path(download_dir, "download_dir", allow_none=True)
        if is_hub_id(model):  # "org/name" (a local path that exists wins)
            model = fetch(model, revision, download)
        elif revision is not None or download is not None:
            raise ConfigError("revision and download_dir apply to a hub id (model='org/name'); "
                              f"model={str(model)!r} is a local path")
        model_path = _path(model, "model")
        if not model_path.is_dir():
            raise ConfigError(f"model={str(model)!r} is not a directory")
        if not (model_path / "config.json").is_file():
            raise ConfigError(f"model={str(model)!r} has no config.json (not a HF checkpoint)")

        _choice(device, "device", {"auto", "cpu", "cuda"} | {f"cuda:{i}" for i in range(16)})
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device={device!r} but CUDA is not available; use 'cpu' or 'auto'")

        _choice(dtype, "dtype", {"auto", *COMPUTE_DTYPES})
        compute = COMPUTE_DTYPES[dtype] if dtype != "auto" else \
            checkpoint_dtype(model_path, COMPUTE_DTYPES) or \
            (torch.bfloat16 if dev.type == "cuda" else torch.float32)
        if dtype == "auto" and compute == torch.float16 and dev.type == "cpu" \
                and not bf16_rows.FP16_GEMM:
            # A CPU without AVX512-FP16 or AMX-FP16 has no float16 GEMM: ATen's float16
            # product streamed weights at ~0.8 GB/s on the AVX2 bench VM (~25x slower than
            # the bfloat16 kernel), so a float16 checkpoint runs as bfloat16: the same
            # bytes, its range, 3 fewer mantissa bits.
            compute = torch.bfloat16
            logger.info("the checkpoint is float16, which this CPU cannot multiply at speed: "
                        "computing in bfloat16 (dtype='float16' forces float16)")
        _choice(kv_cache_dtype, "kv_cache_dtype", {"auto", *KV_DTYPES})
        if kv_cache_dtype == "auto":
            kv = torch.float8_e4m3fn if dev.type == "cuda" else compute
        else:
            kv = KV_DTYPES[kv_cache_dtype]

        max_model_len = check_int("max_model_len", max_model_len, min_value=2, allow_none=True)
        block_size = check_int("block_size", block_size, min_value=1, max_value=1024)
        if block_size & (block_size - 1):
            raise ConfigError(
                f"block_size must be a power of two between 1 and 1024, got {block_size!r}")
        kv_bytes = None if kv_cache_memory is None else parse_num_bytes(
            kv_cache_memory, "kv_cache_memory")
        if kv_bytes == 0:
            raise ConfigError(f"kv_cache_memory must be > 0 bytes, got {kv_cache_memory!r}")
        workers = (prefill_worker,) if isinstance(prefill_worker, str) else prefill_worker or ()
        if not isinstance(workers, (list, tuple)):
            raise ConfigError("prefill_worker must be None, 'tcp://host:port' or a list of "
                              f"them, got {prefill_worker!r}")
        for w in workers:
            if not isinstance(w, str) or not re.fullmatch(r"tcp://[^:/]+:\d+", w):
                raise ConfigError(f"prefill_worker must look like 'tcp://host:port', got {w!r}")
        _choice(remote_prefill, "remote_prefill", {m.value for m in RemotePrefillMode})
        auth_file = _auth_key_file(prefill_auth_key_file)
        _choice(attention_backend, "attention_backend", {b.value for b in AttentionBackend})
        _choice(eviction_policy, "eviction_policy", {p.value for p in EvictionPolicy})
        durable = _durability(durability)
        template = _chat_template(chat_template)
        if generation_config is None:  # `--generation-config none` parses as None
            generation_config = GenerationConfigMode.NONE.value
        _choice(generation_config, "generation_config", {m.value for m in GenerationConfigMode})
        _choice(cpu_weight_layout, "cpu_weight_layout", {m.value for m in WeightLayout})
        if quantization is not None:
            _choice(quantization, "quantization",
                    {m.value for m in Quantization if m.value is not None})
        if quantization is not None and dev.type != "cpu":
            raise ConfigError(f"quantization={quantization!r} runs on the CPU (its kernel is a "
                              f"CPU one); on {dev.type} use dtype='bfloat16'")
        budget = check_int("max_num_batched_tokens", max_num_batched_tokens, min_value=1)
        caps = _prefill_caps(max_num_partial_prefills, max_long_partial_prefills,
                             long_prefill_token_threshold, budget)
        return EngineConfig(
            model=model_path, device=dev, dtype=compute, kv_cache_dtype=kv,
            max_model_len=max_model_len, block_size=block_size, kv_cache_memory_bytes=kv_bytes,
            gpu_memory_utilization=check_float(
                "gpu_memory_utilization", gpu_memory_utilization, min_value=0.0,
                min_inclusive=False, max_value=1.0),
            host_cache_memory_bytes=parse_num_bytes(host_cache_memory, "host_cache_memory"),
            session_dir=local_session_dir if session_store is not None else
            _path(session_dir, "session_dir", allow_none=True),
            max_num_seqs=check_int("max_num_seqs", max_num_seqs, min_value=1),
            max_num_batched_tokens=budget,
            enable_prefix_caching=check_bool("enable_prefix_caching", enable_prefix_caching),
            max_pinned_fraction=check_float(
                "max_pinned_fraction", max_pinned_fraction, min_value=0.0, max_value=1.0),
            spill_after_s=check_float("spill_after_s", spill_after_s, min_value=0.0,
                                      allow_none=True, finite=True),
            prefill_workers=tuple(workers), remote_prefill=RemotePrefillMode(remote_prefill),
            remote_prefill_timeout_s=check_float(
                "remote_prefill_timeout_s", remote_prefill_timeout_s, min_value=0.0,
                min_inclusive=False, finite=True),
            attention_backend=AttentionBackend(attention_backend),
            seed=check_int("seed", seed, min_value=SEED_RANGE[0], max_value=SEED_RANGE[1]),
            prefill_auth_key_file=auth_file,
            eviction_policy=EvictionPolicy(eviction_policy),
            durability=durable, chat_template=template,
            generation_config=GenerationConfigMode(generation_config),
            cpu_weight_layout=WeightLayout(cpu_weight_layout),
            quantization=Quantization(quantization),
            disk_cache_memory_bytes=_disk_cache_bytes(disk_cache_memory, session_dir),
            prefill_caps=caps,
            speculative=_speculative(speculative_config),
            object_store=_object_store(object_store, object_store_options,
                                       object_store_memory, session_store),
            session_store=session_store,
        )

    @property
    def kv_cache_dtype_name(self) -> str:
        return "fp8_e4m3" if is_fp8(self.kv_cache_dtype) else str(
            self.kv_cache_dtype).removeprefix("torch.")


# a long prompt's chunk before the step's top-up, by default: this share of the step's budget
# (512 of 2,048 tokens), so that a long prefill leaves three quarters of a step to the short
# requests that arrive beside it, and still takes all of it when none do
LONG_PREFILL_BUDGET_DIVISOR = 4


def _prefill_caps(max_partial, max_long, threshold, budget: int) -> PrefillCaps | None:
    """LLM(max_num_partial_prefills=, max_long_partial_prefills=,
    long_prefill_token_threshold=): None when the threshold is 0 (uncapped: a prefill takes
    all the budget left, as before the caps)."""
    max_partial = check_int("max_num_partial_prefills", max_partial, min_value=1)
    max_long = check_int("max_long_partial_prefills", max_long, min_value=1)
    if max_long > max_partial:
        raise ConfigError(f"max_long_partial_prefills ({max_long}) must be at most "
                          f"max_num_partial_prefills ({max_partial})")
    if threshold is None:
        threshold = max(budget // LONG_PREFILL_BUDGET_DIVISOR, 1)
    threshold = check_int("long_prefill_token_threshold", threshold, min_value=0,
                          max_value=budget)
    if threshold == 0:
        return None
    return PrefillCaps(max_partial, max_long, threshold)


def _disk_cache_bytes(value, session_dir) -> int | None:
    """LLM(disk_cache_memory=...): the disk cache lives in session_dir, so it needs one."""
    if value is None:
        return None
    n = parse_num_bytes(value, "disk_cache_memory")
    if n and session_dir is None:
        raise ConfigError("disk_cache_memory needs a session_dir (the disk cache is a file "
                          "there)")
    return n


def _object_store(url, options, memory, session_store) -> ObjectStoreConfig | None:
    """LLM(object_store=, object_store_options=, object_store_memory=)."""
    if url is None:
        if memory is not None or (options is not None and session_store is None):
            raise ConfigError("object_store_options and object_store_memory apply to an "
                              "object_store (its URL; the options also to a session_dir "
                              "that is one)")
        return None
    cfg = ObjectStoreConfig(check_url(url), check_options(options), parse_num_bytes(
        OBJECT_STORE_MEMORY_DEFAULT if memory is None else memory, "object_store_memory"))
    open_store(cfg.url, cfg.options)  # refused options fail here, before the model loads
    return cfg


def _chat_template(value) -> str | None:
    """LLM(chat_template=...): a template's text (it has `{{` or `{%`), or the path of a
    file holding one; None keeps the checkpoint's."""
    if value is None:
        return None
    if isinstance(value, str) and ("{{" in value or "{%" in value):
        return value
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"chat_template must be None, a template or a file's path, got "
                          f"{value!r:.80}")
    path = Path(value)
    if not path.is_file():
        raise ConfigError(f"chat_template={str(value)!r:.120} is neither a template (it has no "
                          f"'{{{{' or '{{%') nor a file")
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"chat_template: cannot read {path}: {e}") from None


# LLM()'s keyword arguments (everything after `model`), read off the signature so it cannot drift
ENGINE_ARG_NAMES: tuple[str, ...] = tuple(
    p.name for p in inspect.signature(EngineConfig.from_args).parameters.values()
    if p.kind is inspect.Parameter.KEYWORD_ONLY)
