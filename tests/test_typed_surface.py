"""The public API's types: the package ships `py.typed`, its string choices are `Literal`s
(kvsession/choices.py) equal to the values the configuration accepts, and the annotations
of `LLM(...)` and `Session.send` resolve to them."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest

import kvsession
from kvsession import LLM, choices
from kvsession.cache.eviction import EvictionPolicy
from kvsession.config import (
    COMPUTE_DTYPES,
    KV_DTYPES,
    AttentionBackend,
    Durability,
    GenerationConfigMode,
    Quantization,
    RemotePrefillMode,
    WeightLayout,
)
from kvsession.session import Session
from kvsession.tools import ToolChoice


def values(literal) -> set[str]:
    return set(typing.get_args(literal))


@pytest.mark.parametrize("literal, accepted", [
    (choices.DType, {"auto", *COMPUTE_DTYPES}),
    (choices.KVCacheDType, {"auto", *KV_DTYPES}),
    (choices.RemotePrefill, {m.value for m in RemotePrefillMode}),
    (choices.AttentionBackendName, {m.value for m in AttentionBackend}),
    (choices.EvictionPolicyName, {m.value for m in EvictionPolicy}),
    (choices.DurabilityName, {m.value for m in Durability}),
    (choices.GenerationConfigName, {m.value for m in GenerationConfigMode}),
    (choices.WeightLayoutName, {m.value for m in WeightLayout}),
    (choices.QuantizationName, {m.value for m in Quantization} - {None}),  # None: off
    (choices.ToolChoiceName, {m.value for m in ToolChoice} - {"named"}),
])
def test_each_literal_is_the_set_the_configuration_accepts(literal, accepted):
    assert values(literal) == accepted


def test_the_package_is_typed_and_its_annotations_resolve():
    assert (Path(kvsession.__file__).parent / "py.typed").is_file()
    hints = typing.get_type_hints(LLM.__init__)
    assert values(typing.get_args(hints["device"])[0]) == {"auto", "cpu", "cuda"}
    assert hints["dtype"] is choices.DType and hints["kv_cache_dtype"] is choices.KVCacheDType
    assert hints["quantization"] == choices.QuantizationName | None
    assert "required" in values(typing.get_args(
        typing.get_type_hints(Session.send)["tool_choice"])[0])
