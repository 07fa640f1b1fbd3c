"""Remote prefill for agents: a session's follow-up turns offload only their new tokens (the
worker recomputes or hits the context in its own prefix cache), and requests sharing a
prefix spread over several workers with bounded load, follow-ups returning to the worker
that holds their prefix. Real worker processes on loopback (NIXL), as in test_remote."""

from __future__ import annotations

import random
import signal
import threading

import pytest
from internals import Internals
from test_remote import KW, Worker, assert_no_leak, ready_llm, wait_for

from kvsession import LLM, SamplingParams

G = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SYSTEM = "You are a coding agent. Tools: list_files(path), read_file(path), run_tests()."
TURNS = ["List the files in src.", "Read a.py and tell me what it does.",
         "Now run the tests and tell me which failed."]


@pytest.fixture(scope="module")
def worker(llama_dir):
    w = Worker(llama_dir)
    yield w
    assert w.stop() == 0


@pytest.fixture(scope="module")
def two_workers(llama_dir):
    # every prefill first waits 0.3 s: the 8 requests of a burst are all in flight at once,
    # so the split the load bound gives is exact, whatever the machine's speed
    ws = [Worker(llama_dir, faults="delay_rate=1.0,delay_s=0.3") for _ in range(2)]
    yield ws
    for w in ws:
        assert w.stop() == 0


def answers_in(llm, n: int) -> None:
    """Wait until the workers' answers to the n prefills are in: a request completes with
    its last NIXL notification, and the answer (with the worker's cache hits) may trail."""
    ins = Internals(llm)

    def answered():
        ins.poll_remote()
        return ins.connector.transfer_rate.num_samples >= n

    wait_for(answered, 60, f"{n} worker answers")


def test_follow_up_turns_move_only_their_new_tokens(llama_dir, worker):
    with LLM(llama_dir, prefill_worker=worker.address, remote_prefill="always", **KW) as llm, \
            LLM(llama_dir, **KW) as ref:
        bpt, bs = llm.runtime.kv_bytes_per_token, llm.config.block_size
        s, r = llm.session(system=SYSTEM, sampling=G), ref.session(system=SYSTEM, sampling=G)
        turn1, ref1 = s.send(TURNS[0]), r.send(TURNS[0])
        assert turn1.token_ids == ref1.token_ids
        prompt1 = ref1.cached_tokens + ref1.prefill_tokens  # computed here or hit: all of it
        answers_in(llm, llm.stats().remote.prefills)
        hits_before = llm.stats().remote.workers[worker.address].cached_tokens
        for k, msg in enumerate(TURNS[1:], start=2):
            st0 = llm.stats().remote
            reply, want = s.send(msg), r.send(msg)
            assert reply.token_ids == want.token_ids, f"turn {k}"
            assert reply.restored_from == "remote" and want.restored_from == "device"
            answers_in(llm, st0.prefills + 1)
            st = llm.stats().remote
            # the session's KV, attached at admission, as in the local session
            held = reply.cached_tokens
            assert held == want.cached_tokens > prompt1 - 1, f"turn {k}"
            num_prompt = want.cached_tokens + want.prefill_tokens
            # exactly one prefill, which moved exactly the new tokens but the last (computed
            # here for its logits), not the context the session holds: as counted here and
            # as the worker's NIXL writes moved them
            assert st.prefills == st0.prefills + 1, f"turn {k} was not offloaded"
            delta = (num_prompt - 1 - held) * bpt
            assert st.bytes - st0.bytes == delta, f"turn {k}"
            moved = st.workers[worker.address].bytes - st0.workers[worker.address].bytes
            assert moved == delta, f"turn {k}"
            assert not st.fallbacks
            if k == 2:
                turn2_delta, turn2_len = delta, num_prompt
        # the worker served turns 2 and 3 from its own cache: at least the full blocks of the
        # turn-1 prompt it computed (the reply, which it never saw, it recomputed)
        hits = llm.stats().remote.workers[worker.address].cached_tokens - hits_before
        assert hits >= 2 * ((prompt1 - 1) // bs * bs)
        s.close()  # then only the shared system prompt's pin holds blocks
        assert_no_leak(llm, pinned_ok=True)
    # a prompt as long as turn 2's offloaded whole (no session): the full context moves
    rng = random.Random(5)
    with LLM(llama_dir, prefill_worker=worker.address, remote_prefill="always", **KW) as fresh:
        fresh.generate(prompt_token_ids=[[rng.randrange(500) for _ in range(turn2_len)]],
                       sampling_params=G, use_tqdm=False)
        full = fresh.stats().remote.bytes
    assert full == (turn2_len - 1) * bpt
    assert turn2_delta < full / 2
    print(f"turn 2 ({turn2_len} prompt tokens): {turn2_delta} bytes moved for its new tokens;"
          f" {full} bytes offloading the whole context")


def shared_prompts(n: int, shared: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(500) for _ in range(shared)]
    return [system + [rng.randrange(500) for _ in range(rng.randint(20, 60))] for _ in range(n)]


def test_a_shared_system_prompt_spreads_over_two_workers_and_follow_ups_stick(
        llama_dir, two_workers):
    addresses = [w.address for w in two_workers]
    ps = shared_prompts(8, 48, seed=3)
    with LLM(llama_dir, prefill_worker=addresses, remote_prefill="always", **KW) as llm:
        bs = llm.config.block_size
        outs = [o.token_ids for o in llm.generate(prompt_token_ids=ps, sampling_params=G,
                                                  use_tqdm=False)]
        with LLM(llama_dir, **KW) as ref:
            assert outs == [o.token_ids for o in ref.generate(
                prompt_token_ids=ps, sampling_params=G, use_tqdm=False)]
        first = {a: llm.stats().remote.workers[a] for a in addresses}
        # 8 in flight at once over 2 workers: 5 / 3 (cap ceil(1.25 * 8 / 2) = 5), the
        # preferred worker taking every request it is under the cap for, the other the rest
        assert sorted((w.requests, w.routed, w.spilled) for w in first.values()) == [
            (3, 0, 3), (5, 5, 0)]
        answers_in(llm, 8)
        hits0 = {a: w.cached_tokens for a, w in llm.stats().remote.workers.items()}
        # follow-ups one at a time: each goes back to the worker holding its prefix (a
        # hash of the shared first block alone would send all 8 to one worker)
        rng = random.Random(4)
        follow = [p + o + [rng.randrange(500) for _ in range(40)]
                  for p, o in zip(ps, outs, strict=True)]
        for q in follow:
            llm.generate(prompt_token_ids=[q], sampling_params=G, use_tqdm=False)
        st = llm.stats().remote
        assert {a: st.workers[a].requests - first[a].requests for a in addresses} == {
            a: first[a].requests for a in addresses}
        assert all(st.workers[a].spilled == first[a].spilled for a in addresses)
        # each worker found the full blocks of the prompt it had computed in its own cache
        answers_in(llm, 16)
        st = llm.stats().remote
        hits = sum(st.workers[a].cached_tokens - hits0[a] for a in addresses)
        assert hits == sum((len(p) - 1) // bs * bs for p in ps)
        assert not st.fallbacks
        assert_no_leak(llm)


def run_turns(llm, ref, turns=TURNS) -> None:
    s, r = llm.session(system=SYSTEM, sampling=G), ref.session(system=SYSTEM, sampling=G)
    for k, msg in enumerate(turns, start=1):
        assert s.send(msg).token_ids == r.send(msg).token_ids, f"turn {k}"
    s.close()


def test_follow_ups_slower_than_the_timeout_fall_back_with_equal_tokens(llama_dir):
    # every answer comes after the caller gave up: each turn's blocks (the session's KV
    # included: a late write may reach its partial last block) wait in quarantine until
    # the late answer fences them, and the turn is prefilled locally
    slow = Worker(llama_dir, faults="delay_rate=1.0,delay_s=0.6")
    try:
        with ready_llm(llama_dir, slow, "always", 0.3) as llm, LLM(llama_dir, **KW) as ref:
            run_turns(llm, ref)
            st = llm.stats().remote
            assert st.fallbacks.get("timeout", 0) >= len(TURNS) and st.prefills == 0
            wait_for(Internals(llm).poll_remote, 60, "the late answers")
            assert_no_leak(llm, pinned_ok=True)
    finally:
        assert slow.stop() == 0


def test_a_worker_killed_during_a_follow_up_keeps_the_sessions_kv(llama_dir):
    # the kill fences the request at once: the turn keeps the session's KV it was given and
    # computes only its new tokens locally
    victim = Worker(llama_dir, faults="delay_rate=1.0,delay_s=1.0")
    with LLM(llama_dir, prefill_worker=victim.address, remote_prefill="always",
             remote_prefill_timeout_s=30.0, **KW) as llm, LLM(llama_dir, **KW) as ref:
        s, r = llm.session(system=SYSTEM, sampling=G), ref.session(system=SYSTEM, sampling=G)
        assert s.send(TURNS[0]).token_ids == r.send(TURNS[0]).token_ids
        computed = llm.stats().prefill_tokens
        box = {}
        t = threading.Thread(target=lambda: box.update(reply=s.send(TURNS[1])))
        t.start()
        wait_for(lambda: Internals(llm).connector.pending, 60, "turn 2 at the worker")
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(timeout=30)
        t.join(timeout=60)
        want = r.send(TURNS[1])
        assert box["reply"].token_ids == want.token_ids
        assert box["reply"].cached_tokens == want.cached_tokens
        # only the new tokens were computed here, not the session's context again
        assert llm.stats().prefill_tokens - computed == want.prefill_tokens
        assert llm.stats().remote.fallbacks == {"connection lost": 1}
        s.close()
        assert_no_leak(llm, pinned_ok=True)
