"""LLM.stream / astream / agenerate / achat: streamed text joins to exactly generate()'s text
(stop strings never leak, no UTF-8 character is split), concurrent streams batch in the one
engine loop, closing a stream cancels its request."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest
from internals import Internals
from llms import tiny_llm

from kvsession import (
    ConfigError,
    SamplingParams,
    SessionClosedError,
    StructuredOutput,
    TextChunk,
)
from oracle import random_prompts


@pytest.fixture(scope="module")
def llm(llama_dir):
    with tiny_llm(llama_dir) as llm:
        yield llm


def check_deltas(chunks: list[TextChunk], final: str, stops=()) -> list[str]:
    """The chunks of one stream: text deltas that join to `final`, token ids that join to
    the output's, the output on the last chunk only. Returns the deltas."""
    assert chunks and all(isinstance(c, TextChunk) for c in chunks)
    *body, last = chunks
    assert last.output is not None and all(c.output is None for c in body)
    assert [t for c in chunks for t in c.token_ids] == last.output.token_ids
    deltas = [c.text for c in chunks]
    assert "".join(deltas) == final == last.output.text
    acc = ""
    for d in deltas[:-1]:
        assert d  # no empty deltas (the last chunk's may be: it carries the output)
        acc += d
        assert final.startswith(acc)  # never retracted, never a partial character
        assert not any(s in acc for s in stops)
    return deltas


def cases():
    """Seeded configurations; stop strings are cut from the free-running text so they hit."""
    out = []
    for i in range(12):
        out.append(dict(max_tokens=24 + i, temperature=0.9, seed=100 + i, top_k=[-1, 50][i % 2],
                        ignore_eos=i % 3 != 0, min_tokens=[0, 5][i % 2]))
    return out


@pytest.mark.parametrize("i", range(12))
def test_stream_joins_to_generate_text(llm, i):
    kw = cases()[i]
    prompt = random_prompts(i, [5 + 3 * i], 500)[0]
    free = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(**kw),
                        use_tqdm=False)[0]
    stops = []
    if len(free.text) > 8:  # multi-character stop strings from the text itself
        stops = [free.text[len(free.text) // 2: len(free.text) // 2 + 2 + i % 3], "\x00zz"]
    params = SamplingParams(**kw, stop=stops or None)
    want = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]
    stream = llm.stream(prompt_token_ids=prompt, sampling_params=params)
    deltas = list(stream)
    check_deltas(deltas, want.text, stops)
    assert stream.output.text == want.text and stream.output.token_ids == want.token_ids
    assert stream.output.finish_reason == want.finish_reason


def test_stream_never_splits_multibyte_characters(llm):
    """The byte-level tokenizer splits non-ASCII characters over tokens; random weights emit
    many of them. No delta ends inside one (it would decode as U+FFFD)."""
    seen_multibyte = False
    for seed in range(6):
        p = SamplingParams(max_tokens=40, seed=seed, ignore_eos=True)
        want = llm.generate("x", p, use_tqdm=False)[0]
        deltas = check_deltas(list(llm.stream("x", p)), want.text)
        seen_multibyte |= any(ord(c) > 0x7FF for c in want.text)
        if "\ufffd" not in want.text:
            assert not any("\ufffd" in d for d in deltas)
    assert seen_multibyte  # the case was exercised


def test_stream_of_structured_and_chat_requests(llm):
    fmt = StructuredOutput(regex=r"[a-z]{2,6}(, [a-z]{2,6}){1,3}")
    p = SamplingParams(max_tokens=40, seed=4, structured=fmt)
    want = llm.generate("list", p, use_tqdm=False)[0]
    check_deltas(list(llm.stream("list", p)), want.text)
    # jump-forward appends several tokens per step
    fmt = StructuredOutput(json_schema={"type": "object", "required": ["answer_field"],
                                        "properties": {"answer_field": {"enum": [
                                            "the first long answer", "another answer"]}}},
                           jump_forward=True)
    p = SamplingParams(max_tokens=40, seed=4, structured=fmt)
    want = llm.generate("json", p, use_tqdm=False)[0]
    assert want.finish_reason == "stop"
    check_deltas(list(llm.stream("json", p)), want.text)
    msgs = [{"role": "user", "content": "hello there"}]
    p = SamplingParams(max_tokens=12, seed=8, ignore_eos=True)
    want = llm.chat(msgs, p, use_tqdm=False)[0]
    stream = llm.stream(messages=msgs, sampling_params=p)
    check_deltas(list(stream), want.text)
    assert stream.output.prompt_token_ids == want.prompt_token_ids
    # a conversation in the prompt's place, as generate's and chat's callers pass it
    stream = llm.stream(msgs, p)
    chunks = list(stream)
    check_deltas(chunks, want.text)
    assert chunks[-1].output is stream.output
    assert stream.output.prompt_token_ids == want.prompt_token_ids


def test_concurrent_streams_batch_in_one_engine_loop(llm):
    prompts = random_prompts(50, [7, 12, 20, 9, 15, 30, 4, 11], 500)
    params = [SamplingParams(max_tokens=20, seed=i, ignore_eos=True) for i in range(8)]
    wants = [llm.generate(prompt_token_ids=[p], sampling_params=s, use_tqdm=False)[0].text
             for p, s in zip(prompts, params, strict=True)]
    steps0 = Internals(llm).steps
    results: list = [None] * 8
    start = threading.Barrier(8)

    def consume(i):
        start.wait()
        results[i] = list(llm.stream(prompt_token_ids=prompts[i], sampling_params=params[i]))

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for deltas, want in zip(results, wants, strict=True):
        check_deltas(deltas, want)
    # 8 x 20 tokens took far fewer steps than 160: the streams shared steps
    assert Internals(llm).steps - steps0 < 8 * 20 // 2


def test_astream_agenerate_achat(llm):
    prompts = random_prompts(51, [6, 14, 22, 9], 500)
    params = [SamplingParams(max_tokens=16, seed=20 + i, ignore_eos=True, stop=["ab"])
              for i in range(4)]
    wants = [llm.generate(prompt_token_ids=[p], sampling_params=s, use_tqdm=False)[0]
             for p, s in zip(prompts, params, strict=True)]
    msgs = [{"role": "user", "content": "hi"}]
    chat_want = llm.chat(msgs, params[0], use_tqdm=False)[0]

    async def main():
        async def one(i):
            stream = llm.astream(prompt_token_ids=prompts[i], sampling_params=params[i])
            deltas = [d async for d in stream]
            return deltas, stream.output

        streams = await asyncio.gather(*(one(i) for i in range(4)))
        gens = await asyncio.gather(*(llm.agenerate(prompt_token_ids=[p], sampling_params=s)
                                      for p, s in zip(prompts, params, strict=True)))
        chat = await llm.achat(msgs, params[0])
        return streams, gens, chat

    streams, gens, chat = asyncio.run(main())
    for (deltas, out), gen, want in zip(streams, gens, wants, strict=True):
        check_deltas(deltas, want.text, ["ab"])
        assert out.token_ids == want.token_ids == gen[0].token_ids
    assert chat[0].token_ids == chat_want.token_ids


def test_closing_a_stream_cancels_its_request(llm):
    p = SamplingParams(max_tokens=400, ignore_eos=True, seed=1)
    with llm.stream("cancel me", p) as stream:
        first = next(stream)
    assert first.text and first.output is None and stream.output is None
    # the cancel was posted to the engine thread before this call: FIFO, so it has run
    assert Internals(llm).idle()
    llm.check_integrity()
    with llm.stream("closed unread", p):  # closed before its first chunk
        pass
    assert Internals(llm).idle()

    async def early():
        stream = llm.astream("cancel me too", p)
        async for _ in stream:
            break
        await stream.aclose()

    asyncio.run(early())
    assert Internals(llm).idle()
    assert llm.generate("after", SamplingParams(max_tokens=3), use_tqdm=False)[0].token_ids


def test_cancelled_agenerate_and_interrupted_generate_end_their_requests(llm, monkeypatch):
    """A cancelled task awaiting agenerate / achat (asyncio.wait_for timing out), or a
    generate whose caller stops waiting (a request failed, Ctrl-C), ends the requests
    still running: they do not compute on to max_tokens for nobody."""
    long = SamplingParams(max_tokens=400, ignore_eos=True, seed=2)
    generated = llm.stats().generated_tokens

    async def cancel(call):
        task = asyncio.create_task(call)
        await asyncio.sleep(0)  # the task runs up to awaiting its submitted requests
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel(llm.agenerate(["stop me", "and me"], long)))
    # the cancels were posted to the engine thread before this call: FIFO
    assert Internals(llm).idle()
    asyncio.run(cancel(llm.achat([{"role": "user", "content": "hi"}], long)))
    assert Internals(llm).idle()
    # Ctrl-C while generate waits (here raised by its progress bar, once the batch is
    # submitted)
    interrupted = threading.Event()

    def tqdm_interrupt(*args, **kwargs):
        interrupted.set()
        raise KeyboardInterrupt
    monkeypatch.setattr("kvsession.llm.tqdm", tqdm_interrupt)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["a", "b"], long)
    assert interrupted.is_set() and Internals(llm).idle()
    assert llm.stats().generated_tokens - generated < 2 * long.max_tokens
    llm.check_integrity()
    assert llm.generate("after", SamplingParams(max_tokens=3), use_tqdm=False)[0].token_ids


def test_stream_holds_a_stop_string_ending_in_a_split_character(llm):
    """A stop string whose last character is split over tokens: the incomplete character is
    held back first, then the stop string's hold, so no part of the stop string leaks."""
    enc = llm.tokenizer.encode
    assert len(enc("\u00e9")) > 1  # byte-level: é is two tokens
    p = SamplingParams(max_tokens=8, temperature=0.0, stop=["y\u00e9"],
                       structured=StructuredOutput(regex="xy\u00e9"))
    want = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=p, use_tqdm=False)[0]
    assert want.text == "x"
    check_deltas(list(llm.stream(prompt_token_ids=[1, 2, 3], sampling_params=p)), want.text,
                 ["y\u00e9"])


def test_cancelled_session_turn_never_happened(llm):
    """Closing a session's stream early, or cancelling the task awaiting asend, cancels the
    turn: the engine stops generating, and the session is exactly as before it (messages,
    token log); its next turn is what it would have been without the cancelled one."""
    long = dict(max_tokens=400, ignore_eos=True)
    # (sampled: a session's turns are greedy unless the model or the caller says otherwise)
    s = llm.session(system="you are terse",
                    sampling=SamplingParams(max_tokens=6, seed=3, temperature=1.0))
    s.send("first question")
    messages, log = s.messages, s.token_ids
    generated = llm.stats().generated_tokens
    with contextlib.closing(s.stream("ramble on", **long)) as chunks:
        next(chunks), next(chunks)
    # closing posted the cancel before the session's next turn can start: FIFO
    s.send("ping", max_tokens=1)  # waits for the cancelled turn to settle
    assert llm.stats().generated_tokens - generated < long["max_tokens"]
    assert s.messages[:len(messages)] == messages and s.messages[len(messages)]["content"] \
        == "ping"
    assert s.token_ids[:len(log)] == log

    async def cancel_asend():
        task = asyncio.create_task(s.asend("ramble again", **long))
        await asyncio.sleep(0)  # the task runs up to awaiting its submitted request
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    messages, log = s.messages, s.token_ids
    generated = llm.stats().generated_tokens
    asyncio.run(cancel_asend())
    # the next turn equals the oracle built from the log as it was before the cancel
    r = s.send("second question")
    assert llm.stats().generated_tokens - generated < long["max_tokens"]
    assert s.messages[:len(messages)] == messages
    want = llm.generate(prompt_token_ids=[s.token_ids[:len(s.token_ids) - len(r.token_ids)]],
                        sampling_params=SamplingParams(max_tokens=6, seed=3, temperature=1.0),
                        use_tqdm=False)[0]
    assert s.token_ids[:len(log)] == log and r.token_ids == want.token_ids
    assert r.prefill_tokens < len(s.token_ids) - len(log)  # the history was not recomputed
    s.close()
    assert Internals(llm).idle()
    llm.check_integrity()


def test_closing_a_session_with_an_open_stream_cancels_its_turn(llm, llama_dir, tmp_path):
    """A session stream started and left open (neither finished nor closed) holds the
    session's queue: closing the session from the same thread cancels that turn instead of
    waiting for ever, and the stream, resumed, raises SessionClosedError. The same at
    llm.close() with a session_dir (it persists the session first)."""
    s = llm.session(system="open stream")
    s.send("first", max_tokens=2)
    stream = s.stream("ramble", max_tokens=300, ignore_eos=True)
    next(stream)
    s.close()  # same thread: returned
    assert s.state == "closed" and Internals(llm).idle()
    with pytest.raises(SessionClosedError, match="closed while this stream was open"):
        list(stream)
    llm.check_integrity()
    with tiny_llm(llama_dir, session_dir=tmp_path) as other:
        kept = other.session(system="sys", session_id="kept")
        kept.send("one", max_tokens=2)
        open_stream = kept.stream("two", max_tokens=300, ignore_eos=True)
        next(open_stream)
    # closed (returned), persisting the session as it was before the cancelled turn
    with tiny_llm(llama_dir, session_dir=tmp_path) as again:
        assert [m["content"] for m in again.session(session_id="kept").messages
                if m["role"] == "user"] == ["one"]


def test_cancelling_a_queued_asend_keeps_the_turn_order(llm):
    """asend B, queued behind a running turn A and ahead of C, is cancelled: A still gets
    its reply, C starts only after A, and the session's messages are A's then C's."""
    s = llm.session(system="queue", sampling=SamplingParams(max_tokens=4, seed=5))

    async def run():
        a = asyncio.create_task(s.asend("A", max_tokens=200, ignore_eos=True))
        b = asyncio.create_task(s.asend("B"))
        c = asyncio.create_task(s.asend("C"))
        await asyncio.sleep(0)  # all three have taken their places in the queue
        b.cancel()
        return await asyncio.gather(a, b, c, return_exceptions=True)

    ra, rb, rc = asyncio.run(run())
    assert isinstance(rb, asyncio.CancelledError)
    assert len(ra.token_ids) == 200 and rc.token_ids
    assert [m["content"] for m in s.messages if m["role"] == "user"] == ["A", "C"]
    s.close()
    assert Internals(llm).idle()
    llm.check_integrity()


@pytest.mark.parametrize("call, match", [
    (lambda llm: llm.stream("a", SamplingParams(n=2)), "n must be 1 to stream"),
    (lambda llm: llm.stream(["a", "b"]), "prompt must be a string"),
    (lambda llm: llm.stream("a", prompt_token_ids=[1]), "exactly one of"),
    (lambda llm: llm.stream(messages=[[{"role": "user", "content": "a"}]]), "one conversation"),
    (lambda llm: llm.stream("a", max_tokens=3), "did you mean 'sampling_params'"),
    (lambda llm: llm.astream("a", SamplingParams(logit_bias={10**6: 1.0})), "logit_bias"),
    (lambda llm: asyncio.run(llm.agenerate("a", temperature=0)), "sampling_params"),
    (lambda llm: asyncio.run(llm.achat("not messages")), "messages must be a list"),
])
def test_bad_stream_and_async_calls_are_config_errors(llm, call, match):
    with pytest.raises(ConfigError, match=match):
        call(llm)
    assert Internals(llm).idle()


# ---- Session.astream ------------------------------------------------------------------------

def test_session_astream_is_stream_for_asyncio(llm):
    """Session.astream yields the chunks Session.stream yields (two sessions on the same
    conversation, greedy), the reply on the last chunk; the turns are the same turns."""
    g = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    a, b = llm.session(system="twins", sampling=g), llm.session(system="twins", sampling=g)

    async def collect(message):
        return [c async for c in a.astream(message)]

    for message in ("first", "second"):
        got = asyncio.run(collect(message))
        want = list(b.stream(message))
        assert [(c.text, c.token_ids) for c in got] == [(c.text, c.token_ids) for c in want]
        assert got[-1].reply.token_ids == want[-1].reply.token_ids
        assert all(c.reply is None for c in got[:-1]) and all(c.text for c in got[:-1])
    assert a.messages == b.messages and a.token_ids == b.token_ids
    assert a.stats.turns == 2
    a.close()
    b.close()
    assert Internals(llm).idle()


@pytest.mark.parametrize("how", ["aclose", "cancel"])
def test_leaving_a_session_astream_cancels_its_turn(llm, how):
    """Closing the async stream after its first chunk, or cancelling the task that reads
    it, cancels the turn: the session is as before it (messages, token log), its blocks
    are back, and its next turn runs as if the cancelled one never started."""
    g = SamplingParams(max_tokens=4, temperature=0.0)
    s = llm.session(system="leave", sampling=g)
    twin = llm.session(system="leave", sampling=g)
    s.send("one")
    twin.send("one")
    before = (s.messages, s.token_ids)

    async def leave():
        stream = s.astream("ramble", max_tokens=300, ignore_eos=True)
        if how == "aclose":
            await stream.__anext__()
            await stream.aclose()
            return
        started = asyncio.Event()

        async def read():
            async for _ in stream:
                started.set()

        task = asyncio.create_task(read())
        await started.wait()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(leave())
    assert (s.messages, s.token_ids) == before
    assert s.send("two").token_ids == twin.send("two").token_ids
    s.close()
    twin.close()
    assert Internals(llm).idle()
    llm.check_integrity()


def test_session_astreams_keep_call_order(llm):
    """Two astreams of one session started together run one after the other, in call
    order, and each sees the other's turn in its history."""
    s = llm.session(system="order", sampling=SamplingParams(max_tokens=6, temperature=0.0))

    async def run():
        async def one(m):
            return [c async for c in s.astream(m)][-1].reply

        return await asyncio.gather(one("A"), one("B"))

    ra, rb = asyncio.run(run())
    assert [m["content"] for m in s.messages if m["role"] == "user"] == ["A", "B"]
    assert ra.cached_tokens < rb.cached_tokens  # B's prompt holds A's turn, cached
    s.close()
