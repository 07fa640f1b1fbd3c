"""The string choices of the public API as `Literal` types, so that IDEs and type checkers
complete and check them (`LLM(...)`, `Session.send(tool_choice=...)`). Each is the value
set of the enum the configuration parses it into (config.py, tools.py, cache/eviction.py);
tests/test_typed_surface.py holds them equal, so a new value cannot be missed here."""

from __future__ import annotations

from typing import Literal

Device = Literal["auto", "cpu", "cuda"]  # or "cuda:N"
DType = Literal["auto", "float32", "bfloat16", "float16"]
KVCacheDType = Literal["auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3"]
RemotePrefill = Literal["auto", "always", "required", "never"]
AttentionBackendName = Literal["auto", "torch", "triton", "cpu"]
EvictionPolicyName = Literal["cost", "lru"]
DurabilityName = Literal["turn", "close"]
GenerationConfigName = Literal["auto", "none"]
WeightLayoutName = Literal["single", "dual"]
QuantizationName = Literal["int8"]
ToolChoiceName = Literal["auto", "none", "required"]  # or {"type": "function", ...}
