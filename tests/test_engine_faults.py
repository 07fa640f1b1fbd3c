"""Engine faults: a dead engine thread fails every caller (never a hang), and a request that
fails inside a step fails alone, the rest of its batch unchanged."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from contextlib import contextmanager

import pytest
import torch
from internals import CHILD_PRELUDE, Internals
from safetensors.torch import load_file, save_file

from kvsession import LLM, ConfigError, SamplingParams
from kvsession.engine.sampler import Sampler, SamplingFailed
from kvsession.engine.sequence import Sequence
from kvsession.errors import EngineClosedError
from oracle import random_prompts

WAIT_S = 60  # every wait in this file is bounded: a regression fails, it does not hang
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@contextmanager
def one_batch(llm):
    """Hold the engine thread in a posted call while the caller submits: everything
    submitted inside the block is taken from the inbox together, into the same step."""
    started, release = threading.Event(), threading.Event()
    blocker = Internals(llm).post(lambda: (started.set(), release.wait(WAIT_S)))
    assert started.wait(WAIT_S)
    try:
        yield
    finally:
        release.set()
        blocker.result(timeout=WAIT_S)


def submit_batch(llm, prompts, params):
    ins = Internals(llm)
    with one_batch(llm):
        return [ins.submit(p, sp) for p, sp in zip(prompts, params, strict=True)]


def tokens(futures):
    return [f.result(timeout=WAIT_S).output_token_ids for f in futures]


# ---- the engine thread dies -------------------------------------------------------------


def test_engine_thread_death_fails_pending_and_later_calls(llama_dir):
    llm = LLM(llama_dir, kv_cache_memory="4MiB", max_model_len=256)
    ins = Internals(llm)
    boom = RuntimeError("housekeeping broke")
    armed = threading.Event()
    posted = []

    def timer(now):  # a housekeeping timer that fails once armed
        if armed.is_set():
            raise boom

    def after_first_step():  # engine thread: leave a call in the inbox, then arm the timer
        if not armed.is_set():
            posted.append(ins.post(lambda: "never runs"))
            armed.set()

    ins.add_timer(timer)
    ins.after_each_step(after_first_step)
    results = []
    caller = threading.Thread(target=lambda: results.append(_capture(lambda: llm.generate(
        "a long answer", SamplingParams(max_tokens=200, ignore_eos=True), use_tqdm=False))))
    caller.start()
    caller.join(WAIT_S)
    assert not caller.is_alive(), "a caller of a dead engine hung"
    # the request in flight and the call never run both fail, carrying the cause
    for err in (results[0], posted[0].exception(timeout=WAIT_S)):
        assert isinstance(err, EngineClosedError) and err.__cause__ is boom
        assert "housekeeping broke" in str(err)
    # later calls fail at once (the future is resolved before submit returns)
    fut = ins.submit([1, 2, 3], GREEDY)
    assert fut.done() and fut.exception().__cause__ is boom
    for call in (lambda: llm.generate("hi", GREEDY, use_tqdm=False), llm.stats,
                 lambda: llm.session(system="sys")):
        with pytest.raises(EngineClosedError) as e:
            call()
        assert e.value.__cause__ is boom
    assert ins.futures == {}
    llm.close()  # returns (and its integrity check at close runs on the dead engine's state)
    llm.close()


def _capture(fn):
    try:
        return fn()
    except BaseException as e:
        return e


def test_exit_does_not_hang_after_the_engine_thread_died(llama_dir, tmp_path):
    script = CHILD_PRELUDE + f"""
from internals import Internals
from kvsession import LLM, SamplingParams
llm = LLM({str(llama_dir)!r}, kv_cache_memory="4MiB", max_model_len=256,
          session_dir={str(tmp_path / "sd")!r})
s = llm.session(session_id="open", sampling=SamplingParams(max_tokens=2))
s.send("hello")
dead = []
def timer(now):
    if dead:
        raise ValueError("timer failed")
Internals(llm).add_timer(timer)
Internals(llm).on_engine(lambda: dead.append(1))
try:
    s.send("again")
except Exception as e:
    print(type(e).__name__, type(e.__cause__).__name__)
# no close(): at exit the LLM is closed (and its sessions persisted) by atexit
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "EngineClosedError ValueError"


def test_a_cancelled_call_does_not_stop_the_engine(llama_dir):
    with LLM(llama_dir, kv_cache_memory="4MiB", max_model_len=256) as llm:
        s = llm.session(sampling=SamplingParams(max_tokens=2, temperature=0.0))
        with one_batch(llm):
            fut = s.prefetch()  # a Future the caller holds, and may cancel before it runs
            assert fut.cancel()
        again = Internals(llm).submit([1, 2, 3], GREEDY)
        assert len(again.result(timeout=WAIT_S).output_token_ids) == 8
        assert len(s.send("hi").token_ids) == 2
        s.close()


def test_non_json_message_is_refused_before_it_reaches_the_engine(llama_dir, tmp_path):
    # such a message used to be accepted, then kill the engine thread when the idle
    # session spilled to disk (its messages go into the snapshot)
    with LLM(llama_dir, kv_cache_memory="4MiB", max_model_len=256, host_cache_memory=0,
             session_dir=tmp_path / "sd", spill_after_s=1e-3) as llm:
        s = llm.session(sampling=SamplingParams(max_tokens=2, temperature=0.0))
        for bad in ({"when": object()}, {"when": [1, float("nan")]}, 2**70):
            with pytest.raises(ConfigError, match=r"message\[0\]\['meta'\].* must be a JSON"):
                s.send({"role": "user", "content": "hi", "meta": bad})
        assert s.messages == [] and s.stats.turns == 0
        # JSON data (tool calls, metadata) is kept, also through a spill to disk
        s.send({"role": "user", "content": "hi", "meta": {"when": [1, 2.5, None]}})
        Internals(llm).tier_housekeeping(s.kv.last_used + 1.0)
        assert s.state == "disk"
        assert s.send("more").restored_from == "disk"
        assert s.messages[0]["meta"] == {"when": [1, 2.5, None]}
        s.close()


# ---- one request fails inside a step ----------------------------------------------------


def _sampler_run(logits, params, seed=0):
    seqs = [Sequence(token_ids=[1], params=p, max_model_len=64) for p in params]
    return Sampler(seed)(logits, seqs), seqs


def test_sampler_row_failure_is_that_rows_alone():
    torch.manual_seed(0)
    logits = torch.randn(4, 64) * 3
    healthy = [SamplingParams(temperature=0.0, logprobs=3),
               SamplingParams(temperature=0.9, top_p=0.8, seed=11, logprobs=2),
               SamplingParams(temperature=1.3, top_k=5, seed=12),
               SamplingParams(temperature=0.7, seed=13, logprobs=20)]
    alone, _ = _sampler_run(logits, healthy)
    bad = logits[:1].clone()
    bad[0, 7] = float("nan")
    mixed, seqs = _sampler_run(torch.cat([logits[:2], bad, logits[2:]]),
                               healthy[:2] + [SamplingParams(temperature=0.8, seed=1)]
                               + healthy[2:])
    assert isinstance(mixed[2], SamplingFailed) and f"request {seqs[2].seq_id}" in str(mixed[2])
    assert mixed[:2] + mixed[3:] == alone


def test_sampler_flags_nan_rows_exactly_and_takes_inf_as_an_argmax():
    """A row whose sum is NaN only through inf - inf holds no NaN: greedy takes its +inf;
    a row with a NaN fails alone, greedy or not."""
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    logits[0, 5], logits[0, 9] = float("inf"), float("-inf")
    logits[1, 3] = float("nan")
    out, _ = _sampler_run(logits, [SamplingParams(temperature=0.0)] * 3)
    assert out[0][0] == 5 and isinstance(out[1], SamplingFailed)
    assert out[2][0] == int(logits[2].argmax())


def test_sampler_logprobs_beyond_a_small_vocabulary():
    out, _ = _sampler_run(torch.tensor([[0.0, 1.0, 2.0]]), [SamplingParams(
        temperature=0.0, logprobs=20)])
    token, logprobs = out[0]
    assert token == 2 and set(logprobs) == {0, 1, 2}


def test_sampler_top_p_below_float32_keeps_the_top_token():
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    out, _ = _sampler_run(logits, [SamplingParams(temperature=1.0, top_p=p, seed=2)
                                   for p in (5e-324, 1e-50, 1e-9)])
    assert [token for token, _ in out] == logits.argmax(-1).tolist()


def test_tiny_temperature_is_greedy_and_its_batch_unchanged(llama_dir):
    prompts = random_prompts(3, [12, 30, 7, 19], 500)
    healthy = [GREEDY, SamplingParams(max_tokens=8, temperature=0.9, seed=5, ignore_eos=True),
               GREEDY]
    with LLM(llama_dir, kv_cache_memory="4MiB", max_model_len=256) as llm:
        alone = tokens(submit_batch(llm, prompts[:3], healthy))
        greedy = tokens(submit_batch(llm, prompts[3:], [GREEDY]))
        for temperature in (1e-300, 5e-324, 1e-6):
            tiny = SamplingParams(max_tokens=8, temperature=temperature, ignore_eos=True)
            mixed = tokens(submit_batch(llm, prompts, healthy + [tiny]))
            assert mixed == alone + greedy and tiny.greedy


def poisoned_lm_head(model_dir, tmp_path, token: int):
    """A checkpoint whose logit for `token` is +inf or -inf, by the sign of one hidden unit:
    +inf for some requests (no distribution to sample from), -inf for others (harmless).
    Only the output head is touched: every request's KV stays finite."""
    d = shutil.copytree(model_dir, tmp_path / "poisoned")
    w = load_file(str(d / "model.safetensors"))
    row = torch.zeros_like(w["lm_head.weight"][token])
    row[0] = float("inf")
    w["lm_head.weight"][token] = row
    save_file(w, str(d / "model.safetensors"))
    return d


def test_request_failing_in_sampling_fails_alone(llama_dir, tmp_path):
    token = 100
    d = poisoned_lm_head(llama_dir, tmp_path, token)
    prompts = random_prompts(0, [5, 9, 14, 21, 26, 33, 38, 11, 17, 29, 35, 8], 500)
    with LLM(d, kv_cache_memory="4MiB", max_model_len=256) as llm:
        first = tokens(submit_batch(llm, prompts, [SamplingParams(
            max_tokens=1, temperature=0.0)] * len(prompts)))
        inf = [p for p, t in zip(prompts, first, strict=True) if t == [token]]
        finite = [p for p, t in zip(prompts, first, strict=True) if t != [token]]
        assert inf and len(finite) >= 2  # the fixed prompts give both kinds
        # greedy requests never fail (argmax of +inf is fine); seeded ones whose first
        # logits are finite sample one token
        healthy_prompts = prompts[:3] + finite[:2]
        healthy = [GREEDY] * 3 + [SamplingParams(max_tokens=1, temperature=0.8, seed=s)
                                  for s in (1, 2)]
        alone = tokens(submit_batch(llm, healthy_prompts, healthy))
        bad = SamplingParams(max_tokens=4, temperature=0.8, seed=3)
        futures = submit_batch(llm, healthy_prompts[:2] + inf[:1] + healthy_prompts[2:],
                               healthy[:2] + [bad] + healthy[2:])
        assert tokens(futures[:2] + futures[3:]) == alone
        err = futures[2].exception(timeout=WAIT_S)
        assert isinstance(err, SamplingFailed) and "no valid distribution" in str(err)
        # the engine goes on, and the failed request's blocks were released
        assert tokens(submit_batch(llm, healthy_prompts, healthy)) == alone
        llm.check_integrity()


def test_a_finish_callback_that_raises_fails_its_request_alone(llama_dir):
    """A request's finish callback (a session's check-in) that raises fails that request
    (its caller is told, never left waiting); the batch's other requests complete, and a
    step's completions all run their callbacks before any caller is resolved."""
    with LLM(llama_dir, kv_cache_memory="4MiB", max_model_len=256) as llm:
        ins = Internals(llm)
        prompts = random_prompts(1, [6, 6, 6], 500)
        seen: list[tuple[int, bool]] = []  # (seq id, a completed request resolved yet)
        futures = []

        def record(seq, ok):
            seen.append((seq.seq_id, any(f.done() for f in futures[::2])))

        def broken(seq, ok):
            record(seq, ok)
            raise RuntimeError("check-in broke")

        with one_batch(llm):
            for i, p in enumerate(prompts):
                futures.append(ins.submit(p, GREEDY, on_finish=broken if i == 1 else record))
        assert [len(f.result(timeout=WAIT_S).output_token_ids) for f in (futures[0],
                                                                         futures[2])] == [8, 8]
        err = futures[1].exception(timeout=WAIT_S)
        assert isinstance(err, RuntimeError) and "check-in broke" in str(err)
        # the three finished in one step: every callback ran before a completed request's
        # caller was resolved (the failed one is told at once)
        assert len(seen) == 3 and not any(resolved for _, resolved in seen)
        assert tokens(submit_batch(llm, prompts[:1], [GREEDY])) == [
            futures[0].result().output_token_ids]
