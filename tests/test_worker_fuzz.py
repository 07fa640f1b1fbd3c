"""The prefill worker's protocol under hostile input (seeded, CI-sized), against a real
authenticated worker process: wrong frame counts, random bytes, huge messages, valid-looking
requests with bad ids / tokens / block counts, bad handshakes, unauthenticated peers and a
caller that vanishes mid-transfer. After each suite the worker still serves an
authenticated caller with exactly the tokens of a local LLM, and its pool is back to its
baseline (the worker's `WorkerStatus`: every block free, none held, invariants intact).

Each suite records (cases, clean error replies) in REPORT; `pytest -s` prints it."""

from __future__ import annotations

import itertools
import random
import signal
import subprocess
import sys
import textwrap
import time

import msgspec
import pytest
import torch
import zmq
from internals import CHILD_PRELUDE, Internals
from test_remote import KW, Worker, generate, prompts, run_worker, wait_for
from zmq.utils.monitor import recv_monitor_message

from kvsession import LLM
from kvsession.cache.block_pool import blocks_for
from kvsession.connector.base import (
    Bye,
    Hello,
    HelloOk,
    Ping,
    Pong,
    PrefillDone,
    PrefillFailed,
    PrefillRequest,
    Refused,
    Rejected,
    StatsQuery,
    TensorDesc,
    WorkerStatus,
    decode,
    encode,
    load_keys,
    max_message_bytes,
    write_keys,
)
from kvsession.connector.descriptors import describe_tensors, make_agent

MiB = 2**20
REPORT: dict[str, dict[str, object]] = {}
_monitors = itertools.count()


def vm_hwm_bytes(pid: int) -> int:
    """The process's peak resident set size (VmHWM)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


class Peer:
    """A raw DEALER socket (CURVE when `keys` are given) with an event monitor."""

    def __init__(self, ctx, address: str, keys=None, server_key: bytes | None = None):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            self.sock.curve_secretkey, self.sock.curve_publickey = keys.secret, keys.public
            self.sock.curve_serverkey = server_key or keys.peers[0]
        endpoint = f"inproc://fuzz-monitor-{next(_monitors)}"
        self.sock.monitor(endpoint, zmq.EVENT_ALL)
        self.monitor = ctx.socket(zmq.PAIR)
        self.monitor.setsockopt(zmq.LINGER, 0)
        self.monitor.connect(endpoint)
        self.sock.connect(address)

    def send(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def recv(self, timeout_s: float = 20.0):
        assert self.sock.poll(int(timeout_s * 1000)), f"no reply within {timeout_s} s"
        return decode(self.sock.recv())

    def ask(self, msg, timeout_s: float = 20.0):
        self.send(encode(msg))
        return self.recv(timeout_s)

    def wait_event(self, events: set[int], timeout_s: float = 10.0) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.monitor.poll(50):
                event = recv_monitor_message(self.monitor)["event"]
                if event in events:
                    return event
        raise AssertionError(f"none of the socket events {events} within {timeout_s} s")

    def close(self) -> None:
        self.sock.disable_monitor()
        self.sock.close(linger=0)
        self.monitor.close(linger=0)


class FuzzCaller:
    """A NIXL agent with its own KV-shaped tensors and an authenticated socket: what a
    caller is, minus the engine, so it can send anything. It speaks `like`'s handshake:
    KV tensors shaped as that LLM's, its compatibility hash."""

    def __init__(self, ctx, address: str, keys, like: LLM):
        ins = Internals(like)
        self.tensors = {n: torch.zeros_like(t) for n, t in ins.kv_pool.tensors().items()}
        self.agent = make_agent("kvs-fuzz")
        self.reg = self.agent.register_memory(list(self.tensors.values()))
        self.peer = Peer(ctx, address, keys)
        self.num_blocks = next(iter(self.tensors.values())).shape[1]
        self.hello = Hello(ins.compat, self.agent.name, self.agent.get_agent_metadata(),
                           describe_tensors(self.tensors))

    def prefill(self, req: PrefillRequest, num_notes: int, timeout_s: float = 30.0):
        """Send a request and drive this agent's NIXL progress (as a caller's engine thread
        does) until the answer and `num_notes` notifications (which may trail the answer)
        are in: (answer, notifications)."""
        self.peer.send(encode(req))
        reply, notes = None, []
        deadline = time.monotonic() + timeout_s
        while reply is None or len(notes) < num_notes:
            assert time.monotonic() < deadline, f"got {reply}, {notes} within {timeout_s} s"
            for msgs in self.agent.get_new_notifs().values():
                notes += msgs
            if reply is None and self.peer.sock.poll(5):
                reply = decode(self.peer.sock.recv())
        return reply, notes

    def close(self) -> None:
        self.peer.send(encode(Bye()))
        self.peer.close()
        self.agent.deregister_memory(self.reg)
        self.agent = None


# ---- fixtures --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ctx():
    c = zmq.Context()
    yield c
    c.term()


@pytest.fixture(scope="module")
def key_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz-keys")
    assert run_worker("--make-keys", str(d)).returncode == 0
    return d


@pytest.fixture(scope="module")
def caller_keys(key_dir):
    return load_keys(key_dir / "caller.keys", "caller")


REQUEST_TIMEOUT_S = 20  # the worker under test gives up a prefill after this long


@pytest.fixture(scope="module")
def target(llama_dir, key_dir):
    """The worker under test: authenticated, forgets silent callers after 3 s."""
    w = Worker(llama_dir, "--caller-timeout-s", "3", "--request-timeout-s",
               str(REQUEST_TIMEOUT_S),
               key_file=key_dir / "worker.keys")
    yield w
    assert w.stop() == 0  # a clean exit, and the worker's own integrity check at close passed
    if REPORT:
        print("\nworker fuzz report:")
        for suite, row in REPORT.items():
            print(f"  {suite}: {row}")


@pytest.fixture(scope="module")
def reference(llama_dir):
    """A local LLM (no worker): the tokens the caller must get. Each check uses new prompts
    (a repeated one would be a prefix-cache hit, not a remote prefill)."""
    with LLM(llama_dir, **KW) as llm:
        yield llm, itertools.count(100)


@pytest.fixture(scope="module")
def caller(llama_dir, target, key_dir):
    """The authenticated caller whose service must never change."""
    with LLM(llama_dir, prefill_worker=target.address, remote_prefill="always",
             prefill_auth_key_file=key_dir / "caller.keys", **KW) as llm:
        yield llm


@pytest.fixture(scope="module")
def status_peer(ctx, target, caller_keys):
    p = Peer(ctx, target.address, caller_keys)
    yield p
    p.close()


def status(peer: Peer) -> WorkerStatus:
    st = peer.ask(StatsQuery())
    assert isinstance(st, WorkerStatus)
    return st


def at_baseline(st: WorkerStatus) -> bool:
    return (st.free_blocks == st.num_blocks and st.held_blocks == 0 and st.integrity == "ok"
            and st.queued == 0 and not st.busy)


def still_serving(caller_llm, reference, status_peer) -> None:
    """The authenticated caller gets exactly the local tokens, through the worker, and the
    worker's pool returns to its baseline."""
    local_llm, seeds = reference
    ps = prompts(next(seeds), 4, shared=32)
    before = caller_llm.stats().remote
    assert generate(caller_llm, ps) == generate(local_llm, ps)
    after = caller_llm.stats().remote
    assert after.prefills == before.prefills + len(ps) and after.fallbacks == before.fallbacks
    wait_for(lambda: at_baseline(status(status_peer)), 30, "the worker's pool at baseline")


def record(suite: str, tried: int, clean: int, **extra) -> None:
    REPORT[suite] = {"cases": tried, "clean errors": clean, **extra}


# ---- item 2: one bad message never disables the worker ---------------------------------------

def test_a_two_frame_message_is_rejected_and_the_worker_keeps_serving(
        ctx, target, caller_keys, caller, reference, status_peer):
    peer = Peer(ctx, target.address, caller_keys)
    try:
        peer.send(b"one", b"two")
        reply = peer.recv()
        assert isinstance(reply, Rejected) and "expected one frame" in reply.reason
        assert isinstance(peer.ask(Ping(1.0)), Pong)
    finally:
        peer.close()
    still_serving(caller, reference, status_peer)


def test_malformed_frames(ctx, target, caller_keys, caller, reference, status_peer):
    rng = random.Random(20240601)
    cases: list[tuple[str, list[bytes]]] = []
    for n in (2, 3, 5, 9):
        cases.append((f"{n} frames", [rng.randbytes(rng.randint(0, 64)) for _ in range(n)]))
    cases.append(("empty frame", [b""]))
    cases += [("random bytes", [rng.randbytes(rng.randint(1, 4000))]) for _ in range(60)]
    for obj in ([], {}, 0, -1, "x", None, True, 1.5, [1, 2, 3], {"type": "Nope"},
                {"type": "PrefillRequest"}, {"type": "Ping", "t": "soon"},
                {"type": "PrefillRequest", "req_id": "a", "token_ids": [1], "first_block": 0,
                 "block_ids": [0]},
                {"type": "PrefillRequest", "req_id": 1, "token_ids": [1.5], "first_block": 0,
                 "block_ids": [0]},
                {"type": "PrefillRequest", "req_id": 1.5, "token_ids": [1],
                 "first_block": 0, "block_ids": [0]}):
        cases.append(("wrong schema", [msgspec.msgpack.encode(obj)]))
    for msg in (HelloOk("x"), Pong(0.0), PrefillDone(1, 0, 0.0), Rejected("x"),
                Refused("x"), WorkerStatus(1, 1, 0, "ok", 0, 0, False, 0, 0, 0)):
        cases.append(("unexpected type", [encode(msg)]))
    peer = Peer(ctx, target.address, caller_keys)
    clean = 0
    try:
        for kind, frames in cases:
            peer.send(*frames)
            reply = peer.recv()
            assert isinstance(reply, Rejected), (kind, reply)
            clean += 1
    finally:
        peer.close()
    record("malformed frames", len(cases), clean)
    still_serving(caller, reference, status_peer)


def test_huge_messages_are_refused_without_growing_the_worker(
        ctx, target, caller_keys, caller, reference, status_peer):
    limit = max_message_bytes(512)  # the worker's max_model_len
    peak_before = vm_hwm_bytes(target.proc.pid)
    peer = Peer(ctx, target.address, caller_keys)
    peer.wait_event({zmq.EVENT_HANDSHAKE_SUCCEEDED})
    tried = clean = dropped = 0
    try:
        replies = {
            "just over the limit": [b"\x00" * (limit + 1)],
            "two 1.5 MiB frames": [b"\x01" * (3 * MiB // 2)] * 2,
            "100k token ids": [encode(PrefillRequest(1, [1] * 100_000, 0,
                                                     list(range(6250))))],
        }
        for kind, frames in replies.items():
            peer.send(*frames)
            reply = peer.recv()
            tried += 1
            assert isinstance(reply, Rejected | PrefillFailed), (kind, reply)
            clean += 1
        # far above the limit: zmq drops the connection after reading the frame's size,
        # before buffering it (the worker never sees it); the peer reconnects by itself
        rejected = status(status_peer).rejected
        for size in (29 * MiB, 64 * MiB):
            peer.send(b"\x02" * size)
            tried += 1
            peer.wait_event({zmq.EVENT_DISCONNECTED})
            dropped += 1
            peer.wait_event({zmq.EVENT_HANDSHAKE_SUCCEEDED})
        assert status(status_peer).rejected == rejected
        assert isinstance(peer.ask(Ping(2.0)), Pong)
    finally:
        peer.close()
    growth = vm_hwm_bytes(target.proc.pid) - peak_before
    record("huge messages", tried, clean, dropped_by_zmq=dropped,
           worker_vm_hwm_mib=round(vm_hwm_bytes(target.proc.pid) / MiB, 1),
           vm_hwm_growth_mib=round(growth / MiB, 1))
    assert growth < 32 * MiB, f"the worker's peak RSS grew by {growth / MiB:.1f} MiB"
    still_serving(caller, reference, status_peer)


# ---- valid-looking messages --------------------------------------------------------------------

def bad_requests(rng: random.Random, vocab: int, num_blocks: int, bs: int = 16):
    """(kind, request) pairs that must each get a PrefillFailed."""

    def req(tokens, first=0, blocks=None, salt=None):
        n = blocks_for(len(tokens), bs) - first if tokens else 1
        blocks = list(range(10, 10 + max(n, 0))) if blocks is None else blocks
        return PrefillRequest(rng.randrange(1, 2**31), tokens, first, blocks, salt)

    def toks(n):
        return [rng.randrange(vocab) for _ in range(n)]

    out = [("negative token", req(toks(20) + [-1])),
           ("token = vocab", req(toks(20) + [vocab])),
           ("huge token", req([2**62] + toks(5))),
           ("no tokens", req([])),
           ("too many tokens", req(toks(600))),
           ("first_block < 0", req(toks(40), first=-1)),
           ("first_block past the end", req(toks(40), first=3)),
           ("too few blocks", req(toks(40), blocks=[1, 2])),
           ("too many blocks", req(toks(40), blocks=[1, 2, 3, 4])),
           ("negative block id", req(toks(40), blocks=[1, -2, 3])),
           ("repeated block id", req(toks(40), blocks=[1, 1, 3])),
           ("block id past the caller's pool", req(toks(40), blocks=[1, 2, num_blocks])),
           ("huge block id", req(toks(40), blocks=[1, 2, 2**40])),
           ("long cache salt", req(toks(20), salt="s" * 2000))]
    for i in range(40):  # random corruptions of a valid request
        n = rng.randint(1, 120)
        tokens = toks(n)
        first = rng.randrange(blocks_for(n, bs))
        blocks = list(range(20, 20 + blocks_for(n, bs) - first))
        what = rng.choice(["token", "count", "block", "first"])
        if what == "token":
            tokens[rng.randrange(n)] = rng.choice([-rng.randint(1, 2**31), vocab + rng.randrange(
                2**20)])
        elif what == "count":
            blocks = blocks + [99] if rng.random() < 0.5 or len(blocks) < 2 else blocks[:-1]
        elif what == "block":
            blocks[rng.randrange(len(blocks))] = rng.choice([-1, num_blocks + rng.randrange(99)])
        else:
            first = rng.choice([-rng.randint(1, 5), blocks_for(n, bs) + rng.randint(0, 5)])
        out.append((f"random {what}", PrefillRequest(1000 + i, tokens, first, blocks)))
    return out


def test_valid_looking_requests_with_bad_ids_tokens_or_blocks(
        ctx, target, caller_keys, caller, reference, status_peer):
    fc = FuzzCaller(ctx, target.address, caller_keys, caller)
    rng = random.Random(7)
    tried = clean = 0
    try:
        # before a handshake nothing is computed
        no_hello = PrefillRequest(5, [1, 2, 3], 0, [0])
        reply = fc.peer.ask(no_hello)
        assert isinstance(reply, PrefillFailed) and reply.reason == "no handshake"
        assert isinstance(fc.peer.ask(fc.hello), HelloOk)
        vocab = caller.runtime.spec.vocab_size
        for kind, req in bad_requests(rng, vocab, fc.num_blocks):
            reply = fc.peer.ask(req)
            tried += 1
            assert isinstance(reply, PrefillFailed) and reply.req_id == req.req_id, (kind, reply)
            clean += 1
        # odd but valid request ids are served (into the fuzz caller's own tensors)
        for req_id in (-7, 0, 2**62):
            num_layers = caller.runtime.spec.num_layers
            reply, notes = fc.prefill(PrefillRequest(req_id, [3] * 40, 0, [4, 5, 6]), num_layers)
            assert isinstance(reply, PrefillDone) and reply.req_id == req_id
            assert sorted(notes) == sorted(f"{req_id}:{layer}".encode()
                                           for layer in range(num_layers))
    finally:
        fc.close()
    record("valid-looking requests", tried + 1, clean + 1, served_odd_ids=3)
    still_serving(caller, reference, status_peer)


def test_bad_handshakes_are_refused(ctx, target, caller_keys, caller, reference, status_peer):
    fc = FuzzCaller(ctx, target.address, caller_keys, caller)
    other = make_agent("kvs-fuzz-other")
    rng = random.Random(11)
    h = fc.hello
    t0 = h.tensors[0]

    def with_tensor(**change):
        return Hello(h.compat, h.agent_name, h.agent_metadata,
                     [msgspec.structs.replace(t0, **change), *h.tensors[1:]])

    cases = [
        ("wrong compat", Hello("0" * 64, h.agent_name, h.agent_metadata, h.tensors)),
        ("no tensors", Hello(h.compat, h.agent_name, h.agent_metadata, [])),
        ("renamed tensor", with_tensor(name="evil")),
        ("wrong layer count", with_tensor(num_layers=t0.num_layers + 1)),
        ("wrong block size", with_tensor(block_bytes=t0.block_bytes * 2)),
        ("no blocks", with_tensor(num_blocks=0)),
        ("null address", with_tensor(addr=0)),
        ("unknown memory type", with_tensor(mem_type="XPU")),
        ("extra tensor", Hello(h.compat, h.agent_name, h.agent_metadata,
                               [*h.tensors, TensorDesc("x", 1, 1, 1, 1)])),
        ("metadata of another agent", Hello(h.compat, h.agent_name,
                                            other.get_agent_metadata(), h.tensors)),
        ("empty metadata", Hello(h.compat, h.agent_name, b"", h.tensors)),
    ]
    cases += [("random metadata", Hello(h.compat, f"kvs-fuzz-{i}",
                                        b"junk" + rng.randbytes(rng.randint(0, 3000)), h.tensors))
              for i in range(20)]
    clean = 0
    try:
        for kind, hello in cases:
            reply = fc.peer.ask(hello)
            assert isinstance(reply, Refused), (kind, reply)
            clean += 1
        assert isinstance(fc.peer.ask(fc.hello), HelloOk)  # the real one still works
    finally:
        fc.close()
        other = None
    record("bad handshakes", len(cases), clean)
    still_serving(caller, reference, status_peer)


# ---- unauthenticated peers ---------------------------------------------------------------------

def test_unauthenticated_peers_get_nothing(ctx, target, caller_keys, caller, reference,
                                           status_peer, tmp_path):
    ins = Internals(caller)
    _, stranger_caller_file = write_keys(tmp_path)
    stranger = load_keys(stranger_caller_file, "caller")
    hello = Hello(ins.compat, "kvs-stranger", b"", describe_tensors(
        ins.kv_pool.tensors()))
    before = status(status_peer)
    failures = {zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL}
    peers = {"no key": (None, None),
             "a key the worker does not list": (stranger, caller_keys.peers[0]),
             "the wrong worker key": (caller_keys, stranger.peers[0])}
    tried = 0
    for kind, (keys, server_key) in peers.items():
        peer = Peer(ctx, target.address, keys, server_key)
        try:
            for msg in (hello, PrefillRequest(1, [1] * 40, 0, [1, 2, 3]), Ping(0.0),
                        StatsQuery()):
                peer.send(encode(msg))
                tried += 1
            peer.wait_event(failures)
            assert not peer.sock.poll(0), kind  # nothing came back
        finally:
            peer.close()
    after = status(status_peer)
    assert (after.callers, after.rejected, after.served, after.failed) == (
        before.callers, before.rejected, before.served, before.failed)
    record("unauthenticated peers", tried, 0, handshakes_failed=len(peers),
           messages_reaching_the_worker=0)
    still_serving(caller, reference, status_peer)


# ---- a caller that vanishes mid-transfer -------------------------------------------------------

VANISHING_CALLER = CHILD_PRELUDE + textwrap.dedent("""
    import os, signal, sys, threading, time
    from internals import Internals
    from kvsession import LLM, SamplingParams
    model, address, key_file = sys.argv[1:4]
    llm = LLM(model, prefill_worker=address, remote_prefill="always",
              prefill_auth_key_file=key_file, kv_cache_memory="8MiB", max_model_len=512)
    conn = Internals(llm).connector
    ps = [[(7 * i + j) % 500 for j in range(400)] for i in range(6)]
    params = SamplingParams(max_tokens=4, temperature=0.0)
    threading.Thread(target=llm.generate, daemon=True,
                     kwargs=dict(prompt_token_ids=ps, sampling_params=params,
                                 use_tqdm=False)).start()
    deadline = time.monotonic() + 60
    while not conn.pending and time.monotonic() < deadline:
        time.sleep(0.001)  # a poll interval; what is waited for is the condition
    print("pending" if conn.pending else "never", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no Bye, no deregistration: gone
""")


def test_a_caller_vanishing_mid_transfer(llama_dir, key_dir, target, caller, reference,
                                         status_peer):
    out = subprocess.run([sys.executable, "-c", VANISHING_CALLER, str(llama_dir),
                          target.address, str(key_dir / "caller.keys")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == -signal.SIGKILL and out.stdout.strip() == "pending", out.stderr
    still_serving(caller, reference, status_peer)
    # the vanished caller's registration is dropped once it has been silent 3 s, and so is
    # any other gone peer's: only the module's caller remains. Its queued prefills are
    # skipped and a running one ends then too (each used to run to the request timeout, a
    # transfer to a dead process failing only then, and the drop waited behind them all)
    wait_for(lambda: status(status_peer).callers == 1, REQUEST_TIMEOUT_S + 10,
             "the caller to be forgotten")
    record("vanishing caller", 1, 1)


# ---- a busy worker: bounded queue, heartbeats, SIGTERM ----------------------------------------

def test_a_full_queue_answers_busy_and_heartbeats_go_on(ctx, llama_dir):
    w = Worker(llama_dir, "--max-queue", "1", faults="delay_rate=1,delay_s=120")
    peer = Peer(ctx, w.address)
    try:
        req = PrefillRequest(1, [1] * 40, 0, [1, 2, 3])
        peer.send(encode(req))  # the job thread takes it and sleeps (the injected delay)
        wait_for(lambda: peer.ask(StatsQuery()).busy, 20, "the job thread to be busy")
        peer.send(encode(msgspec.structs.replace(req, req_id=2)))  # queued
        wait_for(lambda: peer.ask(StatsQuery()).queued == 1, 20, "one queued job")
        reply = peer.ask(msgspec.structs.replace(req, req_id=3))
        assert isinstance(reply, PrefillFailed) and reply.req_id == 3
        assert "busy" in reply.reason
        assert isinstance(peer.ask(Ping(3.0)), Pong)  # the socket loop never blocked
        rejected = peer.ask(Hello("x", "y", b"", []))  # a handshake cannot queue either
        assert isinstance(rejected, Rejected) and "busy" in rejected.reason
    finally:
        peer.close()
        t0 = time.monotonic()
        assert w.stop() == 0  # SIGTERM interrupts the injected delay
        assert time.monotonic() - t0 < 15


def test_sigterm_exits_within_a_bound_during_a_long_job(ctx, llama_dir):
    w = Worker(llama_dir, faults="delay_rate=1,delay_s=120")
    peer = Peer(ctx, w.address)
    try:
        peer.send(encode(PrefillRequest(1, [1] * 40, 0, [1, 2, 3])))
        wait_for(lambda: peer.ask(StatsQuery()).busy, 20, "the job thread to be busy")
    finally:
        peer.close()
    t0 = time.monotonic()
    w.proc.send_signal(signal.SIGTERM)
    assert w.proc.wait(timeout=30) == 0
    assert time.monotonic() - t0 < 15  # not the 120 s the job would have taken


# ---- the caller table: a peer cannot cut others off ------------------------------------------

def test_a_refused_hello_naming_a_callers_agent_leaves_it_registered(
        ctx, target, caller_keys, caller, reference, status_peer):
    """A Hello carrying a registered caller's agent name but metadata that does not parse is
    refused without dropping that caller's registration (it was dropped first)."""
    fc = FuzzCaller(ctx, target.address, caller_keys, caller)
    intruder = Peer(ctx, target.address, caller_keys)
    try:
        assert isinstance(fc.peer.ask(fc.hello), HelloOk)
        before = status(status_peer).callers
        h = fc.hello
        reply = intruder.ask(Hello(h.compat, h.agent_name, b"junk", h.tensors))
        assert isinstance(reply, Refused)
        assert status(status_peer).callers == before
    finally:
        intruder.close()
        fc.close()
    still_serving(caller, reference, status_peer)


def test_a_full_caller_table_is_a_transient_refusal(ctx, llama_dir):
    """At MAX_CALLERS the worker answers Rejected (retry later), not Refused (give up for
    good); a caller that reconnects replaces its own entry, which does not count."""
    from kvsession.worker_service import MAX_CALLERS

    w = Worker(llama_dir)
    with LLM(llama_dir, **KW) as tmp:
        fc = FuzzCaller(ctx, w.address, None, tmp)
    peers = []
    try:
        h, name = fc.hello, fc.agent.name
        for start in range(0, MAX_CALLERS - 1, 50):  # other callers (agents named apart),
            batch = []  # in batches the job queue (64) takes
            for i in range(start, min(start + 50, MAX_CALLERS - 1)):
                fake = name[:-8] + f"{i:08x}"
                batch.append(Peer(ctx, w.address))
                batch[-1].send(encode(Hello(h.compat, fake, h.agent_metadata.replace(
                    name.encode(), fake.encode()), h.tensors)))
            peers += batch
            assert all(isinstance(p.recv(), HelloOk) for p in batch)
        assert isinstance(fc.peer.ask(h), HelloOk)  # the last place
        late = Peer(ctx, w.address)
        peers.append(late)
        fake = name[:-8] + "ffffffff"
        reply = late.ask(Hello(h.compat, fake, h.agent_metadata.replace(
            name.encode(), fake.encode()), h.tensors))
        assert isinstance(reply, Rejected) and "retry later" in reply.reason
        again = Peer(ctx, w.address)  # fc reconnects on a new socket: its entry is replaced
        peers.append(again)
        assert isinstance(again.ask(h), HelloOk)
        assert again.ask(StatsQuery()).callers == MAX_CALLERS
    finally:
        for p in peers:
            p.close()
        fc.peer.close()
        assert w.stop() == 0


def test_a_bye_refused_by_a_full_queue_still_ends_the_registration(ctx, llama_dir):
    """A Bye the full job queue cannot take is answered busy; the caller stays in the
    silence sweep, which forgets it once the queue has room (it was leaked for good)."""
    w = Worker(llama_dir, "--max-queue", "1", "--caller-timeout-s", "1",
               faults="delay_rate=1,delay_s=1.5,seed=0")
    with LLM(llama_dir, **KW) as tmp:
        fc = FuzzCaller(ctx, w.address, None, tmp)
    busy, watcher = Peer(ctx, w.address), Peer(ctx, w.address)
    try:
        assert isinstance(fc.peer.ask(fc.hello), HelloOk)
        req = PrefillRequest(1, [5] * 40, 0, [1, 2, 3])
        busy.send(encode(req))  # the job thread sleeps in the injected delay
        wait_for(lambda: watcher.ask(StatsQuery()).busy, 20, "the job thread to be busy")
        busy.send(encode(msgspec.structs.replace(req, req_id=2)))  # queued: the queue is full
        wait_for(lambda: watcher.ask(StatsQuery()).queued == 1, 20, "one queued job")
        reply = fc.peer.ask(Bye())
        assert isinstance(reply, Rejected) and "busy" in reply.reason
        fc.peer.close()
        wait_for(lambda: watcher.ask(StatsQuery()).callers == 0, 30, "the caller forgotten")
    finally:
        busy.close()
        watcher.close()
        assert w.stop() == 0


def test_a_quiet_callers_skipped_prefill_is_still_answered(ctx, llama_dir):
    """A caller silent past --caller-timeout-s is forgotten and its queued prefill skipped;
    the skip is answered (PrefillFailed), so a caller that was only quiet gets its blocks
    back instead of keeping them in quarantine for good."""
    w = Worker(llama_dir, "--caller-timeout-s", "1", faults="delay_rate=1,delay_s=2.5,seed=0")
    busy, quiet = Peer(ctx, w.address), Peer(ctx, w.address)
    try:
        req = PrefillRequest(1, [5] * 40, 0, [1, 2, 3])
        busy.send(encode(req))  # the job thread sleeps in the injected delay
        wait_for(lambda: busy.ask(StatsQuery()).busy, 20, "the job thread to be busy")
        quiet.send(encode(Hello("x", "y", b"", [])))  # known to the sweep from now on
        quiet.send(encode(msgspec.structs.replace(req, req_id=7)))  # queued; then silent
        replies = [quiet.recv(60), quiet.recv(60)]  # its Hello's answer, then the prefill's
        failed = [r for r in replies if isinstance(r, PrefillFailed)]
        assert [r.req_id for r in failed] == [7] and "silent" in failed[0].reason
    finally:
        busy.close()
        quiet.close()
        assert w.stop() == 0
