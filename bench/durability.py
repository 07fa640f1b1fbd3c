"""Durable sessions (durability="turn"): what they cost and what they buy.

1. Overhead: the agent workload (8 sessions x 6 turns, 1,024-token pinned system prompt,
   ~120-token messages, 32 generated tokens, 8 threads) with durability="turn" vs "close".
   The target (makespan overhead <= 5%) is judged on --paired-runs paired measurements
   (median): the two modes in two processes, interleaved turn by turn, each mode's
   makespan the sum of its turns (as bench/agent_workload.py measures), because the shared
   2-core machine's speed drifts by more than 5% within a minute. Also reported: --repeat
   pairs of free-running runs back to back (the order alternating; median of the pairs'
   ratios and best vs best), log records per fsync batch, KV blocks written behind, and
   the overhead accounted from what durability adds, each measured: the log batch each
   turn waits for, the engine thread's gathers, and the CPU time of the writer and commit
   threads (the cores they take from the engine).
2. Recovery after a kill: a child process builds 64 sessions with ~2k-token histories and
   one more turn each, and is SIGKILLed right after the last reply. A fresh process (as a
   restarted app; the benchmark's own process has run engines before) then opens the
   directory: time to start (recovery) and to list the sessions; KV reused
   by the resumed sessions against what they held one turn before the kill (target
   >= 90%); time to first token of a resumed session (log replay, KV attached from disk,
   loaded by the cost model, the rest prefilled) vs re-prefilling the same history
   (target >= 10x faster; resumed and re-prefilled sessions alternate, so that a drift
   of the machine's speed hits both): as after a process kill, and cold, the resumed
   sessions' files dropped from the page cache first (posix_fadvise DONTNEED after fsync)
   so that their KV is read from the disk (as after a reboot; the write-behind's O_DIRECT
   appends leave little of it in the page cache anyway). Medians of --probes probes of
   each kind; every probe is recorded.
3. Write-behind bandwidth, as a fraction of the disk's sequential write limit measured in
   the same run on the same file system (8 MiB writes, fdatasync every 64 MiB, through
   the page cache and with O_DIRECT: the faster of the two) (target >= 0.7): 8 sessions'
   worth of mid-model KV blocks (512 MiB) handed to the write-behind at once, from the
   first gather to the last block fdatasynced. --drain-rounds rounds after an uncounted
   warm-up drain, each a limit measurement then a drain, each after os.sync() (the
   recovery part leaves GBs dirty).
   The fraction is the median of the rounds' ratios: a round's limit and drain are
   measured seconds apart, and the disk's speed here varies several-fold from one round
   to the next (1.2 to 2.9 GB/s in one run), so a drain is compared with the limit of its
   own moment, as the makespans are paired. Also reported: the best drain over the best
   limit (whichever rounds they came from) and each round's ratio.
   Also reported: the writer's rate per second of busy time inside the recovery run's
   child, where it shares the 2 cores with prefill.

Part 2 runs first: its resumed probes are short and were slowed by whatever the agent
runs before them left behind (167-283 ms there, 94-136 ms on their own minutes later).

Writes bench/results/durability.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from child_protocol import answer_rounds
from common import (
    RoundsProcess,
    in_threads,
    mid_model,
    pyplot,
    save_figure,
    text_of,
    write_result,
)

from kvsession import LLM, SamplingParams
from kvsession.testing import make_tiny_model
from kvsession.tiers.checksum import crc32
from kvsession.tiers.disk import DiskTier
from kvsession.tiers.writeback import SnapshotLocks, WriteBehind, WriteOp

NEW_TOKENS = 32
CHILD = r"""
import json, sys, threading
sys.path.insert(0, sys.argv[5])
from kvsession import LLM, SamplingParams
model, sd, n, hist = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
from common import text_of
import random
llm = LLM(model, session_dir=sd, kv_cache_memory="2GiB", host_cache_memory="4GiB",
          max_model_len=hist + 512)
rng = random.Random(1)
p = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
first = [f"session {i}: " + text_of(llm.tokenizer, rng, hist) for i in range(n)]
second = [f"and then {i}? " + text_of(llm.tokenizer, rng, 64) for i in range(n)]
sessions = [llm.session(session_id=f"r{i:02d}", sampling=p) for i in range(n)]
lock = threading.Lock()
def emit(obj):
    with lock:
        sys.stdout.write(json.dumps(obj) + "\n"); sys.stdout.flush()
def run(msgs, rnd):
    def agent(k):
        for i in range(k, n, 8):
            sessions[i].send(msgs[i])
            emit({"round": rnd, "sid": sessions[i].session_id,
                  "held": sessions[i].num_cached_tokens})
    ts = [threading.Thread(target=agent, args=(k,)) for k in range(8)]
    [t.start() for t in ts]; [t.join() for t in ts]
    wb = llm._rt.writeback
    emit({"writeback": {"bytes": wb.bytes_written, "busy_s": wb.busy_s,
                        "blocks": wb.blocks_written, "dropped": wb.dropped}, "round": rnd})
run(first, 1)
run(second, 2)
emit({"done": True})
sys.stdin.readline()
"""


def turn_messages(tokenizer, sessions: int, turns: int) -> list[list[dict]]:
    rng = random.Random(0)
    return [[{"role": "user" if t % 2 == 0 else "tool",
              "content": f"agent {i} turn {t}: " + text_of(tokenizer, rng, 120)}
             for t in range(turns)] for i in range(sessions)]


def open_agents(model: Path, sd: Path, durability: str, sessions: int, turns: int):
    """(the engine, its agents' sessions, their messages: [agent][turn])."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    llm = LLM(model, session_dir=sd, durability=durability, kv_cache_memory="2GiB")
    rng = random.Random(7)
    system = "You are a coding agent. " + text_of(llm.tokenizer, rng, 1000)
    convs = turn_messages(llm.tokenizer, sessions, turns)
    opened = [llm.session(session_id=f"a{i}", system=system, sampling=params)
              for i in range(sessions)]
    return llm, opened, convs


def agent_run(model: Path, sd: Path, durability: str, sessions: int, turns: int) -> dict:
    shutil.rmtree(sd, ignore_errors=True)
    llm, opened, convs = open_agents(model, sd, durability, sessions, turns)
    try:
        def agent(i):
            for msg in convs[i]:
                opened[i].send(msg)

        makespan = in_threads(agent, sessions)
        # the machine's load while it ran (others' processes share the 2 cores)
        out = {"makespan_s": makespan, "loadavg_1min": os.getloadavg()[0]}
        j, wb = llm._rt.journal, llm._rt.writeback
        if j is not None:
            out |= {"log_records": j.records, "fsync_batches": j.batches,
                    "records_per_batch": j.records / max(j.batches, 1),
                    "commit_s_total": j.commit_s,
                    "commit_ms_per_batch": 1e3 * j.commit_s / max(j.batches, 1),
                    "commit_cpu_s": j.cpu_s, "writeback_cpu_s": wb.cpu_s,
                    "writeback_gather_s": wb.gather_s, "writeback_busy_s": wb.busy_s,
                    "writeback_blocks": wb.blocks_written,
                    "writeback_mib": wb.bytes_written / 2**20, "writeback_dropped": wb.dropped}
        t0 = time.perf_counter()
    finally:
        llm.close()
    out["close_s"] = time.perf_counter() - t0
    return out


def serve_rounds(model: Path, sd: Path, durability: str, sessions: int, turns: int) -> None:
    """Child process of the paired measurement (common.RoundsProcess): the agent workload
    of agent_run, one round (every agent's turn t, the agents in threads) per request."""
    llm, opened, convs = open_agents(model, sd, durability, sessions, turns)

    def run_round(t: int) -> float:
        return in_threads(lambda i: opened[i].send(convs[i][t]), sessions)

    answer_rounds(run_round)
    wb = llm._rt.writeback
    print(json.dumps({} if wb is None else {
        "writeback_cpu_s": wb.cpu_s, "writeback_gather_s": wb.gather_s,
        "writeback_mib": wb.bytes_written / 2**20}), flush=True)
    llm.close()


def paired_rounds(model: Path, root: Path, sessions: int, turns: int, run: int,
                  timeout_s: float = 600) -> dict:
    """durability="turn" and "close" turn by turn, interleaved: each in its own process,
    every agent's turn t in one mode then in the other (which goes first alternating each
    turn), each mode's makespan the sum of its turns. A change of the shared cores' speed,
    which here is often larger than the 5% target within a minute, hits both alike (free-
    running runs back to back differed by -22% to +39% with nothing changed). The
    write-behind's work left when a turn ends runs during the next turn, which is the
    other mode's every other turn: at most its writer CPU (reported) is counted there."""
    children = {}
    for mode in ("close", "turn"):
        sd = root / f"paired-{mode}"
        shutil.rmtree(sd, ignore_errors=True)
        children[mode] = RoundsProcess(__file__, [
            "--serve-rounds", mode, "--model", str(model), "--rounds-dir", str(sd),
            "--sessions", str(sessions), "--turns", str(turns)], timeout_s)
    try:
        for child in children.values():
            child.read()  # ready
        turn_s = {m: [] for m in children}
        cpu = dict.fromkeys(children, 0.0)
        for t in range(turns):
            order = ("close", "turn") if (t + run) % 2 == 0 else ("turn", "close")
            for mode in order:
                r = children[mode].ask(t)
                turn_s[mode].append(r["elapsed_s"])
                cpu[mode] += r["user_cpu_s"]
        stats = {m: c.ask(None) for m, c in children.items()}
    finally:
        for child in children.values():
            child.close()
    span = {m: sum(v) for m, v in turn_s.items()}
    return {"turn_s": turn_s, "makespan_s": span, "user_cpu_s": cpu,
            "writeback": stats["turn"], "overhead": span["turn"] / span["close"] - 1}


def seq_write_limit(root: Path, nbytes: int = 512 << 20) -> dict:
    """Sequential write bandwidth of the file system under `root` (bytes/s), written the
    way the write-behind writes: 8 MiB writes, fdatasync every 64 MiB and at the end;
    through the page cache and with O_DIRECT (what the write-behind uses), the disk's limit
    being the faster of the two."""
    import mmap

    from kvsession.tiers.direct_io import O_DIRECT

    path = root / "seqwrite.tmp"
    buf = mmap.mmap(-1, 8 << 20)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(8 << 20))
    out = {}
    for mode, extra in (("buffered", 0), ("direct", O_DIRECT)):
        if mode == "direct" and not O_DIRECT:
            continue
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | extra, 0o644)
        except OSError:  # a file system without O_DIRECT
            continue
        try:
            t0 = time.perf_counter()
            for i in range(nbytes // len(buf)):
                os.pwrite(fd, buf, i * len(buf))
                if i % 8 == 7:
                    os.fdatasync(fd)
            os.fdatasync(fd)
            out[mode] = nbytes / (time.perf_counter() - t0)
        finally:
            os.close(fd)
            path.unlink()
    out["limit"] = max(out.values())
    return out


def writeback_drain(root: Path, mib: int = 512, sessions: int = 8) -> dict:
    """The write-behind's bandwidth with a backlog: mid-model KV blocks (random bytes) of
    `sessions` sessions, held through the real cache manager, handed over at once."""
    import torch

    from kvsession.cache.block_pool import BlockPool
    from kvsession.cache.eviction import EvictionPolicy
    from kvsession.cache.identity import StorageIdentity
    from kvsession.cache.kv_pool import KVPool
    from kvsession.cache.manager import KVCacheManager, SessionKV, Transient

    layers, heads, dim, bs = 8, 4, 64, 16  # bench/common.MID_SIZE, float32 KV
    block_bytes = 2 * layers * bs * heads * dim * 4
    per = (mib << 20) // block_bytes // sessions
    pool = BlockPool(per * sessions, bs, True, EvictionPolicy.COST)
    kv = KVPool(layers, per * sessions, bs, heads, dim, torch.float32, torch.device("cpu"))
    kv.k.normal_()
    kv.v.normal_()
    manager = KVCacheManager(pool, kv)
    hasher = StorageIdentity("bench", "float32", bs).hasher()
    identity = StorageIdentity("bench", "float32", bs, "t", "t", layers, heads, dim, ("k", "v"))
    wb = WriteBehind(DiskTier(root / "drain"), identity, SnapshotLocks())
    wb.MAX_QUEUED_BYTES = 2 * (mib << 20)
    rng = random.Random(5)
    held = []
    for i in range(sessions):
        staged = Transient()
        manager.allocate_slots(staged, per)
        tokens = [rng.randrange(32000) for _ in range(per * bs)]
        s = SessionKV(f"d{i}", meta=dict)
        manager.checkin(s, staged, tokens, hasher.extend([], tokens, len(tokens), None))
        held.append(s)
    t0 = time.perf_counter()
    for s in held:
        wb.after_turn(s, kv.tensors())
    gather_s = time.perf_counter() - t0
    wb.request(WriteOp.FLUSH, None).result(timeout=600)
    wall = time.perf_counter() - t0
    wb.close()
    for s in held:
        manager.release(s)
    shutil.rmtree(root / "drain", ignore_errors=True)
    return {"bytes": wb.bytes_written, "wall_s": wall, "gather_s": gather_s,
            "writer_cpu_s": wb.cpu_s, "bytes_per_s": wb.bytes_written / wall}


def quiesce(llm) -> None:
    """Wait until the engine's write-behind has written what it was given (a closed
    session's last turn, say), so that the next timed probe does not share the cores or the
    disk with it."""
    wb = llm._rt.writeback
    if wb is not None:
        wb.request(WriteOp.FLUSH, None).result(timeout=300)


def drop_from_page_cache(sd: Path, sid: str) -> None:
    for suffix in (".log", ".seg", ".kvs"):
        p = sd / f"{sid}{suffix}"
        if p.exists():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def recovery(model: Path, root: Path, n: int, hist: int, probes: int) -> dict:
    sd = root / "killed"
    shutil.rmtree(sd, ignore_errors=True)
    bench_dir = str(Path(__file__).resolve().parent)
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(model), str(sd), str(n),
                             str(hist), bench_dir], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    held1, held2, wb = {}, {}, {}
    t0 = time.perf_counter()
    for line in proc.stdout:
        obj = json.loads(line)
        if "sid" in obj:
            (held1 if obj["round"] == 1 else held2)[obj["sid"]] = obj["held"]
        if "writeback" in obj:
            wb[obj["round"]] = obj["writeback"]
        if "done" in obj:
            break
    child_s = time.perf_counter() - t0
    proc.send_signal(signal.SIGKILL)  # right after the last reply of the second round
    proc.wait(60)
    assert len(held1) == n, "the child did not finish its first round"

    # the sessions are opened by a fresh process, as after a crash (this one has run
    # engines of its own before: their leftovers are not a restarted app's)
    out = subprocess.run([sys.executable, __file__, "--probe-recovery", str(sd),
                          "--model", str(model), "--recover-sessions", str(n),
                          "--history", str(hist), "--probes", str(probes)],
                         capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise RuntimeError("the recovery probe failed:\n" + out.stderr[-3000:])
    probed = json.loads(out.stdout.strip().splitlines()[-1])
    # KV reused against what each session held one turn before the kill (after round 1;
    # round 2's blocks may still have been queued for write-behind), and at the kill
    reuse = probed.pop("reuse")
    earlier = [min(1.0, c / held1[sid]) for c, sid in reuse]
    at_kill = [c / held2[sid] for c, sid in reuse if sid in held2]
    r1 = wb.get(2) or wb.get(1)
    return {
        "sessions": n, "history_tokens": hist, "child_run_s": child_s, **probed,
        "kv_reused_fraction_mean": statistics.mean(earlier),
        "kv_reused_fraction_min": min(earlier),
        "kv_reused_vs_held_at_kill_mean": statistics.mean(at_kill),
        "writeback": r1,
        "writeback_bytes_per_s": r1["bytes"] / max(r1["busy_s"], 1e-9),
    }


def probe_recovery(model: Path, sd: Path, n: int, hist: int, probes: int) -> dict:
    """In a fresh process: recover the killed directory, list it, resume sessions and
    time their first token against re-prefilling the same kind of history."""
    # start-up recovery (stale locks, torn tails, temporaries) and the listing, on their
    # own: LLM() also allocates the KV pools, which says nothing about recovery
    t0 = time.perf_counter()
    disk = DiskTier(sd)
    recover_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    listed = sorted(disk.scan())
    list_s = time.perf_counter() - t0
    assert len(listed) == n, listed
    t0 = time.perf_counter()
    llm = LLM(model, session_dir=sd, kv_cache_memory="2GiB", host_cache_memory="4GiB",
              max_model_len=hist + 512)
    try:
        start_s = time.perf_counter() - t0
        assert llm.sessions() == listed
        rng = random.Random(3)
        resumed_ttft, cold_ttft, reprefill_ttft, attach, reuse = [], [], [], [], []
        resumed, reprefilled = listed[0:2 * probes:2], listed[1:2 * probes:2]
        histories = {}
        for sid in listed:  # the KV each resume attaches; the re-prefilled histories' text
            if sid not in resumed:
                s = llm.session(session_id=sid)
                reuse.append((s.num_cached_tokens, sid))
                if sid in reprefilled:
                    histories[sid] = s.messages
                s.close()
        quiesce(llm)
        for k, (sid, other) in enumerate(zip(resumed, reprefilled, strict=True)):
            # resumed: log replay, KV attached, loaded from disk, the rest prefilled
            cold = k % 2 == 1
            if cold:
                drop_from_page_cache(sd, sid)
            msg = "next step: " + text_of(llm.tokenizer, rng, 32)
            t0 = time.perf_counter()
            s = llm.session(session_id=sid)
            attach_s = time.perf_counter() - t0
            reuse.append((s.num_cached_tokens, sid))
            r = s.send(msg, max_tokens=1)
            assert r.restored_from == "disk", r.restored_from
            (cold_ttft if cold else resumed_ttft).append(attach_s + r.metrics.ttft_s)
            attach.append(attach_s)
            s.close()
            quiesce(llm)
            # the same kind of history, recomputed from its text
            msg = "next step: " + text_of(llm.tokenizer, rng, 32)
            out = llm.chat(histories[other] + [{"role": "user", "content": msg}],
                           SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
            reprefill_ttft.append(out[0].metrics.ttft_s)
            quiesce(llm)
    finally:
        llm.close()
    return {
        "probes": 2 * probes, "recover_s": recover_s, "list_s": list_s,
        "llm_start_s": start_s, "reuse": reuse,
        "ttft_resumed_s": statistics.median(resumed_ttft),
        "ttft_resumed_cold_s": statistics.median(cold_ttft),
        "ttft_reprefill_s": statistics.median(reprefill_ttft),
        "ttft_speedup": statistics.median(reprefill_ttft) / statistics.median(resumed_ttft),
        "ttft_speedup_cold": statistics.median(reprefill_ttft) / statistics.median(cold_ttft),
        "ttft_resumed_all_s": resumed_ttft, "ttft_resumed_cold_all_s": cold_ttft,
        "ttft_reprefill_all_s": reprefill_ttft, "attach_all_s": attach,
    }


def plot(result: dict) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.6))
    a = result["agent"]
    x = range(len(a["paired"]))
    for k, mode in enumerate(("close", "turn")):
        ax1.bar([i + 0.4 * k for i in x], [p["makespan_s"][mode] for p in a["paired"]],
                width=0.4, label=f'durability="{mode}"')
    ax1.set_xticks([i + 0.2 for i in x], [f"run {i + 1}\n{p['overhead']:+.1%}"
                                          for i, p in enumerate(a["paired"])])
    ax1.set_ylabel("agent workload makespan (s)")
    ax1.set_xlabel("paired runs (turn by turn interleaved)", fontsize=8)
    ax1.set_title(f"overhead {a['makespan_overhead']:+.1%} (median, turn by turn "
                  f"interleaved)", fontsize=9)
    ax1.legend(fontsize=8)
    rounds = result["drain_rounds"]
    x = range(len(rounds))
    ax2.bar([i for i in x], [r["seq_write_bytes_per_s"] / 1e9 for r in rounds], width=0.4,
            label="sequential write (8 MiB writes)")
    ax2.bar([i + 0.4 for i in x], [r["drain"]["bytes_per_s"] / 1e9 for r in rounds],
            width=0.4, label="write-behind (512 MiB backlog)")
    ax2.set_xticks([i + 0.2 for i in x], [f"round {i + 1}" for i in x])
    ax2.set_ylabel("GB/s")
    ax2.set_title(f"write-behind {result['writeback_fraction_of_seq_write']:.2f} of the "
                  f"limit (median of rounds)", fontsize=9)
    ax2.legend(fontsize=8)
    save_figure(fig, "durability")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    # 9: one turn's ratio swings 0.83-1.42 here, a 6-turn run's -5% to +12% (5-run medians
    # fell at +0.1% and +7.4% with the code unchanged); the median of 9 halves that spread
    ap.add_argument("--paired-runs", type=int, default=9,
                    help="paired measurements (the two modes interleaved turn by turn)")
    ap.add_argument("--repeat", type=int, default=2,
                    help="pairs of free-running agent runs, back to back")
    ap.add_argument("--drain-rounds", type=int, default=5)
    ap.add_argument("--plot", action="store_true")
    ap.add_argument("--recover-sessions", type=int, default=64)
    ap.add_argument("--history", type=int, default=2000)
    ap.add_argument("--probes", type=int, default=12)
    ap.add_argument("--tiny", action="store_true", help="the tiny model (a smoke run)")
    ap.add_argument("--dir", type=Path, default=None, help="where session_dirs go "
                    "(default: a temporary directory on the same disk as the repo)")
    ap.add_argument("--serve-rounds", choices=("turn", "close"), default=None,
                    help=argparse.SUPPRESS)  # the paired measurement's child
    ap.add_argument("--model", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--probe-recovery", type=Path, default=None,
                    help=argparse.SUPPRESS)  # the recovery part's fresh process
    ap.add_argument("--rounds-dir", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_rounds:
        serve_rounds(args.model, args.rounds_dir, args.serve_rounds, args.sessions, args.turns)
        return
    if args.probe_recovery:
        print(json.dumps(probe_recovery(args.model, args.probe_recovery,
                                        args.recover_sessions, args.history, args.probes)))
        return
    root = Path(tempfile.mkdtemp(prefix="kvs-durability-", dir=args.dir))
    model = make_tiny_model(root / "tiny") if args.tiny else mid_model()
    try:
        # recovery first: its probes (~0.1 s each, a third of it a disk read) took 167-283
        # ms after the agent runs, against 94-136 ms in a run of its own minutes later
        os.sync()
        rec = recovery(model, root, args.recover_sessions, args.history, args.probes)
        paired = []
        for run in range(args.paired_runs):
            os.sync()
            paired.append(paired_rounds(model, root, args.sessions, args.turns, run))
            p = paired[-1]
            print(f"paired run {run + 1}: turn {p['makespan_s']['turn']:.2f} s, close "
                  f"{p['makespan_s']['close']:.2f} s: {p['overhead']:+.1%}", flush=True)
        overhead = statistics.median(p["overhead"] for p in paired)
        runs = {"turn": [], "close": []}
        ratios = []
        for p in range(args.repeat):  # pairs: machine noise hits both of a pair alike
            pair = {}
            for mode in ("close", "turn") if p % 2 == 0 else ("turn", "close"):
                os.sync()  # the run before's files are on the disk, not written back now
                pair[mode] = agent_run(model, root / f"agent-{mode}", mode, args.sessions,
                                       args.turns)
                runs[mode].append(pair[mode])
                print(mode, {k: round(v, 3) for k, v in pair[mode].items()}, flush=True)
            ratios.append(pair["turn"]["makespan_s"] / pair["close"]["makespan_s"])
        best = {m: min(r, key=lambda x: x["makespan_s"]) for m, r in runs.items()}
        best_overhead = best["turn"]["makespan_s"] / best["close"]["makespan_s"] - 1
        # what durability adds, accounted: each turn waits for its log batch; the engine
        # thread gathers the new blocks; the writer's and commit thread's CPU time is
        # taken from the cores the engine computes on
        cores = os.cpu_count() or 1
        accounted = statistics.median(
            (r["commit_ms_per_batch"] * 1e-3 * args.turns + r["writeback_gather_s"]
             + (r["writeback_cpu_s"] + r["commit_cpu_s"]) / cores) / r["makespan_s"]
            for r in runs["turn"])
        rounds = []
        os.sync()
        writeback_drain(root)  # warm-up, not counted: a process's first drain pays its
        # first touches (in one run 0.34 GB/s, its writer 1.0 s of CPU against 0.16-0.2)
        for _ in range(args.drain_rounds):
            # what earlier parts left dirty (GBs of session files) would be written back
            # during the measurements: flushed first, in every round
            os.sync()
            limit = seq_write_limit(root)
            os.sync()
            rounds.append({"seq_write_bytes_per_s": limit["limit"], "seq_write": limit,
                           "drain": writeback_drain(root)})
            rounds[-1]["ratio"] = rounds[-1]["drain"]["bytes_per_s"] / limit["limit"]
            print("drain", {k: round(v / 1e9, 3) for k, v in (
                *limit.items(), ("drain", rounds[-1]["drain"]["bytes_per_s"]))},
                flush=True)
        limit = max(r["seq_write_bytes_per_s"] for r in rounds)
        drain = max((r["drain"] for r in rounds), key=lambda d: d["bytes_per_s"])
        best_vs_best = drain["bytes_per_s"] / limit
        fraction = statistics.median(r["ratio"] for r in rounds)
        print(json.dumps(rec, indent=1))
        result = {
            "model": "tiny" if args.tiny else "mid",
            "agent": {"sessions": args.sessions, "turns": args.turns, "runs": runs,
                      "paired": paired, "makespan_overhead": overhead,
                      "pair_ratios": ratios,
                      "makespan_overhead_free_pairs": statistics.median(ratios) - 1,
                      "makespan_overhead_best_vs_best": best_overhead,
                      "accounted_overhead": accounted, "target_overhead": 0.05},
            "recovery": rec, "targets": {"ttft_speedup": 10.0, "kv_reused_fraction": 0.9,
                                         "writeback_fraction": 0.7},
            "disk_seq_write_bytes_per_s": limit,
            "writeback_drain": drain, "drain_rounds": rounds,
            "writeback_fraction_of_seq_write": fraction,
            "writeback_fraction_best_vs_best": best_vs_best,
            "writeback_crc32": crc32.__module__,
            "writeback_in_workload_fraction": rec["writeback_bytes_per_s"] / limit,
        }
        write_result("durability", result)
        if args.plot:
            plot(result)
        print(f"makespan overhead {overhead:+.1%} (median of {len(paired)} paired runs: "
              + ", ".join(f"{p['overhead']:+.1%}" for p in paired)
              + f"; free-running pairs: median {statistics.median(ratios) - 1:+.1%}, best vs "
              f"best {best_overhead:+.1%}; accounted {accounted:.1%}; target <= 5%); "
              f"TTFT resumed {rec['ttft_resumed_s'] * 1e3:.0f} ms (cold "
              f"{rec['ttft_resumed_cold_s'] * 1e3:.0f} ms) vs re-prefill "
              f"{rec['ttft_reprefill_s'] * 1e3:.0f} ms = {rec['ttft_speedup']:.1f}x (cold "
              f"{rec['ttft_speedup_cold']:.1f}x; target >= 10x); KV reused "
              f"{rec['kv_reused_fraction_mean']:.1%} (min "
              f"{rec['kv_reused_fraction_min']:.1%}; target >= 90%); write-behind "
              f"{fraction:.2f} of sequential write (median of rounds; best vs best "
              f"{best_vs_best:.2f}; target >= 0.7); list "
              f"{rec['list_s'] * 1e3:.1f} ms after {rec['recover_s'] * 1e3:.0f} ms of recovery")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
