"""A crash inside a random trace over every tier loses cache blocks at most: a child process
runs a seeded trace (stateless prompts over shared stems, turns of two durable sessions,
suspends, prefetches, floods that push content from the device to the host and from the
host to the disk cache) and is SIGKILLed at a seeded point: between two operations, or in
the middle of a disk cache slot's write (half of it written). The next process on the same
directory then finds every acknowledged turn, continues each session, and answers the
trace's prompts exactly as an engine that caches nothing, with the blocks that survived in
the disk cache, and its integrity checks hold."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys

import pytest
from internals import CHILD_PRELUDE, Internals
from test_prefix_cache import gen
from test_shared_tiers import BPT, G

from kvsession import LLM
from oracle import random_prompts

SYSTEM = "You are a terse agent. Tools: read(path), run()."
WORDS = "the cache is state agents call tools and wait then read write test fix".split()
SLOT = 8192  # a slot of the tiny llama's 8-token block
# a device pool far smaller than the trace's working set, a host tier of 12 blocks: floods
# push reused content down to the disk cache
SMALL = dict(kv_cache_memory=24 * 8 * BPT, max_model_len=192, block_size=8)
TIERS = dict(host_cache_memory=12 * 8 * BPT, disk_cache_memory=64 * SLOT, **SMALL)
NUM_OPS = 14


def trace(seed: int) -> list[dict]:
    """The operations, drawn once: each with what it needs (prompt, message, session)."""
    rng = random.Random(seed)
    stems = random_prompts(seed, [64, 96], 500)
    ops = []
    for _ in range(NUM_OPS):
        op = rng.choice(["gen", "gen", "gen", "send", "send", "suspend", "prefetch", "flood"])
        item = {"op": op, "session": rng.randrange(2)}
        if op == "gen":
            item["prompt"] = rng.choice(stems)[:rng.randint(24, 64)] + [rng.randrange(500)
                                                                       for _ in range(3)]
        elif op == "send":
            item["message"] = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 7)))
        elif op == "suspend":
            item["idle_s"] = rng.choice([0.01, 600.0])
        elif op == "flood":
            item["prompts"] = random_prompts(rng.randrange(10_000), [120, 120], 500)
        ops.append(item)
    return ops


CHILD = CHILD_PRELUDE + r"""
import json, os, signal, sys, types
from internals import Internals
from kvsession import LLM, SamplingParams
import kvsession.tiers.disk_cache as disk_cache

model, sd, site, nth = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
ops, kw, system = json.loads(sys.argv[5]), json.loads(sys.argv[6]), sys.argv[7]
G = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def die():
    os.kill(os.getpid(), signal.SIGKILL)


if site == "cache_write":  # the nth slot written to the disk cache is torn: half, then death
    writes = [0]

    def torn(fd, bufs, offset):
        writes[0] += 1
        if writes[0] == nth:
            data = b"".join(bytes(b) for b in bufs)
            os.pwrite(fd, data[: len(data) // 2], offset)
            die()
        return os.pwritev(fd, bufs, offset)
    disk_cache.os = types.SimpleNamespace(**{k: getattr(os, k) for k in dir(os)
                                             if not k.startswith("__")})
    disk_cache.os.pwritev = torn

llm = LLM(model, session_dir=sd, **kw)
ins = Internals(llm)
for name, rate in (("host", 1e12), ("disk_read", 1e12), ("prefill", 1e3)):
    ins.fix_rate(name, rate)
sessions = [llm.session(session_id=f"s{i}", system=system, sampling=G) for i in range(2)]
for k, item in enumerate(ops):
    if site == "between" and k == nth:
        die()
    s, op, out = sessions[item["session"]], item["op"], None
    if op == "gen":
        out = llm.generate(prompt_token_ids=[item["prompt"]], sampling_params=G,
                           use_tqdm=False)[0].token_ids
    elif op == "send":
        out = s.send(item["message"]).token_ids
    elif op == "suspend":
        s.suspend(expected_idle_s=item["idle_s"])
    elif op == "prefetch":
        s.prefetch().result(timeout=60)
    elif op == "flood":
        for p in item["prompts"]:
            llm.generate(prompt_token_ids=[p], sampling_params=G, use_tqdm=False)
    print(json.dumps({"ack": k, "out": out}), flush=True)
print(json.dumps({"done": True}), flush=True)
llm.close()
"""


def run_child(model, sd, site: str, nth: int, ops: list[dict]) -> tuple[list[dict], bool]:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(model), str(sd), site, str(nth), json.dumps(ops),
         json.dumps(TIERS), SYSTEM], capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, -signal.SIGKILL), proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()], \
        proc.returncode == -signal.SIGKILL


@pytest.mark.parametrize("seed, site, nth", [(0, "between", 9), (1, "cache_write", 3),
                                             (2, "cache_write", 1)])
def test_a_crash_in_a_random_trace_loses_cache_blocks_at_most(llama_dir, tmp_path, seed,
                                                               site, nth):
    ops = trace(seed)
    lines, killed = run_child(llama_dir, tmp_path, site, nth, ops)
    acked = [x for x in lines if "ack" in x]
    # killed where the seed says (a slot write the trace never reaches: it finishes)
    assert killed if site == "between" else killed or lines[-1] == {"done": True}
    with LLM(llama_dir, enable_prefix_caching=False, host_cache_memory=0,
             **SMALL) as plain:
        refs = [plain.session(system=SYSTEM, sampling=G) for _ in range(2)]
        sent: list[list[str]] = [[], []]
        for line in acked:  # what the child answered is what no cache would answer
            item = ops[line["ack"]]
            if item["op"] == "gen":
                assert line["out"] == gen(plain, [item["prompt"]], G)[0].token_ids
            elif item["op"] == "send":
                want = refs[item["session"]].send(item["message"]).token_ids
                assert line["out"] == want, (seed, line["ack"])
                sent[item["session"]].append(item["message"])
        with LLM(llama_dir, session_dir=tmp_path, **TIERS) as llm:
            ins = Internals(llm)
            ins.check_every_step()
            for name, rate in (("host", 1e12), ("disk_read", 1e12), ("prefill", 1e3)):
                ins.fix_rate(name, rate)
            for i, ref in enumerate(refs):
                if not sent[i]:
                    continue
                s = llm.session(session_id=f"s{i}")  # resumed: every acknowledged turn
                assert [m["content"] for m in s.messages if m["role"] == "user"] == sent[i]
                assert s.send("and now?").token_ids == ref.send("and now?").token_ids
            for line in acked:  # the trace's prompts again, from what survived
                item = ops[line["ack"]]
                if item["op"] == "gen":
                    assert gen(llm, [item["prompt"]], G)[0].token_ids == line["out"]
            llm.check_integrity()

