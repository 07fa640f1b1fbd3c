"""Fencing a remote prefill worker: blocks a worker may still write are reused only on proof
that no write of it can land any more. Re-registering the KV memory proves nothing (with UCX,
the old remote keys keep working): a worker declared dead while only hung keeps its requests'
blocks in quarantine until it answers, its notifications arrive, or its handshake completes
again. Real worker processes on loopback (NIXL), as in test_remote."""

from __future__ import annotations

import gc
import os
import signal
import threading
import weakref

from internals import Internals
from test_remote import (
    KW,
    Worker,
    assert_no_leak,
    generate,
    idle_client,
    local,
    prompts,
    wait_for,
    worker_stats,
    worker_status,
)

from kvsession import LLM


def completions_for(client, seq_id: int, timeout_s: float, what: str) -> list:
    """Poll the client (as the engine thread would) until a completion for seq_id."""
    got: list = []

    def polled():
        got.extend(c for c in client.poll(0.02) if c.seq_id == seq_id)
        return bool(got)

    wait_for(polled, timeout_s, what)
    return got


def test_a_hung_worker_declared_dead_cannot_write_into_released_blocks(llama_dir):
    """The worker hangs (SIGSTOP) with a prefill in its job thread: the caller declares it
    dead (no heartbeat) and falls back, but keeps the request's blocks in quarantine. Once
    resumed, the worker finishes that job, writing into the blocks, and only then (it answers
    the caller's reconnect Hello after its earlier jobs) are they released."""
    w = Worker(llama_dir, faults="delay_rate=1,delay_s=120")  # held until SIGUSR1
    client, _, tensors = idle_client(llama_dir, w.address, heartbeat_s=0.1,
                                     dead_after_s=1.0, reconnect_min_s=0.2)
    try:
        wait_for(lambda: client.poll(0.01) == [] and client.healthy(), 60, "the handshake")
        blocks = [1, 2, 3]
        assert client.submit(7, [5] * 40, 0, blocks, [], None)
        wait_for(lambda: worker_status(w.address).busy, 30, "the job thread on it")
        os.kill(w.proc.pid, signal.SIGSTOP)
        failed = completions_for(client, 7, 30, "the death")
        assert [(c.kind, c.fenced, c.reason) for c in failed] == [
            ("failed", False, "no heartbeat")]
        assert 7 in {r.seq_id for r in client.quarantine.values()}
        assert tensors["k"][:, blocks].abs().sum() == 0  # nothing written yet
        os.kill(w.proc.pid, signal.SIGCONT)
        w.proc.send_signal(signal.SIGUSR1)  # the job goes on: it computes and writes
        released = completions_for(client, 7, 60, "the release")
        assert [c.kind for c in released] == ["fenced"]
        # the late write landed before the release, never into blocks reused meanwhile
        assert tensors["k"][:, blocks].abs().sum() > 0
        assert not client.quarantine and not client.pending
        wait_for(lambda: client.poll(0.02) == [] and client.healthy(), 60, "the reconnect")
        assert client.workers[0].reconnects == 1
    finally:
        client.close()
        os.kill(w.proc.pid, signal.SIGCONT)
        assert w.stop() == 0


def test_a_hung_workers_requests_are_prefilled_here_and_freed_when_it_returns(llama_dir):
    """Through the engine: the hung worker's requests are prefilled locally in new blocks
    (outputs exact), the old ones held; the worker resumed, everything is released."""
    w = Worker(llama_dir, faults="delay_rate=1,delay_s=120")
    ps = prompts(21, 3)
    want = local(llama_dir, ps)
    try:
        with LLM(llama_dir, prefill_worker=w.address, remote_prefill="always",
                 remote_prefill_timeout_s=60.0, **KW) as llm:
            conn = Internals(llm).connector
            conn.heartbeat_s, conn.dead_after_s, conn.reconnect_min_s = 0.1, 1.0, 0.2
            wait_for(lambda: worker_stats(llm, w.address).state == "ready", 60, "ready")
            out: list = []
            t = threading.Thread(target=lambda: out.append(generate(llm, ps)))
            t.start()
            wait_for(lambda: worker_status(w.address).busy, 30, "a prefill at the worker")
            os.kill(w.proc.pid, signal.SIGSTOP)
            t.join(timeout=120)
            assert out == [want]  # prefilled here instead
            st = llm.stats().remote
            assert st.fallbacks.get("no heartbeat", 0) >= 1
            assert Internals(llm).remote_holds()["quarantine"]  # the hung worker's blocks are held
            os.kill(w.proc.pid, signal.SIGCONT)
            w.proc.send_signal(signal.SIGUSR1)
            wait_for(Internals(llm).poll_remote, 60, "the release")
            wait_for(lambda: worker_stats(llm, w.address).state == "ready", 60, "back")
            assert generate(llm, ps) == want  # and it serves again
            assert_no_leak(llm)
    finally:
        os.kill(w.proc.pid, signal.SIGCONT)
        assert w.stop() == 0


def test_closing_with_a_worker_that_never_returns(llama_dir):
    """A hung worker never resumed: its blocks stay held (no proof), the engine serves on
    with the rest of its pool, and close() ends cleanly (the held blocks are accounted to
    the connector's quarantine, not leaked)."""
    w = Worker(llama_dir, faults="delay_rate=1,delay_s=120")
    ps = prompts(22, 2)
    want = local(llama_dir, ps)
    try:
        llm = LLM(llama_dir, prefill_worker=w.address, remote_prefill="always",
                  remote_prefill_timeout_s=60.0, **KW)
        conn = Internals(llm).connector
        conn.heartbeat_s, conn.dead_after_s = 0.1, 1.0
        wait_for(lambda: worker_stats(llm, w.address).state == "ready", 60, "ready")
        out: list = []
        t = threading.Thread(target=lambda: out.append(generate(llm, ps[:1])))
        t.start()
        wait_for(lambda: worker_status(w.address).busy, 30, "a prefill at the worker")
        os.kill(w.proc.pid, signal.SIGSTOP)
        t.join(timeout=120)
        assert out == [want[:1]]
        assert generate(llm, ps[1:]) == want[1:]  # locally: no healthy worker
        assert Internals(llm).remote_holds()["quarantine"]
        llm.check_integrity()
        llm.close()  # integrity at rest included: raises on a leak
    finally:
        w.proc.kill()
        w.proc.wait(timeout=30)


def test_a_worker_that_cannot_cancel_a_write_exits_and_the_caller_fences(llama_dir):
    """NIXL cannot release a transfer (faked: stuck_rate): the worker waits for it up to its
    request timeout, then exits (status 3) rather than answer or handshake while a write
    may still land; the caller reads the closed connection as the process gone."""
    from kvsession.worker_service import EXIT_WRITE_NOT_CANCELLED

    w = Worker(llama_dir, "--request-timeout-s", "1", faults="stuck_rate=1")
    ps = prompts(23, 2)
    want = local(llama_dir, ps)
    try:
        with LLM(llama_dir, prefill_worker=w.address, remote_prefill="always",
                 remote_prefill_timeout_s=60.0, **KW) as llm:
            wait_for(lambda: worker_stats(llm, w.address).state == "ready", 60, "ready")
            # its writes completed (every layer's notification): done, without an answer
            assert generate(llm, ps[:1]) == want[:1]
            assert w.proc.wait(timeout=60) == EXIT_WRITE_NOT_CANCELLED
            assert "could not be cancelled" in w.errors()
            wait_for(lambda: worker_stats(llm, w.address).state != "ready", 60, "the death")
            assert worker_stats(llm, w.address).deaths == {"connection lost": 1}
            assert generate(llm, ps[1:]) == want[1:]  # locally now
            assert_no_leak(llm)
    finally:
        if w.proc.poll() is None:
            w.proc.kill()
            w.proc.wait(timeout=30)


def _close_and_watch(llama_dir, w, submit: bool) -> weakref.ref:
    """Close a client (with a prefill held at the worker, or nothing in flight) and drop
    every reference of ours to its KV memory: a weak reference to it."""
    client, _, tensors = idle_client(llama_dir, w.address, heartbeat_s=0.1)
    wait_for(lambda: client.poll(0.01) == [] and client.healthy(), 60, "the handshake")
    if submit:
        assert client.submit(7, [5] * 40, 0, [1, 2, 3], [], None)
        wait_for(lambda: worker_status(w.address).busy, 30, "the job thread on it")
    kept = weakref.ref(tensors["k"])
    client.close()
    client = tensors = None  # (the lambda above holds `client` through this frame)
    gc.collect()
    return kept


def test_closing_while_a_worker_may_still_write_keeps_the_memory(llama_dir):
    """Closing is no fence: a worker writes into the memory with no agent or registration
    of the caller's left. A client closed with a prefill the worker may still write keeps
    that memory allocated (no other tensor is placed where the late write lands); one
    closed with nothing in flight frees it."""
    w = Worker(llama_dir, faults="delay_rate=1,delay_s=120")
    try:
        assert _close_and_watch(llama_dir, w, submit=False)() is None  # freed
        kept = _close_and_watch(llama_dir, w, submit=True)
        assert kept() is not None  # no proof came within the close's wait: kept
        w.proc.send_signal(signal.SIGUSR1)  # the held job goes on and writes
        wait_for(lambda: kept()[:, [1, 2, 3]].abs().sum() > 0, 60, "the late write")
    finally:
        assert w.stop() == 0
