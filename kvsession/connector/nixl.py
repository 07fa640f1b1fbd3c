"""The NIXL data plane (UCX backend) and the caller-side client of remote prefill workers.

Only the blocks a request needs move (pitfall 4): descriptors are built from block ids,
consecutive ids merged into runs, one transfer request per layer so the KV streams layer by
layer. NIXL's progress thread is off (it spins a core even when idle); the engine thread
drives progress from `poll`. Agents are torn down explicitly on close (letting them go at
interpreter exit crashes processes).

Completion and fencing: a request is done when the caller has received the worker's NIXL
notification for every layer (a notification is delivered after its transfer's data).
A request that times out keeps its blocks in quarantine until the worker answers for it or
is declared dead; a dead worker is fenced by re-registering the KV memory (its remote keys
stop working) and re-handshaking the live workers, so a late write can never land in a
block that was handed to someone else.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import time
import uuid
from dataclasses import dataclass, field

import torch

from kvsession.connector.base import (
    Bye,
    Completion,
    Hello,
    HelloOk,
    Ping,
    PrefillConnector,
    PrefillDone,
    PrefillFailed,
    PrefillRequest,
    Refused,
    TensorDesc,
    decode,
    encode,
)
from kvsession.costmodel import RateEstimator

log = logging.getLogger("kvsession")


def make_agent(prefix: str):
    from nixl._api import nixl_agent, nixl_agent_config

    if "NIXL_LOG_LEVEL" not in os.environ:  # NIXL logs every agent at INFO to stdout
        logging.getLogger("nixl").setLevel(logging.WARNING)
    config = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                               backends=["UCX"])
    return nixl_agent(f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}", config)


def describe_tensors(tensors: dict[str, torch.Tensor]) -> list[TensorDesc]:
    return [TensorDesc(name, t.data_ptr(), t.shape[0], t.shape[1],
                       t[0, 0].numel() * t.element_size(),
                       "VRAM" if t.is_cuda else "DRAM", t.device.index or 0)
            for name, t in tensors.items()]


def layer_descs(local: list[TensorDesc], remote: list[TensorDesc], layer: int,
                runs: list[tuple[int, int, int]]) -> tuple[list, list]:
    """(local, remote) (addr, length, device) lists for one layer of every tensor."""
    src, dst = [], []
    for lt, rt in zip(local, remote, strict=True):
        for s0, d0, n in runs:
            src.append((lt.addr + (layer * lt.num_blocks + s0) * lt.block_bytes,
                        n * lt.block_bytes, lt.device_id))
            dst.append((rt.addr + (layer * rt.num_blocks + d0) * rt.block_bytes,
                        n * rt.block_bytes, rt.device_id))
    return src, dst


@dataclass
class _Worker:
    address: str
    socket: object
    state: str = "connecting"  # connecting | ready | refused | dead
    last_heard: float = field(default_factory=time.monotonic)
    last_ping: float = 0.0
    reason: str = ""
    num_requests: int = 0


@dataclass
class _Request:
    seq_id: int
    worker: _Worker
    started: float
    num_layers: int
    layers_done: set = field(default_factory=set)
    num_bytes: int = 0


class NixlPrefillClient(PrefillConnector):
    def __init__(self, addresses: list[str], tensors: dict[str, torch.Tensor], compat: str,
                 timeout_s: float, heartbeat_s: float = 0.25, dead_after_s: float = 2.0):
        import zmq

        self.zmq = zmq
        self.compat, self.timeout_s = compat, timeout_s
        self.heartbeat_s, self.dead_after_s = heartbeat_s, dead_after_s
        self.tensors = tensors
        self.num_layers = next(iter(tensors.values())).shape[0]
        self._bytes_per_block = sum(t[:, 0].numel() * t.element_size() for t in tensors.values())
        self.agent = make_agent("kvs-caller")
        self.reg = self.agent.register_memory(list(tensors.values()))
        self.ctx = zmq.Context()
        self.workers = [self._connect(a) for a in addresses]
        self.pending: dict[int, _Request] = {}
        self.quarantine: dict[int, _Request] = {}
        self._ids = itertools.count(1)
        self.fallbacks: dict[str, int] = {}
        self.num_prefills = 0
        self.bytes = 0
        # the worker's measured write times (posting to the last completion): the cost
        # model's transfer input. Prior 0: "not measured yet" (the caller picks its default)
        self.transfer_rate = RateEstimator(prior=0.0)

    # ---- connections ------------------------------------------------------------------

    def _connect(self, address: str) -> _Worker:
        sock = self.ctx.socket(self.zmq.DEALER)
        sock.setsockopt(self.zmq.LINGER, 0)
        sock.connect(address)
        w = _Worker(address, sock)
        self._hello(w)
        return w

    def _hello(self, w: _Worker) -> None:
        w.state = "connecting"
        w.socket.send(encode(Hello(self.compat, self.agent.name,
                                   self.agent.get_agent_metadata(),
                                   describe_tensors(self.tensors))))

    def healthy(self) -> bool:
        return any(w.state == "ready" for w in self.workers)

    def _pick(self, affinity: bytes) -> _Worker | None:
        """Rendezvous hashing on the request's first block hash: the same prefix keeps
        landing on the same healthy worker (where it is cached)."""
        ready = [w for w in self.workers if w.state == "ready"]
        if not ready:
            return None
        return max(ready, key=lambda w: hashlib.sha256(affinity + w.address.encode()).digest())

    # ---- requests -----------------------------------------------------------------------

    def submit(self, seq_id: int, token_ids: list[int], first_block: int,
               block_ids: list[int], affinity: bytes, cache_salt: str | None) -> bool:
        w = self._pick(affinity)
        if w is None:
            return False
        req_id = next(self._ids)
        try:
            w.socket.send(encode(PrefillRequest(req_id, list(token_ids), first_block,
                                                list(block_ids), cache_salt)),
                          flags=self.zmq.NOBLOCK)
        except self.zmq.ZMQError:
            return False
        self.pending[req_id] = _Request(seq_id, w, time.monotonic(), self.num_layers,
                                        num_bytes=self._bytes_per_block * len(block_ids))
        w.num_requests += 1
        return True

    def poll(self, timeout_s: float = 0.0) -> list[Completion]:
        out: list[Completion] = []
        self._notifications(out)
        poller = self.zmq.Poller()
        for w in self.workers:
            if w.state != "dead":
                poller.register(w.socket, self.zmq.POLLIN)
        ready = dict(poller.poll(int(timeout_s * 1000))) if self.workers else {}
        for w in self.workers:
            while w.socket in ready and w.state != "dead":
                try:
                    data = w.socket.recv(flags=self.zmq.NOBLOCK)
                except self.zmq.Again:
                    break
                self._on_message(w, data, out)
        self._notifications(out)
        self._timers(out)
        return out

    def _notifications(self, out: list[Completion]) -> None:
        """Drive NIXL progress; per-layer notifications complete requests."""
        for msgs in self.agent.get_new_notifs().values():
            for m in msgs:
                try:
                    req_id, layer = (int(x) for x in m.decode().split(":"))
                except ValueError:
                    continue
                r = self.pending.get(req_id)
                if r is not None:
                    r.layers_done.add(layer)
                    if len(r.layers_done) == r.num_layers:
                        self._done(req_id, out)

    def _done(self, req_id: int, out: list[Completion]) -> None:
        r = self.pending.pop(req_id)
        self.num_prefills += 1
        self.bytes += r.num_bytes
        out.append(Completion(r.seq_id, "done", num_bytes=r.num_bytes,
                              seconds=time.monotonic() - r.started))

    @property
    def bandwidth_bytes_per_s(self) -> float:
        """The data plane's measured bandwidth (an EWMA over transfers); 0.0 before the
        first transfer."""
        return self.transfer_rate.value

    def _fail(self, req_id: int, reason: str, fenced: bool, out: list[Completion]) -> None:
        r = self.pending.pop(req_id)
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
        if not fenced:
            self.quarantine[req_id] = r
        out.append(Completion(r.seq_id, "failed", reason=reason, fenced=fenced))

    def _on_message(self, w: _Worker, data: bytes, out: list[Completion]) -> None:
        w.last_heard = time.monotonic()
        try:
            msg = decode(data)
        except Exception as e:  # malformed: the worker cannot be trusted any more
            log.warning("malformed message from prefill worker %s: %s", w.address, e)
            self._declare_dead(w, "malformed message", out)
            return
        if isinstance(msg, HelloOk):
            w.state = "ready"
        elif isinstance(msg, Refused):
            w.state, w.reason = "refused", msg.reason
            log.warning("prefill worker %s refused the handshake: %s", w.address, msg.reason)
            self.fallbacks["handshake refused"] = self.fallbacks.get("handshake refused", 0) + 1
        elif isinstance(msg, PrefillDone):
            self.transfer_rate.observe(msg.num_bytes, msg.seconds)
            if msg.req_id in self.quarantine:  # a late answer fences the blocks
                out.append(Completion(self.quarantine.pop(msg.req_id).seq_id, "fenced"))
            # for a pending request, completion comes with its last NIXL notification
        elif isinstance(msg, PrefillFailed):
            if msg.req_id in self.pending:
                self._fail(msg.req_id, "worker error", True, out)
            elif msg.req_id in self.quarantine:
                out.append(Completion(self.quarantine.pop(msg.req_id).seq_id, "fenced"))

    def _timers(self, out: list[Completion]) -> None:
        now = time.monotonic()
        for req_id, r in list(self.pending.items()):
            if now - r.started > self.timeout_s:
                self._fail(req_id, "timeout", False, out)
        for w in self.workers:
            if w.state in ("ready", "connecting") and now - w.last_ping > self.heartbeat_s:
                w.last_ping = now
                try:
                    w.socket.send(encode(Ping(now)), flags=self.zmq.NOBLOCK)
                except self.zmq.ZMQError:
                    pass
            busy = any(r.worker is w for r in itertools.chain(self.pending.values(),
                                                              self.quarantine.values()))
            if w.state in ("ready", "connecting") and (busy or w.state == "ready") \
                    and now - w.last_heard > self.dead_after_s:
                reason = "unreachable" if w.state == "connecting" else "worker died"
                self._declare_dead(w, reason, out)

    def _declare_dead(self, w: _Worker, reason: str, out: list[Completion]) -> None:
        """Fence everything the worker could still write: re-register the KV memory (its
        remote keys stop working), re-handshake live workers, then release quarantines."""
        if w.state == "dead":
            return
        was_ready = w.state == "ready"
        w.state, w.reason = "dead", reason
        w.socket.close(linger=0)
        log.warning("prefill worker %s is %s; fencing its transfers", w.address, reason)
        mine = [q for q, r in self.pending.items() if r.worker is w]
        stale = [q for q, r in self.quarantine.items() if r.worker is w]
        if was_ready or mine or stale:
            self.agent.deregister_memory(self.reg)
            self.reg = self.agent.register_memory(list(self.tensors.values()))
            for other in self.workers:
                if other.state in ("ready", "connecting"):
                    self._hello(other)  # new memory keys; old in-flight writes fail
        for q in mine:
            self._fail(q, reason, True, out)
        for q in stale:
            out.append(Completion(self.quarantine.pop(q).seq_id, "fenced"))

    def close(self) -> None:
        for w in self.workers:
            if w.state != "dead":
                try:
                    w.socket.send(encode(Bye()), flags=self.zmq.NOBLOCK)
                except self.zmq.ZMQError:
                    pass
                w.socket.close(linger=100)
        self.ctx.term()
        if self.reg is not None:
            self.agent.deregister_memory(self.reg)
            self.reg = None
        self.agent = None

    @property
    def num_registrations(self) -> int:
        return 0 if self.reg is None else 1
