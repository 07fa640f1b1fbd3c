"""Agent hints: what a client knows about its conversation that the server would otherwise
guess, passed with any request (chat completions, Responses, Messages) as a `kvsession`
object in the body or as `X-KVSession-*` headers (the body wins):

    session_ttl_s            how long the conversation's Session may wait for its next
                             request before it is closed (its KV freed in every tier);
    expected_tool_latency_s  after a reply that calls a tool, how long until the tool's
                             result comes back: the Session is suspended with it
                             (`Session.suspend(expected_idle_s=...)`: the engine keeps its
                             KV, spills it to host or disk, or drops it, by expected cost);
    priority                 the request's priority (an integer, lower is more urgent, as
                             vLLM): it orders the scheduler's admission and preemption, and
                             is kept with the conversation's Session (its later turns, and
                             the order idle sessions' KV is reclaimed in).

Without `expected_tool_latency_s` the server uses what it learned of that conversation
(`ToolGaps`): the time between each reply that called a tool and the conversation's next
request, averaged (the tool's latency plus the client's, which is what the KV waits for).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

from kvsession.serve import protocol as P

HEADERS = {"session_ttl_s": "x-kvsession-session-ttl-s",
           "expected_tool_latency_s": "x-kvsession-expected-tool-latency-s",
           "priority": "x-kvsession-priority"}
MAX_PRIORITY = 1_000_000


@dataclass(frozen=True)
class AgentHints:
    session_ttl_s: float | None = None
    expected_tool_latency_s: float | None = None
    priority: int | None = None


def read_hints(body, headers: Mapping[str, str]) -> AgentHints:
    """A request's hints: its body's `kvsession` object over its `X-KVSession-*` headers.
    A 400 naming the hint for a value that is not one."""
    if body is not None and not isinstance(body, dict):
        raise P.APIError(400, "kvsession must be an object of agent hints", param="kvsession")
    body = body or {}
    unknown = sorted(set(body) - set(HEADERS))
    if unknown:
        raise P.APIError(400, f"unknown agent hint {unknown[0]!r} (known: "
                              f"{', '.join(HEADERS)})", param=f"kvsession.{unknown[0]}")
    values = {}
    for name, header in HEADERS.items():
        value = body.get(name)
        if value is None and header in headers:
            value = _number(headers[header], header)
        if value is not None:
            values[name] = _checked(name, value)
    return AgentHints(**values)


def _number(text: str, header: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise P.APIError(400, f"{header} must be a number, got {text!r:.40}",
                         param=header) from None


def _checked(name: str, value):
    where = f"kvsession.{name}"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value):
        raise P.APIError(400, f"{where} must be a finite number", param=where)
    if name == "priority":
        if value != int(value) or abs(value) > MAX_PRIORITY:
            raise P.APIError(400, f"{where} must be an integer within +-{MAX_PRIORITY}",
                             param=where)
        return int(value)
    if value < 0 or (name == "session_ttl_s" and value == 0):
        raise P.APIError(400, f"{where} must be {'> 0' if name == 'session_ttl_s' else '>= 0'}",
                         param=where)
    return float(value)


class ToolGaps:
    """Per conversation (its Session's id): the time between a reply that called a tool
    and the next request, as an exponential average (recent gaps weigh most: a tool that
    got slower shows at once). Bounded: the least recently seen conversations are
    forgotten first. Event-loop side only."""

    ALPHA = 0.5  # the newest gap's weight
    CAPACITY = 4096  # conversations remembered

    def __init__(self):
        self._waiting: OrderedDict[str, float] = OrderedDict()  # id -> when it replied
        self._average: OrderedDict[str, float] = OrderedDict()  # id -> average gap, s

    def replied_with_calls(self, session_id: str, now_s: float) -> None:
        self._put(self._waiting, session_id, now_s)

    def request_arrived(self, session_id: str, now_s: float) -> None:
        replied = self._waiting.pop(session_id, None)
        if replied is None:
            return
        gap = max(now_s - replied, 0.0)
        old = self._average.get(session_id)
        self._put(self._average, session_id,
                  gap if old is None else self.ALPHA * gap + (1 - self.ALPHA) * old)

    def estimate(self, session_id: str) -> float | None:
        return self._average.get(session_id)

    def _put(self, table: OrderedDict, key: str, value: float) -> None:
        table[key] = value
        table.move_to_end(key)
        while len(table) > self.CAPACITY:
            table.popitem(last=False)
