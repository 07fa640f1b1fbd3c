"""The suite's one way to build an `LLM` on a tiny model (kvsession.testing's checkpoints,
the `model_dirs` / `llama_dir` fixtures): a small KV budget and context, so tests are fast
and pools small enough for the integrity check after every step; any argument overrides.
Test modules that need other defaults bind them once (`functools.partial`)."""

from __future__ import annotations

from kvsession import LLM

TINY = {"kv_cache_memory": "8MiB", "max_model_len": 512}


def tiny_llm(model_dir, **overrides) -> LLM:
    return LLM(model_dir, **{**TINY, **overrides})
