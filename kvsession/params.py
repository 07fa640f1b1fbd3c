"""Per-request sampling parameters (public) and their validation."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvsession.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. temperature 0 is greedy; frozen, validated on construction."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    cache_salt: str | None = None
    # Normalised forms, filled in __post_init__ (not constructor arguments).
    stop_strings: tuple[str, ...] = field(init=False, repr=False, default=())
    stop_ids: frozenset[int] = field(init=False, repr=False, default=frozenset())

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0.0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k == 0 or self.top_k < -1:
            raise ConfigError(f"top_k must be -1 (off) or an int >= 1, got {self.top_k!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise ConfigError(f"logprobs must be None or an int >= 0, got {self.logprobs!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ConfigError(f"seed must be None or an int, got {self.seed!r}")
        stop = self.stop
        strings = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if any(not isinstance(s, str) or not s for s in strings):
            raise ConfigError(f"stop must be a non-empty string or a list of them, got {stop!r}")
        ids = tuple(self.stop_token_ids or ())
        if any(not isinstance(i, int) or i < 0 for i in ids):
            raise ConfigError(f"stop_token_ids must be non-negative ints, got {ids!r}")
        object.__setattr__(self, "stop_strings", strings)
        object.__setattr__(self, "stop_ids", frozenset(ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
