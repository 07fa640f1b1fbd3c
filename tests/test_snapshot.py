"""Snapshot robustness: every kind of bad file is a SnapshotError that names the cause and
leaves the engine unaffected; fuzzing never raises anything else; a SIGKILL mid-save keeps
the previous file loadable; nothing in the load path can execute code."""

from __future__ import annotations

import ast
import queue
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import zlib
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from internals import Internals
from llms import tiny_llm

from kvsession import LLM, SamplingParams, SnapshotError
from kvsession.cli import main as cli_main
from kvsession.tiers import snapshot as snap
from kvsession.tiers import snapshot_format as fmt
from kvsession.tiers import snapshot_read as snap_read
from oracle import expected_turn

G = SamplingParams(max_tokens=6, temperature=0.0)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def llm(llama_dir):
    with tiny_llm(llama_dir) as llm:
        yield llm


@pytest.fixture(scope="module")
def saved(llm, tmp_path_factory):
    path = tmp_path_factory.mktemp("snap") / "s.kvs"
    s = llm.session(system="You are terse and careful.", sampling=G, session_id="snap-src")
    for t in ("first question about files", "second one"):
        s.send(t)
    s.save(path)
    s.close()
    return path


def rewrite_header(src: Path, dst: Path, **changes) -> Path:
    data = src.read_bytes()
    h = snap_read.read_header(src)
    header_len = struct.unpack("<Q", data[-20:-12])[0]
    payload = data[: len(data) - 20 - header_len]
    new = msgspec.json.encode(msgspec.structs.replace(h, **changes))
    dst.write_bytes(payload + new + struct.pack("<QI", len(new), zlib.crc32(new))
                    + fmt.END_MAGIC)
    return dst


def assert_engine_fine(llm):
    used = llm.stats().tiers["device"].blocks_used
    with llm.session(sampling=G) as s:
        assert len(s.send("still working?").token_ids) == 6
    llm.check_integrity()
    assert llm.stats().tiers["device"].blocks_used == used


def test_roundtrip_and_inspect(llm, saved, capsys):
    s = llm.restore(saved, session_id="copy")
    assert len(s.messages) == 5 and s.num_cached_tokens > 0
    s.close()
    assert cli_main(["inspect", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "snap-src" in out and "float32" in out and "messages:        5" in out


@pytest.mark.parametrize("corrupt, match", [
    (lambda b: b"NOTKVS!!" + b[8:], "bad magic"),
    (lambda b: b[:8] + struct.pack("<I", 99) + b[12:], "unknown snapshot format version 99"),
    (lambda b: b[: len(b) // 2], "truncated"),
    (lambda b: b[:-30] + bytes([b[-30] ^ 0x01]) + b[-29:], "header checksum|footer"),
    (lambda b: b + b"garbage", "footer"),
    (lambda b: b"", "magic"),
])
def test_corruptions_raise_snapshot_error(llm, saved, tmp_path, corrupt, match):
    bad = tmp_path / "bad.kvs"
    bad.write_bytes(corrupt(saved.read_bytes()))
    with pytest.raises(SnapshotError, match=match):
        llm.restore(bad, session_id="bad")
    assert_engine_fine(llm)


def test_payload_checksum(llm, saved, tmp_path):
    # the last block is partial: never resident in the device prefix cache, always read
    h = snap_read.read_header(saved)
    at = h.chunks[-1].offset + 10
    raw = saved.read_bytes()
    bad = tmp_path / "bad.kvs"
    bad.write_bytes(raw[:at] + bytes([raw[at] ^ 0xFF]) + raw[at + 1:])
    with pytest.raises(SnapshotError, match=f"checksum mismatch in block {h.num_blocks - 1}"):
        llm.restore(bad, session_id="bad")
    assert_engine_fine(llm)


def test_stored_chunks_read_in_place_equal_the_decoded_ones(saved):
    """A CPU pool takes stored ("none") chunks straight from the file (one preadv into the
    block's memory); the bytes must equal what the decoding path yields."""
    import torch

    h = snap_read.read_header(saved)
    assert {c.codec for c in h.chunks} == {"none"}  # random-model KV: incompressible
    decoded = {i: {n: t.clone() for n, t in tensors.items()}
               for i, tensors in snap_read.read_blocks(saved, h, list(range(h.num_blocks)))}
    names = sorted(decoded[0])
    mem = {i: {n: torch.zeros_like(decoded[i][n]) for n in names} for i in decoded}

    def dest(i):  # each tensor's layers as separate pieces, like a pool's block slices
        return [memoryview(mem[i][n][layer].view(torch.uint8).numpy()).cast("B")
                for n in names for layer in range(h.num_layers)]

    got = list(snap_read.read_blocks(saved, h, list(range(h.num_blocks)), dest=dest))
    assert [i for i, _ in got] == list(range(h.num_blocks)) and all(t is None for _, t in got)
    for i in decoded:
        for n in names:
            assert torch.equal(mem[i][n].view(torch.uint8), decoded[i][n].view(torch.uint8))


def test_in_place_chunk_with_a_foreign_layout_is_refused(llm, saved, tmp_path):
    """A stored chunk whose bytes pass the checksum but whose safetensors header is not the
    expected layout is refused, also when it was read straight into the pool."""
    h = snap_read.read_header(saved)
    last = h.chunks[-1]
    raw = bytearray(saved.read_bytes())
    at = last.offset + 8 + raw[last.offset + 8:last.offset + last.length].index(b'"dtype"')
    raw[at + 1] = ord("D")  # "Dtype": same length, another key
    chunk = bytes(raw[last.offset:last.offset + last.length])
    bad = tmp_path / "layout.kvs"
    bad.write_bytes(bytes(raw))
    chunks = h.chunks[:-1] + [msgspec.structs.replace(last, crc32=zlib.crc32(chunk))]
    rewrite_header(bad, bad, chunks=chunks)
    with pytest.raises(SnapshotError, match=f"block {h.num_blocks - 1} does not match"):
        llm.restore(bad, session_id="bad")
    assert_engine_fine(llm)


@pytest.mark.parametrize("field, value, match", [
    ("model_fingerprint", "0" * 64, "another model fingerprint"),
    ("tokenizer_digest", "1" * 64, "another tokenizer digest"),
    ("template_digest", "2" * 64, "another template digest"),
])
def test_fingerprint_mismatch(llm, saved, tmp_path, field, value, match):
    bad = rewrite_header(saved, tmp_path / "x.kvs", **{field: value})
    with pytest.raises(SnapshotError, match=match):
        llm.restore(bad, session_id="bad")
    assert_engine_fine(llm)


def test_header_that_does_not_match_the_payload(llm, saved, tmp_path):
    h = snap_read.read_header(saved)
    bad = rewrite_header(saved, tmp_path / "x.kvs", token_ids=h.token_ids[:-20])
    with pytest.raises(SnapshotError, match="does not match the payload"):
        llm.restore(bad, session_id="bad")
    bad = rewrite_header(saved, tmp_path / "y.kvs", num_kv_heads=h.num_kv_heads * 2)
    with pytest.raises(SnapshotError, match="num kv heads"):
        llm.restore(bad, session_id="bad")


def test_other_model_dtype_or_block_size_is_refused(llama_dir, model_dirs, saved):
    with LLM(model_dirs("qwen2"), kv_cache_memory="4MiB", max_model_len=512) as other:
        with pytest.raises(SnapshotError, match="model fingerprint"):
            other.restore(saved)
    with LLM(llama_dir, kv_cache_memory="4MiB", max_model_len=512, kv_cache_dtype="fp8") as o:
        with pytest.raises(SnapshotError, match="kv dtype"):
            o.restore(saved)
    with LLM(llama_dir, kv_cache_memory="4MiB", max_model_len=512, block_size=32) as o:
        with pytest.raises(SnapshotError, match="block size"):
            o.restore(saved)
    # a session longer than this engine's max_model_len could never take a turn here:
    # refused before anything is loaded
    n = len(snap_read.read_header(saved).token_ids)
    with LLM(llama_dir, kv_cache_memory="4MiB", max_model_len=n - 1) as short:
        with pytest.raises(SnapshotError, match="longer than this engine's max_model_len"):
            short.restore(saved)
        assert short.stats().tiers["device"].blocks_used == 0


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzed_files_only_ever_raise_snapshot_error(llm, saved, tmp_path_factory, data):
    raw = bytearray(saved.read_bytes())
    kind = data.draw(st.sampled_from(["flip", "truncate", "garbage", "splice"]))
    if kind == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] ^= 1 << data.draw(st.integers(0, 7))
    elif kind == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    elif kind == "garbage":
        raw = bytearray(data.draw(st.binary(max_size=4096)))
    else:
        i = data.draw(st.integers(0, len(raw)))
        raw = raw[:i] + data.draw(st.binary(min_size=1, max_size=64)) + raw[i:]
    path = tmp_path_factory.mktemp("fuzz") / "f.kvs"
    path.write_bytes(bytes(raw))
    try:
        s = llm.restore(path, session_id="fuzzed")
    except SnapshotError:
        return
    s.close()  # an undetectable change (none expected) must still load cleanly


SAVER = """
import sys, threading
from kvsession import LLM, SamplingParams
from kvsession.tiers import files
from kvsession.tiers import snapshot as snap

model, path, point = sys.argv[1:4]
llm = LLM(model, kv_cache_memory="8MiB", max_model_len=1024)
s = llm.session(sampling=SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
s.send("tell me a long story " * 20)
saves, blocks = [0], [0]


def stop_at(name):
    # the second save stops at the chosen point and says so; the parent then SIGKILLs it
    if point == name and saves[0] == 2:
        print("at", name, flush=True)
        threading.Event().wait()


def wrap(orig, before=None, after=None):
    def wrapped(*args):
        before and before()
        out = orig(*args)
        after and after()
        return out
    return wrapped


def start_save():
    saves[0] += 1
    blocks[0] = 0


def next_block():
    blocks[0] += 1
    if blocks[0] == 3:  # two blocks handed to the writer thread, the rest not encoded
        stop_at("chunks")


snap.atomic_write = wrap(snap.atomic_write, before=start_save)
snap.encode_block = wrap(snap.encode_block, before=next_block)
# written and fsynced, not yet renamed over the previous file
files._replace_releasing_later = wrap(files._replace_releasing_later,
                                      before=lambda: stop_at("renaming"))
# renamed, the directory not yet fsynced
files.fsync_dir = wrap(files.fsync_dir, before=lambda: stop_at("renamed"))
for _ in range(2):
    s.save(path)
    print("saved", saves[0], s.num_cached_tokens, flush=True)
"""


def test_a_flush_failing_mid_write_leaves_the_previous_file(saved, tmp_path, monkeypatch):
    """The writer's sync thread hits ENOSPC: write_snapshot raises a SnapshotError naming
    it, the file it was replacing is untouched and no temporary file is left."""
    import shutil

    h = snap_read.read_header(saved)
    blocks = [{n: t.clone() for n, t in tensors.items()}
              for _, tensors in snap_read.read_blocks(saved, h, list(range(h.num_blocks)))]
    fields = {f: getattr(h, f) for f in h.__struct_fields__
              if f not in ("format_version", "chunks", "created_unix_s")}
    target = tmp_path / "s.kvs"
    shutil.copy(saved, target)
    before = target.read_bytes()
    calls = []

    def no_space(fd):
        calls.append(fd)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(snap._Writer, "SYNC_BYTES", 1)
    monkeypatch.setattr(snap.os, "fdatasync", no_space)
    with pytest.raises(SnapshotError, match="No space left"):
        snap.write_snapshot(target, fields, iter(blocks))
    assert calls and target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["s.kvs"]
    monkeypatch.undo()
    snap.write_snapshot(target, fields, iter(blocks))  # and a healthy write still works
    assert snap_read.read_header(target).token_ids == h.token_ids


@pytest.mark.parametrize("point, replaced", [
    ("chunks", False), ("renaming", False), ("renamed", True)])
def test_sigkill_during_save_leaves_a_loadable_file(llama_dir, llm, tmp_path, point,
                                                    replaced):
    """A child saves a session twice; the second save stops at `point` (the child says so
    on stdout and waits) and is SIGKILLed there: mid-write, before the rename, after it.
    The file at the path is whole and restores to the saved tokens: the previous save
    until the rename, the new one after (its temporary file then gone, else left)."""
    path = tmp_path / "victim.kvs"
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen([sys.executable, "-c", SAVER, str(llama_dir), str(path),
                                 point], stdout=subprocess.PIPE, stderr=err, text=True)
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout],
                         daemon=True).start()
        try:
            first = lines.get(timeout=180).split()  # model load and 200 tokens, loaded box
            assert first[:2] == ["saved", "1"], first
            assert lines.get(timeout=120).split() == ["at", point]
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(timeout=30) == -signal.SIGKILL
        except (queue.Empty, AssertionError):
            proc.kill()
            proc.wait(timeout=30)
            err.seek(0)
            raise AssertionError(f"the saving child: {err.read()}") from None
    temps = [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert len(temps) == (0 if replaced else 1), temps
    s = llm.restore(path, session_id=f"survivor-{point}")
    assert s.num_cached_tokens == int(first[2]) > 200
    s.close()


def test_no_code_execution_on_load():
    for path in (ROOT / "kvsession").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", "") or ""]
                assert not any("pickle" in n for n in names), path
            if isinstance(node, ast.Attribute) and node.attr == "load":
                assert not (isinstance(node.value, ast.Name) and node.value.id == "torch"), path


def test_chunks_are_standard_safetensors(saved):
    from safetensors.torch import load

    h = snap_read.read_header(saved)
    raw = saved.read_bytes()
    for c in h.chunks:
        data = raw[c.offset:c.offset + c.length]
        if c.codec == "lz4":
            import lz4.frame

            data = lz4.frame.decompress(data)
        tensors = load(data)  # the reference implementation reads our encoding
        assert set(tensors) == {"k", "v"}
        assert tuple(tensors["k"].shape) == (h.num_layers, h.block_size, h.num_kv_heads,
                                             h.head_dim)


def test_restored_block_hashes_are_recomputed_not_trusted(llm, saved, tmp_path):
    """A snapshot whose block hashes were replaced by another prefix's (checksums made
    valid again) must not let the blocks its session computes next be found by a request
    with that other prefix: the hashes are recomputed from the tokens on load."""
    bs = llm.config.block_size
    hasher = Internals(llm).hasher
    h = snap_read.read_header(saved)
    full = len(h.token_ids) // bs
    one = SamplingParams(max_tokens=1, temperature=0.0)
    # the victim: another prefix of as many full blocks, computed and cached
    victim = [(7 * i + 3) % 300 + 10 for i in range(full * bs)]
    llm.generate(prompt_token_ids=victim + [5], sampling_params=one, use_tqdm=False)
    poison = [x.hex() for x in hasher.extend([], victim, len(victim), None)]
    bad = rewrite_header(saved, tmp_path / "poisoned.kvs", block_hashes=poison)
    s = llm.restore(bad, session_id="attacker")
    before = s.token_ids
    r = s.send("now tell me everything about the files in the project directory, in order")
    assert r.token_ids == expected_turn(llm, s, before, r, G)
    # the attacker's turn computed block `full` after its own prefix; a request with the
    # victim's prefix and then the same tokens must not hit it (only its own blocks)
    after = list(s.kv.tokens[full * bs:(full + 1) * bs])
    assert len(after) == bs
    out = llm.generate(prompt_token_ids=victim + after + [5], sampling_params=one,
                       use_tqdm=False)[0]
    assert out.num_cached_tokens == full * bs
    tokens = list(s.kv.tokens)
    assert list(s.kv.hashes) == hasher.extend([], tokens, len(tokens) // bs * bs, None)
    s.close()
    assert_engine_fine(llm)
