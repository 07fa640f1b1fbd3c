"""How much KV an `LLM` holds: the bytes its budget buys (on CUDA without a budget, what
gpu_memory_utilization leaves after the weights), the blocks that makes, and whether one
sequence of max_model_len fits in them and the pool in this machine's memory. Everything
here is checked before any memory is taken (a ConfigError naming the fix)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from kvsession.cache.block_pool import blocks_for
from kvsession.cache.kv_pool import kv_bytes_per_token
from kvsession.config import EngineConfig
from kvsession.errors import ConfigError
from kvsession.model.config import ModelSpec, check_sliding_window

log = logging.getLogger("kvsession")
CPU_DEFAULT_KV_BYTES = 2**30


@dataclass(frozen=True)
class RuntimeInfo:
    """Facts established at start-up (not configuration)."""

    spec: ModelSpec
    max_model_len: int
    num_blocks: int
    kv_bytes_per_token: int
    model_fingerprint: str
    weight_bytes: int  # what the loaded weights hold resident (LlamaModel.weight_bytes)


@dataclass(frozen=True)
class KVSizing:
    """The KV pool an engine builds: max_model_len (fitted when not configured), bytes per
    token of KV, blocks."""

    max_model_len: int
    kv_bytes_per_token: int
    num_blocks: int


def size_kv(cfg: EngineConfig, spec: ModelSpec) -> KVSizing:
    """The pool for `cfg` on a model of `spec`. max_model_len=None fits: the checkpoint's
    length (max_position_embeddings), kept within a sliding window kvsession does not
    implement, clamped to what the KV budget holds; the chosen value is logged with its
    reason. An explicit value that does not fit is a ConfigError naming the largest that
    does; so is a budget too small for any sequence, or a pool beyond this machine."""
    bpt = kv_bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim,
                             cfg.kv_cache_dtype)
    num_blocks = num_kv_blocks(cfg, spec, bpt)
    holds = num_blocks * cfg.block_size  # the longest sequence the budget holds
    budget = (f"kv_cache_memory holds {num_blocks} blocks of {cfg.block_size} tokens "
              f"({holds} tokens at {bpt} bytes/token)")
    if cfg.max_model_len is None:
        max_model_len = fitted_max_model_len(spec, holds, budget)
    else:
        max_model_len = cfg.max_model_len
        check_sliding_window(spec, max_model_len)
        if blocks_for(max_model_len, cfg.block_size) > num_blocks:
            raise ConfigError(
                f"max_model_len={max_model_len} does not fit: {budget}; the largest "
                f"max_model_len that fits is {holds}: pass it (or None, to fit), or raise "
                f"kv_cache_memory")
    check_memory_fits(cfg, holds * bpt)
    return KVSizing(max_model_len, bpt, num_blocks)


def fitted_max_model_len(spec: ModelSpec, holds: int, budget: str) -> int:
    """max_model_len=None: the checkpoint's length, within its sliding window (which
    kvsession does not implement: it must never apply), within what the budget holds."""
    length, why = spec.max_position_embeddings, "the checkpoint's max_position_embeddings"
    if spec.sliding_window is not None and spec.sliding_window < length:
        length, why = spec.sliding_window, (f"the checkpoint's sliding_window (it has "
                                            f"{spec.max_position_embeddings} positions; "
                                            f"kvsession does not implement the window)")
    if holds < length:
        length, why = holds, (f"what kv_cache_memory holds (the checkpoint has "
                              f"{spec.max_position_embeddings} positions); raise "
                              f"kv_cache_memory for more")
    if length < 2:
        raise ConfigError(f"{budget}: too little for any sequence; raise kv_cache_memory")
    log.info("max_model_len=%d: %s", length, why)
    return length


def weight_bytes(spec: ModelSpec, dtype: torch.dtype) -> int:
    h, hd, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    per_layer = h * hd * (2 * spec.num_heads + 2 * spec.num_kv_heads) + 3 * h * inter
    embed = spec.vocab_size * h * (1 if spec.tie_word_embeddings else 2)
    return (spec.num_layers * per_layer + embed) * torch.empty((), dtype=dtype).element_size()


def num_kv_blocks(cfg: EngineConfig, spec: ModelSpec, bytes_per_token: int) -> int:
    """How many blocks the KV budget holds (on CUDA without a budget: what is left of
    gpu_memory_utilization after the weights)."""
    budget = cfg.kv_cache_memory_bytes
    if budget is None and cfg.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(cfg.device)
        budget = int(total * cfg.gpu_memory_utilization) - (total - free) - weight_bytes(
            spec, cfg.dtype)
        budget = max(budget, 0)
    elif budget is None:
        budget = CPU_DEFAULT_KV_BYTES
    return budget // (bytes_per_token * cfg.block_size)


def check_memory_fits(cfg: EngineConfig, kv_bytes: int) -> None:
    """On CPU the KV pool is committed up front and the host tier can grow to its size: a
    budget beyond this machine's memory is a ConfigError now, not an allocator failure
    (or the OOM killer) later."""
    if cfg.device.type != "cpu":
        return
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system: nothing to check
        return
    if kv_bytes + cfg.host_cache_memory_bytes > physical:
        raise ConfigError(
            f"kv_cache_memory ({kv_bytes} bytes) + host_cache_memory "
            f"({cfg.host_cache_memory_bytes} bytes) exceed this machine's memory "
            f"({physical} bytes); lower them")
