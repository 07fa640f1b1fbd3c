"""The model's own request defaults: what a request gets in the fields its caller left unset.

Three layers, the first that has a value wins:

    the caller's SamplingParams fields (SamplingParams.explicit)
    the checkpoint's generation_config.json (LLM(generation_config="auto"), the default)
    the call's fallback: its token budget (Budget) and, for sessions, greedy

Why the checkpoint's: model cards tune their sampling (Qwen3's warns that greedy decoding
loops and ships temperature 0.6, top_p 0.95, top_k 20), and transformers, vLLM and
llama.cpp all start from it. `generation_config="none"` keeps SamplingParams' own defaults.

The fields read (transformers' names -> ours): temperature, top_p, top_k, min_p,
repetition_penalty, max_new_tokens -> max_tokens. transformers samples only with
`do_sample: true`; a file that says `do_sample: false` means greedy (temperature 0 and its
other sampling fields unused); one that does not say is read as vLLM does (its fields
apply). transformers' "off" values (top_k 0, top_p 1, min_p 0, repetition_penalty 1) map
to ours, and a value SamplingParams refuses is a ModelLoadError naming the file.
"""

from __future__ import annotations

import enum
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from kvsession.config import GenerationConfigMode
from kvsession.errors import ConfigError, ModelLoadError
from kvsession.model.config import read_json
from kvsession.params import SAMPLING_ARG_NAMES, SamplingParams

logger = logging.getLogger("kvsession")

FILE_NAME = "generation_config.json"
# transformers' generation_config name -> SamplingParams' name
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# generate()'s budget when neither the caller nor the checkpoint sets one: vLLM's
GENERATE_MAX_TOKENS = 16


class Budget(enum.Enum):
    """How many tokens a request may generate when nobody set max_tokens."""

    FIXED = "fixed"            # generate(): GENERATE_MAX_TOKENS, as vLLM
    END_OF_TURN = "end_of_turn"  # chat, stream, sessions, the server: until the model ends
    # its turn (an end-of-turn / EOS token), bounded by max_model_len


@dataclass(frozen=True)
class GenerationDefaults:
    """The defaults one LLM applies; `values` maps SamplingParams fields to the checkpoint's
    values (empty with GenerationConfigMode.NONE or when the file sets none)."""

    values: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    max_model_len: int = 0

    @classmethod
    def load(cls, model_dir: Path, mode: GenerationConfigMode,
             max_model_len: int) -> GenerationDefaults:
        values = read_generation_config(model_dir) if mode is GenerationConfigMode.AUTO else {}
        if values:
            logger.info("request defaults from %s: %s", FILE_NAME, values)
        return cls(MappingProxyType(values), max_model_len)

    def apply(self, params: SamplingParams, budget: Budget,
              fallback: dict | None = None) -> SamplingParams:
        """`params` with the unset fields filled: the checkpoint's values, then `fallback`
        ({field: value}: the call's own defaults), then the budget's max_tokens.
        Args:
            params: the caller's (their `explicit` fields are kept as they are).
            budget: what max_tokens becomes when neither the caller nor the checkpoint
                sets it.
            fallback: defaults below the checkpoint's (sessions: greedy).
        Returns: a SamplingParams whose every filled field counts as set (applying
        defaults twice changes nothing)."""
        max_tokens = GENERATE_MAX_TOKENS if budget is Budget.FIXED else self.max_model_len
        return params.with_defaults({"max_tokens": max_tokens, **(fallback or {}),
                                     **self.values})


    def complete(self, params: SamplingParams, budget: Budget) -> SamplingParams:
        """`apply`, then SamplingParams' own defaults in what is still unset: every field
        set, so nothing below (a session's greedy fallback) changes it. What a caller with
        its own defaults (the OpenAI server: temperature 1) hands on."""
        done = self.apply(params, budget)
        return done.with_defaults({n: getattr(done, n) for n in SAMPLING_ARG_NAMES
                                   if n not in ("response_format", "structured")})


def read_generation_config(model_dir: Path) -> dict:
    """The sampling defaults of `model_dir`'s generation_config.json as SamplingParams
    fields ({} without the file); ModelLoadError for a file or value that cannot be one."""
    path = Path(model_dir) / FILE_NAME
    if not path.is_file():
        return {}
    raw = read_json(path)  # the tokenizer reads its eos ids from it too, the same way
    values = {ours: raw[theirs] for theirs, ours in FIELDS.items()
              if raw.get(theirs) is not None}
    if raw.get("do_sample") is False:
        # transformers decodes greedily and ignores the sampling fields (a repetition
        # penalty is a logits processor: it still applies)
        values = {"temperature": 0.0} | {k: v for k, v in values.items()
                                         if k in ("max_tokens", "repetition_penalty")}
    if values.get("top_k") == 0:
        values["top_k"] = -1  # transformers' "no top-k"
    for name, value in values.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ModelLoadError(f"{path}: {name} must be finite, got {value!r}")
    try:
        SamplingParams(**values)
    except ConfigError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    return values
