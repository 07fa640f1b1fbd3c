"""The OpenAI wire format: request bodies (msgspec structs, decoded and type-checked in one
pass), their translation into `SamplingParams`, OpenAI error JSON, and the response
objects built from `RequestOutput` / `Reply`.

Fields the OpenAI API defines and kvsession has no use for (`user`, `store`, `metadata`,
...) are accepted and ignored, as OpenAI-compatible servers do; vLLM's extensions that map
onto `SamplingParams` (`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`,
`stop_token_ids`, `cache_salt`) are honoured, as is `session_id` (binds a durable session).
"""

from __future__ import annotations

import contextvars
import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from kvsession import (
    CacheFullError,
    ConfigError,
    EngineClosedError,
    KVSessionError,
    SamplingParams,
    SessionClosedError,
    SessionLockedError,
    SessionLostError,
    SessionStoreError,
    ToolCall,
)

# ---- errors ---------------------------------------------------------------------------


class APIError(Exception):
    """An error answered as OpenAI error JSON: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


# ConfigError says "prompt of N tokens leaves no room to generate within max_model_len=..."
# for a prompt the engine cannot take at all: that is OpenAI's 413 / context_length_exceeded
_TOO_LONG = re.compile(r"prompt of \d+ tokens .*max_model_len")
_LEADING_NAME = re.compile(r"^([a-z_][a-z0-9_]*)[\s\[=]")


# the request field a prompt comes in, per endpoint ("prompt" for /v1/completions): what a
# too-long prompt's error names (set by the endpoint; tasks it starts inherit it)
PROMPT_FIELD: contextvars.ContextVar[str] = contextvars.ContextVar("prompt_field",
                                                                  default="messages")


def from_routing_error(status: int, detail: str, method: str, path: str) -> APIError:
    """Starlette's routing errors (404 no route, 405 no method) as OpenAI error JSON."""
    what = "route" if status == 404 else "method"
    return APIError(status, f"{detail}: no {what} {method} {path}",
                    code="not_found" if status == 404 else None)


def from_engine_error(e: Exception, fields: tuple[str, ...] = ()) -> APIError:
    """The HTTP answer to an error the engine raised for one request."""
    msg = str(e)
    if isinstance(e, ConfigError):
        if _TOO_LONG.search(msg):
            return APIError(413, msg, param=PROMPT_FIELD.get(),
                            code="context_length_exceeded")
        m = _LEADING_NAME.match(msg)  # ConfigError messages start with the argument's name
        param = m.group(1) if m and (not fields or m.group(1) in fields) else None
        return APIError(400, msg, param=param)
    if isinstance(e, SessionLockedError):
        return APIError(409, msg, code="session_locked")
    if isinstance(e, SessionLostError):  # a tombstone: the client should start anew
        return APIError(410, msg, param="session_id", code="session_lost")
    if isinstance(e, (EngineClosedError, SessionClosedError)):
        return APIError(503, msg, type="server_error", code="shutting_down",
                        headers={"Retry-After": "1"})
    if isinstance(e, CacheFullError):
        return APIError(503, msg, type="server_error", code="cache_full",
                        headers={"Retry-After": "1"})
    if isinstance(e, SessionStoreError):  # the store may answer again: worth a retry
        return APIError(503, msg, type="server_error", code="session_store_unavailable",
                        headers={"Retry-After": "2"})
    if isinstance(e, KVSessionError):
        return APIError(500, f"{type(e).__name__}: {msg}", type="server_error")
    # a bug of ours: say what it was (the traceback is in the server's log)
    return APIError(500, f"internal error: {type(e).__name__}: {msg:.300}", type="server_error")


# ---- request bodies -------------------------------------------------------------------


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Sampling(msgspec.Struct, kw_only=True):
    """Fields shared by chat and text completions."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extensions (names of SamplingParams)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    cache_salt: str | None = None


class ChatRequest(_Sampling, kw_only=True):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    session_id: str | None = None
    kvsession: Any = None  # agent hints (serve/agent_hints.py)


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list[Any]  # a string, strings, token ids or lists of them (_prompts)
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    kvsession: Any = None  # agent hints (serve/agent_hints.py): only priority applies here


_AT = re.compile(r"at `\$\.([A-Za-z_][A-Za-z0-9_]*)")

# How deep a request body may nest arrays and objects (the body itself is level 1). The
# deepest part of a real request is a JSON schema (response_format, a tool's parameters):
# two levels per nested object ("properties", then the property), so a schema 30 objects
# deep, far beyond any real one, is ~65 levels with the body's own. Every recursive step a
# body meets below this bound (msgspec's decoder, the schema checks, json.dumps, the chat
# template) stays far from Python's recursion limit (1,000 frames), which a deeper body
# reached: a 500 (RecursionError) instead of a 400.
MAX_NESTING = 128
_SCAN_CHUNK = 1 << 20  # bytes whose running depth is summed at once (int32 each)


def _unescaped(body: bytes) -> bytes:
    """`body` with its escaped backslashes and quotes blanked (same length), so that every
    '"' left opens or closes a string. A run of backslashes is escapes from its first one,
    so its pairs replaced left to right leave the odd one beside the character it escapes
    (bytes.replace: no per-escape Python work whatever the body holds)."""
    return body.replace(b"\\\\", b"__").replace(b'\\"', b"__")


def _nesting_excess(body: bytes, limit: int) -> int | None:
    """Where the top-level value in which `body` first nests deeper than `limit` begins (-1
    when it is the body itself), or None when it nests no deeper. A scan of the bytes: a
    decoder or any walk of the decoded value would recurse as deep as the body nests.
    Vectorised with numpy, not a Python loop per byte: a 32 MiB body of brackets takes a
    fraction of a second, less than decoding it would. Exact for valid JSON; invalid JSON
    is refused by the decoder at the first byte that makes it invalid, and up to there the
    scan read it as the decoder does."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return None  # too few openers to nest that deep: most bodies stop here
    a = np.frombuffer(_unescaped(body), np.uint8)
    in_string = np.bitwise_xor.accumulate((a == ord('"')).view(np.uint8)).view(bool)
    step = (((a == ord("[")) | (a == ord("{"))).view(np.int8)
            - ((a == ord("]")) | (a == ord("}"))).view(np.int8))
    step[in_string] = 0  # brackets inside strings are text
    depth, top = 0, -1
    for start in range(0, len(step), _SCAN_CHUNK):
        s = step[start:start + _SCAN_CHUNK]
        d = np.cumsum(s, dtype=np.int32) + np.int32(depth)
        over = np.flatnonzero(d > limit)
        end = int(over[0]) if over.size else len(s)
        # openers of the body's own values (the body is level 1): the last one before the
        # excess starts the field it is in
        opens = np.flatnonzero((d[:end] == 2) & (s[:end] == 1))
        if opens.size:
            top = start + int(opens[-1])
        if over.size:
            return top
        depth = int(d[-1])
    return None


def _key_before(body: bytes, at: int) -> str | None:
    """The key of the object member whose value starts at `at` (`"key": [`), or None."""
    plain = _unescaped(body[:at])
    close = plain.rfind(b'"')
    open_ = plain.rfind(b'"', 0, max(close, 0))
    if open_ < 0 or plain[close + 1:].strip() != b":":
        return None
    try:
        key = json.loads(body[open_:close + 1])
    except ValueError:
        return None
    return key if isinstance(key, str) and len(key) <= 64 else None


def check_nesting(body: bytes, limit: int = MAX_NESTING) -> None:
    """400 naming the top-level field (where it is one) when `body` nests arrays and
    objects deeper than `limit` (MAX_NESTING), before anything recursive reads it."""
    at = _nesting_excess(body, limit)
    if at is None:
        return
    name = _key_before(body, at) if at >= 0 else None
    raise APIError(400, f"{name or 'the request body'} nests arrays and objects more than "
                        f"{limit} levels deep (the body itself is level 1)", param=name)


def decode_body(body: bytes, kind: type):
    """Decode and type-check a request body (400 naming the field if it is wrong, or nested
    deeper than MAX_NESTING)."""
    if not body:
        raise APIError(400, "the request body is empty: send a JSON object")
    check_nesting(body)
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        m = _AT.search(str(e))
        raise APIError(400, f"invalid request: {e}", param=m.group(1) if m else None) from None
    except msgspec.DecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:  # (check_nesting bounds valid JSON; this is a last guard)
        raise APIError(400, "the request body nests arrays and objects too deeply") from None


# media types a POST body may declare (any parameter, e.g. charset=utf-8, is ignored: JSON
# is UTF-8); a missing Content-Type is taken as JSON
JSON_TYPES = ("application/json",)


def check_content_type(value: str | None) -> None:
    """A body declared as something else than JSON (text/plain; a form, which `curl -d`
    declares) is a 400 naming its Content-Type, as OpenAI answers it. Without a
    Content-Type the body is read as JSON: some clients send none, and a body that is not
    JSON is a 400 anyway."""
    if value is None or not value.strip():
        return
    media = value.split(";", 1)[0].strip().lower()
    if media in JSON_TYPES or (media.startswith("application/") and media.endswith("+json")):
        return
    raise APIError(400, f"the request body must be JSON: send Content-Type: application/json, "
                        f"not {value[:100]!r}", code="unsupported_content_type")


# the roles OpenAI's chat API takes ("developer": o1's system; "function": the deprecated
# tool results). The library renders any role its chat template knows; OpenAI clients
# expect these to be checked
ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def check_chat_messages(messages: list) -> None:
    """400 naming the message (param "messages") for what OpenAI refuses and the library
    lets through: an unknown role, a tool result without the `tool_call_id` of the call it
    answers. Checked for every message of the request, before anything runs (a turn on a
    kept session sends the library only the new ones). Other faults (a message that is not a
    dict, a bad content) are the library's to name."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            continue
        role = m.get("role")
        if role not in ROLES:
            raise APIError(400, f"messages[{i}].role must be one of {list(ROLES)}, got "
                                f"{role!r:.40}", param="messages")
        if role == "tool" and m.get("tool_call_id") is None:
            raise APIError(400, f"messages[{i}].tool_call_id is required for a tool message "
                                f"(the id of the tool call it answers)", param="messages")


def check_template_kwarg_names(kwargs: dict | None) -> None:
    """The names chat_template_kwargs may set: template variables, so identifiers, and none
    that starts with '_' (dunders reach Python internals in a template). The rule of
    kvsession.history.check_template_kwargs (which the server, on the public API only,
    cannot import), checked here before anything runs: a named session already open
    would not read them at all."""
    for k in kwargs or ():
        if not k.isidentifier() or k.startswith("_"):
            raise APIError(400, f"chat_template_kwargs keys must be template variable names "
                                f"(identifiers not starting with '_'), got {k!r:.80}",
                           param="chat_template_kwargs")


def check_max_tokens(req: _Sampling, max_model_len: int) -> None:
    """A token limit above the whole context is a 400 naming the field: no prompt leaves
    room for it, so it is a mistake (10**12), not a wish to fill the context (omit it for
    that). One that fits the context but not after this prompt is cut to the room left, and
    the answer says so (x-kvsession-max-tokens)."""
    for name in ("max_tokens", "max_completion_tokens"):
        value = getattr(req, name, None)
        if isinstance(value, int) and value > max_model_len:
            raise APIError(400, f"{name}={value} is more than this model's whole context "
                                f"(max_model_len={max_model_len}); omit it to generate up to "
                                f"the end of the context", param=name)


SAMPLING_FIELDS = tuple(f for f in ChatRequest.__struct_fields__)


def sampling_params(req: ChatRequest | CompletionRequest, default_max_tokens: int,
                    logprobs: int | None, response_format: dict | None,
                    max_tokens: int | None) -> SamplingParams:
    """The SamplingParams of a request: OpenAI's defaults (temperature 1, no token limit
    but the context), a ConfigError as a 400 naming the field."""
    bias = None
    if req.logit_bias is not None:
        try:
            bias = {int(k): v for k, v in req.logit_bias.items()}
        except ValueError:
            raise APIError(400, "logit_bias keys must be token ids", param="logit_bias") from None
    given = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
             "min_p": req.min_p, "seed": req.seed, "presence_penalty": req.presence_penalty,
             "frequency_penalty": req.frequency_penalty,
             "repetition_penalty": req.repetition_penalty, "min_tokens": req.min_tokens,
             "ignore_eos": req.ignore_eos, "cache_salt": req.cache_salt,
             "stop": req.stop or None, "logit_bias": bias,
             "stop_token_ids": req.stop_token_ids, "logprobs": logprobs,
             "response_format": response_format}
    try:
        return SamplingParams(max_tokens=default_max_tokens if max_tokens is None else max_tokens,
                              n=req.n,
                              **{k: v for k, v in given.items() if v is not None})
    except ConfigError as e:
        raise from_engine_error(e, SAMPLING_FIELDS) from None


# ---- results --------------------------------------------------------------------------


@dataclass
class Choice:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[dict[int, float]] | None = None
    tool_calls: list = field(default_factory=list)
    reasoning: str | None = None  # a reasoning template's thinking (`text`: the answer)


@dataclass
class Result:
    """One request's outcome, from a RequestOutput (stateless) or a Reply (a session)."""

    choices: list[Choice]
    prompt_tokens: int
    cached_tokens: int

    @classmethod
    def of_output(cls, out) -> Result:
        return cls([Choice(c.index, c.text, c.token_ids, c.finish_reason, c.logprobs,
                           list(c.tool_calls), c.reasoning) for c in out.outputs],
                   len(out.prompt_token_ids), max(out.num_cached_tokens, 0))

    @classmethod
    def of_reply(cls, r, session=None) -> Result:
        """A session turn's Reply as a result. The usage's cached tokens are those reused
        from before the request: on a session's first turn, the system prompt's tokens that
        opening it computed (pinning them, within this same request) are not
        (`session.stats.system_computed_tokens`)."""
        cached = max(r.cached_tokens, 0)  # (not prefill + cached: a preempted turn
        # computes its prompt again, counted in prefill_tokens)
        if session is not None and session.stats.turns == 1:
            cached = max(cached - session.stats.system_computed_tokens, 0)
        return cls([Choice(0, r.text, r.token_ids, r.finish_reason, r.logprobs,
                           list(r.tool_calls), r.reasoning)], r.prompt_tokens, cached)

    @classmethod
    def of_stored(cls, message: dict, token_ids: list[int], prompt_tokens: int) -> Result:
        """A reply already given (a named session's last assistant message), sent again:
        nothing was computed, so the whole prompt counts as cached. The finish reason is
        "tool_calls" or "stop" (a reply cut at max_tokens is not told apart)."""
        calls = [ToolCall(c.get("id") or "", (c.get("function") or {}).get("name") or "",
                          _arguments_of(c)) for c in message.get("tool_calls") or ()]
        reasoning = message.get("reasoning_content")
        return cls([Choice(0, message.get("content") or "", list(token_ids), "stop", None,
                           calls, reasoning if isinstance(reasoning, str) else None)],
                   prompt_tokens, prompt_tokens)

    def usage(self) -> dict:
        completion = sum(len(c.token_ids) for c in self.choices)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


def _arguments_of(call: dict) -> dict:
    args = (call.get("function") or {}).get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return {}
    return args if isinstance(args, dict) else {}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def tool_call_json(call, index: int | None = None) -> dict:
    """A kvsession ToolCall as an OpenAI tool call (with its index in a stream delta)."""
    out = call.to_dict()
    return out if index is None else {"index": index, **out}


def assistant_message(c: Choice) -> dict:
    """The assistant message of a choice, as a client will send it back next turn: with
    calls, `content` is the text before the first call (None when there is none); a
    reasoning template's thinking in `reasoning_content` (vLLM's and DeepSeek's field)."""
    msg: dict = {"role": "assistant", "content": c.text}
    if c.reasoning is not None:
        msg["reasoning_content"] = c.reasoning
    if c.tool_calls:
        msg |= {"content": c.text or None,
                "tool_calls": [tool_call_json(t) for t in c.tool_calls]}
    return msg


def stream_delta(chunk) -> dict:
    """A streamed chunk's chat delta: `reasoning_content`, `content` and `tool_calls`
    (OpenAI's pieces: index, id and name first, then argument fragments), each only
    when the chunk has some."""
    delta: dict = {}
    if chunk.reasoning:
        delta["reasoning_content"] = chunk.reasoning
    if chunk.content:
        delta["content"] = chunk.content
    if chunk.tool_calls:
        delta["tool_calls"] = [c.to_dict() for c in chunk.tool_calls]
    return delta


def finish_reason(c: Choice) -> str:
    return "tool_calls" if c.tool_calls else c.finish_reason


class Logprobs:
    """Token logprobs in OpenAI's shapes; token ids are shown as the text they decode to."""

    def __init__(self, decode, top: int):
        self._decode, self.top = decode, top

    def _entry(self, tid: int, lp: float) -> dict:
        text = self._decode([tid])
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    def chat(self, token_ids: list[int], logprobs: list[dict[int, float]] | None) -> dict | None:
        if logprobs is None:
            return None
        content = []
        for tid, d in zip(token_ids, logprobs, strict=False):
            ranked = sorted(d.items(), key=lambda kv: -kv[1])[: self.top]
            content.append({**self._entry(tid, d.get(tid, float("-inf"))),
                            "top_logprobs": [self._entry(t, lp) for t, lp in ranked]})
        return {"content": content}

    def completion(self, token_ids: list[int],
                   logprobs: list[dict[int, float]] | None) -> dict | None:
        if logprobs is None:
            return None
        tokens, lps, tops, offsets, pos = [], [], [], [], 0
        for tid, d in zip(token_ids, logprobs, strict=False):
            text = self._decode([tid])
            tokens.append(text)
            lps.append(d.get(tid, float("-inf")))
            ranked = sorted(d.items(), key=lambda kv: -kv[1])[: self.top]
            tops.append({self._decode([t]): lp for t, lp in ranked})
            offsets.append(pos)
            pos += len(text)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
                "text_offset": offsets}


def chat_response(rid: str, model: str, res: Result, lp: Logprobs | None) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()),
            "model": model, "system_fingerprint": None,
            "choices": [{"index": c.index, "message": assistant_message(c),
                         "logprobs": lp.chat(c.token_ids, c.logprobs) if lp else None,
                         "finish_reason": finish_reason(c)} for c in res.choices],
            "usage": res.usage()}


def chat_chunk(rid: str, model: str, created: int, index: int, delta: dict,
               finish: str | None = None, logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": None,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                         "finish_reason": finish}]}


def usage_chunk(rid: str, model: str, created: int, obj: str, res: Result) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": res.usage()}


def completion_response(rid: str, model: str, results: list[tuple[str, Result]],
                        lp: Logprobs | None, echo: bool) -> dict:
    """`results`: (prompt text, its Result) per prompt; choices are numbered across them."""
    choices, prompt, cached, completion = [], 0, 0, 0
    for text, res in results:
        for c in res.choices:
            choices.append({"index": len(choices),
                            "text": (text if echo else "") + c.text,
                            "logprobs": lp.completion(c.token_ids, c.logprobs) if lp else None,
                            "finish_reason": c.finish_reason})
        u = res.usage()
        prompt += u["prompt_tokens"]
        cached += u["prompt_tokens_details"]["cached_tokens"]
        completion += u["completion_tokens"]
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "system_fingerprint": None, "choices": choices,
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                      "total_tokens": prompt + completion,
                      "prompt_tokens_details": {"cached_tokens": cached}}}


def completion_chunk(rid: str, model: str, created: int, text: str,
                     finish: str | None = None, logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs,
                         "finish_reason": finish}]}
