"""Shared fixtures: tiny random checkpoints (built once per test session) and the HF oracle."""

from __future__ import annotations

import functools
import os

import pytest

from kvsession.testing import make_tiny_model

# Triton kernels run on CPU tensors through Triton's interpreter in the tests; this must be
# set before any kernel module is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """arch -> checkpoint dir, created lazily, once per session."""

    @functools.cache
    def get(arch: str, **overrides):
        # dict-valued overrides arrive as tuples of items (hashable for the cache)
        kwargs = {k: dict(v) if isinstance(v, tuple) else v for k, v in overrides.items()}
        return make_tiny_model(tmp_path_factory.mktemp(arch), arch=arch, **kwargs)

    return get


@pytest.fixture(scope="session")
def llama_dir(model_dirs):
    return model_dirs("llama")
