"""Append-only session history (kvsession/history.py): a turn computes only the delta the
template renders for its new messages, whatever the template does to past turns; template
history re-renders and equals llm.chat. Layered cache salts and pin(system=...)."""

from __future__ import annotations

import functools
import shutil

import pytest
from llms import tiny_llm

from kvsession import ConfigError, SamplingParams
from kvsession.testing import CHATML_TEMPLATE
from oracle import expected_turn

G = SamplingParams(max_tokens=6, temperature=0.0)
SYSTEM = "You are a coding agent. Use the tools to read files and run the tests. " * 2

# (a) reasoning stripped from assistant turns before the last user message (Qwen3-like)
STRIP_THINK = (
    "{% set ns = namespace(last=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last = loop.index0 %}"
    "{% endif %}{% endfor %}"
    "{% for m in messages %}{% set c = m['content'] %}"
    "{% if m['role'] == 'assistant' and loop.index0 < ns.last %}"
    "{% set c = c.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ c }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# (b) the system turn re-dated at every render (Llama 3.x writes today's date there)
DATED = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'system' %}Now: {{ strftime_now('%H:%M:%S.%f') }}\n{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# (c) the last assistant turn rendered differently (left open, as a continuation)
OPEN_LAST = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if not (m['role'] == 'assistant' and loop.last) %}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEMPLATES = {"strip_think": STRIP_THINK, "dated": DATED, "open_last": OPEN_LAST,
             "chatml": CHATML_TEMPLATE}

# 8 turns of an agent: user asks, tool results come back (added alone, or sent with a note);
# the first reply is forced to think first (a reasoning model's reply)
THINK = G.with_overrides(max_tokens=24, response_format={
    "type": "regex", "pattern": r"<think>[a-z]{2,6}</think>\n[a-z]{2,6}"})
TURNS = [
    ("send", "List the files in the project", THINK),
    ("add", '{"files": ["a.py", "b.py"]}', None),
    ("send", "Open a.py", G),
    ("send", [{"role": "tool", "content": "def f(): return 1"},
              {"role": "user", "content": "Now run the tests"}], G),
    ("add", "3 passed, 1 failed: test_b", None),
    ("send", "Fix the failing test", G),
    ("send", "Thanks, and then?", G),
    ("send", "Summarise what you did", G),
    ("send", "Done?", G),
]


def send(s, msg, params):
    return s.send(msg, max_tokens=params.max_tokens, response_format=None if
                  params.structured is None else THINK_FORMAT)


THINK_FORMAT = {"type": "regex", "pattern": r"<think>[a-z]{2,6}</think>\n[a-z]{2,6}"}


@pytest.fixture(scope="module")
def template_dirs(llama_dir, tmp_path_factory):
    out = {}
    for name, text in TEMPLATES.items():
        d = shutil.copytree(llama_dir, tmp_path_factory.mktemp(name) / "m")
        (d / "chat_template.jinja").write_text(text)
        out[name] = d
    return out


new_llm = functools.partial(tiny_llm, kv_cache_memory="16MiB", max_model_len=2048)


def chatml_delta(messages: list[dict], reply_closed: bool) -> str:
    """What the four test templates append after a reply: written out by hand, from the
    templates above (they agree on everything after a past reply)."""
    head = "\n" if reply_closed else "<|im_end|>\n"
    body = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return head + body + "<|im_start|>assistant\n"


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_append_history_computes_only_each_turns_delta(template_dirs, name):
    with new_llm(template_dirs[name]) as llm:
        s = llm.session(system=SYSTEM, sampling=G)
        assert s.history == "append"
        pending: list[dict] = []
        for k, (kind, msg, params) in enumerate(TURNS):
            if kind == "add":
                s.add("tool", msg)
                pending.append({"role": "tool", "content": msg})
                continue
            before = s.token_ids
            r = send(s, msg, params)
            new = pending + ([{"role": "user", "content": msg}] if isinstance(msg, str)
                             else msg)
            pending = []
            assert r.token_ids == expected_turn(llm, s, before, r, params), (name, k)
            log = s.token_ids
            prompt = log[: len(log) - len(r.token_ids)]
            delta = prompt[len(before):]
            assert r.diverged_at is None
            if before:
                text = llm.tokenizer.decode(delta, skip_special_tokens=False)
                closed = llm.tokenizer.decode(before[-1:], skip_special_tokens=False)
                assert text == chatml_delta(new, closed == "<|im_end|>"), (name, k)
                # the delta and the previous reply's last token: nothing else
                assert r.prefill_tokens == len(delta) + 1, (name, k)
                assert r.cached_tokens == len(before) - 1
            elif name != "dated":  # (its system turn says when it was rendered)
                assert prompt == llm.tokenizer.encode_chat(s.messages[:-1])
        st = s.stats
        assert st.turns == 7 and st.cached_tokens + st.computed_tokens == st.prompt_tokens


@pytest.mark.parametrize("name", ["strip_think", "open_last", "chatml"])
def test_template_history_equals_chat(template_dirs, name):
    with new_llm(template_dirs[name]) as llm:
        s = llm.session(system=SYSTEM, sampling=G, history="template")
        diverged = []
        for kind, msg, params in TURNS:
            if kind == "add":
                s.add("tool", msg)
                continue
            r = send(s, msg, params)
            want = llm.chat(s.messages[:-1], params, use_tqdm=False)[0]
            assert r.token_ids == want.token_ids
            diverged.append(r.diverged_at)
            if len(diverged) == 1:
                first_prompt = len(s.token_ids) - len(r.token_ids)
        if name == "strip_think":  # the first reply's thinking is gone from turn 2 on
            assert diverged[1] == first_prompt
        elif name == "open_last":  # the last reply is re-rendered closed
            assert any(d is not None for d in diverged[1:])


def test_dated_template_recomputes_everything_in_template_mode_only(template_dirs):
    with new_llm(template_dirs["dated"]) as llm:
        a = llm.session(system=SYSTEM, sampling=G, history="template", pin_system=False)
        b = llm.session(system=SYSTEM, sampling=G, pin_system=False)
        a.send("hello")
        b.send("hello")
        ra, rb = a.send("and then?"), b.send("and then?")
        assert ra.diverged_at is not None and ra.diverged_at < 24  # the time, in the system turn
        assert rb.diverged_at is None and rb.cached_tokens == len(b.token_ids) - len(
            rb.token_ids) - rb.prefill_tokens


def test_history_survives_snapshot_fork_and_resume(llama_dir, tmp_path):
    sd = tmp_path / "sd"
    with new_llm(llama_dir, session_dir=sd) as llm:
        s = llm.session(session_id="h", system=SYSTEM, sampling=G)
        s.send("first")
        s.add("tool", "result one")  # pending: rendered with the next turn
        t = llm.session(session_id="t", system=SYSTEM, sampling=G, history="template")
        t.send("first")
        s.save(tmp_path / "h.kvs")
        child = s.fork(session_id="h-child")
        assert child.history == "append" and child.token_ids == s.token_ids
        before = child.token_ids
        r = child.send("child's turn")
        assert r.token_ids == expected_turn(llm, child, before, r, G)
        assert r.prefill_tokens == len(child.token_ids) - len(r.token_ids) - len(before) + 1
        log_h = s.token_ids
    with new_llm(llama_dir, session_dir=sd) as llm:  # resumed from the log
        s = llm.session(session_id="h")
        t = llm.session(session_id="t")
        assert s.history == "append" and t.history == "template"
        assert s.token_ids == log_h
        r = s.send("second")
        text = llm.tokenizer.decode(s.token_ids[len(log_h):], skip_special_tokens=False)
        assert "result one" in text and "first" not in text  # the pending tool result
        assert r.token_ids == expected_turn(llm, s, log_h, r, G)
        rt = t.send("second")
        assert rt.token_ids == llm.chat(t.messages[:-1], G, use_tqdm=False)[0].token_ids
        restored = llm.restore(tmp_path / "h.kvs", session_id="h-copy")
        assert restored.history == "append" and restored.token_ids == log_h
        r2 = restored.send("second")
        assert r2.token_ids == r.token_ids  # the same log, the same message


def test_pinned_system_serves_chat_and_sessions(llama_dir):
    with new_llm(llama_dir) as llm:
        p = llm.pin(system=SYSTEM)
        assert p.num_blocks >= 2
        out = llm.chat([{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": "hi"}], G, use_tqdm=False)[0]
        assert out.num_cached_tokens == p.num_blocks * 16
        s = llm.session(system=SYSTEM, sampling=G, pin_system=False)
        assert s.send("something else").cached_tokens == p.num_blocks * 16


def test_tenants_share_the_public_system_prompt_and_nothing_else(llama_dir):
    with new_llm(llama_dir) as llm:
        system_blocks = len(llm.tokenizer.encode_chat(
            [{"role": "system", "content": SYSTEM}], add_generation_prompt=False)) // 16
        a = llm.session(system=SYSTEM, sampling=G, cache_salt="tenant-a")
        b = llm.session(system=SYSTEM, sampling=G, cache_salt="tenant-b")
        same = "read the same file in the same project please, then run the tests " * 3
        ra = a.send(same)
        before = llm.stats().prefix.hit_tokens
        rb = b.send(same)
        # b reused the pinned public prefix a computed (a also hit it: it was pinned first)
        assert ra.cached_tokens == rb.cached_tokens >= system_blocks * 16
        # and nothing of a's: the identical conversation after the system prompt is b's own
        prompt_len = len(b.token_ids) - len(rb.token_ids)
        assert rb.cached_tokens < prompt_len - 16
        assert llm.stats().prefix.hit_tokens - before == rb.cached_tokens
        # the same tenant again: its own blocks are shared
        a2 = llm.session(system=SYSTEM, sampling=G, cache_salt="tenant-a")
        assert a2.send(same).cached_tokens > ra.cached_tokens
        # an unsalted request with the same text shares only the public prefix too
        out = llm.chat([{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": same}], G, use_tqdm=False)[0]
        assert out.num_cached_tokens == ra.cached_tokens


def test_reasoning_is_split_from_the_answer_and_kept_in_the_log(llama_dir, tmp_path):
    d = shutil.copytree(llama_dir, tmp_path / "m")
    (d / "chat_template.jinja").write_text(STRIP_THINK)
    forced = SamplingParams(max_tokens=40, temperature=0.0, response_format={
        "type": "regex", "pattern": r"<think>[a-z]{3,8}</think>\n[a-z]{3,8}"})
    with new_llm(d) as llm:
        s = llm.session(sampling=forced)
        r = s.send("think first")
        assert r.reasoning and r.text and "<think>" not in r.text
        assert s.messages[-1] == {"role": "assistant", "content": r.text,
                                  "reasoning_content": r.reasoning}
        before = s.token_ids
        r2 = s.send("again")
        # the model sees what it thought: the reasoning stays in the log
        assert llm.tokenizer.decode(before).count(r.reasoning) == 1
        assert s.token_ids[: len(before)] == before
        assert r2.prefill_tokens == len(s.token_ids) - len(r2.token_ids) - len(before) + 1


def test_a_system_prompt_longer_than_the_model_is_refused_alone(llama_dir):
    with new_llm(llama_dir, max_model_len=256) as llm:
        with pytest.raises(ConfigError, match="max_model_len"):
            llm.session(system="read the file " * 300)
        with pytest.raises(ConfigError, match="max_model_len"):
            llm.pin(system="read the file " * 300)
        s = llm.session(system=SYSTEM, sampling=G)  # the engine is unaffected
        chunks = list(s.stream("hello"))
        assert "".join(c.text for c in chunks) == chunks[-1].reply.text
        assert len(chunks) > 2  # text arrives as it is generated, not at the end


def test_sessions_opened_concurrently_share_one_system_pin(llama_dir):
    import threading

    with new_llm(llama_dir) as llm:
        sessions, go = [], threading.Barrier(4)

        def open_one():
            go.wait(timeout=60)
            sessions.append(llm.session(system=SYSTEM, sampling=G))

        threads = [threading.Thread(target=open_one) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(sessions) == 4
        pinned = llm.stats().tiers["device"].blocks_pinned
        assert {s.system_key for s in sessions} == {sessions[0].system_key}
        assert pinned == len(sessions[0].system_key) // 16
        for s in sessions:
            s.close()
        assert llm.stats().tiers["device"].blocks_pinned == 0
