"""Per-request sampling parameters (public) and their validation."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from kvsession.errors import ConfigError
from kvsession.validation import (
    SEED_RANGE,
    check_bool,
    check_float,
    check_int,
    check_str,
    reject_unknown,
)

# temperatures below this sample greedily (vLLM's _SAMPLING_EPS): dividing logits by a tinier
# one overflows float32 to inf, and the tempered distribution is one-hot well before that
SAMPLING_EPS = 1e-5
# vLLM's default max_logprobs: asking for more there is an error, so it is here too
MAX_LOGPROBS = 20
# names users reach for that spelling alone does not lead back to the argument
_HINTS = {"stop_strings": "stop", "stop_ids": "stop_token_ids", "max_new_tokens": "max_tokens"}


def _seq(name: str, value, accepted: str, check) -> tuple | None:
    """A list/tuple -> a tuple of checked items (hashable, so the params are too)."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{name} must be None or {accepted}, got {value!r}")
    return tuple(check(item) for item in value)


@dataclass(frozen=True, init=False)
class SamplingParams:
    """How to sample one request; frozen, validated on construction. temperature 0 (or any
    below SAMPLING_EPS = 1e-5) and top_k 1 are greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] | str | None = None
    stop_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    cache_salt: str | None = None
    # Normalised forms, filled in __init__ (not constructor arguments).
    stop_strings: tuple[str, ...] = field(init=False, repr=False, default=())
    stop_ids: frozenset[int] = field(init=False, repr=False, default=frozenset())

    def __init__(self, /, *, max_tokens: int = 16, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = -1, seed: int | None = None,
                 stop: str | list[str] | tuple[str, ...] | None = None,
                 stop_token_ids: list[int] | tuple[int, ...] | None = None,
                 ignore_eos: bool = False, logprobs: int | None = None,
                 cache_salt: str | None = None, **unknown) -> None:
        reject_unknown("SamplingParams()", unknown, SAMPLING_ARG_NAMES, hints=_HINTS)
        top_k = check_int("top_k", top_k, min_value=-1)
        if top_k == 0:
            raise ConfigError(f"top_k must be -1 (off) or an int >= 1, got {top_k!r}")
        if isinstance(stop, str):
            check_str("stop", stop, non_empty=True)
        else:
            stop = _seq("stop", stop, "a non-empty string or a list of them",
                        lambda s: check_str("stop", s, non_empty=True))
        ids = _seq("stop_token_ids", stop_token_ids, "a list of token ids (ints >= 0)",
                   lambda i: check_int("stop_token_ids", i, min_value=0))
        values = {
            "max_tokens": check_int("max_tokens", max_tokens, min_value=1),
            "temperature": check_float("temperature", temperature, min_value=0.0),
            "top_p": check_float("top_p", top_p, min_value=0.0, min_inclusive=False,
                                 max_value=1.0),
            "top_k": top_k,
            "seed": check_int("seed", seed, min_value=SEED_RANGE[0], max_value=SEED_RANGE[1],
                              allow_none=True),
            "stop": stop,
            "stop_token_ids": ids,
            "ignore_eos": check_bool("ignore_eos", ignore_eos),
            "logprobs": check_int("logprobs", logprobs, min_value=0, max_value=MAX_LOGPROBS,
                                  allow_none=True),
            "cache_salt": check_str("cache_salt", cache_salt, allow_none=True),
            "stop_strings": (stop,) if isinstance(stop, str) else stop or (),
            "stop_ids": frozenset(ids or ()),
        }
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def with_overrides(self, **overrides) -> SamplingParams:
        """A validated copy with `overrides` applied (e.g. one session turn's settings)."""
        reject_unknown("SamplingParams.with_overrides()", {
            k: v for k, v in overrides.items() if k not in SAMPLING_ARG_NAMES},
            SAMPLING_ARG_NAMES, hints=_HINTS)
        return SamplingParams(**{**{n: getattr(self, n) for n in SAMPLING_ARG_NAMES},
                                 **overrides})

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1


# the constructor's keyword arguments, read off its signature so it cannot drift
SAMPLING_ARG_NAMES: tuple[str, ...] = tuple(
    p.name for p in inspect.signature(SamplingParams.__init__).parameters.values()
    if p.kind is inspect.Parameter.KEYWORD_ONLY)
