"""The prefill worker: `python -m kvsession.worker --model DIR --listen tcp://HOST:PORT`.

An application on top of the library (it builds an `LLM`), not part of the connector
package, which holds only the protocol (`kvsession.connector.base`) and the NIXL helpers
(`kvsession.connector.nixl`). It runs the same engine (its own prefix cache included) in a
prefill-only role. The main thread owns the zmq ROUTER socket (handshakes are answered in
order; heartbeats at once, so a busy worker is never mistaken for a dead one); one job
thread owns the NIXL agent and runs prefills: compute the KV with the local engine, then
write the caller's blocks layer by layer with NIXL WRITEs, each layer's request carrying a
notification, and answer when every write has completed. SIGTERM / SIGINT / Bye shut it
down cleanly (agents and registrations released explicitly, exit code 0).

Testing only: `KVSESSION_WORKER_FAULTS` injects faults (see `Faults`,
docs/remote-prefill.md "Testing: fault injection").
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import queue
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, fields

import torch

from kvsession.cache.kv_pool import block_runs
from kvsession.config import EngineConfig
from kvsession.connector.base import (
    Bye,
    Hello,
    HelloOk,
    Ping,
    Pong,
    PrefillDone,
    PrefillFailed,
    PrefillRequest,
    PrefillService,
    Refused,
    compat_hash,
    decode,
    encode,
)
from kvsession.connector.nixl import describe_tensors, layer_descs, make_agent
from kvsession.runtime import Runtime

log = logging.getLogger("kvsession")

FAULTS_ENV = "KVSESSION_WORKER_FAULTS"


@dataclass(frozen=True)
class Faults:
    """Injected faults, for tests: `KVSESSION_WORKER_FAULTS="delay_rate=0.5,delay_s=2.0,
    drop_rate=0.1,seed=0"` (every key optional; unset or empty: no faults).

    delay_rate: the probability that a prefill request first sleeps `delay_s` seconds
    (slower than the caller's timeout); drop_rate: the probability that a prefill's answer is
    never sent (the NIXL writes still happen); seed: the random generator's seed."""

    delay_rate: float = 0.0
    delay_s: float = 0.0
    drop_rate: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("delay_rate", "drop_rate"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {v}")
        if not (math.isfinite(self.delay_s) and self.delay_s >= 0.0):
            raise ValueError(f"delay_s must be a finite number >= 0, got {self.delay_s}")

    @property
    def active(self) -> bool:
        return bool(self.delay_s and self.delay_rate) or bool(self.drop_rate)

    @classmethod
    def parse(cls, text: str) -> Faults:
        """`key=value` pairs separated by commas; raises ValueError (one line) on anything
        else: unknown or repeated keys, values that are not numbers, values out of range."""
        kinds = {f.name: type(f.default) for f in fields(cls)}  # float or int
        values: dict[str, float | int] = {}
        for item in (i.strip() for i in text.split(",")):
            if not item:
                continue
            key, sep, raw = (x.strip() for x in item.partition("="))
            if not sep or not key or not raw:
                raise ValueError(f"expected key=value, got {item!r}")
            if key not in kinds:
                raise ValueError(f"unknown key {key!r} (known: {', '.join(kinds)})")
            if key in values:
                raise ValueError(f"{key} given twice")
            try:
                values[key] = kinds[key](raw)
            except ValueError:
                what = "an integer" if kinds[key] is int else "a number"
                raise ValueError(f"{key}={raw!r} is not {what}") from None
        return cls(**values)

    @classmethod
    def from_env(cls, environ=os.environ) -> Faults:
        return cls.parse(environ.get(FAULTS_ENV, ""))


class NixlPrefillService(PrefillService):
    """The worker's engine is a `Runtime` (the engine side of an LLM, no sessions): it
    submits prefill-only sequences and releases their blocks through the KV manager."""

    def __init__(self, rt: Runtime):
        self.rt = rt
        self.compat = compat_hash(rt.identity)
        self.agent = make_agent("kvs-worker")
        self.tensors = rt.kv.tensors()
        self.reg = self.agent.register_memory(list(self.tensors.values()))
        self.local = describe_tensors(self.tensors)
        self.callers: dict[str, tuple[str, list]] = {}

    def handshake(self, caller: str, hello: Hello) -> HelloOk | Refused:
        if hello.compat != self.compat:
            return Refused("incompatible: model fingerprint, kv dtype, block size, layout or "
                           "protocol version differ")
        if [t.name for t in hello.tensors] != [t.name for t in self.local]:
            return Refused(f"tensor layout differs: {[t.name for t in hello.tensors]}")
        if caller in self.callers:
            self.disconnect(caller)
        name = self.agent.add_remote_agent(hello.agent_metadata)
        self.callers[caller] = (name, hello.tensors)
        return HelloOk(self.agent.name)

    def prefill(self, caller: str, req: PrefillRequest) -> PrefillDone | PrefillFailed:
        from kvsession.engine.sequence import Sequence
        from kvsession.params import SamplingParams

        if caller not in self.callers:
            return PrefillFailed(req.req_id, "no handshake")
        agent_name, remote = self.callers[caller]
        rt = self.rt
        seq = Sequence(token_ids=list(req.token_ids), max_model_len=rt.info.max_model_len,
                       params=SamplingParams(max_tokens=1, temperature=0.0,
                                             cache_salt=req.cache_salt), retain_blocks=True)
        layers: queue.Queue = queue.Queue()
        cuda = rt.config.device.type == "cuda"

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

        def reap() -> None:
            nonlocal busy_s
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
                    mine = [b.block_id for b in seq.blocks[req.first_block:]]
                    if len(mine) != len(req.block_ids):
                        raise RuntimeError(f"{len(req.block_ids)} target blocks for "
                                           f"{len(mine)} computed")
                    runs = block_runs(mine, req.block_ids)
                src, dst = layer_descs(self.local, remote, layer, runs)
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
            seq = fut.result()
            if posted < num_layers:
                raise RuntimeError("the prefill finished without every layer")
            while in_flight:
                reap()
            return PrefillDone(req.req_id, moved, busy_s)
        except Exception as e:
            return PrefillFailed(req.req_id, f"prefill or transfer failed: {e}")
        finally:
            for h in handles:
                self.agent.release_xfer_handle(h)
            try:
                seq = fut.result()
            except Exception:
                pass
            if seq.blocks:
                rt.call(lambda: rt.manager.release(seq)).result()

    def disconnect(self, caller: str) -> None:
        entry = self.callers.pop(caller, None)
        if entry is not None:
            self.agent.remove_remote_agent(entry[0])

    def close(self) -> None:
        for caller in list(self.callers):
            self.disconnect(caller)
        self.agent.deregister_memory(self.reg)
        self.agent = None


def serve(args, faults: Faults) -> int:
    import zmq

    rt = Runtime(EngineConfig.from_args(
        args.model, device=args.device, kv_cache_memory=args.kv_cache_memory,
        kv_cache_dtype=args.kv_cache_dtype, max_model_len=args.max_model_len,
        block_size=args.block_size))
    service = NixlPrefillService(rt)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(args.listen)
    jobs: queue.Queue = queue.Queue()
    replies: queue.Queue = queue.Queue()
    stop = threading.Event()
    rng = random.Random(faults.seed)

    def job_thread():  # the only thread that touches the NIXL agent
        while (job := jobs.get()) is not None:
            caller, msg = job
            if isinstance(msg, Hello):
                replies.put((caller, service.handshake(caller, msg)))
            elif isinstance(msg, Bye):
                service.disconnect(caller)
            else:
                if faults.delay_s and rng.random() < faults.delay_rate:
                    time.sleep(faults.delay_s)  # injected fault: slower than the timeout
                reply = service.prefill(caller, msg)
                if faults.drop_rate and rng.random() < faults.drop_rate:
                    continue  # injected fault: the answer is lost
                replies.put((caller, reply))
        service.close()

    worker = threading.Thread(target=job_thread, name="kvsession-worker-jobs")
    worker.start()
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: stop.set())
    print(f"kvsession worker listening on {args.listen}", flush=True)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while not stop.is_set():
        if dict(poller.poll(10)):
            while True:
                try:
                    caller_id, data = sock.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                caller = caller_id.hex()
                try:
                    msg = decode(data)
                except Exception:
                    continue  # malformed input is ignored; the caller times out
                if isinstance(msg, Ping):
                    sock.send_multipart([caller_id, encode(Pong(msg.t))])
                elif isinstance(msg, Hello | Bye | PrefillRequest):
                    jobs.put((caller, msg))
        while not replies.empty():
            caller, reply = replies.get()
            sock.send_multipart([bytes.fromhex(caller), encode(reply)])
    jobs.put(None)
    worker.join()
    sock.close()
    ctx.term()
    rt.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvsession.worker",
                                description="a kvsession remote prefill worker")
    p.add_argument("--model", required=True)
    p.add_argument("--listen", required=True, help="tcp://HOST:PORT")
    p.add_argument("--device", default="auto")
    p.add_argument("--kv-cache-memory", default=None)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args(argv)
    try:
        faults = Faults.from_env()
    except ValueError as e:
        print(f"error: {FAULTS_ENV}: {e}", file=sys.stderr)
        return 2
    if faults.active:
        print(f"kvsession worker: injecting faults ({FAULTS_ENV}): {faults}", file=sys.stderr,
              flush=True)
    from kvsession.errors import KVSessionError

    try:
        return serve(args, faults)
    except KVSessionError as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
