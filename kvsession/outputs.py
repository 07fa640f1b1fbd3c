"""What `LLM.generate` / `LLM.chat` return."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvsession.metrics import RequestMetrics


@dataclass
class RequestOutput:
    """One finished request. `text` excludes any matched stop string; `logprobs` (if asked)
    has one {token_id: logprob} dict per generated token."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    num_cached_tokens: int
    metrics: RequestMetrics
    logprobs: list[dict[int, float]] | None = field(default=None, repr=False)
