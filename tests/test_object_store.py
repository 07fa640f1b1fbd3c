"""The object-store tier against a real S3 server (moto's, started here on 127.0.0.1):
content the host evicts after it was used more than once is put there, content-addressed;
another LLM (another replica: nothing in its device, host or disk) finds it by hash and
loads it instead of computing it; every object is verified when read, so a damaged or
foreign object is a miss; the server going away, hanging, answering errors or cut off
mid-transfer means recompute, never a hang; no credential appears in a message. Sessions
in the store (session_dir="s3://..."): resumed on another machine, after a crash too;
refused where nothing of them is here and the store cannot be read; a second writer
fenced; app files beside them. Replicas on a local Ray cluster sharing nothing but the
store. Every output is the one an engine without caching gives."""

from __future__ import annotations

import contextlib
import logging
import re
import struct
from concurrent.futures import ThreadPoolExecutor

import pytest
from internals import Internals
from test_prefix_cache import gen
from test_shared_tiers import BPT, DEVICE, G, fixed_rates, flood

from kvsession import (
    LLM,
    ConfigError,
    SamplingParams,
    SessionLockedError,
    SessionStoreError,
)
from oracle import expected_turn, random_prompts

moto_server = pytest.importorskip("moto.server")
boto3 = pytest.importorskip("boto3")
pytest.importorskip("obstore")

BUCKET = "kvs-test"
SECRET = "sEcReT-do-not-print-7f3a"  # the secret key: must never reach a message
HOST = dict(host_cache_memory=8 * 8 * BPT)  # 8 host blocks: a document cannot stay there


class S3:
    """A moto S3 server on 127.0.0.1 with one bucket."""

    def __init__(self):
        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request
        self.server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0,
                                                     verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self.client = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                                   aws_access_key_id="kvs", aws_secret_access_key=SECRET)
        self.client.create_bucket(Bucket=BUCKET)
        self.options = {"endpoint": self.endpoint, "region": "us-east-1",
                        "access_key_id": "kvs", "secret_access_key": SECRET,
                        "allow_http": True}

    def keys(self, prefix: str) -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET,
                                                                      Prefix=prefix)
        return [o["Key"] for page in pages for o in page.get("Contents", [])]

    def stop(self):
        self.server.stop()


@pytest.fixture(scope="module")
def s3():
    server = S3()
    yield server
    server.stop()


def store_llm(llama_dir, s3, prefix, **kw):
    llm = fixed_rates(LLM(llama_dir, object_store=f"s3://{BUCKET}/{prefix}",
                          object_store_options=s3.options, **{**HOST, **DEVICE, **kw}))
    ins = Internals(llm)
    ins.fix_rate("object_read", 1e12)
    ins.fix_rate("object_latency", 1e-9)
    return llm


def computed_and_stored(llama_dir, s3, prefix, doc, seed, **kw):
    """One replica computes the document, finds it once more (so it is admitted below the
    host), pushes it off the device and the host, and closes (its uploads stored).
    Returns its two outputs."""
    with store_llm(llama_dir, s3, prefix, **kw) as llm:
        out = [gen(llm, [doc + [7, 8, 9]], G)[0], gen(llm, [doc + [10, 11]], G)[0]]
        assert out[1].num_cached_tokens == len(doc) // 8 * 8
        flood(llm, seed)
        flood(llm, seed + 1)
        llm.check_integrity()
    return out


def test_a_prefix_one_replica_computed_is_loaded_by_another(llama_dir, s3):
    (doc,) = random_prompts(31, [120], 500)
    q = doc + [1, 2, 3, 4]
    first = computed_and_stored(llama_dir, s3, "share", doc, 300)
    keys = s3.keys("share/kv/")
    assert len(keys) >= 15  # the document's 15 full blocks (and the flood's reused ones)
    with store_llm(llama_dir, s3, "share") as other, \
            LLM(llama_dir, enable_prefix_caching=False, **DEVICE) as plain:
        out = gen(other, [q], G)[0]
        st = other.stats()
        assert out.num_cached_tokens == 120
        assert st.tiers["object"].hit_tokens == 120
        assert st.prefill_tokens == len(q) - 120
        assert st.tiers["object"].bytes_read >= 120 * BPT
        assert st.tiers["object"].read_bytes_per_s == 1e12  # what the cost model uses
        assert st.tiers["object"].latency_s == 1e-9
        assert out.token_ids == gen(plain, [q], G)[0].token_ids
        assert [o.token_ids for o in first] == [
            gen(plain, [p], G)[0].token_ids for p in (doc + [7, 8, 9], doc + [10, 11])]
        other.check_integrity()


def block_objects(s3, prefix, doc) -> list[str]:
    """The keys of the objects holding the document's full blocks, in order (found by the
    token ids each record's header carries)."""
    bodies = {k: s3.client.get_object(Bucket=BUCKET, Key=k)["Body"].read()
              for k in s3.keys(f"{prefix}/kv/")}
    out = []
    for i in range(len(doc) // 8):
        tokens = struct.pack("<8I", *doc[i * 8:(i + 1) * 8])
        out.append(next(k for k, body in bodies.items() if tokens in body))
    return out


def test_a_damaged_or_foreign_object_is_a_miss(llama_dir, s3):
    (doc,) = random_prompts(32, [120], 500)
    q = doc + [5, 6]
    computed_and_stored(llama_dir, s3, "damage", doc, 310)
    keys = block_objects(s3, "damage", doc)
    with LLM(llama_dir, enable_prefix_caching=False, **DEVICE) as plain:
        want = gen(plain, [q], G)[0].token_ids
    # the document's 6th block: a byte of its payload flipped
    good = s3.client.get_object(Bucket=BUCKET, Key=keys[5])["Body"].read()
    damaged = bytearray(good)
    damaged[-1] ^= 0xFF
    s3.client.put_object(Bucket=BUCKET, Key=keys[5], Body=bytes(damaged))
    with store_llm(llama_dir, s3, "damage") as llm:
        out = gen(llm, [q], G)[0]
        assert out.token_ids == want
        assert llm.stats().tiers["object"].hit_tokens == 5 * 8  # up to the damaged one
        assert out.num_cached_tokens == 5 * 8
        llm.check_integrity()
    # mended; now the 7th block's name holds the 8th block's record (a foreign block)
    s3.client.put_object(Bucket=BUCKET, Key=keys[5], Body=good)
    s3.client.copy_object(Bucket=BUCKET, Key=keys[6],
                          CopySource={"Bucket": BUCKET, "Key": keys[7]})
    with store_llm(llama_dir, s3, "damage") as llm:
        out = gen(llm, [q], G)[0]
        assert out.token_ids == want
        assert llm.stats().tiers["object"].hit_tokens == 6 * 8
        llm.check_integrity()


def test_content_reused_goes_to_the_store_before_any_eviction(llama_dir, s3):
    """The document found again on the device is put at once (while this process still
    holds it), so another process loads it; content used once is not put."""
    doc, once = random_prompts(38, [120, 120], 500)
    with store_llm(llama_dir, s3, "reuse") as llm:
        gen(llm, [doc + [7]], G)
        assert gen(llm, [doc + [8]], G)[0].num_cached_tokens == 120
        gen(llm, [once + [7]], G)
        assert llm.stats().prefix.evictions == 0
    assert len(s3.keys("reuse/kv/")) == 15  # the document's blocks, none of `once`'s
    with store_llm(llama_dir, s3, "reuse") as other, \
            LLM(llama_dir, enable_prefix_caching=False, **DEVICE) as plain:
        out = gen(other, [doc + [9]], G)[0]
        assert out.num_cached_tokens == 120
        assert out.token_ids == gen(plain, [doc + [9]], G)[0].token_ids


def test_without_a_host_tier_the_device_evicts_to_the_store(llama_dir, s3):
    (doc,) = random_prompts(33, [120], 500)
    q = doc + [3, 3]
    computed_and_stored(llama_dir, s3, "nohost", doc, 320, host_cache_memory=0)
    with store_llm(llama_dir, s3, "nohost", host_cache_memory=0) as other, \
            LLM(llama_dir, enable_prefix_caching=False, **DEVICE) as plain:
        out = gen(other, [q], G)[0]
        assert out.num_cached_tokens == 120
        assert other.stats().tiers["object"].hit_tokens == 120
        assert out.token_ids == gen(plain, [q], G)[0].token_ids


def test_the_store_going_away_means_recompute_and_no_secret_is_printed(llama_dir, caplog):
    """A server of its own, stopped under a replica that had listed it: the load fails
    (every request bounded), the prompt is computed, the same tokens come out; the puts
    of the blocks it then evicts fail too; nothing names the secret key."""
    caplog.set_level(logging.DEBUG, logger="kvsession")
    (doc,) = random_prompts(34, [120], 500)
    q = doc + [2, 7]
    own = S3()
    try:
        computed_and_stored(llama_dir, own, "down", doc, 330)
        llm = store_llm(llama_dir, own, "down")
        assert llm.stats().tiers["object"].cached_blocks >= 15
    finally:
        own.stop()
    with llm, LLM(llama_dir, enable_prefix_caching=False, **DEVICE) as plain:
        out = gen(llm, [q], G)[0]
        assert out.token_ids == gen(plain, [q], G)[0].token_ids
        assert out.num_cached_tokens == 0
        assert llm.stats().tiers["object"].hit_tokens == 0
        gen(llm, [doc + [1]], G)  # used twice: admitted below the host when evicted
        flood(llm, 340)
        flood(llm, 341)
        llm.check_integrity()
        text = repr(llm.config) + repr(llm.stats())
    assert "object store s3://kvs-test/down" in caplog.text  # the failures were logged
    assert SECRET not in caplog.text + text


def test_what_one_process_writes_stays_within_its_budget(llama_dir, s3):
    (doc,) = random_prompts(35, [120], 500)
    # a record: one block's 4 KiB of KV and its header (~200 bytes): six fit, not seven
    computed_and_stored(llama_dir, s3, "budget", doc, 350,
                        object_store_memory=6 * (8 * BPT + 512))
    assert len(s3.keys("budget/kv/")) == 6


def test_the_budget_holds_for_the_store_not_only_for_what_one_process_wrote(llama_dir, s3):
    """One process writes a document's blocks under a large budget; the next, whose budget
    holds six records, lists the store at start-up and deletes the oldest beyond six,
    whoever wrote them; a listing keeps it there; outputs stay exact."""
    (doc,) = random_prompts(42, [120], 500)
    computed_and_stored(llama_dir, s3, "shared-budget", doc, 420)
    before = s3.client.list_objects_v2(Bucket=BUCKET, Prefix="shared-budget/kv/")["Contents"]
    assert len(before) >= 15
    record = 8 * BPT + 512
    with store_llm(llama_dir, s3, "shared-budget", object_store_memory=6 * record) as llm, \
            LLM(llama_dir, enable_prefix_caching=False, **DEVICE) as plain:
        kept = s3.client.list_objects_v2(Bucket=BUCKET, Prefix="shared-budget/kv/")["Contents"]
        assert len(kept) == 6
        newest = sorted(before, key=lambda o: (o["LastModified"], o["Key"].rsplit("/")[-1]))
        assert {o["Key"] for o in kept} == {o["Key"] for o in newest[-6:]}
        assert llm.stats().tiers["object"].cached_blocks == 6
        q = doc + [9]
        assert gen(llm, [q], G)[0].token_ids == gen(plain, [q], G)[0].token_ids
        llm.check_integrity()


@pytest.mark.parametrize("kw, match", [
    (dict(object_store="ftp://host/x"), "object_store must be a URL"),
    (dict(object_store_options={"region": "x"}), "apply to an object_store"),
    (dict(object_store_memory="1GiB"), "apply to an object_store"),
    (dict(object_store="s3://b/p", object_store_options=["region"]), "must be a dict"),
    (dict(object_store="s3://b/p", object_store_memory="lots"), "object_store_memory"),
    (dict(object_store="file:///tmp/kvs", object_store_options={"region": "x"}),
     "do not apply"),
    (dict(object_store="s3://b/p", object_store_options={"no_such_option": SECRET}),
     "object_store='s3://b/p'"),
    (dict(session_dir="ftp://host/sessions"), "session_dir must be a URL"),
    (dict(session_dir="s3://b/s", object_store_options={"no_such_option": SECRET}),
     "session_dir='s3://b/s'"),
])
def test_bad_object_store_arguments_are_config_errors(llama_dir, kw, match):
    with pytest.raises(ConfigError, match=match) as e:
        LLM(llama_dir, **DEVICE, **kw).close()
    assert SECRET not in str(e.value)


def test_refused_session_store_options_fail_before_anything_is_done(tmp_path, monkeypatch):
    """A session store's refused options are a ConfigError before anything else is done:
    the model is not read (here it does not even exist) and no local directory is made.
    (An object_store's are refused as the arguments are read, before the model loads.)"""
    monkeypatch.setenv("KVSESSION_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match="session_dir='s3://b/s'.*no_such_option") as e:
        LLM(tmp_path / "no-model", session_dir="s3://b/s",
            object_store_options={"no_such_option": SECRET})
    assert SECRET not in str(e.value)
    assert not (tmp_path / "cache").exists()


def test_serve_and_the_worker_take_the_object_store_flags():
    import argparse

    from kvsession.flags import add_llm_flags, llm_kwargs
    from kvsession.worker import CALLER_ONLY

    for exclude in (frozenset(), CALLER_ONLY):  # the server's flags, the worker's
        p = argparse.ArgumentParser()
        add_llm_flags(p, LLM, exclude)
        args = p.parse_args(["--model", "m", "--object-store", "s3://b/kv",
                             "--object-store-options", '{"allow_http": true}',
                             "--object-store-memory", "2GiB"])
        kw = llm_kwargs(args, LLM, exclude)
        assert kw["object_store"] == "s3://b/kv"
        assert kw["object_store_options"] == {"allow_http": True}
        assert kw["object_store_memory"] == "2GiB"


# ---- the tier on its own ---------------------------------------------------------------

def small_records(identity: str = "model-a"):
    import torch

    from kvsession.tiers.block_record import BlockRecords
    gen_ = torch.Generator().manual_seed(0)
    tensors = {"k": torch.randn(2, 4, 8, 2, 4, generator=gen_),
               "v": torch.randn(2, 4, 8, 2, 4, generator=gen_)}
    return BlockRecords(tensors, 8, {"model": identity}), tensors


def test_a_record_is_used_only_when_every_check_passes():
    """Seeded: 400 damaged copies of one record (a flipped byte anywhere, cut short, grown,
    another identity's, another block's tokens or hash) are all refused; the intact one
    gives back the block's exact bytes."""
    import random

    import torch

    records, tensors = small_records()
    tokens, h = tuple(range(8)), b"\x01" * 32
    raw = records.encode(tensors, 2, h, tokens, b"\x02" * 32, 0, 3)
    assert len(raw) == records.record_bytes
    out = {n: torch.zeros_like(t) for n, t in tensors.items()}
    records.copy_into(records.check(bytearray(raw), h, tokens), out, 1)
    assert all(torch.equal(out[n][:, 1], tensors[n][:, 2]) for n in tensors)
    rng = random.Random(53)
    for _ in range(400):
        bad = bytearray(raw)
        kind = rng.randrange(3)
        if kind == 0:
            bad[rng.randrange(len(bad))] ^= 1 << rng.randrange(8)
        elif kind == 1:
            del bad[rng.randrange(len(bad)):]
        else:
            bad += bytes(rng.randrange(1, 64))
        assert records.check(bad, h, tokens) is None
    assert records.check(bytearray(raw), h, tokens[:-1] + (99,)) is None
    assert records.check(bytearray(raw), b"\x03" * 32, tokens) is None
    other, _ = small_records("model-b")
    assert other.check(bytearray(raw), h, tokens) is None


def test_a_store_that_fails_is_backed_off_until_a_listing_succeeds():
    import torch

    from kvsession.tiers.object_store import ObjectCache

    records, tensors = small_records()
    own = S3()
    cache = ObjectCache(f"s3://{BUCKET}/backoff", own.options, records, 1 << 20,
                        list_interval_s=3600)
    try:
        h, tokens = b"\x05" * 32, tuple(range(8))
        assert cache.offer(tensors, [(0, h, tokens, None, 2)]) == 1
        assert cache.has(h) and cache.flush(30)
        assert cache.lookup_run([h], 0, 1) == [h]
        out = {n: torch.zeros_like(t) for n, t in tensors.items()}
        assert cache.load([h], [tokens], out, [3])[0] == 1
        assert torch.equal(out["k"][:, 3], tensors["k"][:, 0])
        own.stop()
        assert cache.load([h], [tokens], out, [3])[0] == 0  # a miss, bounded, no error
        assert cache.errors >= 1
        assert cache.lookup_run([h], 0, 1) == []  # backed off: no load waits on it again
        assert h in cache.known
    finally:
        cache.close(timeout_s=5)
        with contextlib.suppress(Exception):
            own.stop()


def test_two_replicas_in_one_store_at_once(llama_dir, s3):
    """Two LLMs put the same documents into one store at the same time (the same objects
    from both); a third loads them; every output is exact."""
    docs = random_prompts(37, [120, 120], 500)
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda i: computed_and_stored(llama_dir, s3, "both", docs[i % 2],
                                                    360 + i), range(2)))
    with store_llm(llama_dir, s3, "both") as llm, \
            LLM(llama_dir, enable_prefix_caching=False, **DEVICE) as plain:
        for doc in docs:
            q = doc + [4, 4]
            out = gen(llm, [q], G)[0]
            assert out.token_ids == gen(plain, [q], G)[0].token_ids
        assert llm.stats().tiers["object"].hit_tokens >= 120
        llm.check_integrity()


# ---- sessions in the store: session_dir="s3://..." ----------------------------------------

SESSION_LLM = dict(kv_cache_memory="1MiB", max_model_len=512, host_cache_memory=0)
TERSE = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

CRASHING_CHILD = r"""
import json, os, signal, sys
from kvsession import LLM, SamplingParams
model, url = sys.argv[1], sys.argv[2]
options, llm_args = json.loads(sys.argv[3]), json.loads(sys.argv[4])
llm = LLM(model, session_dir=url, object_store_options=options, **llm_args)
s = llm.session(session_id="crashed", system="You are terse.",
                sampling=SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
for turn in ("list the files", "open the first one"):
    s.send(turn)
    print("ack", flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no close, no snapshot: only what each turn put
"""


def machine(monkeypatch, tmp_path, name):
    """Another machine: its own cache directory (and so its own local session_dir)."""
    monkeypatch.setenv("KVSESSION_CACHE", str(tmp_path / name))


def check_next_turn(llama_dir, s, params=TERSE):
    """The resumed session's next turn is what an engine without any of this gives."""
    before = list(s.token_ids)
    reply = s.send("now run the tests")
    with LLM(llama_dir, enable_prefix_caching=False, **SESSION_LLM) as plain:
        assert reply.token_ids == expected_turn(plain, s, before, reply, params)


def test_a_session_closed_on_one_machine_resumes_on_another(llama_dir, s3, tmp_path,
                                                            monkeypatch):
    url = f"s3://{BUCKET}/sessions-a"
    machine(monkeypatch, tmp_path, "a")
    with LLM(llama_dir, session_dir=url, object_store_options=s3.options,
             **SESSION_LLM) as llm:
        s = llm.session(session_id="agent-1", system="You are terse.", sampling=TERSE)
        s.send("list the files")
        s.send("open the first one")
        messages = s.messages
        assert (tmp_path / "a" / "sessions").is_dir()  # the local session_dir
    assert sorted(s3.keys("sessions-a/")) == ["sessions-a/agent-1.kvs"]  # its log replaced
    machine(monkeypatch, tmp_path, "b")
    with LLM(llama_dir, session_dir=url, object_store_options=s3.options,
             **SESSION_LLM) as llm:
        assert llm.sessions() == ["agent-1"]
        s = llm.session(session_id="agent-1")
        assert s.messages == messages
        check_next_turn(llama_dir, s)
        s.close(delete=True)
    assert s3.keys("sessions-a/") == []  # deleted everywhere


def test_turns_acknowledged_before_a_crash_resume_on_another_machine(llama_dir, s3, tmp_path,
                                                                   monkeypatch):
    """A process SIGKILLed right after two acknowledged turns (no close): each turn's log
    was put in the store before the turn returned, so another machine resumes both."""
    import json
    import subprocess
    import sys

    from internals import CHILD_PRELUDE

    url = f"s3://{BUCKET}/sessions-b"
    machine(monkeypatch, tmp_path, "a")
    child = subprocess.run(
        [sys.executable, "-c", CHILD_PRELUDE + CRASHING_CHILD, str(llama_dir), url,
         json.dumps(s3.options), json.dumps(SESSION_LLM)],
        capture_output=True, text=True, timeout=300)
    assert child.returncode == -9 and child.stdout.count("ack") == 2, child.stderr[-2000:]
    assert SECRET not in child.stderr
    machine(monkeypatch, tmp_path, "b")
    with LLM(llama_dir, session_dir=url, object_store_options=s3.options,
             **SESSION_LLM) as llm:
        s = llm.session(session_id="crashed")
        assert users(s) == ["list the files", "open the first one"]
        check_next_turn(llama_dir, s)
        s.send("and fix the bug")
    # back on the first machine, whose directory still holds the log of two turns: the
    # session closed elsewhere since is fetched, never its older state resumed
    machine(monkeypatch, tmp_path, "a")
    with LLM(llama_dir, session_dir=url, object_store_options=s3.options,
             **SESSION_LLM) as llm:
        s = llm.session(session_id="crashed")
        assert users(s) == ["list the files", "open the first one", "now run the tests",
                            "and fix the bug"]
        check_next_turn(llama_dir, s)


def users(s) -> list[str]:
    return [m["content"] for m in s.messages if m["role"] == "user"]


class Proxy:
    """A TCP proxy on 127.0.0.1 in front of the S3 server that can fail the way a store
    does: `stall()` makes connections made after it accepted and never answered (a store
    that hangs); `cut(n)` makes every answer (on connections old and new) stop after n
    bytes, the connection closed (the server killed mid-transfer); `fail(status)` answers
    every request with that HTTP error, passing nothing on (a store returning errors);
    `heal()` ends them."""

    def __init__(self, target: str):
        import socket
        import threading

        host, port = target.removeprefix("http://").split(":")
        self.target = (host, int(port))
        self.silent = threading.Event()
        self.cut_bytes: int | None = None
        self.status: int | None = None
        self.cuts = 0  # answers cut short
        self.relayed_bytes = 0  # the server's bytes passed on to clients
        self.server = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.held: list = []
        threading.Thread(target=self._accept, daemon=True).start()

    def stall(self):
        self.silent.set()

    def cut(self, n_bytes: int):
        self.cut_bytes = n_bytes

    def fail(self, status: int):
        """Every answer replaced by this HTTP error (a store returning errors)."""
        self.status = status

    def heal(self):
        self.silent.clear()
        self.cut_bytes = self.status = None

    def _accept(self):
        import socket
        import threading

        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            if self.silent.is_set():
                self.held.append(conn)  # accepted, never answered
                continue
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._to_server, args=(conn, upstream),
                             daemon=True).start()
            threading.Thread(target=self._to_client, args=(upstream, conn),
                             daemon=True).start()

    def _to_server(self, conn, upstream):
        """The client's bytes to the server; once failing, refused here (never reaching
        the server: a store that refuses stores nothing)."""
        with contextlib.suppress(OSError):
            while data := conn.recv(65536):
                if self.status is not None:
                    self.cuts += 1
                    conn.sendall(f"HTTP/1.1 {self.status} Failing\r\nContent-Length: 0\r\n"
                                 f"Connection: close\r\n\r\n".encode())
                    self._close(conn, upstream)
                    return
                upstream.sendall(data)
        with contextlib.suppress(OSError):
            upstream.shutdown(1)

    def _to_client(self, upstream, conn):
        """The server's bytes to the client; once cutting, at most `cut_bytes` more, then
        both sockets closed."""
        sent = 0
        with contextlib.suppress(OSError):
            while data := upstream.recv(65536):
                if self.cut_bytes is None:
                    conn.sendall(data)
                    self.relayed_bytes += len(data)
                    continue
                conn.sendall(data[:max(0, self.cut_bytes - sent)])
                sent += len(data)
                if sent >= self.cut_bytes:
                    self.cuts += 1
                    self._close(conn, upstream)  # as a killed server's kernel does
                    return
        with contextlib.suppress(OSError):
            conn.shutdown(1)

    @staticmethod
    def _close(*socks):
        import socket

        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # (wakes the other direction's recv)
            sock.close()

    def close(self):
        self.server.close()
        for c in self.held:
            c.close()


def test_a_store_that_hangs_is_waited_for_within_its_timeout_then_recomputed(llama_dir, s3,
                                                                              caplog):
    """The store stops answering (connections accepted, nothing sent back) after a replica
    listed it: the load gives up at the client's timeout (1 s here, with its retries) and
    the prompt is computed, with the same tokens."""
    caplog.set_level(logging.WARNING, logger="kvsession")
    (doc,) = random_prompts(39, [120], 500)
    computed_and_stored(llama_dir, s3, "hang", doc, 390)
    proxy = Proxy(s3.endpoint)
    options = {**s3.options, "endpoint": proxy.endpoint, "timeout": "1s",
               "connect_timeout": "1s"}
    try:
        llm = fixed_rates(LLM(llama_dir, object_store=f"s3://{BUCKET}/hang",
                              object_store_options=options, **{**HOST, **DEVICE}))
        with llm, LLM(llama_dir, enable_prefix_caching=False, **DEVICE) as plain:
            Internals(llm).fix_rate("object_read", 1e12)
            Internals(llm).fix_rate("object_latency", 1e-9)
            assert llm.stats().tiers["object"].cached_blocks >= 15  # listed through it
            proxy.stall()
            for q in (doc + [1], doc + [2]):
                out = gen(llm, [q], G)[0]
                assert out.token_ids == gen(plain, [q], G)[0].token_ids
            assert llm.stats().tiers["object"].hit_tokens == 0
            llm.check_integrity()
        assert "object store s3://kvs-test/hang: reading kv/" in caplog.text  # it was tried
    finally:
        proxy.close()


@pytest.mark.parametrize("failure", ["cut", "503"])
def test_a_store_killed_mid_transfer_or_failing_means_recompute(llama_dir, s3, caplog,
                                                                failure):
    """Every answer of the store stops part way through a block's object, the connection
    closed (a server killed mid-transfer; each retry the same), or is an HTTP 503: the
    load fails, is never used in part, and the prompt is computed with the same tokens."""
    caplog.set_level(logging.WARNING, logger="kvsession")
    prefix = f"fail-{failure}"
    (doc,) = random_prompts(40 + len(failure), [120], 500)
    computed_and_stored(llama_dir, s3, prefix, doc, 400)
    sizes = [o["Size"] for o in s3.client.list_objects_v2(Bucket=BUCKET,
                                                          Prefix=f"{prefix}/kv/")["Contents"]]
    assert min(sizes) > 4000  # a block's record: the cut below falls inside its body
    proxy = Proxy(s3.endpoint)
    try:
        llm = fixed_rates(LLM(llama_dir, object_store=f"s3://{BUCKET}/{prefix}",
                              object_store_options={**s3.options, "endpoint": proxy.endpoint,
                                                    "timeout": "1s", "connect_timeout": "1s"},
                              **{**HOST, **DEVICE}))
        with llm, LLM(llama_dir, enable_prefix_caching=False, **DEVICE) as plain:
            Internals(llm).fix_rate("object_read", 1e12)
            Internals(llm).fix_rate("object_latency", 1e-9)
            assert llm.stats().tiers["object"].cached_blocks >= 15  # listed through it
            if failure == "cut":
                proxy.cut(1500)  # the answer's headers and a part of its body
            else:
                proxy.fail(503)
            q = doc + [5]
            out = gen(llm, [q], G)[0]
            assert out.token_ids == gen(plain, [q], G)[0].token_ids
            st = llm.stats()
            assert st.tiers["object"].hit_tokens == 0 and st.prefill_tokens == len(q)
            assert proxy.cuts >= 1
            llm.check_integrity()
        assert f"object store s3://kvs-test/{prefix}: reading kv/" in caplog.text
        assert SECRET not in caplog.text
    finally:
        proxy.close()


def test_a_session_not_here_is_refused_while_the_store_cannot_be_read(llama_dir, s3, tmp_path,
                                                                      monkeypatch):
    """A session closed on machine a; machine b has nothing of it and every answer of the
    store is cut short: opening it is a SessionStoreError (not a new session that would
    replace the store's copy), and the store's copy is untouched. Machine a, which has it,
    resumes it meanwhile; b resumes it once the store answers again."""
    url = f"s3://{BUCKET}/sessions-c"
    # every machine reaches the store through the proxy (one endpoint: one store)
    proxy = Proxy(s3.endpoint)
    options = {**s3.options, "endpoint": proxy.endpoint, "timeout": "1s",
               "connect_timeout": "1s"}

    def stored():
        return s3.client.get_object(Bucket=BUCKET, Key="sessions-c/agent-9.kvs")["Body"].read()

    try:
        machine(monkeypatch, tmp_path, "a")
        with LLM(llama_dir, session_dir=url, object_store_options=options,
                 **SESSION_LLM) as llm:
            s = llm.session(session_id="agent-9", system="You are terse.", sampling=TERSE)
            s.send("list the files")
            messages = s.messages
        before = stored()
        proxy.cut(200)  # within the headers: nothing can be read
        machine(monkeypatch, tmp_path, "b")
        with LLM(llama_dir, session_dir=url, object_store_options=options,
                 **SESSION_LLM) as llm:
            with pytest.raises(SessionStoreError, match="agent-9") as e:
                llm.session(session_id="agent-9")
            assert SECRET not in str(e.value)
            proxy.heal()
            proxy.fail(503)  # a store answering errors: the same
            with pytest.raises(SessionStoreError, match="agent-9"):
                llm.session(session_id="agent-9")
            proxy.heal()
            proxy.cut(200)
            # nothing was put in its place
            assert s3.keys("sessions-c/") == ["sessions-c/agent-9.kvs"]
            assert stored() == before
            assert llm.sessions() == []  # (the listing failed too: nothing here)
            machine(monkeypatch, tmp_path, "a")
            with LLM(llama_dir, session_dir=url, object_store_options=options,
                     **SESSION_LLM) as here:
                assert here.session(session_id="agent-9").messages == messages
            assert proxy.cuts >= 2
            proxy.heal()
            s = llm.session(session_id="agent-9")  # b again, the store answering
            assert s.messages == messages
            check_next_turn(llama_dir, s)
    finally:
        proxy.close()


def test_files_kept_beside_sessions_are_read_on_another_machine(llama_dir, s3, tmp_path,
                                                                monkeypatch):
    """`put_file` keeps a document beside the sessions, in the store too: another machine
    reads it, replaces it, deletes it everywhere, and the first machine, open all along
    with its copy, reads each change; it is never listed as a session."""
    url = f"s3://{BUCKET}/sessions-d"
    kw = dict(session_dir=url, object_store_options=s3.options, **SESSION_LLM)
    machine(monkeypatch, tmp_path, "a")
    with LLM(llama_dir, **kw) as a:
        a.put_file("notes/plan.json", b'{"step": 1}')
        assert a.get_file("notes/plan.json") == b'{"step": 1}'
        assert len(list((tmp_path / "a").rglob("notes/plan.json"))) == 1  # here too
        for bad in ("plan.json", "../x", "notes/../x", ".hidden/x", "a/b/c", "a/.x", 7):
            with pytest.raises(ConfigError, match="name"):
                a.put_file(bad, b"x")
        with pytest.raises(ConfigError, match="bytes"):
            a.put_file("notes/x", "text")
        s = a.session(session_id="agent-x", sampling=TERSE)
        s.send("hello")
        s.close()
        assert "sessions-d/notes/plan.json" in s3.keys("sessions-d/")
        machine(monkeypatch, tmp_path, "b")
        with LLM(llama_dir, **kw) as b:
            assert b.sessions() == ["agent-x"]  # the folder is no session
            assert b.get_file("notes/plan.json") == b'{"step": 1}'  # from the store
            assert b.get_file("notes/other.json") is None
            b.put_file("notes/plan.json", b'{"step": 2}')
            assert s3.client.get_object(Bucket=BUCKET, Key="sessions-d/notes/plan.json")[
                "Body"].read() == b'{"step": 2}'
            assert a.get_file("notes/plan.json") == b'{"step": 2}'  # changed there
            assert a.get_file("notes/plan.json") == b'{"step": 2}'  # (unchanged since)
            assert b.delete_file("notes/plan.json") is True
            assert b.get_file("notes/plan.json") is None
            assert a.get_file("notes/plan.json") is None  # removed there: here too
            assert not list((tmp_path / "a").rglob("notes/plan.json"))
    assert not [k for k in s3.keys("sessions-d/") if "plan" in k]
    with LLM(llama_dir, **SESSION_LLM) as llm, pytest.raises(ConfigError, match="session_dir"):
        llm.put_file("notes/plan.json", b"x")


def test_replicas_on_ray_share_nothing_but_the_store(llama_dir, s3, tmp_path, monkeypatch):
    """`serve --replicas 2` on a local Ray cluster with its sessions and cache blocks in the
    store (no --session-dir directory; credentials from the environment), driven by raw
    HTTP and the openai client. A replica SIGKILLed for good (no restart; its
    machine gone, with its local files) has its sessions and its Responses chain continued
    by the other from the store, every turn exact, and a document it computed is loaded by
    the other from the store instead of computed."""
    import json
    import os
    import shutil
    import signal
    import urllib.request
    import uuid

    from test_scale_out import PROMPT, Cluster, _needs_ray, reference_replies, run_turns, user

    from kvsession.kernels.cpp_build import cache_root
    from kvsession.serve.process import ServerProcess
    from kvsession.tiers.session_mirror import local_root

    _needs_ray()
    openai = pytest.importorskip("openai")
    for name, value in (("AWS_ENDPOINT", s3.endpoint), ("AWS_REGION", "us-east-1"),
                        ("AWS_ACCESS_KEY_ID", "kvs"), ("AWS_SECRET_ACCESS_KEY", SECRET)):
        monkeypatch.setenv(name, value)
    # (a prefix of its own: the local directory mirroring it, under the cache every
    # process here shares, is this run's, and removed after it)
    sessions_url = f"s3://{BUCKET}/ray-sessions-{uuid.uuid4().hex[:8]}"
    local = local_root(sessions_url, cache_root())
    cluster = Cluster.__new__(Cluster)  # the scale-out tests' helpers, over this process
    cluster.proc = ServerProcess(
        llama_dir, "--device", "cpu", "--kv-cache-memory", "64MiB", "--max-model-len", "1024",
        "--host-cache-memory", "0", "--object-store", f"s3://{BUCKET}/ray-kv",
        "--object-store-options", '{"allow_http": true}', "--session-dir", sessions_url,
        "--replicas", "2", "--ray-address", "local", "--ray-num-cpus", "2",
        "--replica-max-restarts", "0", "--summary-interval-s", "0.2",
        stderr_path=tmp_path / "ingress.stderr", start_timeout_s=300)
    cluster.url, cluster.model = cluster.proc.url, llama_dir.name
    try:
        cluster.wait_ready()
        client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="x", max_retries=0,
                               timeout=60)
        # a document asked about twice: computed by one replica, reused, so put in the store
        (words,) = random_prompts(41, [300], 26)
        doc = " ".join(chr(97 + t) * 2 for t in words)

        def ask(question):
            raw = client.chat.completions.with_raw_response.create(
                model=cluster.model, max_tokens=6, temperature=0,
                messages=[{"role": "user", "content": f"{doc}\n{question}"}])
            r = raw.parse()
            return (raw.headers["x-kvsession-replica"], r.choices[0].message.content,
                    r.usage.prompt_tokens_details.cached_tokens)

        def metric(replica: str, name: str) -> float:
            url = next(r["url"] for r in cluster.health()["replicas"] if r["name"] == replica)
            text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
            m = re.search(rf'^kvsession_tiers_{name}\{{tier="object"\}} (\S+)$', text, re.M)
            return float(m.group(1)) if m else 0.0

        victim = ask("first question")[0]
        replica, _, reused = ask("second question")
        assert replica == victim and reused >= 16
        cluster.wait_for(lambda: metric(victim, "bytes_written") >= reused * BPT,
                         "the reused blocks' uploads")
        # named sessions, spread over both replicas, two turns each
        sids = [f"kill-{i}" for i in range(6)]
        histories = {sid: [{"role": "system", "content": PROMPT}] for sid in sids}
        holder = {sid: run_turns(cluster, sid, histories[sid], range(2))[-1][0]
                  for sid in sids}
        assert victim in holder.values() and len(set(holder.values())) == 2, holder
        # a Responses chain on the victim (a new chain goes where its id hashes)
        for _ in range(16):
            raw = client.responses.with_raw_response.create(
                model=cluster.model, input="list the files", max_output_tokens=6,
                temperature=0)
            if raw.headers["x-kvsession-replica"] == victim:
                break
        first = raw.parse()
        assert raw.headers["x-kvsession-replica"] == victim
        second = client.responses.create(model=cluster.model, input="open the first one",
                                         previous_response_id=first.id,
                                         max_output_tokens=6, temperature=0)

        stored = len(s3.keys("ray-kv/kv/"))  # everything the store holds now
        pid = cluster.replica(victim)["pid"]
        os.kill(pid, signal.SIGKILL)
        # its machine is gone: nothing of its sessions or its chain is left locally
        chain = f"responses-{first.id[5:21]}"
        gone = [p for sid in [chain, *(s for s in sids if holder[s] == victim)]
                for p in local.glob(f"{sid}.*")]
        gone += [*local.glob(f"responses/resp_{first.id[5:21]}*"),
                 *local.glob(f"responses/{chain}.*")]
        assert any(p.suffix == ".log" for p in gone), gone
        for p in gone:
            p.unlink()

        for sid in sids:
            run_turns(cluster, sid, histories[sid], range(2, 4))
        with LLM(llama_dir, device="cpu", kv_cache_memory="64MiB", max_model_len=1024,
                 host_cache_memory=0) as reference:
            for sid in sids:  # no acknowledged turn lost, identical tokens
                got = [m["content"] for m in histories[sid] if m["role"] == "assistant"]
                assert got == reference_replies(reference, [user(sid, t) for t in range(4)]), sid
            raw = client.responses.with_raw_response.create(
                model=cluster.model, input="and fix the bug", max_output_tokens=6,
                temperature=0, previous_response_id=second.id)
            third = raw.parse()
            other = raw.headers["x-kvsession-replica"]
            assert other != victim
            turns = [("list the files", first), ("open the first one", second),
                     ("and fix the bug", third)]
            conversation = []
            for text, response in turns:  # the chain's history came from the store
                conversation.append({"role": "user", "content": text})
                want = reference.chat(conversation, SamplingParams(max_tokens=6,
                                                                   temperature=0.0),
                                      use_tqdm=False)[0].text
                assert response.output_text == want
                conversation.append({"role": "assistant", "content": want})
            # the survivor lists the store every 5 s, or 10x a listing's time if slower
            # (a loaded machine): it knows what the victim put once it listed since
            cluster.wait_for(lambda: metric(other, "cached_blocks") >= stored,
                             "the survivor's listing", timeout=120)
            replica, text, cached = ask("third question")
            assert replica == other and cached >= 16, (  # loaded, computed by the victim
                metric(other, "cached_blocks"), metric(other, "hit_tokens"),
                cluster.proc.stderr_tail(3000))
            want = reference.chat([{"role": "user", "content": f"{doc}\nthird question"}],
                                  SamplingParams(max_tokens=6, temperature=0.0),
                                  use_tqdm=False)[0].text
            assert text == want
        assert metric(other, "hit_tokens") >= 16
        assert json.loads(urllib.request.urlopen(f"{cluster.url}/health", timeout=10).read())[
            "ready"] == 1
    finally:
        try:
            assert cluster.proc.stop(timeout=90) == 0, cluster.proc.stderr_tail()
        finally:
            shutil.rmtree(local, ignore_errors=True)
    assert SECRET not in (tmp_path / "ingress.stderr").read_text()


def test_a_session_continued_elsewhere_is_never_overwritten_from_here(llama_dir, s3, tmp_path,
                                                                     monkeypatch, caplog):
    """Machines a and b hold one session at once (no router between them): b resumes it
    and takes a turn; a's next turn finds a newer version in the store, so its put is
    refused there (conditional on the version a read) and the session is fenced on a: that
    turn stays in a's local log, a's turn after it is a SessionLockedError, and a's close
    neither puts nor removes anything there. The store keeps b's conversation."""
    caplog.set_level(logging.ERROR, logger="kvsession")
    url = f"s3://{BUCKET}/sessions-e"
    kw = dict(session_dir=url, object_store_options=s3.options, **SESSION_LLM)
    machine(monkeypatch, tmp_path, "a")
    a_llm = LLM(llama_dir, **kw)
    try:
        a = a_llm.session(session_id="both", system="You are terse.", sampling=TERSE)
        a.send("list the files")
        machine(monkeypatch, tmp_path, "b")
        with LLM(llama_dir, **kw) as b_llm:
            b = b_llm.session(session_id="both")
            assert users(b) == ["list the files"]
            b.send("b: open the first one")
            a.send("a: open the second one")  # acknowledged: a's local log holds it
            assert "was written by another process" in caplog.text
            with pytest.raises(SessionLockedError, match="continued by another process"):
                a.send("a: and the third")
            a.close()  # nothing put or removed there
            assert sorted(s3.keys("sessions-e/")) == ["sessions-e/both.log"]
            b.send("b: run the tests")  # b never noticed
        machine(monkeypatch, tmp_path, "c")
        with LLM(llama_dir, **kw) as c_llm:
            c = c_llm.session(session_id="both")
            assert users(c) == ["list the files", "b: open the first one", "b: run the tests"]
            check_next_turn(llama_dir, c)
        # back on a: the store's copy is resumed, not a's branch
        machine(monkeypatch, tmp_path, "a")
        with LLM(llama_dir, **kw) as again:
            s = again.session(session_id="both")
            assert users(s)[:3] == ["list the files", "b: open the first one",
                                    "b: run the tests"]
            s.send("a: from the store's copy")
    finally:
        a_llm.close()


def test_a_put_whose_answer_was_lost_is_adopted_not_fenced(llama_dir, s3, tmp_path,
                                                           monkeypatch):
    """A turn's log reaches the store but the answer is cut (so this process does not
    learn the new version): the next turn's put finds that version there, sees it is its
    own log's prefix, adopts it and puts again; nothing is fenced, and another machine
    resumes every turn."""
    url = f"s3://{BUCKET}/sessions-f"
    proxy = Proxy(s3.endpoint)
    try:
        machine(monkeypatch, tmp_path, "a")
        with LLM(llama_dir, session_dir=url, **SESSION_LLM,
                 object_store_options={**s3.options, "endpoint": proxy.endpoint,
                                       "timeout": "1s", "connect_timeout": "1s"}) as llm:
            s = llm.session(session_id="lost", sampling=TERSE)
            s.send("list the files")
            proxy.cut(100)  # the put arrives; its answer does not
            s.send("open the first one")
            proxy.heal()
            assert proxy.cuts >= 1
            s.send("run the tests")
            s.send("fix the bug")  # not fenced
    finally:
        proxy.close()
    machine(monkeypatch, tmp_path, "b")
    with LLM(llama_dir, session_dir=url, object_store_options=s3.options,
             **SESSION_LLM) as llm:
        assert users(llm.session(session_id="lost")) == [
            "list the files", "open the first one", "run the tests", "fix the bug"]


def test_one_bucket_name_on_two_servers_is_two_local_directories(tmp_path):
    from kvsession.tiers.session_mirror import local_root

    url = "s3://bucket/sessions"
    a = local_root(url, tmp_path, {"endpoint": "http://10.0.0.1:9000", "region": "x"})
    assert a == local_root(url, tmp_path, {"region": "y", "endpoint": "http://10.0.0.1:9000"})
    assert a != local_root(url, tmp_path, {"endpoint": "http://10.0.0.2:9000"})
    assert local_root(url, tmp_path) != local_root("s3://bucket/other", tmp_path)
    # credentials in the URL or the options never change (or reach) the directory's name
    assert local_root("s3://key:secret@bucket/sessions", tmp_path) == local_root(url, tmp_path)
    assert local_root(url, tmp_path, {"secret_access_key": "s"}) == local_root(url, tmp_path)


def test_a_snapshot_the_store_refused_at_close_loses_nothing(llama_dir, s3, tmp_path,
                                                             monkeypatch):
    """Two turns reach the store's log; at close the store answers errors, so the snapshot
    that replaced the log here is not there: the store's log stays (an older state, whole)
    and another machine resumes both turns from it. Back on this machine, the store's copy
    is the version this machine last synced (a conditional get: nothing read), so the
    snapshot here is resumed; its close then puts it and removes the log there."""
    url = f"s3://{BUCKET}/sessions-g"
    proxy = Proxy(s3.endpoint)
    options = {**s3.options, "endpoint": proxy.endpoint, "timeout": "1s",
               "connect_timeout": "1s"}
    turns = ["list the files", "open the first one"]
    try:
        machine(monkeypatch, tmp_path, "a")
        with LLM(llama_dir, session_dir=url, object_store_options=options,
                 **SESSION_LLM) as llm:
            s = llm.session(session_id="kept", system="You are terse.", sampling=TERSE)
            for t in turns:
                s.send(t)
            proxy.fail(503)
        assert s3.keys("sessions-g/") == ["sessions-g/kept.log"]  # not removed
        proxy.heal()
        machine(monkeypatch, tmp_path, "b")
        with LLM(llama_dir, session_dir=url, object_store_options=options,
                 **SESSION_LLM) as llm:
            assert users(llm.session(session_id="kept")) == turns
            # (its close puts b's snapshot: b continued it)
        machine(monkeypatch, tmp_path, "a")
        local = next((tmp_path / "a" / "sessions").iterdir())
        with LLM(llama_dir, session_dir=url, object_store_options=options,
                 **SESSION_LLM) as llm:
            s = llm.session(session_id="kept")  # b's close changed the store: fetched
            assert users(s) == turns
            s.send("run the tests")
        assert sorted(p.name for p in local.iterdir() if p.name.startswith("kept")) == [
            "kept.kvs", "kept.synced"]
        with LLM(llama_dir, session_dir=url, object_store_options=options,
                 **SESSION_LLM) as llm:
            before = proxy.relayed_bytes
            s = llm.session(session_id="kept")  # unchanged there since a's close
            assert proxy.relayed_bytes - before < 4096 < (local / "kept.kvs").stat().st_size
            assert users(s) == [*turns, "run the tests"]
            s.close(delete=True)
        assert s3.keys("sessions-g/") == []
        assert not any(p.name.startswith("kept") for p in local.iterdir())
    finally:
        proxy.close()


def test_a_process_that_lost_a_session_closes_it_without_touching_the_store(
        llama_dir, s3, tmp_path, monkeypatch):
    """Machine a holds a session and goes quiet (a replica taken for dead); b resumes it
    and takes a turn. a then closes (its LLM, so its live session is persisted) without
    another turn: its close finds the store's
    log is not the one it put, so it neither puts its snapshot nor removes b's log; b,
    the owner, goes on and closes it normally, and a third machine resumes b's history."""
    url = f"s3://{BUCKET}/sessions-h"
    kw = dict(session_dir=url, object_store_options=s3.options, **SESSION_LLM)
    machine(monkeypatch, tmp_path, "a")
    with LLM(llama_dir, **kw) as a_llm:
        a = a_llm.session(session_id="moved", system="You are terse.", sampling=TERSE)
        a.send("list the files")
        machine(monkeypatch, tmp_path, "b")
        with LLM(llama_dir, **kw) as b_llm:
            b = b_llm.session(session_id="moved")
            b.send("b: open the first one")
            a_llm.close()  # the stale holder's close: its live session persisted
            assert s3.keys("sessions-h/") == ["sessions-h/moved.log"]  # b's log, alone
            b.send("b: run the tests")  # not fenced: its version is the store's
    assert s3.keys("sessions-h/") == ["sessions-h/moved.kvs"]  # b's close
    machine(monkeypatch, tmp_path, "c")
    with LLM(llama_dir, **kw) as llm:
        s = llm.session(session_id="moved")
        assert users(s) == ["list the files", "b: open the first one", "b: run the tests"]
        check_next_turn(llama_dir, s)
