"""Fuzzing the public API with arguments of every type: a call either works or raises a
KVSessionError (never a raw TypeError/ValueError/AttributeError...), and a healthy batch
generating on the same LLM at the same time gets exactly the tokens it gets alone.

Seeded (derandomize) and CI-sized. Keyword names that are a function's own positional
parameters (`self`, `model`, `message`) are not drawn: passing one twice is a TypeError
Python raises while binding the call, before any of our code runs.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections import Counter
from contextlib import contextmanager

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsession import LLM, KVSessionError, SamplingParams
from kvsession.config import ENGINE_ARG_NAMES
from kvsession.errors import SessionClosedError
from kvsession.params import SAMPLING_ARG_NAMES
from oracle import random_prompts

WAIT_S = 120
LLM_EXAMPLES = 100  # each builds (and closes) an engine when its arguments are valid
CALL_EXAMPLES = 300
BINDING = {"self", "model", "message"}  # see the module docstring


def fuzz_settings(examples: int) -> settings:
    return settings(derandomize=True, database=None, deadline=None, max_examples=examples,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])

SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                   st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
                   st.binary(max_size=2))
MIXED = st.recursive(SCALAR, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.tuples(inner),
    st.dictionaries(st.text(max_size=4), inner, max_size=3)), max_leaves=6)
NAME = st.text(min_size=1, max_size=10).filter(lambda n: n not in BINDING)


# values at the edges of what is valid, so that drawn calls also pass validation and run
# (any request that passes it must run without failing its batch)
EDGE = {
    "max_tokens": st.sampled_from([1, 2, 2**70]),
    "temperature": st.sampled_from([0, 0.0, 5e-324, 1e-300, 1e-6, 0.7, 1e308, float("inf")]),
    "top_p": st.sampled_from([5e-324, 1e-9, 0.5, 1, 1.0]),
    "top_k": st.sampled_from([-1, 1, 2, 511, 512, 2**70]),
    "seed": st.sampled_from([None, 0, -(2**63), 2**64 - 1]),
    "stop": st.sampled_from([None, "\x00", "a", ["a", "\ufffd"], ()]),
    "stop_token_ids": st.sampled_from([None, [], [0], [2**70], (511, 512)]),
    "ignore_eos": st.booleans(),
    "logprobs": st.sampled_from([None, 0, 1, 20]),
    "cache_salt": st.sampled_from([None, "", "salt", "\x00"]),
    # generate() and chat()
    "prompts": st.sampled_from(["hi", ["a", "b c"], ("x",), []]),
    "prompt_token_ids": st.sampled_from([[1, 2, 3], [[4], [5, 6]], (7, 8), [[9]]]),
    "use_tqdm": st.just(False),
    "add_generation_prompt": st.booleans(),
}


ENGINE_EDGE = {
    "device": st.sampled_from(["cpu", "auto"]),
    "dtype": st.sampled_from(["auto", "float32", "bfloat16", "float16"]),
    "kv_cache_dtype": st.sampled_from(["auto", "fp8", "float16"]),
    "max_model_len": st.sampled_from([None, 1, 2, 16, 64]),
    "block_size": st.sampled_from([8, 16, 32]),
    "max_num_seqs": st.sampled_from([1, 2**20]),
    "max_num_batched_tokens": st.sampled_from([1, 16, 2**40]),
    "enable_prefix_caching": st.booleans(),
    "max_pinned_fraction": st.sampled_from([0, 0.0, 1, 1.0]),
    "spill_after_s": st.sampled_from([None, 0, 5e-324, 1e308, float("inf")]),
    "remote_prefill": st.sampled_from(["auto", "never", "always", "required"]),
    "remote_prefill_timeout_s": st.sampled_from([5e-324, 1e308]),
    "gpu_memory_utilization": st.sampled_from([5e-324, 1, 1.0]),
    "attention_backend": st.sampled_from(["auto", "torch"]),
    "seed": st.sampled_from([0, -(2**63), 2**64 - 1]),
}


def kwargs(names) -> st.SearchStrategy[dict]:
    """Known argument names (and misspelt or unknown ones), each with a value of any type;
    known sampling arguments often get an edge-of-valid value."""
    known = sorted(set(names) - BINDING)
    edge = {**EDGE, **ENGINE_EDGE} if set(names) == set(ENGINE_ARG_NAMES) else EDGE
    valid = st.fixed_dictionaries({}, optional={n: edge[n] for n in known if n in edge})
    keys = st.one_of(st.sampled_from(known), NAME)
    anything = st.dictionaries(keys, MIXED, max_size=4)
    return st.one_of(valid, anything, st.builds(lambda a, b: {**a, **b}, valid,
                                                st.dictionaries(keys, MIXED, max_size=1)))


ROLE = st.one_of(st.sampled_from(["user", "assistant", "system", "tool"]), MIXED)
PART = st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=6)}),
                 st.dictionaries(st.sampled_from(["type", "text", "image_url"]), MIXED,
                                 max_size=2))
CONTENT = st.one_of(st.text(max_size=12), st.lists(PART, max_size=3), MIXED)
MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": ROLE, "content": CONTENT},
                          optional={"name": MIXED, "tool_call_id": st.text(max_size=4)}),
    MIXED)
MESSAGES = st.one_of(st.lists(MESSAGE, max_size=3),
                     st.lists(st.lists(MESSAGE, max_size=2), max_size=2), MIXED)
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)
EDGE["sampling_params"] = st.sampled_from([None, ONE_TOKEN, [ONE_TOKEN], [ONE_TOKEN] * 2])


@pytest.fixture(scope="module")
def llm(llama_dir):
    with LLM(llama_dir, kv_cache_memory="4MiB", max_model_len=128,
             host_cache_memory="4MiB") as llm:
        yield llm


@contextmanager
def healthy_batch_running(llm):
    """A greedy and a seeded request generating in another thread, again and again, for
    as long as the block runs; every run must give the tokens of a run alone."""
    prompts = random_prompts(0, [9, 23, 14], 500)
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.7, top_k=20, seed=8, logprobs=2,
                             ignore_eos=True)]

    def run():
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        return [(o.token_ids, o.logprobs) for o in outs]

    want = run()
    stop, runs, errors = threading.Event(), [], []

    def loop():
        while not stop.is_set():
            try:
                runs.append(run())
            except BaseException as e:  # reported below, in the test's thread
                errors.append(e)
                return

    t = threading.Thread(target=loop, name="healthy-batch", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(WAIT_S)
    assert not t.is_alive(), "the healthy batch hung"
    assert not errors, errors
    assert runs
    for r in runs:
        assert [t for t, _ in r] == [t for t, _ in want], (r, want)
        for (_, got), (_, exp) in zip(r, want, strict=True):  # float noise of batch shapes
            assert (got is None) == (exp is None)
            for g, e in zip(got or [], exp or [], strict=True):
                assert g == pytest.approx(e, abs=1e-4)


class Tally:
    """Outcomes per call, printed at the end (run with -s to see them)."""

    def __init__(self, name: str):
        self.name, self.counts = name, Counter()

    def call(self, what: str, fn) -> None:
        try:
            fn()
        except SessionClosedError as e:  # EngineClosedError too: the engine must live on
            raise AssertionError(f"{what}: the engine or the session was closed: {e!r}") from e
        except KVSessionError:
            self.counts[what, "clean error"] += 1
            return
        except Exception as e:
            raise AssertionError(f"{what} raised {type(e).__name__}, not a KVSessionError: "
                                 f"{e!r}") from e
        self.counts[what, "ok"] += 1

    def report(self) -> None:
        total = sum(self.counts.values())
        clean = sum(n for (_, kind), n in self.counts.items() if kind == "clean error")
        print(f"\n{self.name}: {total} calls, {clean} clean errors, {total - clean} ok: "
              + ", ".join(f"{w} {k} {n}" for (w, k), n in sorted(self.counts.items())))


def test_fuzz_llm_constructor(llm, llama_dir, tmp_path):
    tally = Tally("LLM(...)")
    # memory sizes above 64 MiB are left out: a size the machine cannot allocate is not a
    # typing question (and would take the memory); so is a reachable prefill worker
    small = MIXED.filter(lambda v: not (isinstance(v, int) and v > 2**26))
    args = kwargs(ENGINE_ARG_NAMES).map(lambda kw: {k: v for k, v in kw.items()
                                                    if k != "prefill_worker"})
    sizes = st.fixed_dictionaries({}, optional={"kv_cache_memory": small,
                                                "host_cache_memory": small})
    cwd = os.getcwd()
    os.chdir(tmp_path)  # a drawn session_dir is created relative to here, not in the repo

    @fuzz_settings(LLM_EXAMPLES)
    @given(args, sizes)
    def fuzz(kw, size_kw):
        kw = {k: v for k, v in kw.items() if k not in ("kv_cache_memory", "host_cache_memory")}
        base = {"kv_cache_memory": "4MiB", "host_cache_memory": 0, "max_model_len": 64}

        def build():
            LLM(llama_dir, **{**base, **kw, **size_kw}).close()

        tally.call("LLM", build)

    try:
        with healthy_batch_running(llm):
            fuzz()
    finally:
        os.chdir(cwd)
        tally.report()
    assert tally.counts["LLM", "clean error"] > LLM_EXAMPLES // 2 and tally.counts["LLM", "ok"]


def test_fuzz_calls(llm):
    tally = Tally("calls")
    session = [llm.session(sampling=ONE_TOKEN)]

    def fresh_session():
        # a session whose history nears max_model_len refuses every turn (cleanly); start
        # over so that valid turns keep running
        s = session[0]
        # the history's length, not the cached tokens: a suspended or spilled session holds
        # few tokens on the device but still renders its whole history
        if len(llm.tokenizer.encode_chat(s.messages)) > 64:
            s.close()
            session[0] = llm.session(sampling=ONE_TOKEN)
        return session[0]

    def generate_with(kw):
        p = SamplingParams(**kw)
        # any SamplingParams that constructs must run (a long one, shortened: the point is
        # that it does not fail, nor its batch)
        llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=p.with_overrides(
            max_tokens=min(p.max_tokens, 3)), use_tqdm=False)

    targets = st.one_of(
        st.tuples(st.just("SamplingParams"), kwargs(SAMPLING_ARG_NAMES)),
        st.tuples(st.just("generate"), kwargs(("prompts", "prompt_token_ids", "use_tqdm",
                                               "sampling_params"))),
        st.tuples(st.just("chat"), st.tuples(MESSAGES, st.one_of(st.just(ONE_TOKEN), MIXED),
                                             kwargs(("use_tqdm", "add_generation_prompt")))),
        st.tuples(st.just("send"), st.tuples(st.one_of(MESSAGE, MESSAGES, st.text(max_size=8)),
                                             kwargs(SAMPLING_ARG_NAMES))),
        st.tuples(st.just("add"), st.tuples(ROLE, CONTENT)),
        st.tuples(st.just("suspend"), MIXED),
    )

    def act(target, arg):
        s = fresh_session()
        if target == "SamplingParams":
            return generate_with(arg)
        if target == "generate":
            return llm.generate(**{"use_tqdm": False, "sampling_params": ONE_TOKEN, **arg})
        if target == "chat":
            messages, params, kw = arg
            return llm.chat(messages, params, **{"use_tqdm": False, **kw})
        if target == "send":
            message, overrides = arg
            if isinstance(overrides.get("max_tokens"), int):
                overrides["max_tokens"] = min(overrides["max_tokens"], 3)
            return s.send(message, **overrides) if len(overrides) % 2 else asyncio.run(
                s.asend(message, **overrides))
        if target == "add":
            return s.add(*arg)
        return s.suspend(expected_idle_s=arg)

    @fuzz_settings(CALL_EXAMPLES)
    @given(targets)
    def fuzz(target_arg):
        target, arg = target_arg
        tally.call(target, lambda: act(target, arg))

    try:
        with healthy_batch_running(llm):
            fuzz()
    finally:
        tally.report()
    # the session is intact: it still converses, and the LLM's books balance
    s = fresh_session()
    s.send("one more turn")
    s.close()
    llm.check_integrity()
    for what in ("SamplingParams", "generate", "chat", "send", "add", "suspend"):
        assert tally.counts[what, "clean error"] > 0 and tally.counts[what, "ok"] > 0, what
