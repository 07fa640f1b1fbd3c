"""OpenAI's Responses API on the chat machinery: `POST /v1/responses` and
`GET` / `DELETE /v1/responses/{id}` (the routes are the app's; this module is the protocol).

A request becomes a chat request (`to_chat`): `instructions` the system message, `input`
(a string, or items: messages with text parts, `function_call` and
`function_call_output`) the messages, function `tools` and `tool_choice` in chat's shape,
`text.format` a `response_format`, `max_output_tokens` the token limit. A reply becomes a
response (`response_object`): its output items (`reasoning` for a reasoning template's
thinking, a `message` with `output_text`, a `function_call` per call, whose `call_id` is the
call's id) and usage (`input_tokens_details.cached_tokens`: the prompt tokens served from
cache, which shows a continued Session). A stream becomes Responses events
(`ResponseEvents`: `response.created`, `response.output_item.added`,
`response.output_text.delta`, `response.function_call_arguments.delta`, ...,
`response.completed`, each with its `sequence_number`).

Stored responses (`store`, the default) are chains of a named Session (`ResponseStore`):
the first response of a conversation opens a session named after its chain (the first 16
hex digits of every id in it: `chain_session`); a request whose
`previous_response_id` is the latest response of its chain is that session's next turn,
sent only the new items (the session's KV holds the rest: nothing is computed again). One
that continues an older response (a branch), or whose instructions differ from the
chain's, starts a chain of its own from the stored conversation up to that response. With
--session-dir the sessions are persisted as any named session and the responses are
written beside them (`responses/<id>.json`), so a restarted server continues them.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from kvsession.serve import protocol as P

_ID = re.compile(r"resp_[0-9a-f]{32}")


class ResponsesRequest(msgspec.Struct, kw_only=True):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    user: str | None = None
    ignore_eos: bool | None = None  # vLLM's extension, as on chat completions
    kvsession: Any = None  # agent hints (serve/agent_hints.py)


# A response id is "resp_" + its chain's 16 hex digits + 16 of its own, so that whoever
# routes requests (the Ray ingress) finds a chain's Session from any of its responses'
# ids; the ingress picks a new chain's digits itself and passes them in this header
CHAIN_HEADER = "x-kvsession-response-chain"
_CHAIN = re.compile(r"[0-9a-f]{16}")


def new_chain() -> str:
    return uuid.uuid4().hex[:16]


def new_response_id(chain: str | None = None) -> str:
    """A response id in `chain` (its 16 hex digits), or in a new chain."""
    return f"resp_{chain or new_chain()}{uuid.uuid4().hex[:16]}"


def chain_session(rid_or_chain: str) -> str | None:
    """The named Session of the chain a response id (or a chain's digits) belongs to;
    None for anything else."""
    digits = rid_or_chain[5:21] if _ID.fullmatch(rid_or_chain) else rid_or_chain
    return f"responses-{digits}" if _CHAIN.fullmatch(digits) else None


# ---- request -> chat --------------------------------------------------------------------


def _text(content, where: str) -> str:
    """An item's content as text: a string, or text parts (input_text, output_text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise P.APIError(400, f"{where}.content must be a string or a list of parts",
                         param="input")
    out = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or \
                not isinstance(part.get("text"), str):
            raise P.APIError(400, f"{where}.content[{i}]: only text parts (input_text, "
                                  f"output_text) are supported, got {kind!r}",
                             param="input")
        out.append(part["text"])
    return "".join(out)


def input_messages(items, where: str = "input") -> list[dict]:
    """The chat messages of a request's `input`: a string is one user message; items are
    messages, function calls (consecutive ones: one assistant message with their
    tool_calls) and their outputs (tool messages); reasoning items are dropped (the model
    saw its thinking when it wrote it; templates strip it from history)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise P.APIError(400, "input must be a non-empty string or list of items",
                         param="input")
    messages: list[dict] = []
    for i, item in enumerate(items):
        here = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise P.APIError(400, f"{here} must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise P.APIError(400, f"{here}.role must be user, system, developer or "
                                      f"assistant, got {role!r}", param="input")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text(item.get("content"), here)})
        elif kind == "function_call":
            name, call_id, args = item.get("name"), item.get("call_id"), item.get("arguments")
            if not all(isinstance(v, str) for v in (name, call_id, args)):
                raise P.APIError(400, f"{here}: a function_call needs string name, call_id "
                                      f"and arguments", param="input")
            call = {"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": args}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            elif last is not None and last["role"] == "assistant":
                last["tool_calls"] = [call]  # the text before the calls, then the calls
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise P.APIError(400, f"{here}.call_id must be a string", param="input")
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": _text(output, here) if not isinstance(output, str)
                             else output})
        elif kind == "reasoning":
            continue
        else:
            raise P.APIError(400, f"{here}: items of type {kind!r} are not supported "
                                  f"(message, function_call, function_call_output)",
                             param="input")
    return messages


def chat_tools(tools) -> list[dict] | None:
    """Function tools in chat's shape ({"type": "function", "function": {...}})."""
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise P.APIError(400, f"tools[{i}]: only function tools are supported, got "
                                  f"{t.get('type') if isinstance(t, dict) else t!r}",
                             param="tools")
        fn = {k: t[k] for k in ("name", "description", "parameters") if k in t}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice):
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise P.APIError(400, "tool_choice must be auto, none, required or "
                                  "{\"type\": \"function\", \"name\": ...}",
                             param="tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def response_format(text: dict | None) -> dict | None:
    """`text.format` as chat's `response_format`."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    raise P.APIError(400, f"text.format.type must be text, json_object or json_schema, got "
                          f"{kind!r}", param="text")


def to_chat(req: ResponsesRequest, messages: list[dict]) -> P.ChatRequest:
    """The chat request that runs a Responses request on `messages`."""
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise P.APIError(400, "max_output_tokens must be >= 1", param="max_output_tokens")
    return P.ChatRequest(
        model=req.model, messages=messages, max_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, stream=req.stream,
        tools=chat_tools(req.tools), tool_choice=chat_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls, response_format=response_format(req.text),
        ignore_eos=req.ignore_eos)


# ---- reply -> response ------------------------------------------------------------------


def output_items(c: P.Choice, ids: dict | None = None) -> list[tuple]:
    """The output items of a reply, each with its key ("reasoning", "message",
    ("call", i)): its reasoning, its message (when it has text, or no calls), its function
    calls. `ids`: the items' ids so far (a stream's), by key."""
    ids = ids if ids is not None else {}
    items: list[tuple] = []
    if c.reasoning:
        items.append(("reasoning", {
            "type": "reasoning", "id": ids.setdefault("reasoning", _item("rs")),
            "summary": [], "content": [{"type": "reasoning_text", "text": c.reasoning}],
            "status": "completed"}))
    if c.text or not c.tool_calls:
        items.append(("message", message_item(ids.setdefault("message", _item("msg")),
                                              c.text, "completed")))
    for i, call in enumerate(c.tool_calls):
        items.append((("call", i), call_item(
            ids.setdefault(("call", i), _item("fc")), call.id, call.name,
            json.dumps(call.arguments, ensure_ascii=False), "completed")))
    return items


def message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}] if text or status == "completed" else []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _item(prefix: str) -> str:
    return P.new_id(prefix).replace(f"{prefix}-", f"{prefix}_")


def response_object(rid: str, req: ResponsesRequest, model: str, created: int,
                    res: P.Result | None, items: list[dict] | None = None) -> dict:
    """The response: in progress (`res` None) or done."""
    out = {"id": rid, "object": "response", "created_at": created, "model": model,
           "status": "in_progress", "error": None, "incomplete_details": None,
           "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
           "metadata": req.metadata or {}, "output": items or [],
           "parallel_tool_calls": req.parallel_tool_calls is not False,
           "previous_response_id": req.previous_response_id, "store": req.store,
           "temperature": req.temperature, "top_p": req.top_p,
           "text": req.text or {"format": {"type": "text"}},
           "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
           "truncation": "disabled", "usage": None, "user": req.user}
    if res is None:
        return out
    c = res.choices[0]
    u = res.usage()
    out["status"] = "incomplete" if c.finish_reason == "length" and not c.tool_calls \
        else "completed"
    if out["status"] == "incomplete":
        out["incomplete_details"] = {"reason": "max_output_tokens"}
    out["output"] = items if items is not None else [item for _, item in output_items(c)]
    out["usage"] = {"input_tokens": u["prompt_tokens"],
                    "input_tokens_details": {"cached_tokens": res.cached_tokens},
                    "output_tokens": u["completion_tokens"],
                    "output_tokens_details": {"reasoning_tokens": 0},
                    "total_tokens": u["total_tokens"]}
    return out


def event(kind: str, seq: int, **fields) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq, **fields}, ensure_ascii=False)}\n\n"  # noqa: E501


class ResponseEvents:
    """A streamed reply as Responses events. Items are added as their first piece arrives
    (reasoning, the message, each call: one output index each) and done, in order, when
    the reply is."""

    def __init__(self, rid: str, req: ResponsesRequest, model: str, created: int):
        self.rid, self.req, self.model, self.created = rid, req, model, created
        self.seq = 0
        self.ids: dict = {}  # item key -> item id (output_items takes them)
        self.index: dict = {}  # item key -> output index
        self.text = {"reasoning": "", "message": ""}
        self.calls: dict[int, list] = {}  # call index -> [call id, name, arguments]
        self.response: dict | None = None  # once finished

    def _event(self, kind: str, **fields) -> str:
        self.seq += 1
        return event(kind, self.seq - 1, **fields)

    def start(self) -> list[str]:
        snapshot = response_object(self.rid, self.req, self.model, self.created, None)
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def _add(self, key, item: dict) -> list[str]:
        self.index[key] = len(self.index)
        return [self._event("response.output_item.added", output_index=self.index[key],
                            item=item)]

    def delta(self, chunk) -> list[str]:
        out: list[str] = []
        if chunk.reasoning:
            if "reasoning" not in self.index:
                rid = self.ids.setdefault("reasoning", _item("rs"))
                out += self._add("reasoning", {"type": "reasoning", "id": rid, "summary": [],
                                               "content": [], "status": "in_progress"})
            self.text["reasoning"] += chunk.reasoning
            out.append(self._event("response.reasoning_text.delta", item_id=self.ids[
                "reasoning"], output_index=self.index["reasoning"], content_index=0,
                delta=chunk.reasoning))
        if chunk.content:
            if "message" not in self.index:
                mid = self.ids.setdefault("message", _item("msg"))
                out += self._add("message", message_item(mid, "", "in_progress"))
                out.append(self._event("response.content_part.added", item_id=mid,
                                       output_index=self.index["message"], content_index=0,
                                       part={"type": "output_text", "text": "",
                                             "annotations": [], "logprobs": []}))
            self.text["message"] += chunk.content
            out.append(self._event("response.output_text.delta", item_id=self.ids["message"],
                                   output_index=self.index["message"], content_index=0,
                                   delta=chunk.content, logprobs=[]))
        for piece in chunk.tool_calls:
            key = ("call", piece.index)
            if piece.id is not None:
                self.calls[piece.index] = [piece.id, piece.name, ""]
                fid = self.ids.setdefault(key, _item("fc"))
                out += self._add(key, call_item(fid, piece.id, piece.name, "", "in_progress"))
            if piece.arguments and piece.index in self.calls:
                self.calls[piece.index][2] += piece.arguments
                out.append(self._event("response.function_call_arguments.delta",
                                       item_id=self.ids[key], output_index=self.index[key],
                                       delta=piece.arguments))
        return out

    def error(self, e: P.APIError) -> str:
        err = e.body()["error"]
        return self._event("error", code=err["code"], message=err["message"],
                           param=err["param"])

    def finish(self, res: P.Result) -> list[str]:
        """The items' done events and `response.completed` (the response: `response`)."""
        c = res.choices[0]
        # an item the finished reply has that no delta announced goes out whole (added
        # and done); every item is done in output order
        keyed = output_items(c, self.ids)
        out: list[str] = []
        for key, item in keyed:
            if key not in self.index:
                out += self._add(key, item)
        for key, item in sorted(keyed, key=lambda kv: self.index[kv[0]]):
            i = self.index[key]
            if item["type"] == "reasoning":
                out.append(self._event("response.reasoning_text.done", item_id=item["id"],
                                       output_index=i, content_index=0,
                                       text=item["content"][0]["text"]))
            elif item["type"] == "message":
                part = item["content"][0]
                out += [self._event("response.output_text.done", item_id=item["id"],
                                    output_index=i, content_index=0, text=part["text"],
                                    logprobs=[]),
                        self._event("response.content_part.done", item_id=item["id"],
                                    output_index=i, content_index=0, part=part)]
            else:
                out.append(self._event("response.function_call_arguments.done",
                                       item_id=item["id"], output_index=i,
                                       arguments=item["arguments"]))
            out.append(self._event("response.output_item.done", output_index=i, item=item))
        ordered = [item for _, item in sorted(keyed, key=lambda kv: self.index[kv[0]])]
        response = response_object(self.rid, self.req, self.model, self.created, res, ordered)
        # completed also when the response is "incomplete" (cut at max_output_tokens; its
        # status says so): the openai package's stream helpers and the Agents SDK wait for
        # response.completed, as vLLM sends it
        out.append(self._event("response.completed", response=response))
        self.response = response
        return out


# ---- stored responses -------------------------------------------------------------------


@dataclass
class Stored:
    """A stored response: the object, the chain (named session) it is a turn of, the
    conversation up to and including it (chat messages), and the chain's instructions."""

    response: dict
    chain: str | None  # None: a stateless response (continued as a branch)
    messages: list[dict]
    instructions: str | None


class KeptFiles(Protocol):
    """Where stored responses persist: the LLM's files beside its sessions (`LLM.put_file`
    and friends: in session_dir, and in its object store where it is a URL)."""

    def put_file(self, name: str, data: bytes) -> None: ...

    def get_file(self, name: str) -> bytes | None: ...

    def delete_file(self, name: str) -> bool: ...


class ResponseStore:
    """Stored responses by id, and the latest response of each chain; with `files`
    (--session-dir), each is kept as `responses/<id>.json` (and a chain's latest id as
    `responses/<chain>.latest`) and read back on a miss, so a restarted server, or another
    replica naming the same session store, finds them. Thread-safe (the server calls it
    from worker threads: files may be in an object store): each dict update is one
    operation, each file written whole."""

    def __init__(self, files: KeptFiles | None):
        self.files = files
        self._by_id: dict[str, Stored] = {}
        self._latest: dict[str, str] = {}  # chain -> its latest response id

    def get(self, rid: str) -> Stored | None:
        if rid in self._by_id:
            return self._by_id[rid]
        if self.files is None or not _ID.fullmatch(rid):
            return None
        try:
            data = json.loads(self.files.get_file(f"responses/{rid}.json") or b"null")
            stored = Stored(data["response"], data["chain"], data["messages"],
                            data.get("instructions"))
        except (ValueError, KeyError, TypeError):
            return None  # none, or not one of ours
        self._by_id[rid] = stored
        return stored

    def is_latest(self, rid: str, stored: Stored) -> bool:
        """Whether `rid` is the latest response of its chain: what the chain's Session
        holds (a continuation of any other is a branch)."""
        chain = stored.chain
        if chain not in self._latest and self.files is not None and chain is not None:
            # the chain's, as a restarted server (or another replica) left it
            latest = self.files.get_file(f"responses/{chain}.latest")
            if latest is not None:
                self._latest[chain] = latest.decode(errors="replace").strip()
        return self._latest.get(chain) == rid

    def put(self, rid: str, stored: Stored) -> None:
        self._by_id[rid] = stored
        if stored.chain is not None:
            self._latest[stored.chain] = rid
        if self.files is not None:
            self.files.put_file(f"responses/{rid}.json", json.dumps({
                "response": stored.response, "chain": stored.chain,
                "messages": stored.messages, "instructions": stored.instructions},
                ensure_ascii=False).encode())
            if stored.chain is not None:
                self.files.put_file(f"responses/{stored.chain}.latest", rid.encode())

    def delete(self, rid: str) -> Stored | None:
        stored = self.get(rid)
        if stored is None:
            return None
        self._by_id.pop(rid, None)
        if self.files is not None:
            self.files.delete_file(f"responses/{rid}.json")
        return stored


def now() -> int:
    return int(time.time())
