"""Sessions: exactness against llm.chat, KV reuse, divergence, concurrency, fork, stream."""

from __future__ import annotations

import asyncio
import shutil
import threading

import pytest
from internals import Internals
from llms import tiny_llm

from kvsession import LLM, ConfigError, SamplingParams, SessionClosedError
from kvsession.cache.prefix import common_prefix_len
from oracle import expected_turn, sends_racing_a_close

SYSTEM = "You are a coding agent. Tools: list_files(path), read_file(path), run_tests()."
G = SamplingParams(max_tokens=10, temperature=0.0)
TURNS = [
    "List the files in src.",
    {"role": "tool", "content": '{"files": ["a.py", "b.py", "test_a.py"]}'},
    "Read a.py",
    {"role": "tool", "content": '{"content": "def f(x): return x + 1"}'},
    "Now run the tests and tell me what failed.",
    [{"role": "tool", "content": '{"failed": ["test_a"]}'}, {"role": "user", "content": "Fix"}],
]


def as_list(msg):
    if isinstance(msg, str):
        return [{"role": "user", "content": msg}]
    return [msg] if isinstance(msg, dict) else list(msg)


def new_llm(model_dir, **kw):
    llm = tiny_llm(model_dir, **{"max_model_len": 1024, **kw})
    Internals(llm).check_every_step()
    return llm


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_six_turns_match_chat_and_reuse_kv(model_dirs, arch):
    """Template history: each turn equals llm.chat over the re-rendered conversation."""
    with new_llm(model_dirs(arch)) as llm:
        s = llm.session(system=SYSTEM, sampling=G, history="template")
        history = [{"role": "system", "content": SYSTEM}]
        cached: list[int] = []
        prev_prompt_len = 0
        for k, msg in enumerate(TURNS):
            history += as_list(msg)
            ids = llm.tokenizer.encode_chat(history)
            reply = s.send(msg)
            want = llm.chat(history, G, use_tqdm=False)[0]
            assert reply.token_ids == want.token_ids, f"turn {k}"
            common = min(common_prefix_len(cached, ids), len(ids) - 1)
            if k > 0:
                # only what is not in the session's cache was computed
                assert reply.prefill_tokens == len(ids) - common
                assert reply.cached_tokens == common >= prev_prompt_len
                assert reply.restored_from == "device"
                assert reply.diverged_at == (common if common < len(cached) else None)
            else:
                assert reply.cached_tokens >= 32  # the pinned system prompt
            history.append({"role": "assistant", "content": reply.text})
            cached = ids + reply.token_ids[:-1]
            prev_prompt_len = len(ids)
        assert s.stats.turns == 6 and len(s.messages) == 1 + 7 + 6
        assert s.stats.cached_tokens + s.stats.computed_tokens == s.stats.prompt_tokens
        assert len(s.stats.ttfts_s) == 6 and all(t > 0 for t in s.stats.ttfts_s)
        s.close()
        st = llm.stats()
        p = st.prefix
        assert p.hit_tokens > 0 and p.hit_rate == p.hit_tokens / p.queried_tokens
        assert st.tiers["device"].blocks_used == st.tiers["device"].blocks_pinned == 0


def test_divergence_when_template_drops_history(llama_dir, tmp_path):
    d = shutil.copytree(llama_dir, tmp_path / "m")
    # a template that keeps only the last assistant message's content (like templates that
    # strip earlier reasoning)
    (d / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] != 'assistant' or loop.last %}{{ m['content'] }}{% endif %}"
        "<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with new_llm(d) as llm:
        s = llm.session(sampling=G, history="template")
        first = s.send("hello there")
        prompt1 = llm.tokenizer.encode_chat([{"role": "user", "content": "hello there"}])
        second = s.send("and again")
        history = s.messages[:-1]
        want = llm.chat(history, G, use_tqdm=False)[0]
        assert second.token_ids == want.token_ids
        assert len(first.token_ids) > 1
        assert second.diverged_at == len(prompt1)  # right where the old reply started
        assert second.cached_tokens == len(prompt1)
        s.close()


def test_sessions_batched_from_threads_and_asyncio(llama_dir):
    prompts = [f"task {i}: find the bug in module {i}" for i in range(20)]

    def conversation(send, i):
        return [send(f"{prompts[i]} (turn {t})").token_ids for t in range(4)]

    with new_llm(llama_dir, max_num_seqs=16) as llm:
        sequential = []
        for i in range(20):
            with llm.session(system=SYSTEM, sampling=G) as s:
                sequential.append(conversation(s.send, i))

        results = {}
        sessions = [llm.session(system=SYSTEM, sampling=G) for _ in range(16)]

        def worker(idxs):
            for i in idxs:
                results[i] = conversation(sessions[i].send, i)

        threads = [threading.Thread(target=worker, args=([2 * t, 2 * t + 1],))
                   for t in range(8)]

        async def async_part():
            async def one(i):
                with llm.session(system=SYSTEM, sampling=G) as s:
                    return [(await s.asend(f"{prompts[i]} (turn {t})")).token_ids
                            for t in range(4)]
            return await asyncio.gather(*(one(i) for i in range(16, 20)))

        for t in threads:
            t.start()
        async_results = asyncio.run(async_part())
        for t in threads:
            t.join()
        for s in sessions:
            s.close()
        assert [results[i] for i in range(16)] == sequential[:16]
        assert async_results == sequential[16:]
        llm.check_integrity()
        dev = llm.stats().tiers["device"]
        assert dev.blocks_used == dev.blocks_pinned == 0
        assert Internals(llm).steps < sum(len(c) for c in sequential) * 10 * 2


def test_same_session_sends_run_in_call_order(llama_dir):
    with new_llm(llama_dir) as llm:
        s = llm.session(sampling=G)
        called = []
        turns = s._turns  # the session's TurnQueue
        enqueue, record = turns.enter, threading.Lock()

        def recording_enqueue(**kw):  # records the order in which sends queued up
            with record:
                turn = enqueue(**kw)
                called.append(threading.current_thread().name)
                return turn

        turns.enter = recording_enqueue
        threads = [threading.Thread(target=s.send, args=(f"msg {i}",), name=f"msg {i}")
                   for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        users = [m["content"] for m in s.messages if m["role"] == "user"]
        assert users == called and sorted(users) == [f"msg {i}" for i in range(6)]
        s.close()


def test_close_refuses_sends_racing_it(llama_dir):
    """A session closed while another thread keeps sending on it: the sends queued before
    the close run, those after raise SessionClosedError; none runs on released KV."""
    with new_llm(llama_dir) as llm:
        s = llm.session(sampling=G)
        acked, errors = sends_racing_a_close(s, s.close, max_tokens=2)
        assert len(acked) >= 3
        assert len(errors) == 1 and isinstance(errors[0], SessionClosedError), errors
        llm.check_integrity()
        dev = llm.stats().tiers["device"]
        assert dev.blocks_used == dev.blocks_pinned


def test_a_preempted_turn_reports_its_prompt_once(llama_dir):
    """A turn preempted by a request that needs the whole pool computes its prompt again:
    prefill_tokens counts that, prompt_tokens stays the prompt (the server's usage and
    prompt-token metrics are built from it)."""
    from kvsession.serve import protocol as P  # the server's usage from a Reply

    async def both(llm, s):
        return await asyncio.gather(
            llm.agenerate(prompt_token_ids=[list(range(10, 60))], sampling_params=SamplingParams(
                max_tokens=260, temperature=0, ignore_eos=True)),
            s.asend("a user message that is a few tokens long " * 3, max_tokens=100,
                    ignore_eos=True))

    with LLM(llama_dir, kv_cache_memory=20 * 16 * 512, max_model_len=320) as llm:
        s = llm.session(sampling=G)
        _, r = asyncio.run(both(llm, s))
        assert llm.stats().num_preemptions > 0  # the pool holds one of the two at the end
        prompt = len(s.token_ids) - len(r.token_ids)
        assert r.prompt_tokens == prompt == s.stats.prompt_tokens
        assert P.Result.of_reply(r).usage()["prompt_tokens"] == prompt


def test_fork_shares_blocks_and_diverges(llama_dir):
    with new_llm(llama_dir) as llm:
        parent = llm.session(system=SYSTEM, sampling=G)
        parent.send("Read a.py")
        used = llm.stats().tiers["device"].blocks_used
        child = parent.fork()
        assert llm.stats().tiers["device"].blocks_used == used  # shared, counted once
        before = parent.token_ids
        assert child.token_ids == before  # the fork starts from the parent's log
        c = child.send("Now read b.py")
        p = parent.send("Now run the tests")
        assert c.token_ids == expected_turn(llm, child, before, c, G)
        assert p.token_ids == expected_turn(llm, parent, before, p, G)
        assert child.messages[:3] == parent.messages[:3]
        assert child.messages[3] != parent.messages[3]
        parent.close()
        before = child.token_ids
        again = child.send("and then?")
        assert again.token_ids == expected_turn(llm, child, before, again, G)
        assert again.cached_tokens > 0
        child.close()
        dev = llm.stats().tiers["device"]
        assert dev.blocks_used == dev.blocks_pinned == 0


def test_stream_yields_the_reply(llama_dir):
    with new_llm(llama_dir) as llm:
        s = llm.session(sampling=SamplingParams(max_tokens=16, temperature=0.0))
        chunks = list(s.stream("stream please"))
        reply = chunks[-1].reply
        assert reply is not None and all(c.reply is None for c in chunks[:-1])
        assert "".join(c.text for c in chunks) == reply.text
        assert [t for c in chunks for t in c.token_ids] == reply.token_ids
        assert all(c.text for c in chunks[:-1])  # as LLM.stream: no chunk without text
        s.close()


def test_session_errors_and_lifecycle(llama_dir):
    with new_llm(llama_dir) as llm:
        s = llm.session(session_id="agent-7", sampling=G)
        with pytest.raises(ConfigError, match="agent-7"):
            llm.session(session_id="agent-7")
        s.add("tool", '{"ok": true}')
        assert s.state == "idle" and s.messages[-1]["role"] == "tool"
        s.close()
        assert s.state == "closed"
        with pytest.raises(SessionClosedError):
            s.send("hi")
        llm.session(session_id="agent-7").close()  # the id is free again
        with pytest.raises(ConfigError):
            llm.session(sampling=G).send(12345)
    with pytest.raises(SessionClosedError):
        s.send("after close")


def test_slo_goodput_and_reply_metrics(llama_dir):
    from kvsession import SLO

    with new_llm(llama_dir) as llm:
        s = llm.session(sampling=G)
        r = s.send("hello")
        assert 0 < r.metrics.ttft_s <= r.metrics.e2e_s and r.metrics.queue_s >= 0
        llm.slo = SLO(ttft_s=1e-9, tpot_s=1e-9)
        assert llm.stats().slo_attainment == 0 and llm.stats().goodput_tokens_per_s == 0
        llm.slo = SLO(ttft_s=60, tpot_s=60)
        st = llm.stats()
        assert st.slo_attainment == 1 and st.goodput_tokens_per_s > 0
        with pytest.raises(ConfigError):
            SLO(ttft_s=0, tpot_s=1)
        s.close()
