"""Object-store tier: a prefix restored from an object store, and shared across replicas.

The object store (`LLM(object_store="s3://..." | "file://...")`, kvsession/tiers/
object_store.py) keeps cached KV blocks used at least twice, content-addressed, as the
device (or host) evicts them; any process that names the same store lists it at start-up
and loads a matching prefix from it on the copier instead of computing it. The S3 server is
moto's (`python -m moto.server`), run as a process of its own on 127.0.0.1 (it does not
share a GIL with the engine, but it shares the VM's 2 cores).

`--part restore`: one 4,096-token document (seeded random token ids) plus a 64-token
question, 16 output tokens (greedy, ignore_eos), the mid-size model (bench/common.py),
max_model_len 4,176, a device pool of 4,608 tokens, no host tier (`host_cache_memory=0`).
Per configuration, in fresh processes: a "writer" computes the document (two prompts share
it, so its blocks are used twice), pushes it off the device with unrelated ~4,100-token
prompts (two; with a disk cache, more until the cache holds the whole document: the
device's frequency order keeps its head a while), and closes (its queued uploads stored);
then a "reader" (nothing on its device) sends one 256-token warm-up prompt, then document +
question, and records the TTFT, the prompt tokens it computed and the tokens hit per tier.
Configurations:
- recompute: a reader with no tier below the device (no writer: it would leave nothing);
- disk: `session_dir` + `disk_cache_memory` in both processes (the disk cache);
- s3: `object_store` on the moto server (a fresh bucket prefix per round), no session_dir;
- file: `object_store="file://<tmpdir>"` (obstore's local store).
Reports per configuration: TTFT median (range), its ratio to recompute's, prompt tokens
computed, hit tokens per tier, and the effective load bandwidth: bytes the tier read /
the load's time as the engine measured it (its rate estimate for that tier, plus the store's
first-byte latency for an object store; bytes / TTFT where there is none), against a plain
read of as many bytes from a local file, measured in the reader right after (the file
written, nothing dropped from the page cache: the best a local copy can do). A reader that
hit nothing in its tier is warned about (the cost model chose to compute, or the writer's
blocks never got there).

`--part replicas`: the RAG part of bench/shared_tiers.py's trace (its `trace`, the disk
workload's draw: 10 shared 2,048-token documents, Zipf popularity, 64-token questions,
16-token answers, Poisson arrivals with a 0.8 s mean gap), its first 48 requests dealt
round-robin (no affinity) to 2 replica processes that run at the same time, each one on
one thread (a core of the VM each), a device pool of 8,192 tokens and a host tier of
8,192 tokens (documents get evicted), up to 4 requests in flight per replica.
Configurations:
- alone: no object store: each replica computes whatever it does not hold;
- shared: both on the same moto bucket prefix (a fresh one per round): what one replica's
  device evicts after two uses goes there, the other finds it at its next listing (5 s).
Reports prompt tokens computed (both replicas), object-store hit tokens, TTFT p50 / p99
over all requests, the makespan (the common start to the last answer), the bytes both
replicas put in the store, and shared / alone.

`--part sessions`: a session whose first turn carries a ~4,096-token message, written on one
"machine" (a process with its own KVSESSION_CACHE) and closed (its snapshot persisted), then
its next turn (a 64-token message) sent by a fresh process. Configurations:
- recompute: the same conversation as one stateless chat request (its history computed);
- disk: the same machine and session_dir (a local directory): the snapshot's KV loaded;
- s3: `session_dir="s3://..."` on the moto server, the reader on another machine (its own
  KVSESSION_CACHE, nothing local): the snapshot fetched from the store, then loaded;
- s3-here: the same store, the reader on the writer's machine: its files carry the store
  versions it last synced, so the resume's conditional gets read nothing and the local
  snapshot is loaded (before they did, it fetched the whole snapshot as 's3' does).
Reports the resume (`llm.session(session_id=...)`: the fetch from the store, the snapshot's
header), the turn's TTFT (the KV loaded or computed), their sum, and its ratio to recompute.

Each configuration runs in fresh processes; medians of `--rounds` rounds with their range,
the order of the configurations rotating between rounds. `--quick`: tiny sizes (512-token
document, 12 requests over 512-token documents), one round, for a smoke test. JSON:
bench/results/object_store.json; `--plot`: bench/results/object_store.png (and a copy in
docs/img/).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import (
    MID_SIZE,
    RESULTS,
    median_range,
    mid_model,
    pyplot,
    save_figure,
    text_of,
    write_result,
)

ROOT = Path(__file__).resolve().parents[1]
BUCKET = "kvs-bench"
# the mid model's float32 KV bytes per token
BPT = 2 * MID_SIZE["num_hidden_layers"] * MID_SIZE["num_key_value_heads"] \
    * MID_SIZE["head_dim"] * 4
OUT_TOKENS = 16
BLOCK_TOKENS = 16  # the engine's default block_size
WARMUP_TOKENS = 256  # the reader's first prompt (the process's first long prefill)
RESTORE_CONFIGS = ("recompute", "disk", "s3", "file")
REPLICA_CONFIGS = ("alone", "shared")
SIZES = {
    # restore: document, question, device pool, unrelated prompts pushing it off (at least,
    # at most; tokens each), max_model_len; replicas: requests, document / question tokens (a prefix
    # of the trace's), device and host tokens per replica, requests in flight per replica
    "full": {"doc": 4096, "question": 64, "pool": 4608, "floods": (2, 6), "flood": 4096,
             "max_len": 4096 + 64 + OUT_TOKENS, "requests": 48, "rag_doc": 2048,
             "rag_question": 64, "device": 8192, "host": 8192, "in_flight": 4},
    "quick": {"doc": 512, "question": 16, "pool": 640, "floods": (2, 6), "flood": 512,
              "max_len": 512 + 16 + OUT_TOKENS, "requests": 12, "rag_doc": 512,
              "rag_question": 16, "device": 2048, "host": 2048, "in_flight": 4},
}


def params():
    from kvsession import SamplingParams

    return SamplingParams(max_tokens=OUT_TOKENS, temperature=0.0, ignore_eos=True)


def gen(llm, ids: list[int], sp=None):
    return llm.generate(prompt_token_ids=[ids], sampling_params=sp or params(),
                        use_tqdm=False)[0]


# ---- the S3 server --------------------------------------------------------------------------

class MotoServer:
    """moto's S3 server as a process of its own on a free port of 127.0.0.1, one bucket."""

    def __init__(self):
        import boto3

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                                      "-p", str(port)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        self.endpoint = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(self.endpoint, timeout=2).close()
                break
            except urllib.error.HTTPError:
                break  # it answers
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError("the moto S3 server did not start") from None
                time.sleep(0.2)
        self.client = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                                   aws_access_key_id="x", aws_secret_access_key="y")
        self.client.create_bucket(Bucket=BUCKET)
        self.options = {"endpoint": self.endpoint, "region": "us-east-1",
                        "access_key_id": "x", "secret_access_key": "y", "allow_http": True}

    def objects(self, prefix: str) -> int:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET,
                                                                      Prefix=prefix)
        return sum(len(page.get("Contents", [])) for page in pages)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ---- children ---------------------------------------------------------------------------------

def tier_hits(st) -> dict:
    return {"device": st.prefix.hit_tokens, "host": st.tiers["host"].hit_tokens or 0,
            "disk": st.tiers["disk"].hit_tokens or 0,
            "object": st.tiers["object"].hit_tokens if "object" in st.tiers else 0}


def restore_texts(sz: dict, seed: int) -> dict:
    """Part 1's token ids: the document, the writer's two questions, the reader's, the
    unrelated prompts (another id range), the reader's warm-up."""
    rng = random.Random(seed)

    def ids(n, lo=4, hi=500):
        return [rng.randrange(lo, hi) for _ in range(n)]
    return {"doc": ids(sz["doc"]), "writer_q": [ids(sz["question"]), ids(sz["question"])],
            "question": ids(sz["question"]),
            "floods": [ids(sz["flood"], 500, 30000) for _ in range(sz["floods"][1])],
            "warmup": ids(WARMUP_TOKENS, 500, 30000)}


def writer(job: dict) -> dict:
    """Compute the document twice over (its blocks used twice), push it off the device with
    unrelated prompts, close (what is queued for the object store is stored). The disk
    cache gets only the blocks the device evicts (the object store also gets their cached
    ancestors), and the device's frequency order keeps the document's head until the
    unrelated prompts have aged it: with a disk cache, more prompts until it holds the
    whole document."""
    from kvsession import LLM

    sz, t = job["sizes"], restore_texts(job["sizes"], job["seed"])
    llm = LLM(job["model"], **job["llm"])
    first = gen(llm, t["doc"] + t["writer_q"][0])
    again = gen(llm, t["doc"] + t["writer_q"][1])
    floods = 0
    for ids in t["floods"]:
        if floods >= sz["floods"][0] and (job["tier"] != "disk" or llm.stats().tiers[
                "disk"].cached_blocks >= sz["doc"] // BLOCK_TOKENS):
            break
        gen(llm, ids)
        floods += 1
    st = llm.stats()
    t0 = time.perf_counter()
    llm.close()
    obj = st.tiers.get("object")
    return {"doc_ttft_s": first.metrics.ttft_s, "doc_cached_again": again.num_cached_tokens,
            "floods": floods,
            "device_evictions": st.prefix.evictions, "close_s": time.perf_counter() - t0,
            "disk_cached_blocks": st.tiers["disk"].cached_blocks,
            "object_bytes_written": obj.bytes_written if obj else 0, "doc_tokens": sz["doc"]}


def plain_read_bytes_per_s(num_bytes: int, directory: str) -> float:
    """A local file of `num_bytes` written, then read back (page cache warm, nothing
    dropped): the median of 3 reads."""
    path = Path(directory) / "plain-read.bin"
    path.write_bytes(os.urandom(num_bytes))
    buf = bytearray(num_bytes)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            got = f.readinto(buf)
        times.append(time.perf_counter() - t)
        assert got == num_bytes
    path.unlink()
    return num_bytes / statistics.median(times)


def engine_load_s(st, tier: str, num_bytes: int) -> float | None:
    """The load's seconds as the engine measured them (`stats().tiers[tier]`: the rate the
    cost model learned, and an object store's first-byte latency); None before any load
    was timed."""
    ts = st.tiers[tier]
    if not num_bytes or not ts.read_bytes_per_s:
        return None
    return ts.latency_s + num_bytes / ts.read_bytes_per_s


def reader(job: dict) -> dict:
    """A fresh process: a warm-up prompt, then document + question; what it computed, hit
    and read, and a plain file read of as many bytes."""
    from kvsession import LLM

    sz, t = job["sizes"], restore_texts(job["sizes"], job["seed"])
    llm = LLM(job["model"], **job["llm"])
    gen(llm, t["warmup"])
    st0 = llm.stats()
    out = gen(llm, t["doc"] + t["question"])
    st = llm.stats()
    h0, h1 = tier_hits(st0), tier_hits(st)
    hits = {k: h1[k] - h0[k] for k in h1}
    tier = job["tier"]
    num_bytes = 0
    if tier is not None:
        num_bytes = st.tiers[tier].bytes_read - (st0.tiers[tier].bytes_read or 0)
    load_s = engine_load_s(st, tier, num_bytes) if tier else None
    llm.close()
    res = {"ttft_s": out.metrics.ttft_s, "prefill_tokens": st.prefill_tokens
           - st0.prefill_tokens, "cached_tokens": out.num_cached_tokens,
           "prompt_tokens": sz["doc"] + sz["question"], "bytes_read": num_bytes,
           "load_s": load_s,
           **{f"{k}_hit_tokens": v for k, v in hits.items()}}
    if num_bytes:
        res["load_bytes_per_s"] = num_bytes / (load_s if load_s else out.metrics.ttft_s)
        res["plain_read_bytes_per_s"] = plain_read_bytes_per_s(num_bytes, job["scratch"])
        res["load_vs_plain_read"] = res["load_bytes_per_s"] / res["plain_read_bytes_per_s"]
    return res


def replica(job: dict) -> dict:
    """One of the two replicas: its share of the RAG trace (every other request), at the
    trace's arrival times from the start the parent sends."""
    import torch

    torch.set_num_threads(1)  # one core of the VM per replica
    from shared_tiers import WORKLOADS, trace

    from kvsession import LLM
    from kvsession.metrics import percentile

    sz = job["sizes"]
    llm = LLM(job["model"], **job["llm"])
    w = trace(llm.tokenizer, WORKLOADS["disk"])
    docs = [d[:sz["rag_doc"]] for d in w["docs"]]
    rag = w["rag"][:sz["requests"]]
    mine = [(i, q) for i, q in enumerate(rag) if i % 2 == job["replica"]]
    print(json.dumps({"ready": True}), flush=True)
    start = json.loads(sys.stdin.readline())["start"]
    sp = params()
    ttfts: dict[int, float] = {}
    cached: dict[int, int] = {}

    def one(i: int, q: dict) -> None:
        out = gen(llm, docs[q["doc"]] + q["question"][:sz["rag_question"]], sp)
        ttfts[i], cached[i] = out.metrics.ttft_s, out.num_cached_tokens

    time.sleep(max(0.0, start - time.time()))
    with ThreadPoolExecutor(sz["in_flight"]) as pool:
        futures = []
        for i, q in mine:
            time.sleep(max(0.0, start + q["at_s"] - time.time()))  # the trace's arrival
            futures.append(pool.submit(one, i, q))
        for f in futures:
            f.result()
    end = time.time()
    st = llm.stats()
    t0 = time.perf_counter()
    llm.close()
    obj = st.tiers.get("object")
    return {"replica": job["replica"], "end": end, "close_s": time.perf_counter() - t0,
            "ttfts": ttfts, "cached_tokens": cached, "prefill_tokens": st.prefill_tokens,
            "object_bytes_read": obj.bytes_read if obj else 0,
            "object_bytes_written": obj.bytes_written if obj else 0,
            "object_cached_blocks": obj.cached_blocks if obj else 0,
            "ttft_p50_s": percentile(list(ttfts.values()), 50),
            **{f"{k}_hit_tokens": v for k, v in tier_hits(st).items()}}


SESSION_ID = "bench-session"


def session_texts(tokenizer, sz: dict, seed: int) -> dict:
    rng = random.Random(seed)
    return {"history": text_of(tokenizer, rng, sz["doc"]),
            "next": text_of(tokenizer, rng, sz["question"])}


def session_writer(job: dict) -> dict:
    """A fresh process (its own KVSESSION_CACHE: a machine): a session whose first turn
    carries a ~doc-token message, closed (its snapshot written, and put in the store when
    session_dir is one)."""
    from kvsession import LLM

    llm = LLM(job["model"], **job["llm"])
    t = session_texts(llm.tokenizer, job["sizes"], job["seed"])
    s = llm.session(session_id=SESSION_ID, sampling=params())
    reply = s.send(t["history"]).text
    tokens = len(s.token_ids)
    t0 = time.perf_counter()
    llm.close()  # persists the live session
    return {"history_tokens": tokens, "close_s": time.perf_counter() - t0, "reply": reply}


def session_reader(job: dict) -> dict:
    """A fresh process: the session resumed (from session_dir, fetched from the store on
    another machine) and its next turn sent; or, with no session_dir, the same conversation
    as one stateless chat request (everything computed)."""
    from kvsession import LLM

    llm = LLM(job["model"], **job["llm"])
    t = session_texts(llm.tokenizer, job["sizes"], job["seed"])
    gen(llm, list(range(10, 10 + WARMUP_TOKENS)))  # the process's first prefill
    st0 = llm.stats()
    t0 = time.perf_counter()
    if "session_dir" in job["llm"]:
        s = llm.session(session_id=SESSION_ID)
        open_s = time.perf_counter() - t0
        assert len(s.messages) == 2, s.messages
        r = s.send(t["next"])
        ttft = r.metrics.ttft_s
    else:
        open_s = 0.0
        history = job["history"]
        r = llm.chat([{"role": "user", "content": t["history"]},
                      {"role": "assistant", "content": history},
                      {"role": "user", "content": t["next"]}], params(), use_tqdm=False)[0]
        ttft = r.metrics.ttft_s
    total = time.perf_counter() - t0
    st = llm.stats()
    llm.close()
    h0, h1 = tier_hits(st0), tier_hits(st)
    return {"open_s": open_s, "ttft_s": ttft, "resume_to_first_token_s": open_s + ttft,
            "total_s": total, "prefill_tokens": st.prefill_tokens - st0.prefill_tokens,
            **{f"{k}_hit_tokens": h1[k] - h0[k] for k in h1}}


ROLES = {"writer": writer, "reader": reader, "replica": replica,
         "session_writer": session_writer, "session_reader": session_reader}


def child(role: str, job: dict, cache: str | None = None) -> dict:
    """`role` in a fresh process (`cache`: its KVSESSION_CACHE, a machine of its own);
    its result."""
    env = {**os.environ, **({"KVSESSION_CACHE": cache} if cache else {})}
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, __file__, "--role", role, "--job", json.dumps(job),
                        "--out", out.name], check=True, cwd=ROOT, env=env)
        return json.loads(Path(out.name).read_text())


# ---- part 1: restore ---------------------------------------------------------------------------

def restore_round(config: str, sz: dict, model: str, s3: MotoServer, seed: int,
                  r: int) -> dict:
    """One configuration's writer (if it has a tier) and reader."""
    base = {"max_model_len": sz["max_len"], "kv_cache_memory": sz["pool"] * BPT,
            "host_cache_memory": 0}
    scratch = tempfile.mkdtemp(prefix="kvs-objbench-")
    try:
        tier, kw, stored = None, {}, None
        if config == "disk":
            tier = "disk"
            kw = {"session_dir": str(Path(scratch) / "sessions"),
                  # slots carry a header and 4 KiB padding: the budget counts them
                  "disk_cache_memory": 2 * sz["doc"] * BPT * 5 // 4}
        elif config == "s3":
            tier = "object"
            prefix = f"restore-{r}-{uuid.uuid4().hex[:8]}"
            kw = {"object_store": f"s3://{BUCKET}/{prefix}", "object_store_options": s3.options}
        elif config == "file":
            tier = "object"
            kw = {"object_store": "file://" + str(Path(scratch) / "store")}
        job = {"model": model, "sizes": sz, "seed": seed, "tier": tier, "scratch": scratch,
               "llm": {**base, **kw}}
        wrote = child("writer", job) if tier else {}
        if config == "s3":
            stored = s3.objects(f"{prefix}/kv/")
        elif config == "file":
            stored = sum(1 for p in (Path(scratch) / "store" / "kv").rglob("*") if p.is_file())
        elif config == "disk":
            stored = wrote["disk_cached_blocks"]
        res = {"config": config, **child("reader", job), "writer": wrote,
               "blocks_stored": stored}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if tier and not res[f"{tier}_hit_tokens"]:
        print(f"WARNING: {config}: the reader hit no {tier} tokens (blocks stored by the "
              f"writer: {stored}); it computed {res['prefill_tokens']} prompt tokens",
              flush=True)
    return res


def round_order(configs: tuple[str, ...], r: int) -> tuple[str, ...]:
    """Round r's order: rotated by r, reversed every other round."""
    k = r % len(configs)
    order = configs[k:] + configs[:k]
    return order if r % 2 == 0 else order[::-1]


def part_restore(args, sz: dict, model: str, s3: MotoServer) -> dict:
    runs: dict[str, list[dict]] = {c: [] for c in RESTORE_CONFIGS}
    for r in range(args.rounds):
        for c in round_order(RESTORE_CONFIGS, r):
            res = restore_round(c, sz, model, s3, args.seed, r)
            runs[c].append(res)
            bw = res.get("load_bytes_per_s")
            print(f"restore round {r + 1} {c:9s} TTFT {res['ttft_s'] * 1e3:7.0f} ms, computed "
                  f"{res['prefill_tokens']} tokens, hits disk {res['disk_hit_tokens']} object "
                  f"{res['object_hit_tokens']}, read {res['bytes_read'] / 2**20:.1f} MiB"
                  + (f" at {bw / 1e6:.0f} MB/s (plain file read "
                     f"{res['plain_read_bytes_per_s'] / 1e6:.0f} MB/s)" if bw else ""),
                  flush=True)
    rec = statistics.median(x["ttft_s"] for x in runs["recompute"])
    summary = {}
    for c in RESTORE_CONFIGS:
        for x in runs[c]:
            x["ttft_vs_recompute"] = x["ttft_s"] / rec
        s = {k: median_range(runs[c], k) for k in
             ("ttft_s", "ttft_vs_recompute", "prefill_tokens", "device_hit_tokens",
              "disk_hit_tokens", "object_hit_tokens", "bytes_read")}
        if all("load_bytes_per_s" in x for x in runs[c]):
            for k in ("load_bytes_per_s", "plain_read_bytes_per_s", "load_vs_plain_read"):
                s[k] = median_range(runs[c], k)
        if all(x["load_s"] for x in runs[c]):
            s["load_s"] = median_range(runs[c], "load_s")
        summary[c] = s
    return {"rounds": runs, "summary": summary}


# ---- part 3: sessions -------------------------------------------------------------------------

SESSION_CONFIGS = ("recompute", "disk", "s3", "s3-here")


def sessions_round(config: str, sz: dict, model: str, s3: MotoServer, seed: int,
                   r: int) -> dict:
    """One configuration: a session written on one machine, resumed (or recomputed)."""
    base = {"max_model_len": sz["max_len"] + 2 * OUT_TOKENS + 64,
            "kv_cache_memory": sz["pool"] * 2 * BPT, "host_cache_memory": 0}
    scratch = tempfile.mkdtemp(prefix="kvs-objbench-")
    try:
        job = {"model": model, "sizes": sz, "seed": seed}
        if config == "disk":  # the same machine, the same directory
            job["llm"] = {**base, "session_dir": str(Path(scratch) / "sessions")}
            wrote = child("session_writer", job, str(Path(scratch) / "a"))
            res = child("session_reader", job, str(Path(scratch) / "a"))
        elif config in ("s3", "s3-here"):
            # s3: another machine, nothing local: the store's copy fetched; s3-here: the
            # same machine, whose copy is the store's version (conditional gets: nothing
            # read)
            url = f"s3://{BUCKET}/sessions-{r}-{uuid.uuid4().hex[:8]}"
            job["llm"] = {**base, "session_dir": url, "object_store_options": s3.options}
            wrote = child("session_writer", job, str(Path(scratch) / "a"))
            res = child("session_reader", job,
                        str(Path(scratch) / ("a" if config == "s3-here" else "b")))
        else:  # the same conversation, stateless: its history computed
            job["llm"] = {**base, "session_dir": str(Path(scratch) / "sessions")}
            wrote = child("session_writer", job, str(Path(scratch) / "a"))
            job["llm"] = base
            job["history"] = wrote["reply"]
            res = child("session_reader", job, str(Path(scratch) / "b"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {"config": config, **res, "writer": wrote}


def part_sessions(args, sz: dict, model: str, s3: MotoServer) -> dict:
    runs: dict[str, list[dict]] = {c: [] for c in SESSION_CONFIGS}
    for r in range(args.rounds):
        for c in round_order(SESSION_CONFIGS, r):
            res = sessions_round(c, sz, model, s3, args.seed, r)
            runs[c].append(res)
            print(f"sessions round {r + 1} {c:9s} open {res['open_s'] * 1e3:6.0f} ms, TTFT "
                  f"{res['ttft_s'] * 1e3:6.0f} ms, computed {res['prefill_tokens']} tokens",
                  flush=True)
    rec = statistics.median(x["resume_to_first_token_s"] for x in runs["recompute"])
    summary = {}
    for c in SESSION_CONFIGS:
        for x in runs[c]:
            x["vs_recompute"] = x["resume_to_first_token_s"] / rec
        summary[c] = {k: median_range(runs[c], k) for k in
                      ("open_s", "ttft_s", "resume_to_first_token_s", "vs_recompute",
                       "prefill_tokens")}
    return {"rounds": runs, "summary": summary}


# ---- part 2: replicas --------------------------------------------------------------------------

def replicas_round(config: str, sz: dict, model: str, s3: MotoServer, r: int) -> dict:
    """Two replica processes at once over one trace; both results combined."""
    from kvsession.metrics import percentile

    llm_kw = {"max_model_len": sz["rag_doc"] + sz["rag_question"] + OUT_TOKENS,
              "kv_cache_memory": sz["device"] * BPT,
              "host_cache_memory": sz["host"] * BPT}
    if config == "shared":
        llm_kw |= {"object_store": f"s3://{BUCKET}/replicas-{r}-{uuid.uuid4().hex[:8]}",
                   "object_store_options": s3.options}
    outs = [tempfile.NamedTemporaryFile(suffix=".json", delete=False) for _ in range(2)]
    procs = []
    try:
        for i in range(2):
            job = {"model": model, "sizes": sz, "replica": i, "llm": llm_kw}
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--role", "replica", "--job", json.dumps(job),
                 "--out", outs[i].name], cwd=ROOT, text=True, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE))
        for p in procs:  # both loaded and listed what the store holds
            for line in p.stdout:
                if line.startswith("{") and json.loads(line).get("ready"):
                    break
            else:
                raise RuntimeError(f"a replica exited with {p.wait()} before it was ready")
        start = time.time() + 0.5
        for p in procs:
            p.stdin.write(json.dumps({"start": start}) + "\n")
            p.stdin.flush()
        for p in procs:
            p.stdout.read()
            if p.wait() != 0:
                raise RuntimeError(f"a replica exited with {p.returncode}")
        reps = [json.loads(Path(o.name).read_text()) for o in outs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for o in outs:
            o.close()
            Path(o.name).unlink(missing_ok=True)
    ttfts = [t for rep in reps for t in rep["ttfts"].values()]
    return {"config": config, "makespan_s": max(rep["end"] for rep in reps) - start,
            "prefill_tokens": sum(rep["prefill_tokens"] for rep in reps),
            **{f"{k}_hit_tokens": sum(rep[f"{k}_hit_tokens"] for rep in reps)
               for k in ("device", "host", "object")},
            "object_bytes_written": sum(rep["object_bytes_written"] for rep in reps),
            "object_bytes_read": sum(rep["object_bytes_read"] for rep in reps),
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "num_requests": len(ttfts), "replicas": reps}


def part_replicas(args, sz: dict, model: str, s3: MotoServer) -> dict:
    runs: dict[str, list[dict]] = {c: [] for c in REPLICA_CONFIGS}
    keys = ("prefill_tokens", "object_hit_tokens", "device_hit_tokens", "host_hit_tokens",
            "ttft_p50_s", "ttft_p99_s", "makespan_s", "object_bytes_written")
    for r in range(args.rounds):
        for c in REPLICA_CONFIGS if r % 2 == 0 else REPLICA_CONFIGS[::-1]:
            res = replicas_round(c, sz, model, s3, r)
            runs[c].append(res)
            print(f"replicas round {r + 1} {c:6s} computed {res['prefill_tokens']} tokens, hits "
                  f"device {res['device_hit_tokens']} host {res['host_hit_tokens']} object "
                  f"{res['object_hit_tokens']}, TTFT p50 {res['ttft_p50_s'] * 1e3:.0f} p99 "
                  f"{res['ttft_p99_s'] * 1e3:.0f} ms, makespan {res['makespan_s']:.1f} s",
                  flush=True)
    summary = {c: {k: median_range(runs[c], k) for k in keys} for c in REPLICA_CONFIGS}
    ratio = {k: summary["shared"][k][0] / summary["alone"][k][0]
             for k in keys if summary["alone"][k][0]}
    return {"rounds": runs, "summary": summary, "shared_vs_alone": ratio}


# ---- report ---------------------------------------------------------------------------------

def rng3(m: tuple, scale: float = 1.0, fmt: str = ".0f") -> str:
    med, lo, hi = (x * scale for x in m)
    return f"{med:{fmt}} [{lo:{fmt}}-{hi:{fmt}}]"


def report(results: dict) -> None:
    if "sessions" in results:
        s = results["sessions"]["summary"]
        print("\nPart 3, sessions: a session written on one machine, its next turn on another")
        print(f"{'config':10s} {'open ms':>16s} {'TTFT ms':>18s} {'open + TTFT ms':>18s} "
              f"{'x recompute':>16s} {'computed':>9s}")
        for c, x in s.items():
            print(f"{c:10s} {rng3(x['open_s'], 1e3):>16s} {rng3(x['ttft_s'], 1e3):>18s} "
                  f"{rng3(x['resume_to_first_token_s'], 1e3):>18s} "
                  f"{rng3(x['vs_recompute'], 1, '.2f'):>16s} {x['prefill_tokens'][0]:9.0f}")
    if "restore" in results:
        s = results["restore"]["summary"]
        print("\nPart 1, restore: document + question, a reader with nothing on its device")
        print(f"{'config':10s} {'TTFT ms':>20s} {'x recompute':>18s} {'computed':>9s} "
              f"{'disk hit':>9s} {'obj hit':>8s} {'load ms':>16s} {'load MB/s':>16s} "
              f"{'file MB/s':>20s} {'load/file':>9s}")
        for c, x in s.items():
            bw = "load_bytes_per_s" in x
            print(f"{c:10s} {rng3(x['ttft_s'], 1e3):>20s} "
                  f"{rng3(x['ttft_vs_recompute'], 1, '.2f'):>18s} "
                  f"{x['prefill_tokens'][0]:9.0f} {x['disk_hit_tokens'][0]:9.0f} "
                  f"{x['object_hit_tokens'][0]:8.0f} "
                  f"{rng3(x['load_s'], 1e3) if 'load_s' in x else '-':>16s} "
                  f"{rng3(x['load_bytes_per_s'], 1e-6) if bw else '-':>16s} "
                  f"{rng3(x['plain_read_bytes_per_s'], 1e-6) if bw else '-':>20s} "
                  f"{x['load_vs_plain_read'][0] if bw else float('nan'):9.3f}")
    if "replicas" in results:
        s = results["replicas"]["summary"]
        print("\nPart 2, replicas: 2 replica processes, requests dealt round-robin")
        print(f"{'config':8s} {'computed':>22s} {'object hit':>20s} {'TTFT p50 ms':>18s} "
              f"{'TTFT p99 ms':>20s} {'makespan s':>18s} {'MiB uploaded':>16s}")
        for c, x in s.items():
            print(f"{c:8s} {rng3(x['prefill_tokens']):>22s} {rng3(x['object_hit_tokens']):>20s} "
                  f"{rng3(x['ttft_p50_s'], 1e3):>18s} {rng3(x['ttft_p99_s'], 1e3):>20s} "
                  f"{rng3(x['makespan_s'], 1, '.1f'):>18s} "
                  f"{rng3(x['object_bytes_written'], 2**-20):>16s}")
        ratio = results["replicas"]["shared_vs_alone"]
        print("shared / alone: " + ", ".join(f"{k} {v:.2f}" for k, v in ratio.items()))


def plot(results: dict) -> None:
    plt = pyplot()
    panels = (["restore"] if "restore" in results else []) + \
        (["computed", "ttft"] if "replicas" in results else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        if panel == "restore":
            s = results["restore"]["summary"]
            med = [s[c]["ttft_s"][0] * 1e3 for c in s]
            err = [[m - s[c]["ttft_s"][1] * 1e3 for m, c in zip(med, s, strict=True)],
                   [s[c]["ttft_s"][2] * 1e3 - m for m, c in zip(med, s, strict=True)]]
            ax.bar(list(s), med, yerr=err, capsize=4)
            ax.set_title("restore a 4k-token prefix: TTFT ms")
            continue
        s = results["replicas"]["summary"]
        if panel == "computed":
            ax.bar(list(s), [s[c]["prefill_tokens"][0] for c in s])
            ax.set_title("2 replicas: prompt tokens computed")
        else:
            for i, key in enumerate(("ttft_p50_s", "ttft_p99_s")):
                ax.bar([j + 0.4 * i for j in range(len(s))],
                       [s[c][key][0] * 1e3 for c in s], 0.4, label=key[5:8])
            ax.set_xticks([j + 0.2 for j in range(len(s))], list(s))
            ax.set_title("2 replicas: TTFT ms")
            ax.legend()
    save_figure(fig, "object_store")
    img = ROOT / "docs" / "img"
    if img.is_dir():
        shutil.copy(RESULTS / "object_store.png", img / "object_store.png")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=("restore", "replicas", "sessions", "all"),
                    default="all")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one round (a smoke test)")
    ap.add_argument("--plot", action="store_true")
    ap.add_argument("--role", choices=ROLES, help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role:
        args.out.write_text(json.dumps(ROLES[args.role](json.loads(args.job))))
        return
    if args.quick:
        args.rounds = 1
    sz = SIZES["quick" if args.quick else "full"]
    model = str(mid_model())
    s3 = MotoServer()
    results: dict = {}
    t0 = time.perf_counter()
    try:
        if args.part in ("restore", "all"):
            results["restore"] = part_restore(args, sz, model, s3)
        if args.part in ("replicas", "all"):
            results["replicas"] = part_replicas(args, sz, model, s3)
        if args.part in ("sessions", "all"):
            results["sessions"] = part_sessions(args, sz, model, s3)
    finally:
        s3.close()
    print(f"\n{args.rounds} round(s) in {time.perf_counter() - t0:.0f} s")
    report(results)
    write_result("object_store", {"sizes": sz, "quick": args.quick, "seed": args.seed,
                                  "bytes_per_token": BPT, **results})
    if args.plot:
        plot(results)


if __name__ == "__main__":
    main()
