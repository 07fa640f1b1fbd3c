"""Remote prefill over NIXL with real worker processes on loopback: exactness, failure
semantics (kill, timeout, dropped answers, refused handshake, unreachable), no leaks,
prefix affinity."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys

import pytest

from kvsession import LLM, SamplingParams
from kvsession.worker import FAULTS_ENV, Faults

G = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
KW = dict(kv_cache_memory="8MiB", max_model_len=512)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(faults: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != FAULTS_ENV}
    if faults is not None:
        env[FAULTS_ENV] = faults
    return env


class Worker:
    def __init__(self, model_dir, *extra, faults: str | None = None):
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvsession.worker", "--model", str(model_dir), "--listen",
             self.address, "--kv-cache-memory", "8MiB", "--max-model-len", "512", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            env=worker_env(faults))
        line = "x"
        while line and "listening" not in line:  # the worker says when it listens
            line = self.proc.stdout.readline()
        if "listening" not in line:
            self.proc.kill()
            raise AssertionError("the worker did not start")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def worker(llama_dir):
    w = Worker(llama_dir)
    yield w
    assert w.stop() == 0  # a clean shutdown: agents and registrations released, exit 0


def prompts(seed, n, shared=0):
    rng = random.Random(seed)
    prefix = [rng.randrange(500) for _ in range(shared)]
    return [prefix + [rng.randrange(500) for _ in range(rng.randint(20, 150))]
            for _ in range(n)]


def generate(llm, ps):
    return [o.token_ids for o in llm.generate(prompt_token_ids=ps, sampling_params=G,
                                              use_tqdm=False)]


def local(model_dir, ps, **kw):
    with LLM(model_dir, **{**KW, **kw}) as llm:
        return generate(llm, ps)


def assert_no_leak(llm):
    llm.check_integrity()
    dev = llm.stats().tiers["device"]
    assert dev.blocks_used == dev.blocks_pinned == 0
    assert not llm._rt.connector.pending and not llm._rt.connector.quarantine
    assert not llm._rt.scheduler.quarantine and not llm._rt.scheduler.remote


@pytest.mark.parametrize("kv_dtype", ["float32", "fp8"])
def test_outputs_with_a_worker_equal_outputs_without(llama_dir, tmp_path, kv_dtype):
    w = Worker(llama_dir, "--kv-cache-dtype", kv_dtype)
    try:
        batches = [prompts(1, 6), prompts(2, 6, shared=64)]
        with LLM(llama_dir, prefill_worker=w.address, remote_prefill="always",
                 kv_cache_dtype=kv_dtype, **KW) as llm:
            for ps in batches:
                assert generate(llm, ps) == local(llama_dir, ps, kv_cache_dtype=kv_dtype)
            st = llm.stats().remote
            assert st.prefills >= 8 and st.bytes > 0 and not st.fallbacks
            assert_no_leak(llm)
        assert llm._rt.connector.num_registrations == 0
    finally:
        assert w.stop() == 0


def test_worker_killed_mid_stream(llama_dir, worker):
    victim = Worker(llama_dir)
    ps = prompts(3, 40)
    want = local(llama_dir, ps)
    with LLM(llama_dir, prefill_worker=victim.address, remote_prefill="always",
             remote_prefill_timeout_s=5.0, **KW) as llm:
        got = generate(llm, ps[:10])
        assert llm.stats().remote.prefills == 10
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait()
        got += generate(llm, ps[10:])
        assert got == want
        st = llm.stats().remote
        assert sum(st.fallbacks.values()) >= 1
        assert_no_leak(llm)


def test_random_faults_never_change_outputs_or_leak(llama_dir):
    # delays past the timeout (quarantine, then a late answer fences), lost answers (the
    # NIXL notifications still complete the request), and a kill at the end
    flaky = Worker(llama_dir, faults="delay_rate=0.15,delay_s=0.6,drop_rate=0.15,seed=7")
    ps = prompts(4, 200)
    want = local(llama_dir, ps)
    with LLM(llama_dir, prefill_worker=flaky.address, remote_prefill="always",
             remote_prefill_timeout_s=0.3, **KW) as llm:
        got = []
        for i in range(0, 200, 25):
            got += generate(llm, ps[i:i + 25])
            if i == 150:
                flaky.proc.send_signal(signal.SIGKILL)
        assert got == want
        st = llm.stats().remote
        assert st.prefills > 0 and st.fallbacks.get("timeout", 0) > 0
        assert_no_leak(llm)
    flaky.proc.wait()


def test_mismatched_worker_is_refused_and_fallback_works(llama_dir, model_dirs):
    other = Worker(model_dirs("qwen2"))
    try:
        ps = prompts(5, 4)
        with LLM(llama_dir, prefill_worker=other.address, remote_prefill="always",
                 **KW) as llm:
            assert not llm._rt.connector.healthy()
            assert generate(llm, ps) == local(llama_dir, ps)
            st = llm.stats().remote
            assert st.prefills == 0 and st.fallbacks.get("handshake refused") == 1
    finally:
        assert other.stop() == 0


def test_unreachable_worker_falls_back(llama_dir):
    ps = prompts(6, 3)
    with LLM(llama_dir, prefill_worker=f"tcp://127.0.0.1:{free_port()}",
             remote_prefill="always", remote_prefill_timeout_s=0.5, **KW) as llm:
        assert not llm._rt.connector.healthy()
        assert generate(llm, ps) == local(llama_dir, ps)
        assert llm.stats().remote.prefills == 0


def test_shared_prefix_sticks_to_one_worker(llama_dir, worker):
    second = Worker(llama_dir)
    try:
        ps = prompts(7, 12, shared=48)
        with LLM(llama_dir, prefill_worker=[worker.address, second.address],
                 remote_prefill="always", **KW) as llm:
            for p in ps:  # one at a time: each is offloaded on its own
                generate(llm, [p])
            counts = sorted(w.num_requests for w in llm._rt.connector.workers)
            assert counts[0] == 0 and counts[1] > 0
            assert_no_leak(llm)
    finally:
        assert second.stop() == 0


def test_auto_mode_uses_the_cost_model(llama_dir, worker):
    with LLM(llama_dir, prefill_worker=worker.address, remote_prefill="auto", **KW) as llm:
        # a measured transfer bandwidth at which ~100 prompt tokens take ~0.1 s to move:
        # worth it for a long answer (saved decode stalls), not for a 1-token one
        assert llm._rt.connector.bandwidth_bytes_per_s == 0.0  # nothing measured yet
        llm._rt.connector.transfer_rate.observe(100 * llm.runtime.kv_bytes_per_token, 0.1)
        assert llm._rt.connector.bandwidth_bytes_per_s == pytest.approx(
            100 * llm.runtime.kv_bytes_per_token / 0.1)
        short_answer = SamplingParams(max_tokens=1, temperature=0.0)
        long_answer = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        p = [(7 * i) % 500 for i in range(101)]
        llm.generate(prompt_token_ids=[p], sampling_params=short_answer, use_tqdm=False)
        assert llm.stats().remote.prefills == 0  # long prompt, short answer: local
        out = llm.generate(prompt_token_ids=[p[::-1]], sampling_params=long_answer,
                           use_tqdm=False)[0]
        assert llm.stats().remote.prefills == 1  # long answer: offloaded
        assert len(out.token_ids) == 200


# ---- fault injection (KVSESSION_WORKER_FAULTS), not a CLI flag ---------------------------

def test_faults_parse():
    assert Faults.parse("") == Faults() and not Faults().active
    f = Faults.parse(" delay_rate=0.5, delay_s=2.0 ,drop_rate=0.1,seed=3,")
    assert f == Faults(delay_rate=0.5, delay_s=2.0, drop_rate=0.1, seed=3) and f.active
    assert Faults.parse("drop_rate=1") == Faults(drop_rate=1.0)
    assert not Faults.parse("delay_rate=0.5").active  # no delay: nothing happens
    with pytest.raises(AttributeError):
        f.seed = 1  # frozen


@pytest.mark.parametrize("text, message", [
    ("delay_rate", "expected key=value"),
    ("delay_rate=", "expected key=value"),
    ("=0.5", "expected key=value"),
    ("delay_rat=0.5", "unknown key 'delay_rat'"),
    ("seed=1,seed=2", "seed given twice"),
    ("delay_s=fast", "delay_s='fast' is not a number"),
    ("seed=1.5", "seed='1.5' is not an integer"),
    ("drop_rate=1.5", "drop_rate must be in [0, 1]"),
    ("delay_rate=-0.1", "delay_rate must be in [0, 1]"),
    ("delay_rate=nan", "delay_rate must be in [0, 1]"),
    ("delay_s=-1", "delay_s must be a finite number >= 0"),
    ("delay_s=inf", "delay_s must be a finite number >= 0"),
])
def test_faults_parse_rejects(text, message):
    with pytest.raises(ValueError) as e:
        Faults.parse(text)
    assert message in str(e.value) and "\n" not in str(e.value)


def run_worker(*args, faults: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvsession.worker", *args],
                          capture_output=True, text=True, timeout=120, env=worker_env(faults))


def test_malformed_fault_variable_is_a_one_line_error(tmp_path):
    # checked at start-up, before the model is loaded (none exists at this path)
    out = run_worker("--model", str(tmp_path / "none"), "--listen",
                     f"tcp://127.0.0.1:{free_port()}", faults="drop_rate=2")
    assert out.returncode == 2 and not out.stdout
    assert out.stderr.splitlines() == [f"error: {FAULTS_ENV}: drop_rate must be in [0, 1], "
                                       "got 2.0"]


def test_fault_flags_are_not_part_of_the_cli():
    help_text = run_worker("--help")
    assert help_text.returncode == 0 and "--listen" in help_text.stdout
    assert "fault" not in help_text.stdout
    old = run_worker("--model", "x", "--listen", "tcp://127.0.0.1:1", "--fault-rate", "0.5")
    assert old.returncode == 2 and "unrecognized arguments: --fault-rate" in old.stderr
