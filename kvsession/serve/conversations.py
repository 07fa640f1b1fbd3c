"""Conversations -> kvsession Sessions, so that stateless clients reuse their KV.

An OpenAI client re-sends the whole conversation every turn. After each turn served by a
Session, the server files that Session under a hash of the conversation as the client will
send it back: the request's messages plus the assistant message the server answered
(canonicalised: text parts joined, None and "" alike, tool-call arguments as sorted JSON,
transport-only fields dropped). A request whose messages extend a filed conversation (the
longest filed prefix that ends with an assistant message) takes that Session out of the
table and sends it only the new messages: with the session's append-only history the
previous reply's exact tokens, and everything before them, are reused.

The table is an LRU of idle Sessions (taken sessions are not in it, so a Session serves
one request at a time and is never closed under a running turn); the least recently used
is closed when it is full. A conversation that diverges from every filed one (an edited
message, a retry of an answered turn) starts a new Session: the prefix cache still serves
the blocks they share.

`session_id` (a body field, `extra_body={"session_id": ...}` in the openai client, or the
`X-Session-Id` header) binds a request to a named Session instead (durable with
--session-dir: `llm.session(session_id=...)` resumes it after a restart). Its messages must
extend the session's history (or hold only new messages); turns on one named session run
one at a time, in arrival order.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import inspect
import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from kvsession import LLM, CacheFullError, Session
from kvsession.serve.protocol import APIError

log = logging.getLogger("kvsession.serve")

# what the installed Session API can take per conversation (read off the signatures, so the
# server uses sessions for tool conversations as soon as the API has them)
SESSION_TAKES = set(inspect.signature(LLM.session).parameters)
SEND_TAKES = set(inspect.signature(Session.send).parameters)


async def _in_thread(fn, *args, if_cancelled):
    """fn(*args) on a worker thread. A thread cannot be stopped: if the caller is cancelled
    (its client went away), the result it would have had goes to `if_cancelled`."""
    work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        work.add_done_callback(functools.partial(_hand_over, if_cancelled))
        raise


def _hand_over(to, work: asyncio.Future) -> None:
    if not work.cancelled() and work.exception() is None:
        to(work.result())


def _close_in_thread(session: Session) -> None:
    """Close a Session nobody took (off the event loop: closing waits on the engine)."""
    threading.Thread(target=session.close, daemon=True, name="kvsession-serve-close").start()


def _content(value) -> str:
    """A message's content as one string: text parts joined, None as ""."""
    if value is None:
        return ""
    if isinstance(value, list):
        return "".join(p.get("text", "") for p in value if isinstance(p, dict))
    return str(value)


def _arguments(args) -> str:
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return args
    return json.dumps(args, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def canonical(m: dict) -> str:
    """One message as the text the conversation key hashes: what the model saw of it, in a
    form every client's way of sending it back gives alike."""
    if not isinstance(m, dict):
        return json.dumps(repr(m))
    d = {"role": m.get("role"), "content": _content(m.get("content"))}
    calls = m.get("tool_calls")
    if calls:
        # a client may drop or blank the content of a tool-call message, and some rewrite
        # the call ids: the calls themselves (name, arguments) identify the reply
        d["content"] = ""
        d["tool_calls"] = [
            [(c.get("function") or {}).get("name"), _arguments((c.get("function") or {})
                                                             .get("arguments"))]
            for c in calls if isinstance(c, dict)]
    for key in ("name", "tool_call_id"):
        if isinstance(m.get(key), str):
            d[key] = m[key]
    return json.dumps(d, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def chain(salt: str, messages: list[dict]) -> list[bytes]:
    """Hashes of every prefix of `messages` (index i: the first i messages)."""
    h = hashlib.sha256(salt.encode()).digest()
    out = [h]
    for m in messages:
        h = hashlib.sha256(h + canonical(m).encode()).digest()
        out.append(h)
    return out


def conversation_salt(tools, chat_template_kwargs, cache_salt) -> str:
    """What shapes a rendered conversation besides its messages (not tool_choice: a
    conversation may force a call on one turn and not the next)."""
    return json.dumps([tools, chat_template_kwargs, cache_salt], sort_keys=True, default=str)


def conversation_keys(messages: list[dict], tools=None, chat_template_kwargs=None,
                      cache_salt=None) -> list[bytes]:
    """The keys a chat request's conversation is filed and looked up under: key i names its
    first i messages (key 0: no message, only the salt). A replica router computes them
    from the request body to find the replica holding a conversation
    (kvsession/serve/router.py)."""
    return chain(conversation_salt(tools, chat_template_kwargs, cache_salt), messages)


def extend(h: bytes, m: dict) -> bytes:
    return hashlib.sha256(h + canonical(m).encode()).digest()


def session_safe(messages: list[dict]) -> bool:
    """Messages a Session turn can take as they are (the Session validates the rest, as
    llm.chat does)."""
    return all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)


def turn_prompt_tokens(session: Session, new: list[dict]) -> int | None:
    """How many tokens the prompt of `session`'s next turn on `new` will have (None when
    it cannot be told): the prompt the session builds (append history: its token log and
    the template's delta for the messages not in it; else the whole conversation),
    rendered here beforehand, because a stream's headers go out before its usage is known
    (x-kvsession-max-tokens). Called before the turn starts, while this request holds the
    session, so nothing changes it meanwhile."""
    opts, messages = session.options(), session.messages
    try:
        if opts.history == "append" and opts.log:
            pending = messages[len(messages) - opts.pending:] if opts.pending else []
            lead = [m for m in messages[:1] if m.get("role") == "system"]
            try:
                return len(opts.log) + len(session.renderer.delta(lead, pending + new,
                                                                  opts.log[-1]))
            except Exception:  # not append-stable for these messages: the turn re-renders
                pass           # the whole conversation, as below
        return len(session.renderer.encode(messages + new))
    except Exception:  # the turn fails too, and says why
        return None


@dataclass
class Plan:
    """How one request runs: on `session` (sending it `new`), or stateless (session None).
    `key`: the hash of the request's messages, to file the session under once the reply
    is known; `named`: the named-session entry it holds (released when the turn ends);
    `prior_key`: the key a reused auto session was filed under (it goes back there when
    its turn is cancelled or fails: the conversation it holds is unchanged)."""

    session: Session | None
    new: list[dict]
    key: bytes
    auto: bool = False
    reused: bool = False
    named: _Named | None = None
    named_len: int = 0  # the named session's messages when the turn began
    prior_key: bytes | None = None
    prior_len: int = 0  # the reused auto session's messages when the turn began
    # a named session's last turn answered exactly this request (a retry): its stored
    # reply (the assistant message) is sent again and nothing runs
    replay: dict | None = None
    hints: object = None  # the request's agent hints (serve/agent_hints.AgentHints)


@dataclass
class _Named:
    session: Session
    view: list[str]  # the conversation as the client sees it (canonical messages)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class Conversations:
    """The conversation table (auto sessions) and the named sessions of one server."""

    def __init__(self, llm: LLM, capacity: int = 256):
        self.llm, self.capacity = llm, capacity
        self._auto: OrderedDict[bytes, Session] = OrderedDict()
        self._named: OrderedDict[str, _Named] = OrderedDict()
        self.hits = self.misses = 0
        # session id -> when it expires (its client's session_ttl_s after its last turn)
        self._deadlines: dict[str, float] = {}
        self.expired = 0

    @property
    def num_sessions(self) -> int:
        return len(self._auto) + len(self._named)

    def filed_keys(self) -> list[bytes]:
        """The conversation keys idle Sessions are filed under (a replica's summary)."""
        return list(self._auto)

    def named_ids(self) -> list[str]:
        """The named sessions open here."""
        return list(self._named)

    async def release(self, session_id: str) -> bool:
        """Close an open named session that has no turn running, so that another process
        can resume it from --session-dir (its lock is released once this returns). True
        when it is not open here (any more); False when a turn holds it."""
        entry = self._named.get(session_id)
        if entry is None:
            return True
        if entry.lock.locked():
            return False
        del self._named[session_id]
        await asyncio.to_thread(entry.session.close, delete=False)
        return True

    # ---- planning --------------------------------------------------------------------

    async def plan(self, messages: list[dict], salt: str, session_id: str | None,
                   session_kwargs: dict, can_session: bool) -> Plan:
        """Where the request runs. `can_session`: its parameters fit a Session turn."""
        hashes = chain(salt, messages)
        if session_id is not None:
            return await self._plan_named(messages, hashes[-1], session_id, session_kwargs)
        if not can_session or not messages:
            return Plan(None, messages, hashes[-1])
        for i in range(len(messages), 0, -1):
            if messages[i - 1].get("role") != "assistant" or hashes[i] not in self._auto:
                continue
            new = messages[i:]
            if not new or not session_safe(new) or new[-1].get("role") == "assistant":
                break
            self.hits += 1
            sess = self._auto.pop(hashes[i])
            return Plan(sess, new, hashes[-1], auto=True, reused=True, prior_key=hashes[i],
                        prior_len=len(sess.messages))
        self.misses += 1
        system = None
        rest = messages
        first = messages[0]
        if first.get("role") == "system" and session_safe([first]):
            system, rest = _content(first.get("content")), messages[1:]
        if not rest or not session_safe(rest) or rest[-1].get("role") == "assistant":
            return Plan(None, messages, hashes[-1])
        sess = await _in_thread(self._new_session, system, None, session_kwargs,
                                if_cancelled=_close_in_thread)
        return Plan(sess, rest, hashes[-1], auto=True)

    def _new_session(self, system: str | None, session_id: str | None,
                     kwargs: dict) -> Session:
        try:
            return self.llm.session(system=system, session_id=session_id, **kwargs)
        except CacheFullError:
            # the pinned share of the cache is full of other system prompts: this
            # conversation still works, its system prompt is only not shared
            return self.llm.session(system=system, session_id=session_id, pin_system=False,
                                    **kwargs)

    async def _plan_named(self, messages: list[dict], key: bytes, session_id: str,
                          kwargs: dict) -> Plan:
        entry = self._named.get(session_id)
        if entry is None:
            # filed even when its client goes away meanwhile: the client's retry finds it
            entry = await asyncio.shield(self._open_and_file(session_id, messages, kwargs))
        self._named.move_to_end(session_id)
        # the client leaving while earlier turns of this session run cancels the wait (the
        # server watches for it): its turn never runs
        await entry.lock.acquire()  # released by finish() / abandon()
        try:
            replay = self._retried(entry, messages)
            new = [] if replay else self._new_messages(entry, messages, session_id)
        except BaseException:
            entry.lock.release()
            raise
        return Plan(entry.session, new, key, named=entry,
                    named_len=len(entry.session.messages), replay=replay)

    async def _open_and_file(self, session_id: str, messages: list[dict],
                             kwargs: dict) -> _Named:
        entry = await asyncio.to_thread(self._open_named, session_id, messages, kwargs)
        self._named[session_id] = entry
        return entry

    def _open_named(self, session_id: str, messages: list[dict], kwargs: dict) -> _Named:
        if session_id in self.llm.sessions():  # persisted in --session-dir: resume it
            sess = self.llm.session(session_id=session_id)
        else:
            first = messages[0] if messages else {}
            system = (_content(first.get("content"))
                      if first.get("role") == "system" and session_safe([first]) else None)
            sess = self._new_session(system, session_id, kwargs)
        return _Named(sess, [canonical(m) for m in sess.messages])

    @staticmethod
    def _retried(entry: _Named, messages: list[dict]) -> dict | None:
        """The session's last reply when `messages` is its history up to that reply: the
        request was answered already, its reply lost on the way (a client's retry after a
        timeout; the ingress re-sending a request whose replica died after the turn's log
        record was written). Answering it again would fork the history."""
        view = entry.view
        if len(messages) != len(view) - 1 or not view:
            return None
        last = entry.session.messages[-1]
        if last.get("role") != "assistant" or canonical(last) != view[-1]:
            return None
        if any(canonical(m) != v for m, v in zip(messages, view[:-1], strict=True)):
            return None
        return last

    @staticmethod
    def _new_messages(entry: _Named, messages: list[dict], session_id: str) -> list[dict]:
        view, got = entry.view, [canonical(m) for m in messages]
        n = 0
        while n < min(len(view), len(got)) and view[n] == got[n]:
            n += 1
        if n == len(view):
            new = messages[n:]
        elif n == 0 or not any(m.get("role") == "assistant" for m in messages):
            # a stateful client sends only the new messages; they may repeat the session's
            # first ones ("continue" twice). A history holds the replies: one that differs
            # from the session's is an edit, refused below
            new = messages
        else:
            raise APIError(409, f"messages[{n}] differs from message {n} of session "
                                f"{session_id!r}: a session's history can only be extended "
                                f"(start a new session_id to branch)", param="messages",
                           code="session_conflict")
        if not new:
            raise APIError(400, f"nothing new to answer: the messages are session "
                                f"{session_id!r}'s history", param="messages")
        return new

    # ---- after the turn --------------------------------------------------------------

    def finish(self, plan: Plan, reply: dict) -> None:
        """The turn answered `reply` (the assistant message sent to the client): file the
        session under the conversation the client will send back."""
        if plan.named is not None:
            if plan.replay is None:
                plan.named.view += [canonical(m) for m in plan.new] + [canonical(reply)]
            plan.named.lock.release()
            self._bound()
            return
        if plan.session is None:
            return
        self._file(extend(plan.key, reply), plan.session)

    def abandon(self, plan: Plan) -> None:
        """The turn failed or its client went away (which cancels the turn). A reused auto
        session whose turn did not happen holds the conversation it held before: it is
        filed back under that conversation's key. One that holds a turn no client has seen
        (the reply was complete before the client left), or a new one, can be continued by
        no conversation: it is closed. A named session is kept (its client may go on): if
        the turn happened, its view becomes the session's own messages, so the client's
        next request must extend those or hold only new ones."""
        if plan.named is not None:
            sess = plan.named.session
            if len(sess.messages) != plan.named_len:
                plan.named.view = [canonical(m) for m in sess.messages]
            plan.named.lock.release()
            return
        if plan.session is None:
            return
        if plan.prior_key is not None and len(plan.session.messages) == plan.prior_len \
                and plan.session.state != "closed":
            self._file(plan.prior_key, plan.session)
            return
        self._close_later(plan.session)

    def expire_after(self, sess: Session, ttl_s: float) -> None:
        """Close `sess` if it waits `ttl_s` for its next turn (an agent hint: its client
        said how long the conversation may be idle). A turn in between re-arms it."""
        loop = asyncio.get_running_loop()
        self._deadlines[sess.session_id] = loop.time() + ttl_s
        loop.call_later(ttl_s, self._expire, sess)

    def _expire(self, sess: Session) -> None:
        deadline = self._deadlines.get(sess.session_id)
        if deadline is None or asyncio.get_running_loop().time() < deadline:
            return  # re-armed by a later turn (its own timer decides)
        for key, filed in self._auto.items():
            if filed is sess:  # idle in the table: closed, its file with it
                del self._auto[key]
                break
        else:
            entry = self._named.get(sess.session_id)
            if entry is None or entry.session is not sess or entry.lock.locked():
                return  # in a turn (which re-arms it), or gone already
            del self._named[sess.session_id]
            del self._deadlines[sess.session_id]
            self.expired += 1
            self._close_later(sess, delete=False)  # a named session stays resumable
            return
        del self._deadlines[sess.session_id]
        self.expired += 1
        self._close_later(sess)

    def _file(self, key: bytes, sess: Session) -> None:
        """File `sess` under `key`, the most recent entry. A session filed there already
        holds the same conversation (an identical request answered twice: a retry, a
        regenerate at temperature 0): it is closed; replaced silently, it held its KV
        outside the table's bound for good."""
        old = self._auto.pop(key, None)
        if old is not None and old is not sess:
            self._close_later(old)
        self._auto[key] = sess
        self._bound()

    def _bound(self) -> None:
        while len(self._auto) + len(self._named) > self.capacity:
            if self._auto:
                _, sess = self._auto.popitem(last=False)
                self._close_later(sess)
                continue
            sid, entry = next(iter(self._named.items()))
            if entry.lock.locked():
                return  # in use; evicted once idle
            del self._named[sid]
            self._close_later(entry.session, delete=False)

    @staticmethod
    def _close_later(sess: Session, delete: bool = True) -> None:
        """Close off the event loop (it waits for the engine thread). An auto session's
        file, if --session-dir wrote one, is useless without this table: delete it."""
        def close():
            try:
                sess.close(delete=delete)
            except Exception:  # closing is best effort; the engine keeps running
                log.exception("closing session %s failed", sess.session_id)
        asyncio.get_running_loop().run_in_executor(None, close)

    def close_all(self) -> None:
        """Shutdown (blocking): close auto sessions (deleting their files); named sessions
        are left to llm.close(), which persists them."""
        for sess in self._auto.values():
            try:
                sess.close(delete=True)
            except Exception:
                log.exception("closing session %s failed", sess.session_id)
        self._auto.clear()
