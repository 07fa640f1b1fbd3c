"""Shared fixtures: tiny random checkpoints (built once per test session) and the HF oracle."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path


# `python -m pytest` puts the working directory first on sys.path. From the repository root
# that makes kernels/ (packaged as kvsession.kernels) importable as a top-level `kernels`,
# which would shadow the Hugging Face package of that name: transformers (5.25 on) requires
# it and imports it when its models load. So the real one is imported first, with the root
# out of the way, and sys.modules serves it from then on. The root stays on sys.path: a
# mutated copy of the tree (tests/mutations.py) is imported from there.
def _import_hub_kernels() -> None:
    import importlib
    import importlib.util

    root = Path(__file__).resolve().parents[1]
    saved = sys.path[:]
    sys.path[:] = [p for p in saved if Path(p or ".").resolve() != root]
    try:
        if importlib.util.find_spec("kernels") is not None:
            importlib.import_module("kernels")
    finally:
        sys.path[:] = saved


_import_hub_kernels()

import pytest  # noqa: E402

from kvsession.testing import make_tiny_model  # noqa: E402

# Triton kernels run on CPU tensors through Triton's interpreter in the tests; this must be
# set before any kernel module is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Every LLM built by a test checks that each block reference is held by a known holder,
# after every step (small pools) and when it closes; close() raises if it ever failed.
os.environ.setdefault("KVSESSION_CHECK_INTEGRITY", "1")
# The suite is the CPU suite even on a GPU machine (device="auto" would otherwise pick CUDA
# and run interpreted kernels on it); test_gpu.py gives its subprocesses the GPUs back.
if "KVSESSION_VISIBLE_GPUS" not in os.environ:
    os.environ["KVSESSION_VISIBLE_GPUS"] = os.environ.get("CUDA_VISIBLE_DEVICES", "<all>")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


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
