"""The prefill worker: `python -m kvsession.worker --model DIR --listen tcp://HOST:PORT
[--auth-key-file FILE]` (`--make-keys DIR` writes a worker and a caller key file).

An application on top of the library (it builds a `Runtime`; the protocol and NIXL helpers
are in `kvsession.connector`), running the same engine in a prefill-only role. The main
thread owns the zmq ROUTER socket: it checks every message (frames, size, decoding, token
ids, block counts), answers what it cannot take with an error (`Rejected`, `PrefillFailed`),
answers heartbeats and status queries at once (a busy worker never looks dead), and hands
handshakes and prefills to a bounded job queue (full: an error reply; it never blocks). One
job thread owns the NIXL agent and runs prefills: compute the KV, write the caller's blocks
layer by layer with NIXL WRITEs (each carrying a notification), answer when every write is
done. With `--auth-key-file` callers authenticate with CURVE (ZAP, `zmq.auth`); without it
the worker only listens on loopback (docs/security.md). SIGTERM / SIGINT shut it down within
a bound (agents and registrations released, exit code 0).

Testing only: `KVSESSION_WORKER_FAULTS` injects faults (see `Faults`,
docs/remote-prefill.md "Testing: fault injection").
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import queue
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass

import torch

from kvsession.cache.manager import HolderKind
from kvsession.config import EngineConfig
from kvsession.connector.base import (
    NO_HANDSHAKE,
    AuthKeys,
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
    Rejected,
    StatsQuery,
    WorkerStatus,
    check_request,
    decode,
    encode,
    is_loopback_endpoint,
    load_keys,
    max_message_bytes,
    recv_message,
    write_keys,
)
from kvsession.connector.descriptors import describe_tensors, layer_descs, make_agent, slot_runs
from kvsession.flags import add_llm_flags, llm_kwargs
from kvsession.llm import LLM
from kvsession.runtime import Runtime
from kvsession.worker_faults import FAULTS_ENV, Faults

log = logging.getLogger("kvsession")

# LLM arguments that only a caller has (sessions, its own prefill workers and their key):
# every other one is a worker flag too (--dtype, --kv-cache-dtype, --block-size, ...)
CALLER_ONLY = frozenset({"session_dir", "durability", "spill_after_s", "max_pinned_fraction",
                         "prefill_worker", "remote_prefill", "remote_prefill_timeout_s",
                         "prefill_auth_key_file"})
EXIT_WRITE_NOT_CANCELLED = 3  # the exit status when a NIXL write could not be cancelled
SHUTDOWN_S = 10.0  # SIGTERM: the job thread gets this long to finish, then the process exits
MAX_CALLERS = 256  # registered caller agents
BURST = 256  # messages read per wake-up, so replies, signals and the job thread get a turn


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
        self.tensors = rt.kv.tensors()
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


@dataclass
class _Counters:
    served: int = 0
    failed: int = 0
    rejected: int = 0
    busy: bool = False


def serve(args, faults: Faults, keys: AuthKeys | None, stop: threading.Event,
          release: threading.Event | None = None) -> int:
    rt = Runtime(EngineConfig.from_args(args.model, **llm_kwargs(args, LLM, CALLER_ONLY)))
    try:
        return _serve(rt, args, faults, keys, stop, release or stop)
    finally:
        rt.close()  # with integrity checking on, raises if a block reference leaked


def _serve(rt: Runtime, args, faults: Faults, keys: AuthKeys | None,
           stop: threading.Event, release: threading.Event) -> int:
    import zmq
    from zmq.auth.thread import ThreadAuthenticator

    service = NixlPrefillService(rt, stop, args.request_timeout_s)
    jobs: queue.Queue = queue.Queue(maxsize=args.max_queue)
    replies: queue.Queue = queue.Queue()  # one per job or status query at most
    counters = _Counters()
    rng = random.Random(faults.seed)

    def run_job(ident: bytes, msg):
        caller = ident.hex()
        if isinstance(msg, Hello):
            return service.handshake(caller, msg)
        if isinstance(msg, Bye):
            service.disconnect(caller)
            # every job it queued before ran already: nothing left to end for it
            gone.discard(ident)  # (one set operation: atomic beside the socket thread's)
            return None
        if faults.delay_s and rng.random() < faults.delay_rate:
            release.wait(faults.delay_s)  # injected fault: slower than the timeout
        if stop.is_set():
            return PrefillFailed(msg.req_id, "the worker is shutting down")
        if ident in gone:  # queued before its caller vanished: nobody to compute it for
            counters.failed += 1  # (answered all the same: a caller that was only quiet
            # would keep the request's blocks in quarantine for good; nothing was written)
            return PrefillFailed(msg.req_id, "the caller was silent past --caller-timeout-s")
        stuck = faults.stuck_rate and rng.random() < faults.stuck_rate
        reply = service.prefill(caller, msg, lambda: ident in gone, stuck)
        if isinstance(reply, PrefillDone):
            counters.served += 1
        else:
            counters.failed += 1
        if faults.drop_rate and rng.random() < faults.drop_rate:
            return None  # injected fault: the answer is lost
        return reply

    def job_thread():  # the only thread that touches the NIXL agent
        try:
            while not stop.is_set():
                try:
                    ident, msg = jobs.get(timeout=0.05)
                except queue.Empty:
                    continue
                counters.busy = True
                try:
                    reply = run_job(ident, msg)
                except WriteNotCancelled as e:
                    # a write into a caller's memory may still land: no answer, and no
                    # handshake either, may tell that caller its blocks are free. Exiting
                    # does (its connection closes: the caller fences at once), and a
                    # supervisor restarts the worker
                    print(f"kvsession worker: {e}; exiting", file=sys.stderr, flush=True)
                    os._exit(EXIT_WRITE_NOT_CANCELLED)
                except Exception as e:  # one job's failure never stops the thread
                    log.exception("worker job failed")
                    reply = (PrefillFailed(msg.req_id, f"internal error: {e}")
                             if isinstance(msg, PrefillRequest) else
                             # transient: a caller reads Refused as another process
                             Rejected(f"internal error: {e}") if isinstance(msg, Hello)
                             else None)
                finally:
                    counters.busy = False
                if reply is not None:
                    replies.put((ident, reply))
        finally:
            service.close()

    worker = threading.Thread(target=job_thread, name="kvsession-worker-jobs", daemon=True)
    worker.start()
    ctx = zmq.Context()
    auth = None
    sock = ctx.socket(zmq.ROUTER)
    stats_lock = threading.Lock()
    stats_waiters: list[bytes] = []
    # callers that sent a Hello: when each last said anything. One silent for
    # caller_timeout_s (a live caller heartbeats) has vanished: its registration is dropped
    seen: dict[bytes, float] = {}
    # callers found silent: their queued and running prefills end at once (a transfer to a
    # dead process may only fail at the request timeout, and the drop of the registration
    # waits behind them in the job queue); any message brings a caller back
    gone: set[bytes] = set()
    last_sweep = time.monotonic()

    def sweep(now: float) -> None:
        for ident, t in list(seen.items()):
            if now - t > args.caller_timeout_s:
                gone.add(ident)
                try:
                    jobs.put_nowait((ident, Bye()))
                except queue.Full:
                    return  # next sweep
                del seen[ident]

    def send(ident: bytes, msg) -> None:
        try:  # a ROUTER drops what a peer cannot take; it never blocks here
            sock.send_multipart([ident, encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.debug("reply to %s dropped: %s", ident.hex(), e)

    def reject(ident: bytes, reason: str, req_id: int | None = None) -> None:
        counters.rejected += 1
        send(ident, Rejected(reason) if req_id is None else PrefillFailed(req_id, reason))

    def snapshot():  # engine thread: the pool, and its invariants
        integrity = "ok"
        try:
            rt.check_integrity_now()
        except AssertionError as e:
            integrity = str(e)[:300] or "failed"
        held = sum(rt.manager.num_held(k) for k in
                   (HolderKind.SEQUENCE, HolderKind.QUARANTINE, HolderKind.TRANSIENT))
        return rt.pool.num_blocks, rt.pool.num_free, held, integrity

    def status_ready(fut) -> None:
        try:
            pool = fut.result()
        except Exception as e:
            pool = (-1, -1, -1, f"status failed: {e}")
        status = WorkerStatus(*pool, callers=len(service.callers), queued=jobs.qsize(),
                              busy=counters.busy, served=counters.served,
                              failed=counters.failed, rejected=counters.rejected)
        with stats_lock:
            waiters = stats_waiters[:]
            stats_waiters.clear()
        for ident in waiters:
            replies.put((ident, status))

    def handle(ident: bytes, data: bytes) -> None:
        try:
            msg = decode(data)
        except Exception as e:
            return reject(ident, f"malformed message: {str(e)[:200]}")
        if isinstance(msg, Ping):
            send(ident, Pong(msg.t))
        elif isinstance(msg, StatsQuery):
            with stats_lock:  # one snapshot at a time answers every query waiting
                stats_waiters.append(ident)
                first = len(stats_waiters) == 1
            if first:
                rt.call(snapshot).add_done_callback(status_ready)
        elif isinstance(msg, PrefillRequest):
            why = check_request(msg, rt.info.spec.vocab_size, service.max_tokens,
                                rt.config.block_size)
            if why:
                return reject(ident, why, msg.req_id)
            try:
                jobs.put_nowait((ident, msg))
            except queue.Full:
                reject(ident, f"worker busy: {jobs.maxsize} jobs queued", msg.req_id)
        elif isinstance(msg, Hello | Bye):
            if isinstance(msg, Hello):
                seen[ident] = time.monotonic()
            try:
                jobs.put_nowait((ident, msg))
            except queue.Full:
                # a Bye not queued leaves the caller in `seen`: the sweep forgets it
                return reject(ident, f"worker busy: {jobs.maxsize} jobs queued; retry later")
            if isinstance(msg, Bye):
                seen.pop(ident, None)
        else:
            reject(ident, f"unexpected message {type(msg).__name__}")

    try:
        sock.setsockopt(zmq.LINGER, 0)
        # frames above twice the limit are dropped by zmq with the connection, before any
        # buffer is allocated; between the limit and that, they get a Rejected
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * service.max_bytes)
        sock.setsockopt(zmq.RCVHWM, 64)  # messages buffered per peer
        if keys is not None:
            auth = ThreadAuthenticator(ctx, log=logging.getLogger("kvsession.zap"))
            auth.start()
            auth.configure_curve_callback("*", credentials_provider=keys)  # its peer keys
            sock.curve_secretkey, sock.curve_publickey = keys.secret, keys.public
            sock.curve_server = True
        sock.bind(args.listen)  # port 0: the system picks a free one, printed here
        print(f"kvsession worker listening on {sock.getsockopt_string(zmq.LAST_ENDPOINT)}",
              flush=True)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not stop.is_set():
            if not worker.is_alive():
                raise RuntimeError("the job thread died")
            if poller.poll(10):
                for _ in range(BURST):
                    got = recv_message(sock, service.max_bytes)
                    if got is None:
                        break
                    ident, data, error = got
                    gone.discard(ident)  # it speaks: not vanished (again)
                    if ident in seen:
                        seen[ident] = time.monotonic()
                    try:
                        if error:
                            reject(ident, error)
                        else:
                            handle(ident, data)
                    except Exception as e:  # one message never stops the loop
                        log.exception("handling a message failed")
                        reject(ident, f"internal error: {type(e).__name__}")
            while not replies.empty():
                send(*replies.get())
            if time.monotonic() - last_sweep > 1.0:
                last_sweep = time.monotonic()
                sweep(last_sweep)
    finally:
        stop.set()
        worker.join(timeout=SHUTDOWN_S)
        if worker.is_alive():  # stuck in NIXL or the engine: leave without releasing,
            # before the socket closes (a caller reads that as this process gone)
            print(f"kvsession worker: a job did not stop within {SHUTDOWN_S:.0f} s; exiting",
                  file=sys.stderr, flush=True)
            os._exit(0)
        sock.close(linger=0)
        if auth is not None:
            auth.stop()
        ctx.term()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvsession.worker",
                                description="a kvsession remote prefill worker")
    p.add_argument("--listen", help="tcp://HOST:PORT (loopback only without --auth-key-file; "
                   "port 0: a free port, printed in the 'listening on' line)")
    p.add_argument("--auth-key-file", metavar="FILE",
                   help="the worker key file: only callers whose keys it lists may connect "
                        "(CURVE; docs/security.md)")
    p.add_argument("--make-keys", metavar="DIR",
                   help="write worker.keys and caller.keys into DIR and exit")
    p.add_argument("--max-queue", type=int, default=64,
                   help="handshakes and prefills waiting; beyond it they get an error reply")
    p.add_argument("--request-timeout-s", type=float, default=60.0,
                   help="a prefill and its writes that take longer fail")
    p.add_argument("--caller-timeout-s", type=float, default=30.0,
                   help="a caller silent this long (no heartbeat) is forgotten")
    add_llm_flags(p, LLM, CALLER_ONLY, model_required=False)
    args = p.parse_args(argv)
    from kvsession.errors import KVSessionError

    if args.make_keys:
        try:
            worker_file, caller_file = write_keys(args.make_keys)
        except (KVSessionError, OSError) as e:
            print(f"error: --make-keys: {e}", file=sys.stderr)
            return 2
        print(f"wrote {worker_file} (for --auth-key-file) and {caller_file} (for "
              f"LLM(prefill_auth_key_file=...)); keep both secret")
        return 0
    if not args.model or not args.listen:
        p.error("--model and --listen are required (or --make-keys DIR)")
    if args.max_queue < 1 or not args.request_timeout_s > 0 or not args.caller_timeout_s > 0:
        p.error("--max-queue must be >= 1, --request-timeout-s and --caller-timeout-s > 0")
    try:
        faults = Faults.from_env()
    except ValueError as e:
        print(f"error: {FAULTS_ENV}: {e}", file=sys.stderr)
        return 2
    loopback = is_loopback_endpoint(args.listen)
    if loopback is None:
        print(f"error: --listen must look like tcp://HOST:PORT, got {args.listen!r}",
              file=sys.stderr)
        return 2
    keys = None
    if args.auth_key_file:
        try:
            keys = load_keys(args.auth_key_file, "worker")
        except KVSessionError as e:
            print(f"error: --auth-key-file: {e}", file=sys.stderr)
            return 2
    elif not loopback:
        print(f"error: --listen {args.listen} is not a loopback address; without "
              f"--auth-key-file anyone who can reach it could use this worker "
              f"(docs/security.md)", file=sys.stderr)
        return 2
    else:
        print("kvsession worker: no --auth-key-file: unauthenticated, listening on loopback "
              "only (docs/security.md)", file=sys.stderr, flush=True)
    if faults.active:
        print(f"kvsession worker: injecting faults ({FAULTS_ENV}): {faults}", file=sys.stderr,
              flush=True)
    stop = threading.Event()  # before the model loads: SIGTERM is always a clean exit
    release = threading.Event()  # ends injected delays: stopping, or SIGUSR1 (a test's cue)
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: (stop.set(), release.set()))
    if faults.active:
        signal.signal(signal.SIGUSR1, lambda *_: release.set())
    try:
        return serve(args, faults, keys, stop, release)
    except KVSessionError as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
