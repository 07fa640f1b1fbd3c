"""A session's sampling settings as its snapshots and logs store them: its defaults and
every turn's overrides, as JSON values (response_format is stored as the `structured` it
becomes), and back."""

from __future__ import annotations

from kvsession.params import SamplingParams, StructuredOutput

# a session's sampling settings: its defaults and every turn's overrides (snapshots and logs
# store them; response_format is stored as the `structured` it becomes)
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                   "stop_token_ids", "ignore_eos", "logprobs", "cache_salt", "min_p",
                   "min_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty",
                   "logit_bias", "response_format")
STRUCTURED_FIELDS = ("json_schema", "regex", "grammar", "json_object", "jump_forward")
# what send / asend / stream take as per-turn overrides (structured is not part of the
# sampling record: it is stored by sampling_record separately)
OVERRIDE_FIELDS = (*SAMPLING_FIELDS, "structured")


def sampling_record(params: SamplingParams) -> dict:
    """A session's SamplingParams as snapshots and logs store them (JSON values)."""
    out = {k: getattr(params, k) for k in SAMPLING_FIELDS if k != "response_format"}
    if params.logit_bias is not None:
        out["logit_bias"] = [list(p) for p in params.logit_bias]
    s = params.structured
    out["structured"] = None if s is None else {k: getattr(s, k) for k in STRUCTURED_FIELDS}
    return out


def sampling_from_record(stored: dict) -> SamplingParams:
    """The inverse of sampling_record (ConfigError for values SamplingParams refuses)."""
    known = {k: v for k, v in stored.items() if k in SAMPLING_FIELDS}
    structured = stored.get("structured")
    if structured is not None:
        known["structured"] = StructuredOutput(**{k: v for k, v in structured.items()
                                                  if k in STRUCTURED_FIELDS})
    return SamplingParams(**known)
