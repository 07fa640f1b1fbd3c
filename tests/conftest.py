"""Shared fixtures: tiny random checkpoints (built once per test session) and the HF oracle."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from kvsession.testing import make_tiny_model

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """arch -> checkpoint dir, created lazily, once per session."""

    @functools.cache
    def get(arch: str, **overrides):
        name = arch + "".join(f"-{k}{v}" for k, v in sorted(overrides.items()))
        return make_tiny_model(tmp_path_factory.mktemp(name), arch=arch, **overrides)

    return get


@pytest.fixture(scope="session")
def llama_dir(model_dirs):
    return model_dirs("llama")


def hf_greedy(model_dir, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The oracle: transformers' greedy generate, one prompt at a time (no padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                               min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return outs


def random_prompts(seed: int, lengths: list[int], vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
