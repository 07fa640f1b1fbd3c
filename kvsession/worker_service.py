"""The prefill worker's service: handshakes and prefills on its engine (a `Runtime`), the
KV written into the caller's blocks with NIXL. `kvsession.worker` is the process around it
(the socket loop, the job thread that calls it, the command line)."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time

import torch

from kvsession.connector.base import (
    NO_HANDSHAKE,
    Hello,
    HelloOk,
    PrefillDone,
    PrefillFailed,
    PrefillRequest,
    PrefillService,
    Refused,
    Rejected,
    max_message_bytes,
)
from kvsession.connector.descriptors import describe_tensors, layer_descs, make_agent, slot_runs
from kvsession.runtime import Runtime

log = logging.getLogger("kvsession")

EXIT_WRITE_NOT_CANCELLED = 3  # the exit status when a NIXL write could not be cancelled
MAX_CALLERS = 256  # registered caller agents


class WriteNotCancelled(RuntimeError):
    """A NIXL write into a caller's memory could be neither released nor completed."""


class NixlPrefillService(PrefillService):
    """The worker's engine is a `Runtime` (the engine side of an LLM, no sessions): it
    submits prefill-only sequences and releases their blocks through the KV manager. A
    prefill gives up (PrefillFailed) at `request_timeout_s` or when `stop` is set."""

    def __init__(self, rt: Runtime, stop: threading.Event | None = None,
                 request_timeout_s: float = 60.0):
        self.rt = rt
        self.stop = stop or threading.Event()
        self.request_timeout_s = request_timeout_s
        self.compat = rt.compat
        self.max_tokens = rt.info.max_model_len - 1  # the worker's sequence samples one
        self.max_bytes = max_message_bytes(rt.info.max_model_len)
        self.agent = make_agent("kvs-worker")
        self.tensors = rt.kv_pool.tensors()
        self.reg = self.agent.register_memory(list(self.tensors.values()))
        self.local = describe_tensors(self.tensors)
        self.callers: dict[str, tuple[str, list]] = {}

    def handshake(self, caller: str, hello: Hello) -> HelloOk | Refused | Rejected:
        if hello.compat != self.compat:
            return Refused("incompatible: model fingerprint, kv dtype, compute dtype, block "
                           "size, layout or protocol version differ")
        if [t.name for t in hello.tensors] != [t.name for t in self.local]:
            return Refused(f"tensor layout differs: {[t.name for t in hello.tensors][:8]}")
        for t, mine in zip(hello.tensors, self.local, strict=True):
            if (t.num_layers, t.block_bytes) != (mine.num_layers, mine.block_bytes):
                return Refused(f"tensor {t.name}: {t.num_layers} layers of {t.block_bytes}-byte "
                               f"blocks, this worker has {mine.num_layers} of {mine.block_bytes}")
            if t.num_blocks < 1 or t.addr <= 0 or t.device_id < 0 or \
                    t.mem_type not in ("DRAM", "VRAM"):
                return Refused(f"tensor {t.name}: invalid descriptor")
        # a caller that reconnects (a new socket) keeps its agent: its old entries are
        # replaced, and do not count against the bound
        stale = [other for other, (name, _) in self.callers.items()
                 if other == caller or name == hello.agent_name]
        if not stale and len(self.callers) >= MAX_CALLERS:
            # transient (callers leave): the caller tries again later, never gives up
            return Rejected(f"this worker already serves {MAX_CALLERS} callers; retry later")
        try:
            name = self.agent.add_remote_agent(hello.agent_metadata)
        except Exception as e:  # NIXL refuses what it cannot deserialize
            return Refused(f"bad agent metadata: {type(e).__name__}")
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name != hello.agent_name:
            if all(n != name for n, _ in self.callers.values()):
                self.agent.remove_remote_agent(name)
            return Refused("the agent metadata names another agent than agent_name")
        # only now, the Hello proven to carry that agent's metadata (a refused Hello naming
        # another caller's agent must not drop that caller's registration): the agent now
        # names this registration, so an old entry of the same name keeps it
        for other in stale:
            old_name, _ = self.callers.pop(other)
            if old_name != name:
                self.agent.remove_remote_agent(old_name)
        self.callers[caller] = (name, hello.tensors)
        return HelloOk(self.agent.name, self.max_tokens, self.max_bytes)

    def prefill(self, caller: str, req: PrefillRequest, abandoned=lambda: False,
                stuck: bool = False) -> PrefillDone | PrefillFailed:
        """abandoned(): the caller has vanished (silent past --caller-timeout-s): the job
        ends as a failure. Raises WriteNotCancelled when a write it could not cancel is
        still in flight past the request timeout (stuck: the fault that fakes it)."""
        from kvsession.engine.sequence import Sequence
        from kvsession.params import SamplingParams

        if caller not in self.callers:
            return PrefillFailed(req.req_id, NO_HANDSHAKE)
        agent_name, remote = self.callers[caller]
        limit = min(t.num_blocks for t in remote)
        if max(req.block_ids) >= limit:
            return PrefillFailed(req.req_id, f"block id {max(req.block_ids)} is outside the "
                                             f"caller's {limit} blocks")
        rt = self.rt
        deadline = time.monotonic() + self.request_timeout_s
        seq = Sequence(token_ids=list(req.token_ids), max_model_len=rt.info.max_model_len,
                       params=SamplingParams(max_tokens=1, temperature=0.0,
                                             cache_salt=req.cache_salt), retain_blocks=True)
        layers: queue.Queue = queue.Queue()
        cuda = rt.config.device.type == "cuda"
        bs = rt.config.block_size

        def layer_done(layer: int) -> None:  # engine thread, right after the layer's KV
            event = None
            if cuda:
                event = torch.cuda.Event()
                event.record()
            layers.put((layer, event))

        seq.on_layer_done = layer_done
        fut = rt.submit(seq)
        fut.add_done_callback(lambda f: layers.put(None))
        num_layers = rt.info.spec.num_layers
        handles, moved, posted = [], 0, 0
        in_flight: list = []
        # time with at least one write in flight (the union of the layers' transfer
        # intervals): the data plane's own speed, whatever the overlap with compute
        busy_s, active_since = 0.0, 0.0

        def bounded() -> None:
            if self.stop.is_set():
                raise RuntimeError("the worker is shutting down")
            if time.monotonic() > deadline:
                raise RuntimeError(f"not done within {self.request_timeout_s} s")
            if abandoned():
                raise RuntimeError("the caller has vanished")

        def reap() -> None:
            nonlocal busy_s
            bounded()
            for h in list(in_flight):
                state = self.agent.check_xfer_state(h)  # also drives progress
                if state == "DONE":
                    in_flight.remove(h)
                    if not in_flight:
                        busy_s += time.perf_counter() - active_since
                elif state != "PROC":
                    raise RuntimeError("transfer failed")

        try:
            # stream: post each layer's WRITE as soon as that layer is computed, while the
            # engine computes the next one
            while posted < num_layers:
                try:
                    item = layers.get(timeout=0.0005)
                except queue.Empty:
                    reap()
                    continue
                if item is None:
                    break
                layer, event = item
                if event is not None:
                    event.synchronize()
                if posted == 0:
                    # only tokens write_from.. move (a follow-up's first block is partly
                    # the caller's own); the prefix before them came from this worker's
                    # prefix cache or was recomputed here, for their attention
                    mine = [b.block_id for b in seq.blocks[req.first_block:]]
                    if len(mine) != len(req.block_ids):
                        raise RuntimeError(f"{len(req.block_ids)} target blocks for "
                                           f"{len(mine)} computed")
                    start = req.write_from(bs)
                    runs = slot_runs(mine, req.block_ids, start - req.first_block * bs,
                                     len(req.token_ids) - start, bs)
                src, dst = layer_descs(self.local, remote, layer, runs, bs)
                moved += sum(n for _, n, _ in src)
                h = self.agent.initialize_xfer(
                    "WRITE", self.agent.get_xfer_descs(src, self.local[0].mem_type),
                    self.agent.get_xfer_descs(dst, remote[0].mem_type), agent_name,
                    f"{req.req_id}:{layer}".encode())
                handles.append(h)
                if not in_flight:
                    active_since = time.perf_counter()
                in_flight.append(h)
                if self.agent.transfer(h) == "ERR":
                    raise RuntimeError("transfer could not be posted")
                posted += 1
            while in_flight and not fut.done():  # keep the writes moving meanwhile
                reap()
            seq = fut.result(timeout=max(deadline - time.monotonic(), 0.0) + 1.0)
            if posted < num_layers:
                raise RuntimeError("the prefill finished without every layer")
            while in_flight:
                reap()
            reply = PrefillDone(req.req_id, moved, busy_s, max(seq.num_cached_tokens, 0))
        except Exception as e:
            reply = PrefillFailed(req.req_id, f"prefill or transfer failed: {e}")
        # an active transfer is cancelled by its release; one NIXL cannot release is
        # waited for (the answer, or the caller's next handshake, tells the caller that
        # its blocks are free: neither may come while a write can still land)
        left, limit = list(handles), time.monotonic() + self.request_timeout_s
        while left:
            for h in list(left):
                try:
                    if stuck:
                        raise RuntimeError("injected fault: the handle cannot be released")
                    self.agent.release_xfer_handle(h)
                    left.remove(h)
                except Exception:
                    with contextlib.suppress(Exception):
                        self.agent.check_xfer_state(h)  # drives progress
            if left and time.monotonic() > limit:
                raise WriteNotCancelled(f"request {req.req_id}: {len(left)} NIXL writes "
                                        f"could not be cancelled")
            if left:
                time.sleep(0.005)  # a poll interval, bounded by `limit`
        try:
            seq = fut.result(timeout=60)  # the engine finishes the sequence in any case
        except Exception:
            pass
        if seq.blocks:
            rt.call(lambda: rt.manager.release(seq)).result(timeout=60)
        return reply

    def disconnect(self, caller: str) -> None:
        entry = self.callers.pop(caller, None)
        if entry is not None:
            self.agent.remove_remote_agent(entry[0])

    def close(self) -> None:
        for caller in list(self.callers):
            self.disconnect(caller)
        self.agent.deregister_memory(self.reg)
        self.agent = None
