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
import logging
import os
import queue
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass

from kvsession.cache.manager import HolderKind
from kvsession.config import EngineConfig
from kvsession.connector.base import (
    AuthKeys,
    Bye,
    Hello,
    Ping,
    Pong,
    PrefillDone,
    PrefillFailed,
    PrefillRequest,
    Rejected,
    StatsQuery,
    WorkerStatus,
    check_request,
    decode,
    encode,
    is_loopback_endpoint,
    load_keys,
    recv_message,
    write_keys,
)
from kvsession.flags import add_llm_flags, llm_kwargs
from kvsession.llm import LLM
from kvsession.runtime import Runtime
from kvsession.worker_faults import FAULTS_ENV, Faults
from kvsession.worker_service import (
    EXIT_WRITE_NOT_CANCELLED,
    NixlPrefillService,
    WriteNotCancelled,
)

log = logging.getLogger("kvsession")

# LLM arguments that only a caller has (sessions, its own prefill workers and their key):
# every other one is a worker flag too (--dtype, --kv-cache-dtype, --block-size, ...)
CALLER_ONLY = frozenset({"session_dir", "durability", "spill_after_s", "max_pinned_fraction",
                         "prefill_worker", "remote_prefill", "remote_prefill_timeout_s",
                         "prefill_auth_key_file"})
SHUTDOWN_S = 10.0  # SIGTERM: the job thread gets this long to finish, then the process exits
BURST = 256  # messages read per wake-up, so replies, signals and the job thread get a turn


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
            rt.integrity.now()
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
