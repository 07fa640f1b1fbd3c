"""kvsession: an embeddable LLM inference SDK whose KV cache is state, not a cache."""

from kvsession.errors import (
    CacheFullError,
    ConfigError,
    EngineClosedError,
    KVSessionError,
    ModelLoadError,
    RemotePrefillError,
    SessionClosedError,
    SessionLockedError,
    SessionLostError,
    SessionStoreError,
    SnapshotError,
    UnsupportedArchitectureError,
)
from kvsession.handles import AsyncTextStream, PinnedPrefix, TextStream
from kvsession.llm import LLM
from kvsession.metrics import SLO, RequestMetrics, Stats
from kvsession.outputs import CompletionOutput, RequestOutput, TextChunk
from kvsession.params import SamplingParams, StructuredOutput
from kvsession.session import Reply, Session, SessionStats, StreamChunk
from kvsession.tools import ToolCall

__all__ = [
    "LLM", "PinnedPrefix", "SamplingParams", "Session", "Reply", "StreamChunk", "SessionStats",
    "RequestOutput", "CompletionOutput", "StructuredOutput", "ToolCall", "TextStream", "TextChunk",
    "AsyncTextStream", "RequestMetrics", "Stats", "SLO",
    "KVSessionError", "ConfigError", "ModelLoadError", "CacheFullError", "SnapshotError",
    "SessionClosedError", "EngineClosedError", "SessionLockedError", "SessionLostError",
    "SessionStoreError", "RemotePrefillError", "UnsupportedArchitectureError",
]
__version__ = "0.1.0"
