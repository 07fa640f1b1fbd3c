"""Anthropic's Messages API (`POST /v1/messages`) on the chat machinery (the route is the
app's; this module is the protocol).

A request becomes a chat request (`to_chat`): `system` (a string or text blocks) the system
message; each message's content blocks: text, `tool_use` (an assistant message's
`tool_calls`), `tool_result` (a tool message each, before the user's own text, where
Anthropic puts them); `tools` (`input_schema`) and `tool_choice` (auto / any / tool / none,
`disable_parallel_tool_use`) in chat's shape; `stop_sequences`, `max_tokens`, `temperature`,
`top_p`, `top_k`. The conversation then runs as any chat conversation: the server continues
the Session that answered its previous turn, so the history is not computed again
(`usage.cache_read_input_tokens`). A reply becomes a message (`message_object`): content
blocks `thinking` (a reasoning template's), `text`, `tool_use` (the call's id, name and
input), and `stop_reason` (end_turn, max_tokens, stop_sequence, tool_use). A stream
becomes Anthropic's events (`MessageEvents`): message_start, content_block_start /
content_block_delta (`text_delta`, `thinking_delta`, `input_json_delta`) /
content_block_stop per block, message_delta (stop_reason, usage), message_stop.

`cache_control` on the system prompt (a block's, or the last tool's: tools are rendered
with it) pins the system prompt's KV for its TTL (`"5m"` default, `"1h"`): it stays on the
device while that TTL runs from its last hit, whatever else evicts; the first request that
pins it reports its tokens as `cache_creation_input_tokens`. Breakpoints inside messages
are accepted: the conversation's Session already holds that KV.

Errors are Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`); the key
is `x-api-key` (or `Authorization: Bearer`).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import msgspec

from kvsession.serve import protocol as P

TTL_S = {"5m": 300.0, "1h": 3600.0}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 409: "invalid_request_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


class MessagesRequest(msgspec.Struct, kw_only=True):
    model: str
    max_tokens: int
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None  # a breakpoint after the system prompt
    output_config: dict[str, Any] | None = None  # {"format": {"type": "json_schema", ...}}
    ignore_eos: bool | None = None  # vLLM's extension, as on chat completions
    kvsession: Any = None  # agent hints (serve/agent_hints.py)


def error_body(e: P.APIError) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"),
                                       "message": e.message}}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


# ---- request -> chat --------------------------------------------------------------------


def _blocks(content, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise P.APIError(400, f"{where}.content must be a string or a list of content "
                              f"blocks", param="messages")
    for i, b in enumerate(content):
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise P.APIError(400, f"{where}.content[{i}] must be a content block with a "
                                  f"type", param="messages")
    return content


def _block_text(block: dict, where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise P.APIError(400, f"{where}: a text block needs a string text", param="messages")
    return text


def system_text(system) -> str | None:
    if system is None or isinstance(system, str):
        return system
    if not isinstance(system, list):
        raise P.APIError(400, "system must be a string or a list of text blocks",
                         param="system")
    parts = []
    for i, b in enumerate(system):
        if not isinstance(b, dict) or b.get("type") != "text" or \
                not isinstance(b.get("text"), str):
            raise P.APIError(400, f"system[{i}] must be a text block", param="system")
        parts.append(b["text"])
    return "\n".join(parts)


def system_ttl_s(req: MessagesRequest) -> float | None:
    """The TTL of a cache_control breakpoint on the system prompt (a system block's or the
    last tool's), or None when it has none."""
    marks = [b.get("cache_control") for b in req.system or () if isinstance(b, dict)] \
        if isinstance(req.system, list) else []
    marks.append(req.cache_control)
    if req.tools:
        marks.append(req.tools[-1].get("cache_control") if isinstance(req.tools[-1], dict)
                     else None)
    ttls = []
    for m in marks:
        if m is None:
            continue
        if not isinstance(m, dict) or m.get("type") != "ephemeral" or \
                m.get("ttl", "5m") not in TTL_S:
            raise P.APIError(400, "cache_control must be {\"type\": \"ephemeral\"} with ttl "
                                  "5m or 1h", param="cache_control")
        ttls.append(TTL_S[m.get("ttl", "5m")])
    return max(ttls) if ttls else None


def chat_messages(req: MessagesRequest) -> list[dict]:
    """The conversation in chat's shape (the module's docstring)."""
    if not isinstance(req.messages, list) or not req.messages:
        raise P.APIError(400, "messages must be a non-empty list", param="messages")
    out: list[dict] = []
    system = system_text(req.system)
    if system:
        out.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise P.APIError(400, f"{where}.role must be user or assistant",
                             param="messages")
        blocks = _blocks(m.get("content"), where)
        if m["role"] == "assistant":
            text, calls = [], []
            for j, b in enumerate(blocks):
                kind = b["type"]
                if kind == "text":
                    text.append(_block_text(b, f"{where}.content[{j}]"))
                elif kind == "tool_use":
                    if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str) \
                            or not isinstance(b.get("input"), dict):
                        raise P.APIError(400, f"{where}.content[{j}]: a tool_use block needs "
                                              f"string id and name and an object input",
                                         param="messages")
                    calls.append({"id": b["id"], "type": "function", "function": {
                        "name": b["name"],
                        "arguments": json.dumps(b["input"], ensure_ascii=False)}})
                elif kind in ("thinking", "redacted_thinking"):
                    continue  # templates strip past thinking
                else:
                    raise P.APIError(400, f"{where}.content[{j}]: {kind!r} blocks are not "
                                          f"supported in assistant messages",
                                     param="messages")
            msg: dict = {"role": "assistant", "content": "".join(text) or None}
            if calls:
                msg["tool_calls"] = calls
            elif msg["content"] is None:
                msg["content"] = ""
            out.append(msg)
            continue
        text = []
        for j, b in enumerate(blocks):
            kind = b["type"]
            if kind == "text":
                text.append(_block_text(b, f"{where}.content[{j}]"))
            elif kind == "tool_result":
                if not isinstance(b.get("tool_use_id"), str):
                    raise P.APIError(400, f"{where}.content[{j}].tool_use_id must be a "
                                          f"string", param="messages")
                content = b.get("content", "")
                if not isinstance(content, str):
                    content = "".join(_block_text(x, f"{where}.content[{j}].content")
                                      for x in _blocks(content, f"{where}.content[{j}]"))
                out.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                            "content": content})
            else:
                raise P.APIError(400, f"{where}.content[{j}]: {kind!r} blocks are not "
                                      f"supported (text, tool_use, tool_result)",
                                 param="messages")
        if text:
            out.append({"role": "user", "content": "".join(text)})
    return out


def chat_tools(tools) -> list[dict] | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or \
                t.get("type", "custom") != "custom":
            raise P.APIError(400, f"tools[{i}] must be a custom tool with a name and an "
                                  f"input_schema", param="tools")
        fn = {"name": t["name"], "parameters": t.get("input_schema") or
              {"type": "object", "properties": {}}}
        if "description" in t:
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice) -> tuple[Any, bool | None]:
    """(chat's tool_choice, parallel_tool_calls) of Anthropic's tool_choice."""
    if choice is None:
        return None, None
    kind = choice.get("type") if isinstance(choice, dict) else None
    parallel = False if isinstance(choice, dict) and \
        choice.get("disable_parallel_tool_use") is True else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise P.APIError(400, "tool_choice.type must be auto, any, tool (with a name) or none",
                     param="tool_choice")


def to_chat(req: MessagesRequest) -> P.ChatRequest:
    if not isinstance(req.max_tokens, int) or req.max_tokens < 1:
        raise P.APIError(400, "max_tokens must be >= 1", param="max_tokens")
    choice, parallel = chat_tool_choice(req.tool_choice)
    return P.ChatRequest(
        model=req.model, messages=chat_messages(req), max_tokens=req.max_tokens,
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
        stop=req.stop_sequences, stream=req.stream, tools=chat_tools(req.tools),
        tool_choice=choice, parallel_tool_calls=parallel,
        response_format=output_format(req.output_config), ignore_eos=req.ignore_eos)


def output_format(config) -> dict | None:
    """`output_config.format` (a JSON schema the reply follows) as chat's
    response_format."""
    fmt = config.get("format") if isinstance(config, dict) else None
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or \
            not isinstance(fmt.get("schema"), dict):
        raise P.APIError(400, "output_config.format must be {\"type\": \"json_schema\", "
                              "\"schema\": {...}}", param="output_config")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


# ---- reply -> message -------------------------------------------------------------------


def stop_reason(c: P.Choice) -> str:
    """Anthropic's stop_reason. (A stop sequence ends a reply as its end of turn does: the
    engine's "stop" does not tell them apart, so both are end_turn.)"""
    if c.tool_calls:
        return "tool_use"
    return "max_tokens" if c.finish_reason == "length" else "end_turn"


def content_blocks(c: P.Choice) -> list[dict]:
    blocks: list[dict] = []
    if c.reasoning:
        blocks.append({"type": "thinking", "thinking": c.reasoning, "signature": ""})
    if c.text or not c.tool_calls:
        blocks.append({"type": "text", "text": c.text})
    for call in c.tool_calls:
        blocks.append({"type": "tool_use", "id": call.id, "name": call.name,
                       "input": call.arguments})
    return blocks


def usage(res: P.Result, created_tokens: int) -> dict:
    """Anthropic counts the prompt in three parts that add up: read from cache, written to
    it at a breakpoint, and the rest. A pin this request made was computed before its turn,
    which then read it from the cache: those tokens count as written, not read."""
    prompt, cached = res.prompt_tokens, res.cached_tokens
    created = min(created_tokens, cached)
    return {"input_tokens": prompt - cached, "cache_read_input_tokens": cached - created,
            "cache_creation_input_tokens": created,
            "output_tokens": sum(len(c.token_ids) for c in res.choices)}


def message_object(mid: str, model: str, res: P.Result, created_tokens: int) -> dict:
    c = res.choices[0]
    return {"id": mid, "type": "message", "role": "assistant", "model": model,
            "content": content_blocks(c), "stop_reason": stop_reason(c),
            "stop_sequence": None, "usage": usage(res, created_tokens)}


def event(kind: str, **fields) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"


class MessageEvents:
    """A streamed reply as Anthropic's events: one content block at a time (a new kind of
    piece stops the open block and starts the next)."""

    def __init__(self, mid: str, model: str, created_tokens: int = 0):
        self.mid, self.model, self.created_tokens = mid, model, created_tokens
        self.index = -1
        self.open: tuple | None = None  # the open block: ("thinking",), ("text",), ("tool", i)

    def start(self) -> list[str]:
        msg = {"id": self.mid, "type": "message", "role": "assistant", "model": self.model,
               "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": 0, "output_tokens": 0}}
        return [event("message_start", message=msg), event("ping")]

    def _switch(self, key: tuple, block: dict) -> list[str]:
        if self.open == key:
            return []
        out = self._stop()
        self.index += 1
        self.open = key
        return out + [event("content_block_start", index=self.index, content_block=block)]

    def _stop(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", index=self.index)]

    def delta(self, chunk) -> list[str]:
        out: list[str] = []
        if chunk.reasoning:
            out += self._switch(("thinking",), {"type": "thinking", "thinking": "",
                                                "signature": ""})
            out.append(event("content_block_delta", index=self.index, delta={
                "type": "thinking_delta", "thinking": chunk.reasoning}))
        if chunk.content:
            out += self._switch(("text",), {"type": "text", "text": ""})
            out.append(event("content_block_delta", index=self.index,
                             delta={"type": "text_delta", "text": chunk.content}))
        for piece in chunk.tool_calls:
            if piece.id is not None:
                out += self._switch(("tool", piece.index), {
                    "type": "tool_use", "id": piece.id, "name": piece.name, "input": {}})
            if piece.arguments and self.open == ("tool", piece.index):
                out.append(event("content_block_delta", index=self.index, delta={
                    "type": "input_json_delta", "partial_json": piece.arguments}))
        return out

    def error(self, e: P.APIError) -> str:
        return event("error", error=error_body(e)["error"])

    def finish(self, res: P.Result) -> list[str]:
        """The rest: blocks of the finished message no piece announced (whole), then
        message_delta (stop_reason, usage) and message_stop."""
        message = message_object(self.mid, self.model, res, self.created_tokens)
        out: list[str] = []
        if self.index < 0:  # nothing streamed (a stored reply sent again): every block
            for block in message["content"]:
                kind = block["type"]
                out += self._switch((kind, self.index + 1), {**block, **(
                    {"text": ""} if kind == "text" else {"input": {}}
                    if kind == "tool_use" else {"thinking": ""})})
                delta = {"type": "text_delta", "text": block["text"]} if kind == "text" \
                    else {"type": "thinking_delta", "thinking": block["thinking"]} \
                    if kind == "thinking" else {
                        "type": "input_json_delta",
                        "partial_json": json.dumps(block["input"], ensure_ascii=False)}
                out.append(event("content_block_delta", index=self.index, delta=delta))
        out += self._stop()
        out.append(event("message_delta", delta={"stop_reason": message["stop_reason"],
                                                 "stop_sequence": message["stop_sequence"]},
                         usage=message["usage"]))
        out.append(event("message_stop"))
        return out
