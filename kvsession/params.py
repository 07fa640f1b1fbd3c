"""Per-request sampling parameters (public) and their validation.

Semantics follow vLLM / the OpenAI API (n, min_p, the three penalties, logit_bias,
min_tokens, prompt_logprobs); the order in which the sampler applies them is transformers'
(engine/sampler.py). `StructuredOutput` constrains the output to a JSON schema, any JSON
object, a regex or an EBNF grammar (compiled by xgrammar, kvsession/structured.py).
"""

from __future__ import annotations

import inspect
import json
import numbers
from dataclasses import dataclass, field

from kvsession.errors import ConfigError
from kvsession.json_schema import check_patterns
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
# the other way: float32 logits divided by a temperature past ~3.4e38 (or by inf) become 0
# and a masked -inf one NaN; the tempered distribution is uniform over the allowed tokens
# long before this
MAX_TEMPERATURE = 1e6
# logits are divided (positive) or multiplied (negative) by it: a tinier one overflows
# float32 to inf, and inf - inf is NaN in the sampler
REPETITION_PENALTY_RANGE = (1e-6, 1e6)
# vLLM's default max_logprobs: asking for more there is an error, so it is here too
MAX_LOGPROBS = 20
# names users reach for that spelling alone does not lead back to the argument
_HINTS = {"stop_strings": "stop", "stop_ids": "stop_token_ids", "max_new_tokens": "max_tokens",
          "guided_json": "response_format", "guided_regex": "response_format",
          "min_new_tokens": "min_tokens"}
# OpenAI's bounds: a bias of +-100 already bans or forces a token; beyond it is a mistake
LOGIT_BIAS_RANGE = (-100.0, 100.0)
# OpenAI's bounds for presence_penalty and frequency_penalty
PENALTY_RANGE = (-2.0, 2.0)
# larger than any vocabulary; an id past int64 cannot even be stored (a session's log)
MAX_TOKEN_ID = 2**31 - 1
# completions per request: each holds its own KV past the shared prompt
MAX_N = 256


def _seq(name: str, value, accepted: str, check) -> tuple | None:
    """A list/tuple -> a tuple of checked items (hashable, so the params are too)."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{name} must be None or {accepted}, got {value!r}")
    return tuple(check(item) for item in value)


def _canonical_schema(schema) -> str:
    """A JSON schema (dict or JSON text) as canonical JSON text: hashable, so equal schemas
    share one compiled grammar whatever their key order."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ConfigError(f"structured.json_schema must be a JSON schema (a dict or JSON "
                              f"text), got text that is not JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ConfigError(f"structured.json_schema must be a JSON schema: a dict or the JSON "
                          f"text of an object, got {schema!r:.80}")
    try:
        text = json.dumps(schema, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"structured.json_schema must hold JSON values only: {e}") from None
    except RecursionError:
        raise ConfigError("structured.json_schema is nested too deeply") from None
    try:  # (the copy, of bounded depth)
        check_patterns(json.loads(text), "structured.json_schema")
    except RecursionError:
        raise ConfigError("structured.json_schema is nested too deeply") from None
    return text


@dataclass(frozen=True, init=False)
class StructuredOutput:
    """Constrain a request's output; exactly one of:

    - `json_schema`: a JSON schema (dict or JSON text); the output is one JSON document
      valid under it, written compactly (no free whitespace, so a small max_tokens suffices);
    - `json_object=True`: any JSON object;
    - `regex`: a regular expression the whole output matches;
    - `grammar`: an EBNF grammar (xgrammar's GBNF dialect, start symbol `root`).

    Jump-forward, always: where the format allows exactly one continuation (a key, a
    separator, the rest of an enum value), xgrammar's tokens for it are drafts, computed in
    one forward pass and kept as far as the model, sampling as it would token by token,
    agrees (engine/drafts.py): fewer passes, the same output as token-by-token constrained
    decoding. `jump_forward=True` appends them unverified instead (no pass is spent on a
    token the model would not have chosen, but the forced text keeps xgrammar's
    tokenization, longest tokens first, which may differ from the model's own). Not with
    `logprobs` (unverified tokens have none); needs xgrammar >= 0.2.

    Frozen and hashable (a schema is kept as canonical JSON text, `json_schema`), so equal
    formats share one compiled grammar. Whether the format compiles is checked when a
    request using it is submitted (ConfigError naming the field)."""

    json_schema: str | None = None
    regex: str | None = None
    grammar: str | None = None
    json_object: bool = False
    jump_forward: bool = False

    def __init__(self, *, json_schema: dict | str | None = None, regex: str | None = None,
                 grammar: str | None = None, json_object: bool = False,
                 jump_forward: bool = False, **unknown) -> None:
        reject_unknown("StructuredOutput()", unknown,
                       ("json_schema", "regex", "grammar", "json_object", "jump_forward"),
                       hints={"schema": "json_schema", "ebnf": "grammar", "json": "json_object",
                              "pattern": "regex"})
        check_bool("structured.json_object", json_object)
        check_bool("structured.jump_forward", jump_forward)
        given = [n for n, v in (("json_schema", json_schema), ("regex", regex),
                                ("grammar", grammar)) if v is not None]
        given += ["json_object"] if json_object else []
        if len(given) != 1:
            raise ConfigError(f"StructuredOutput takes exactly one of json_schema, regex, "
                              f"grammar or json_object=True, got {given or 'none'}")
        values = {
            "json_schema": None if json_schema is None else _canonical_schema(json_schema),
            "regex": check_str("structured.regex", regex, allow_none=True, non_empty=True),
            "grammar": check_str("structured.grammar", grammar, allow_none=True,
                                 non_empty=True),
            "json_object": json_object,
            "jump_forward": jump_forward,
        }
        for name, value in values.items():
            object.__setattr__(self, name, value)

    @property
    def kind(self) -> str:
        """"json_schema" | "regex" | "grammar" | "json_object"."""
        return next(n for n in ("json_schema", "regex", "grammar") if getattr(self, n)) \
            if not self.json_object else "json_object"


def structured_from_response_format(rf) -> StructuredOutput | None:
    """OpenAI's `response_format` (plus vLLM's regex and grammar kinds) as a
    StructuredOutput: {"type": "text"} | {"type": "json_object"} | {"type": "json_schema",
    "json_schema": {"schema": {...}, "name": ..., "strict": ...}} | {"type": "regex",
    "pattern": "..."} | {"type": "grammar", "ebnf": "..."}. ConfigError naming the field."""
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise ConfigError(f"response_format must be None or a dict with a 'type', got "
                          f"{rf!r:.80}")
    kind = rf["type"]
    fields = {"text": (), "json_object": (), "json_schema": ("json_schema",),
              "regex": ("pattern",), "grammar": ("ebnf",)}
    if kind not in fields:
        raise ConfigError(f"response_format['type'] must be one of {sorted(fields)}, got "
                          f"{kind!r:.40}")
    extra = sorted(set(rf) - {"type", *fields[kind]})
    if extra:
        raise ConfigError(f"response_format of type {kind!r} takes {list(fields[kind])}, "
                          f"got also {extra}")
    missing = [f for f in fields[kind] if f not in rf]
    if missing:
        raise ConfigError(f"response_format of type {kind!r} needs {missing}")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind == "regex":
        return StructuredOutput(regex=rf["pattern"])
    if kind == "grammar":
        return StructuredOutput(grammar=rf["ebnf"])
    spec = rf["json_schema"]
    if not isinstance(spec, dict) or "schema" not in spec:
        raise ConfigError(f"response_format['json_schema'] must be a dict with a 'schema' "
                          f"(OpenAI's shape), got {spec!r:.80}")
    try:
        return StructuredOutput(json_schema=spec["schema"])
    except ConfigError as e:  # named as the request has it
        raise ConfigError(f"response_format['json_schema']['schema']: {e}") from None


def _logit_bias(value) -> tuple[tuple[int, float], ...] | None:
    """{token id: bias} (or the (id, bias) pairs this returns) -> sorted pairs, hashable."""
    if value is None:
        return None
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, (list, tuple)) and all(
            isinstance(p, (list, tuple)) and len(p) == 2 for p in value):
        items = [tuple(p) for p in value]
    else:
        raise ConfigError(f"logit_bias must be None or a dict {{token id: bias}}, got "
                          f"{value!r:.80}")
    out = {}
    for tid, bias in items:
        if not isinstance(tid, numbers.Integral) or isinstance(tid, bool) or tid < 0:
            raise ConfigError(f"logit_bias must be None or a dict {{token id: bias}} with "
                              f"token ids ints >= 0, got key {tid!r:.40}")
        if int(tid) in out:
            raise ConfigError(f"logit_bias must be None or a dict {{token id: bias}}, got "
                              f"token id {tid} twice")
        out[int(tid)] = check_float(f"logit_bias[{tid}]", bias, min_value=LOGIT_BIAS_RANGE[0],
                                    max_value=LOGIT_BIAS_RANGE[1])
    return tuple(sorted(out.items()))


@dataclass(frozen=True, init=False)
class SamplingParams:
    """How to sample one request; frozen, validated on construction. temperature 0 (or any
    below SAMPLING_EPS = 1e-5) and top_k 1 are greedy (penalties, logit_bias and a
    structured format still apply: greedy is the argmax of the processed logits).

    n: completions of the prompt (prefilled once; with `seed`, completion i uses seed + i).
    min_p: drop tokens whose probability is below min_p times the top one's.
    repetition_penalty: transformers' (and vLLM's): a logit of a token in the prompt or the
    output is divided by it when positive, multiplied when negative. presence_penalty /
    frequency_penalty: OpenAI's, over output tokens: subtract the penalty once / per
    occurrence. logit_bias: {token id: bias in [-100, 100]} added to the logits.
    min_tokens: EOS, stop_token_ids and stop strings do not end the request before this
    many tokens (EOS and stop ids are masked). prompt_logprobs: per prompt token (the first
    is None) a {token_id: logprob} dict of the top k and the actual token; such a request
    computes its whole prompt (no prefix-cache hits). response_format: OpenAI's dict
    (structured_from_response_format), or structured: a StructuredOutput."""

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
    n: int = 1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] | None = None
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    # OpenAI's dict is converted into `structured` by the constructor and not kept (this
    # reads None): `structured` is the one format a request has, hashable and comparable
    response_format: dict | None = None
    structured: StructuredOutput | None = None
    # Normalised forms, filled in __init__ (not constructor arguments).
    stop_strings: tuple[str, ...] = field(init=False, repr=False, default=())
    stop_ids: frozenset[int] = field(init=False, repr=False, default=frozenset())
    # the fields the caller set (response_format counts as `structured`): the model's own
    # defaults (generation_defaults.py) fill in the others, so `SamplingParams(max_tokens=64)`
    # still samples at the checkpoint's temperature; not part of equality
    explicit: frozenset[str] = field(init=False, repr=False, compare=False,
                                     default=frozenset())

    def __init__(self, /, **given) -> None:
        self._build(**given)
        names = {"structured" if k == "response_format" else k for k in given}
        object.__setattr__(self, "explicit", frozenset(names & set(SAMPLING_ARG_NAMES)))

    def _build(self, /, *, max_tokens: int = 16, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = -1, seed: int | None = None,
                 stop: str | list[str] | tuple[str, ...] | None = None,
                 stop_token_ids: list[int] | tuple[int, ...] | None = None,
                 ignore_eos: bool = False, logprobs: int | None = None,
                 cache_salt: str | None = None, n: int = 1, min_p: float = 0.0,
                 repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0,
                 logit_bias: dict[int, float] | tuple[tuple[int, float], ...] | None = None,
                 min_tokens: int = 0, prompt_logprobs: int | None = None,
                 response_format: dict | None = None,
                 structured: StructuredOutput | None = None, **unknown) -> None:
        reject_unknown("SamplingParams()", unknown, SAMPLING_ARG_NAMES, hints=_HINTS)
        if response_format is not None:
            if structured is not None:
                raise ConfigError("pass one of response_format (OpenAI's dict) or "
                                  "structured (a StructuredOutput), not both")
            structured = structured_from_response_format(response_format)
        top_k = check_int("top_k", top_k, min_value=-1)
        if top_k == 0:
            raise ConfigError(f"top_k must be -1 (off) or an int >= 1, got {top_k!r}")
        if isinstance(stop, str):
            check_str("stop", stop, non_empty=True)
        else:
            stop = _seq("stop", stop, "a non-empty string or a list of them",
                        lambda s: check_str("stop", s, non_empty=True))
        ids = _seq("stop_token_ids", stop_token_ids,
                   f"a list of token ids (ints in [0, {MAX_TOKEN_ID}])",
                   lambda i: check_int("stop_token_ids", i, min_value=0,
                                       max_value=MAX_TOKEN_ID))
        if structured is not None and not isinstance(structured, StructuredOutput):
            raise ConfigError(f"structured must be None or a StructuredOutput(json_schema=..., "
                              f"regex=..., grammar=... or json_object=True), "
                              f"got {structured!r:.80}")
        if structured is not None and structured.jump_forward and logprobs is not None:
            raise ConfigError("structured.jump_forward must be False with logprobs (forced "
                              "tokens are not sampled, so they have no logprobs)")
        max_tokens = check_int("max_tokens", max_tokens, min_value=1)
        values = {
            "max_tokens": max_tokens,
            "temperature": check_float("temperature", temperature, min_value=0.0,
                                       max_value=MAX_TEMPERATURE),
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
            "n": check_int("n", n, min_value=1, max_value=MAX_N),
            "min_p": check_float("min_p", min_p, min_value=0.0, max_value=1.0),
            "repetition_penalty": check_float("repetition_penalty", repetition_penalty,
                                              min_value=REPETITION_PENALTY_RANGE[0],
                                              max_value=REPETITION_PENALTY_RANGE[1]),
            "presence_penalty": check_float("presence_penalty", presence_penalty,
                                            min_value=PENALTY_RANGE[0],
                                            max_value=PENALTY_RANGE[1]),
            "frequency_penalty": check_float("frequency_penalty", frequency_penalty,
                                             min_value=PENALTY_RANGE[0],
                                             max_value=PENALTY_RANGE[1]),
            "logit_bias": _logit_bias(logit_bias),
            "min_tokens": check_int("min_tokens", min_tokens, min_value=0,
                                    max_value=max_tokens),
            "prompt_logprobs": check_int("prompt_logprobs", prompt_logprobs, min_value=0,
                                         max_value=MAX_LOGPROBS, allow_none=True),
            "response_format": None,
            "structured": structured,
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
        # only what was set carries over: a field left to the model's defaults stays so
        base = {n: getattr(self, n) for n in self.explicit}
        if "response_format" in overrides:  # replaces the format, as `structured` would
            base.pop("structured", None)
        return SamplingParams(**{**base, **overrides})

    def with_defaults(self, defaults: dict) -> SamplingParams:
        """A copy with `defaults` ({field: value}) in the fields the caller did not set;
        those become set, so applying defaults again changes nothing."""
        missing = {k: v for k, v in defaults.items() if k not in self.explicit}
        return self.with_overrides(**missing) if missing else self

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Any of the three penalties is on (the sampler then reads the request's tokens)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


# the constructor's keyword arguments, read off its signature so it cannot drift
SAMPLING_ARG_NAMES: tuple[str, ...] = tuple(
    p.name for p in inspect.signature(SamplingParams._build).parameters.values()
    if p.kind is inspect.Parameter.KEYWORD_ONLY)
# help(SamplingParams) and IDEs show the arguments, not **given
SamplingParams.__init__.__signature__ = inspect.Signature(
    [p for p in inspect.signature(SamplingParams._build).parameters.values()])
