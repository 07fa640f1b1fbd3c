"""The caller-side client of remote prefill workers over NIXL (UCX backend; the agents and
descriptors it shares with the worker are in kvsession/connector/descriptors.py).

Only the blocks a request needs move (pitfall 4): descriptors are built from block ids,
consecutive ids merged into runs, one transfer request per layer so the KV streams layer by
layer. NIXL's progress thread is off (it spins a core even when idle); the engine thread
drives progress from `poll`. Agents are torn down explicitly on close (letting them go at
interpreter exit crashes processes).

Completion and fencing: a request is done when the caller has received the worker's NIXL
notification for every layer (a notification is delivered after its transfer's data).
A request that fails without proof that no write of it can land any more (a timeout, a
worker silent past its heartbeat, a malformed message) keeps its blocks in quarantine until
there is such proof: the worker's answer for it, all its notifications, a completed
handshake with that worker (it runs jobs one at a time in arrival order and drops our older
connection's registration first: docs/remote-prefill.md, "Fencing"), a worker at that
address refusing the handshake (another process), or the connection closed by the worker
(its process exited). Re-registering the KV memory is no fence: with UCX, measured not to
stop the old remote keys. A notification counts only when it comes from the agent the
request was sent to. A dead worker is reconnected with backoff (docs/remote-prefill.md,
"Connections").
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvsession.connector.base import (
    NO_HANDSHAKE,
    AuthKeys,
    Bye,
    Completion,
    Hello,
    HelloOk,
    Ping,
    Pong,
    PrefillConnector,
    PrefillDone,
    PrefillFailed,
    PrefillRequest,
    Refused,
    Rejected,
    decode,
    encode,
)
from kvsession.connector.descriptors import describe_tensors, make_agent
from kvsession.costmodel import RateEstimator
from kvsession.errors import ConfigError
from kvsession.routing import PrefixRouter

log = logging.getLogger("kvsession")
CLOSE_WAIT_S = 5.0  # close() waits at most this long for proof that no write can land
# KV memory a worker may still write into when its client closed (no proof came): kept
# allocated for the life of the process, never handed to other tensors
_UNFENCED: list[dict[str, torch.Tensor]] = []


@dataclass
class _Worker:
    address: str
    socket: object = None
    monitor: object = None  # the socket's event monitor (a PAIR socket)
    state: str = "connecting"  # connecting | ready | refused | dead
    since: float = field(default_factory=time.monotonic)  # when the current state began
    last_ping: float = 0.0
    # when the oldest unanswered ping left (None: nothing outstanding); liveness is judged
    # on this, never on the time since we last heard from it (an idle gap is not a death)
    awaiting_pong: float | None = None
    reason: str = ""  # why it is not ready
    agent_name: str = ""  # its NIXL agent: the only sender whose notifications count
    max_tokens: int = 0
    max_message_bytes: int = 0
    handshake_failure: str = ""  # the last security-handshake failure the monitor saw
    retry_at: float = 0.0
    backoff: float = 0.0
    died: bool = False  # dead since its last handshake (the next one is a reconnect)
    num_requests: int = 0
    # counters, for stats().remote.workers
    prefills: int = 0  # completed
    bytes: int = 0  # KV bytes it says it wrote (its answers: what its NIXL writes moved)
    routed: int = 0  # requests it got as their first preference (prefix affinity)
    spilled: int = 0  # requests it got because the preferred worker was at the load bound
    cached_tokens: int = 0  # tokens it served from its own prefix cache (its answers)
    attempts: int = 0
    connects: int = 0
    reconnects: int = 0
    heartbeats: int = 0
    rejected: int = 0
    deaths: dict = field(default_factory=dict)


@dataclass
class _Request:
    seq_id: int
    worker: _Worker
    agent_name: str  # the worker's agent when it was sent: the only one that writes it
    started: float
    num_layers: int
    layers_done: set = field(default_factory=set)
    num_bytes: int = 0


def _handshake_failures(zmq) -> dict[int, str]:
    """Security-handshake failures the socket monitor reports, as death reasons: the worker
    refused our key (ZAP), or the handshake itself failed (a key on one side only, or the
    wrong worker public key: zmq does not tell these apart reliably)."""
    return {zmq.EVENT_HANDSHAKE_FAILED_AUTH: "authentication refused",
            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "security handshake failed",
            zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "security handshake failed"}


class NixlPrefillClient(PrefillConnector):
    """Connections: each worker is `connecting` (a fresh DEALER socket, Hello sent), `ready`,
    `dead` (socket closed; a new attempt at `retry_at`, the delay doubling from
    reconnect_min_s to reconnect_max_s and reset by a completed handshake) or `refused` (an
    incompatible worker: never retried). `schedule(fn)` runs fn on the engine thread
    (`EngineLoop.call`); given, a small timer thread asks for a `poll` whenever the engine
    has not polled for `tick_s`, so heartbeats, handshakes and reconnects go on while it is
    idle.
    Sockets are only ever touched from the engine thread."""

    def __init__(self, addresses: list[str], tensors: dict[str, torch.Tensor], compat: str,
                 timeout_s: float, heartbeat_s: float = 0.25, dead_after_s: float = 2.0,
                 connect_timeout_s: float = 5.0, reconnect_min_s: float = 0.5,
                 reconnect_max_s: float = 10.0, auth: AuthKeys | None = None,
                 schedule: Callable[[Callable[[], None]], object] | None = None):
        import zmq

        dup = sorted({a for a in addresses if addresses.count(a) > 1})
        if dup:
            raise ConfigError(f"prefill_worker lists {dup[0]!r} more than once")
        self.zmq = zmq
        self.compat, self.timeout_s = compat, timeout_s
        self.heartbeat_s, self.dead_after_s = heartbeat_s, dead_after_s
        self.connect_timeout_s = connect_timeout_s
        self.reconnect_min_s, self.reconnect_max_s = reconnect_min_s, reconnect_max_s
        self.auth = auth
        self.tensors = tensors
        first = next(iter(tensors.values()))  # [layers, blocks, block_size, ...]
        self.num_layers, self.block_size = first.shape[0], first.shape[2]
        self._bytes_per_token = sum(t[:, 0, 0].numel() * t.element_size()
                                    for t in tensors.values())
        self.agent = make_agent("kvs-caller")
        self.reg = self.agent.register_memory(list(tensors.values()))
        self.ctx = zmq.Context()
        self._monitor_ids = itertools.count()
        self._failures = _handshake_failures(zmq)
        self.pending: dict[int, _Request] = {}
        self.quarantine: dict[int, _Request] = {}
        self._ids = itertools.count(1)
        self.fallbacks: dict[str, int] = {}
        self.num_prefills = 0
        self.bytes = 0
        self.foreign_notifications = 0  # from agents other than the request's worker
        # the worker's measured write times (posting to the last completion): the cost
        # model's transfer input. Prior 0: "not measured yet" (the caller picks its default)
        self.transfer_rate = RateEstimator(prior=0.0)
        self._completed: dict[int, _Worker] = {}  # req_id -> its worker, recently done
        self.workers = [_Worker(a, backoff=reconnect_min_s) for a in addresses]
        # prefix affinity with bounded load over the workers, by address
        self.router = PrefixRouter(addresses)
        for w in self.workers:
            self._open(w)
        # idle ticks (see the class docstring); an exception in one is raised by next poll
        self._carry: list[Completion] = []
        self._error: BaseException | None = None
        self._last_poll = time.monotonic()
        self._tick_queued = False
        self._schedule = schedule
        self._stop = threading.Event()
        self._ticker = None
        if schedule is not None:
            self._ticker = threading.Thread(target=self._tick_loop, daemon=True,
                                            name="kvsession-prefill-heartbeat")
            self._ticker.start()

    # ---- connections ------------------------------------------------------------------

    def _open(self, w: _Worker) -> None:
        """A fresh socket (a restarted worker knows nothing of the old one) and a Hello."""
        zmq = self.zmq
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.auth is not None:
            sock.curve_secretkey = self.auth.secret
            sock.curve_publickey = self.auth.public
            sock.curve_serverkey = self.auth.peers[0]
        endpoint = f"inproc://kvsession-monitor-{next(self._monitor_ids)}"
        sock.monitor(endpoint, zmq.EVENT_DISCONNECTED | sum(self._failures))
        mon = self.ctx.socket(zmq.PAIR)
        mon.setsockopt(zmq.LINGER, 0)
        mon.connect(endpoint)
        sock.connect(w.address)
        w.socket, w.monitor, w.handshake_failure = sock, mon, ""
        w.attempts += 1
        self._hello(w)

    def _close_socket(self, w: _Worker, linger_ms: int = 0) -> None:
        if w.socket is None:
            return
        try:
            w.socket.disable_monitor()
        except self.zmq.ZMQError:
            pass
        w.socket.close(linger=linger_ms)
        w.monitor.close(linger=0)
        w.socket = w.monitor = None

    def _hello(self, w: _Worker) -> None:
        w.state, w.since, w.awaiting_pong = "connecting", time.monotonic(), None
        try:
            w.socket.send(encode(Hello(self.compat, self.agent.name,
                                       self.agent.get_agent_metadata(),
                                       describe_tensors(self.tensors))),
                          flags=self.zmq.NOBLOCK)
        except self.zmq.ZMQError:
            pass  # queue full: the connect timeout retries

    def healthy(self) -> bool:
        return any(w.state == "ready" for w in self.workers)

    def accepts(self, num_tokens: int) -> bool:
        """A ready worker takes requests of `num_tokens` tokens (its max_model_len)."""
        return any(w.state == "ready" and (not w.max_tokens or num_tokens <= w.max_tokens)
                   for w in self.workers)

    def _loads(self) -> dict[str, int]:
        """Requests each worker is working on: pending, and timed out but unanswered."""
        loads: dict[str, int] = {}
        for r in itertools.chain(self.pending.values(), self.quarantine.values()):
            loads[r.worker.address] = loads.get(r.worker.address, 0) + 1
        return loads

    def _route(self, keys: list[bytes], num_tokens: int):
        """(worker, route) by prefix affinity with bounded load (`PrefixRouter`) among the
        ready workers that take `num_tokens` tokens; (None, None) if there is none."""
        eligible = {w.address: w for w in self.workers if w.state == "ready" and (
            not w.max_tokens or num_tokens <= w.max_tokens)}
        route = self.router.choose(keys, self._loads(), eligible) if eligible else None
        return (None, None) if route is None else (eligible[route.target], route)

    def expected_cached_tokens(self, keys: list[bytes], num_tokens: int) -> int:
        _, route = self._route(keys, num_tokens)
        if route is None:
            return 0
        return min(route.matched_blocks * self.block_size, max(num_tokens - 1, 0))

    # ---- requests -----------------------------------------------------------------------

    def submit(self, seq_id: int, token_ids: list[int], first_token: int,
               block_ids: list[int], keys: list[bytes], cache_salt: str | None) -> bool:
        keys = list(keys)[: len(token_ids) // self.block_size]
        w, route = self._route(keys, len(token_ids))
        if w is None:
            return False
        req_id = next(self._ids)
        data = encode(PrefillRequest(req_id, list(token_ids), first_token // self.block_size,
                                     list(block_ids), cache_salt, first_token))
        if w.max_message_bytes and len(data) > w.max_message_bytes:
            return False  # beyond the worker's limits: it would refuse it
        try:
            w.socket.send(data, flags=self.zmq.NOBLOCK)
        except self.zmq.ZMQError:
            return False
        num_bytes = self._bytes_per_token * (len(token_ids) - first_token)
        self.pending[req_id] = _Request(seq_id, w, w.agent_name, time.monotonic(),
                                        self.num_layers, num_bytes=num_bytes)
        w.num_requests += 1
        if route.preferred:
            w.routed += 1
        else:
            w.spilled += 1
        self.router.record(w.address, keys)  # it will cache this prefix (it computes it)
        return True

    def poll(self, timeout_s: float = 0.0) -> list[Completion]:
        self._last_poll = time.monotonic()
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        out, self._carry = self._carry, []
        self._notifications(out)
        live = [w for w in self.workers if w.socket is not None]
        poller = self.zmq.Poller()
        for w in live:
            poller.register(w.socket, self.zmq.POLLIN)
            poller.register(w.monitor, self.zmq.POLLIN)
        ready = dict(poller.poll(int(timeout_s * 1000))) if live else {}
        for w in live:
            while w.socket is not None and w.socket in ready:
                try:
                    data = w.socket.recv(flags=self.zmq.NOBLOCK)
                except self.zmq.Again:
                    break
                self._on_message(w, data, out)
            if w.monitor is not None and w.monitor in ready:
                self._monitor_events(w, out)
        self._notifications(out)
        self._timers(out)
        return out

    def _notifications(self, out: list[Completion]) -> None:
        """Drive NIXL progress; per-layer notifications complete requests, counted only
        when they come from the agent of the worker the request was sent to."""
        for sender, msgs in self.agent.get_new_notifs().items():
            name = sender.decode() if isinstance(sender, bytes) else str(sender)
            for m in msgs:
                try:
                    req_id, layer = (int(x) for x in m.decode().split(":"))
                except ValueError:  # UnicodeDecodeError included
                    self._foreign(name, m)
                    continue
                r = self.pending.get(req_id) or self.quarantine.get(req_id)
                if r is None:
                    continue  # a late notification of a request that failed: harmless
                if name != r.agent_name or not 0 <= layer < r.num_layers:
                    self._foreign(name, m)
                    continue
                r.layers_done.add(layer)
                if len(r.layers_done) < r.num_layers:
                    continue
                if req_id in self.pending:
                    self._done(req_id, out)
                else:  # timed out, but every write has landed (its answer may be lost)
                    out.append(Completion(self.quarantine.pop(req_id).seq_id, "fenced"))

    def _foreign(self, sender: str, msg: bytes) -> None:
        self.foreign_notifications += 1
        if self.foreign_notifications == 1:  # once: a misbehaving agent can send many
            log.warning("ignoring NIXL notification %r from agent %r: not the worker of that "
                        "request (counted in stats().remote.foreign_notifications)",
                        msg[:40], sender)

    def _done(self, req_id: int, out: list[Completion]) -> None:
        r = self.pending.pop(req_id)
        # its PrefillDone (with the worker's write time) may still be on its way: remember
        # which worker did it, so that answer is still measured (bounded memory)
        self._completed[req_id] = r.worker
        while len(self._completed) > 1024:
            self._completed.pop(next(iter(self._completed)))
        self.num_prefills += 1
        self.bytes += r.num_bytes
        r.worker.prefills += 1
        out.append(Completion(r.seq_id, "done", num_bytes=r.num_bytes,
                              seconds=time.monotonic() - r.started))

    @property
    def bandwidth_bytes_per_s(self) -> float:
        """The data plane's measured bandwidth (an EWMA over transfers); 0.0 before the
        first transfer."""
        return self.transfer_rate.value

    def _fail(self, req_id: int, reason: str, fenced: bool, out: list[Completion]) -> None:
        r = self.pending.pop(req_id)
        self.count_fallback(reason)
        if not fenced:
            self.quarantine[req_id] = r
        out.append(Completion(r.seq_id, "failed", reason=reason, fenced=fenced))

    def _on_message(self, w: _Worker, data: bytes, out: list[Completion]) -> None:
        w.awaiting_pong = None  # anything it says proves it alive
        try:
            msg = decode(data)
        except Exception as e:  # malformed: the worker cannot be trusted any more
            log.warning("malformed message from prefill worker %s: %s", w.address, e)
            self._declare_dead(w, "malformed message", out)
            return
        if isinstance(msg, Pong):
            w.heartbeats += 1
        elif isinstance(msg, HelloOk):
            if w.state != "connecting":
                return
            w.state, w.since, w.reason = "ready", time.monotonic(), ""
            w.agent_name = msg.agent_name
            w.max_tokens, w.max_message_bytes = msg.max_tokens, msg.max_message_bytes
            w.connects += 1
            w.reconnects += w.died
            w.died, w.backoff = False, self.reconnect_min_s
            # every prefill sent to it before this Hello has ended, and none can write: the
            # worker answers a Hello only after the jobs queued before it (one at a time),
            # drops our older connection's registration in doing so (a job ends only with
            # its writes completed or cancelled: the worker exits otherwise); a new agent
            # is a restarted process
            self._release_quarantine(w, out)
        elif isinstance(msg, Refused):
            w.state, w.reason = "refused", msg.reason
            self._close_socket(w)
            # only another process refuses our handshake (an incompatible one, at that
            # address now): the one our prefills went to is gone
            self._release_quarantine(w, out)
            log.warning("prefill worker %s refused the handshake: %s", w.address, msg.reason)
            w.deaths["handshake refused"] = w.deaths.get("handshake refused", 0) + 1
            self.count_fallback("handshake refused")
        elif isinstance(msg, Rejected):
            w.rejected += 1
            log.warning("prefill worker %s rejected a message: %s", w.address, msg.reason)
            if w.state == "connecting":  # e.g. its queue was full: try again later
                self._declare_dead(w, "handshake rejected", out)
        elif isinstance(msg, PrefillDone):
            r = self.pending.get(msg.req_id) or self.quarantine.get(msg.req_id)
            owner = r.worker if r is not None else self._completed.pop(msg.req_id, None)
            if owner is not w:
                return  # not this worker's request: it cannot complete, fence or time it
            self.transfer_rate.observe(msg.num_bytes, msg.seconds)
            w.cached_tokens += msg.cached_tokens
            w.bytes += msg.num_bytes
            if r is None:  # completed by its notifications already
                return
            if msg.req_id in self.quarantine:  # a late answer fences the blocks
                out.append(Completion(self.quarantine.pop(msg.req_id).seq_id, "fenced"))
            # for a pending request, completion comes with its last NIXL notification
        elif isinstance(msg, PrefillFailed):
            r = self.pending.get(msg.req_id) or self.quarantine.get(msg.req_id)
            if r is None or r.worker is not w:
                return
            if msg.req_id in self.pending:
                log.info("prefill worker %s failed request %d: %s", w.address, msg.req_id,
                         msg.reason)
                self._fail(msg.req_id, "worker error", True, out)
                if msg.reason == NO_HANDSHAKE and w.state == "ready":
                    self._hello(w)  # it dropped our registration (e.g. it restarted)
            else:
                out.append(Completion(self.quarantine.pop(msg.req_id).seq_id, "fenced"))

    def _monitor_events(self, w: _Worker, out: list[Completion]) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while w.monitor is not None:
            try:
                event = recv_monitor_message(w.monitor, flags=self.zmq.NOBLOCK)["event"]
            except self.zmq.Again:
                return
            if event in self._failures and w.state == "connecting":
                w.handshake_failure = self._failures[event]
                log.warning("prefill worker %s: %s: are the keys right? (docs/security.md)",
                            w.address, w.handshake_failure)
                self._declare_dead(w, w.handshake_failure, out)
            elif event == self.zmq.EVENT_DISCONNECTED and w.state == "ready":
                # the worker knows a caller by its connection: a new one has no handshake
                self._declare_dead(w, "connection lost", out)

    def _timers(self, out: list[Completion]) -> None:
        now = time.monotonic()
        for req_id, r in list(self.pending.items()):
            if now - r.started > self.timeout_s:
                self._fail(req_id, "timeout", False, out)
        for w in self.workers:
            if w.state == "ready":
                if now - w.last_ping >= self.heartbeat_s:
                    w.last_ping = now
                    if w.awaiting_pong is None:
                        w.awaiting_pong = now
                    try:
                        w.socket.send(encode(Ping(now)), flags=self.zmq.NOBLOCK)
                    except self.zmq.ZMQError:
                        pass
                if w.awaiting_pong is not None and now - w.awaiting_pong > self.dead_after_s:
                    self._declare_dead(w, "no heartbeat", out)
                    continue
            if w.state == "connecting":
                if now - w.since > self.connect_timeout_s:
                    self._declare_dead(w, w.handshake_failure or "unreachable", out)
            elif w.state == "dead" and now >= w.retry_at:
                log.info("prefill worker %s: reconnecting (attempt %d)", w.address,
                         w.attempts + 1)
                self._open(w)

    def _declare_dead(self, w: _Worker, reason: str, out: list[Completion]) -> None:
        """Its requests fall back, then a reconnect is scheduled. A worker that closed our
        connection has exited (it closes its socket only then, after its jobs: kvsession/
        worker.py), so nothing of it can write any more: its requests' blocks are released
        (fenced). Any other death (no heartbeat, a malformed message, a refused handshake)
        may be a live process that still writes: its requests' blocks go to quarantine
        until proof that no write can land (module docstring)."""
        if w.state in ("dead", "refused"):
            return
        exited = reason == "connection lost"
        if exited:
            # what its writes had sent before it exited may still wait in our sockets:
            # progress applies it (and may complete requests) before anything is released
            self._notifications(out)
        w.state, w.reason, w.died = "dead", reason, True
        self.router.forget(w.address)  # it may come back restarted, with an empty cache
        w.deaths[reason] = w.deaths.get(reason, 0) + 1
        self._close_socket(w)
        now = time.monotonic()
        w.since, w.retry_at = now, now + w.backoff
        w.backoff = min(w.backoff * 2, self.reconnect_max_s)
        mine = [q for q, r in self.pending.items() if r.worker is w]
        log.warning("prefill worker %s: %s; retrying in %.1f s%s", w.address, reason,
                    w.retry_at - now, f" ({len(mine)} requests fall back)" if mine else "")
        for q in mine:
            self._fail(q, reason, exited, out)
        if exited:
            self._release_quarantine(w, out)

    def _release_quarantine(self, w: _Worker, out: list[Completion]) -> None:
        """No write of a request sent to `w` can land any more: release their blocks."""
        for q in [q for q, r in self.quarantine.items() if r.worker is w]:
            out.append(Completion(self.quarantine.pop(q).seq_id, "fenced"))

    # ---- idle ticks ---------------------------------------------------------------------

    @property
    def tick_s(self) -> float:
        """How long the engine may go without polling: the finer of the heartbeat and the
        reconnect delay. Not the heartbeat alone: a caller with a long heartbeat would read
        a HelloOk that arrives while the engine is idle (after a worker forgot it, or
        restarted) only a heartbeat later, and fall back to local prefill until then."""
        return min(self.heartbeat_s, self.reconnect_min_s)

    def _tick_loop(self) -> None:
        """Timer thread: never touches a socket, only asks the engine thread to poll."""
        try:
            while not self._stop.wait(self.tick_s):
                if self._tick_queued or time.monotonic() - self._last_poll < self.tick_s:
                    continue
                self._tick_queued = True
                self._schedule(self._tick)
        except Exception as e:  # reaches the engine at its next poll
            log.exception("the prefill heartbeat thread failed")
            self._error = e

    def _tick(self) -> None:  # engine thread
        self._tick_queued = False
        try:
            # two statements: poll() swaps self._carry for a new list (so `self._carry.
            # extend(self.poll())` would append to the old one and lose the completions)
            done = self.poll(0.0)
            self._carry.extend(done)
        except Exception as e:
            self._error = e

    def close(self) -> None:
        """Called once the engine no longer polls. Closing is no fence either (a worker
        may write into the memory with no agent or registration of ours: measured): it
        waits, bounded, for proof on every request a worker may still write; what stays
        unproven keeps the KV memory allocated for good (`_UNFENCED`), so that no other
        tensor is ever placed where a late write lands."""
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=5.0)
        deadline = time.monotonic() + min(self.timeout_s, CLOSE_WAIT_S)
        while (self.pending or self.quarantine) and time.monotonic() < deadline:
            try:
                self.poll(0.01)  # (its completions have no engine to go to any more)
            except Exception:  # noqa: BLE001 - closing: what failed is moot, keep the memory
                break
        if self.pending or self.quarantine:
            log.warning("closing with %d remote prefills a worker may still write: their KV "
                        "memory stays allocated until the process exits",
                        len(self.pending) + len(self.quarantine))
            _UNFENCED.append(self.tensors)
        for w in self.workers:
            if w.socket is not None:
                try:
                    w.socket.send(encode(Bye()), flags=self.zmq.NOBLOCK)
                except self.zmq.ZMQError:
                    pass
                self._close_socket(w, linger_ms=100)
        self.ctx.term()
        if self.reg is not None:
            self.agent.deregister_memory(self.reg)
            self.reg = None
        self.agent = None

    @property
    def num_registrations(self) -> int:
        return 0 if self.reg is None else 1
