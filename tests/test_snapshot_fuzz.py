"""Seeded fuzzing of the snapshot reader with real files: truncations, bit flips, header
lies with valid checksums, chunk internals, lz4 bombs and size amplification. Every case
must end in a clean SnapshotError (or, for a change no check can see, a clean restore),
with bounded extra memory (tracemalloc here; peak RSS in a subprocess for the large
cases), no block leaked, and the engine still continuing a healthy session exactly."""

from __future__ import annotations

import json
import random
import struct
import subprocess
import sys
import tracemalloc
import zlib
from pathlib import Path

import lz4.frame
import pytest

from kvsession import LLM, SamplingParams, SnapshotError
from kvsession.tiers import snapshot_format as fmt
from kvsession.tiers import snapshot_read as snap_read

SEED = 20240611
G = SamplingParams(max_tokens=6, temperature=0.0)
MiB = 1 << 20
ODD = [None, True, False, -1, 0, 1, 2**31, 2**63, -(2**63), 1.5, 1e308, "", "x", "zz" * 32,
       "ü" * 10, [], {}, [[[]]], {"a": 1}, [1, 2], ["k", "v"], {"role": "user"}]


# ---- building files ------------------------------------------------------------------------

def parts(raw: bytes) -> tuple[bytes, dict]:
    """(magic, version and chunks; the header as JSON values)."""
    n = struct.unpack("<Q", raw[-20:-12])[0]
    return raw[: len(raw) - 20 - n], json.loads(raw[len(raw) - 20 - n: -20])


def assemble(payload: bytes, header) -> bytes:
    """A file with this payload and header, footer and header checksum made valid."""
    hb = header if isinstance(header, bytes) else json.dumps(
        header, separators=(",", ":"), ensure_ascii=False).encode()
    return payload + hb + struct.pack("<QI", len(hb), zlib.crc32(hb)) + fmt.END_MAGIC


def chunk_bytes(raw: bytes) -> list[bytes]:
    _, h = parts(raw)
    return [raw[c["offset"]:c["offset"] + c["length"]] for c in h["chunks"]]


def with_chunks(raw: bytes, datas: list[bytes], codecs: list[str] | None = None,
                **chunk_changes) -> bytes:
    """The file with these chunk bytes, laid out back to back, each with a valid crc32."""
    payload, h = parts(raw)
    pos, chunks = len(fmt.MAGIC) + 4, []
    for i, (data, old) in enumerate(zip(datas, h["chunks"], strict=True)):
        codec = codecs[i] if codecs else old["codec"]
        chunks.append({**old, "offset": pos, "length": len(data),
                       "crc32": zlib.crc32(data), "codec": codec, **chunk_changes})
        pos += len(data)
    h["chunks"] = chunks
    return assemble(payload[: len(fmt.MAGIC) + 4] + b"".join(datas), h)


def lz4_variant(raw: bytes) -> bytes:
    """The same session with every block's data zeroed and lz4-compressed (random-model KV
    does not compress, so the lz4 path needs a file like this)."""
    datas = []
    for data in chunk_bytes(raw):
        (hl,) = struct.unpack_from("<Q", data)
        datas.append(lz4.frame.compress(data[: 8 + hl] + bytes(len(data) - 8 - hl)))
    return with_chunks(raw, datas, ["lz4"] * len(datas))


# ---- the cases (seeded) --------------------------------------------------------------------

def header_lies(raw: bytes, rng: random.Random, n: int) -> list[tuple[str, bytes]]:
    """Valid-checksum files whose header states something false or odd."""
    payload, h = parts(raw)
    bs = h["block_size"]
    fixed = {
        "format_version": [0, 2, "1", None], "session_id": ["", "../x", "a" * 200, 7],
        "created_unix_s": [-1, 1e300, "now", None, 1e12], "kv_dtype": ["bogus", 3],
        "model_fingerprint": ["0" * 64, 1, "x" * 10_000], "block_size": [0, -16, 17, 2**40],
        "num_layers": [0, 2**20, h["num_layers"] * 2], "head_dim": [-1, h["head_dim"] + 1],
        "tensor_names": [[], ["k"], ["k", "v", "x"], ["k", "k"], "kv", [1, 2],
                         ["k", "v", "k_scale", "v_scale"]],
        "token_ids": [h["token_ids"][:-1], h["token_ids"][:-bs], h["token_ids"] + [1] * bs,
                      [-1] + h["token_ids"][1:], [2**40] + h["token_ids"][1:],
                      ["a"] + h["token_ids"][1:], [10**6] + h["token_ids"][1:], None, {}],
        "block_hashes": [h["block_hashes"][:-1], h["block_hashes"] + ["0" * 64],
                         ["zz" * 32] + h["block_hashes"][1:],
                         [h["block_hashes"][0].upper()] + h["block_hashes"][1:],
                         [h["block_hashes"][0][:63]] + h["block_hashes"][1:], 5],
        "chunks": [h["chunks"][:-1], h["chunks"] + h["chunks"][-1:], [],
                   [{**h["chunks"][0], "offset": 13}] + h["chunks"][1:],
                   [{**h["chunks"][0], "length": h["chunks"][0]["length"] - 1}]
                   + h["chunks"][1:],
                   [{**c, "raw_length": c["raw_length"] * 1000} for c in h["chunks"]],
                   [{**h["chunks"][0], "codec": "zstd"}] + h["chunks"][1:],
                   [{k: v for k, v in h["chunks"][0].items() if k != "crc32"}]
                   + h["chunks"][1:],
                   [{**h["chunks"][0], "length": 2**62}] + h["chunks"][1:]],
        "messages": [[{"role": "user", "content": 5}], [{"role": "user", "content": ["a"]}],
                     [{"role": "user"}], [{"role": 1, "content": "x"}], ["hello"],
                     [{"role": "user", "content": "x", "tool_calls": [{"a": 1}]}], {},
                     [{"role": "u", "content": ""}] * 70_000],
        "sampling": [{"temperature": "hot"}, {"temperature": -1}, {"max_tokens": 0},
                     {"max_tokens": True}, {"top_k": 0}, {"stop": [1]},
                     {"stop_token_ids": ["a"]}, {"seed": "x"}, {"cache_salt": 5}, [],
                     {"x": "y" * 70_000}],
        "system": [5, [], {"a": 1}, "s" * 40_000],
    }
    out = [(f"{k}={v!r:.40}", assemble(payload, {**h, k: v}))
           for k, vs in fixed.items() for v in vs]
    for deep in ("messages", "system", "sampling", "unknown_field"):
        nested = b"[" * 200_000 + b"]" * 200_000
        hb = json.dumps({**h, deep: "@@"}, separators=(",", ":")).encode()
        out.append((f"{deep}=deep", assemble(payload, hb.replace(b'"@@"', nested))))
    fields = sorted(h)
    for _ in range(n):  # random odd values in random places
        field = rng.choice(fields)
        value = rng.choice(ODD)
        changed = json.loads(json.dumps(h))
        target = changed[field]
        if isinstance(target, list) and target and rng.random() < 0.7:
            i = rng.randrange(len(target))
            if isinstance(target[i], dict) and rng.random() < 0.7:
                target[i][rng.choice(sorted(target[i]) + ["extra"])] = value
            else:
                target[i] = value
        elif isinstance(target, dict) and rng.random() < 0.7:
            target[rng.choice(sorted(target) + ["extra"])] = value
        else:
            changed[field] = value
        out.append((f"random {field}", assemble(payload, changed)))
    return out


def chunk_internals(raw: bytes, lz4raw: bytes, rng: random.Random, n: int):
    """Chunks changed inside, their checksums made valid again."""
    out = []
    datas = chunk_bytes(raw)
    for _ in range(n):
        i = rng.randrange(len(datas))
        data = bytearray(datas[i])
        (hl,) = struct.unpack_from("<Q", data)
        where = rng.choice(["length", "prefix", "data", "cut", "grow"])
        if where == "length":
            struct.pack_into("<Q", data, 0, rng.choice([0, 1, hl + 8, 2**63, len(data)]))
        elif where == "prefix":
            data[8 + rng.randrange(hl)] ^= 1 << rng.randrange(8)
        elif where == "data":  # no check can see this: the file must still load cleanly
            data[8 + hl + rng.randrange(len(data) - 8 - hl)] ^= 1 << rng.randrange(8)
        elif where == "cut":
            del data[rng.randrange(len(data)):]
        else:
            data += bytes(rng.randrange(1, 64))
        new = list(datas)
        new[i] = bytes(data)
        out.append((f"chunk {i} {where}", with_chunks(raw, new)))
    zdatas = chunk_bytes(lz4raw)
    raw_len = parts(lz4raw)[1]["chunks"][0]["raw_length"]
    frames = {
        "lz4 cut": lambda z: z[: len(z) // 2],
        "lz4 trailing": lambda z: z + b"\x00" * 7,
        "lz4 garbage": lambda z: bytes(rng.randrange(256) for _ in range(len(z))),
        "lz4 short": lambda z: lz4.frame.compress(bytes(raw_len - 1)),
        "lz4 flip": lambda z: z[:20] + bytes([z[20] ^ 0x40]) + z[21:],
        "lz4 two frames": lambda z: z + z,
        # decompresses to 1 MiB (ratio ~250) from a chunk no larger than one block
        "lz4 bomb": lambda z: lz4.frame.compress(bytes(MiB)),
    }
    for name, make in frames.items():
        new = list(zdatas)
        new[-1] = make(new[-1])
        out.append((name, with_chunks(lz4raw, new)))
    bomb = lz4.frame.compress(bytes(300 * MiB))  # the reported 1 MiB -> 286 MiB bomb
    new = list(zdatas)
    new[-1] = bomb
    out.append(("lz4 bomb declared", with_chunks(lz4raw, new, raw_length=300 * MiB)))
    return out


def byte_damage(raw: bytes, rng: random.Random, n_cut: int, n_flip: int):
    out = [(f"cut {k}", raw[:k]) for k in (0, 8, 12, 13, len(raw) - 20, len(raw) - 21,
                                            len(raw) - 1)]
    out += [(f"cut {k}", raw[:k]) for k in sorted(rng.sample(range(len(raw)), n_cut))]
    for _ in range(n_flip):
        b = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        out.append(("flip", bytes(b)))
    return out


# ---- the tests -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm(llama_dir):
    # without prefix caching every block of a restore is read from its file (none is
    # re-referenced from the device instead), and a restore runs no model step (no system
    # prompt pin), so what is measured is the reader
    with LLM(llama_dir, kv_cache_memory="8MiB", max_model_len=512,
             enable_prefix_caching=False) as llm:
        yield llm


@pytest.fixture(scope="module")
def healthy(llm, tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "healthy.kvs"
    s = llm.session(system="You are terse and careful.", sampling=G, session_id="healthy")
    for t in ("first question about the files", "second, longer question about tests"):
        s.send(t)
    s.save(path)
    s.close()
    return path


def continuation(llm, path) -> list[int]:
    with llm.restore(path, session_id="probe") as s:
        return s.send("and now?").token_ids


def try_case(llm, path: Path, outcome: dict) -> int:
    """Restore (and inspect) one file: a SnapshotError or a clean session, nothing else.
    Returns the traced peak of extra Python memory."""
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    try:
        with llm.restore(path, session_id="fuzzed"):
            outcome["restored"] += 1
    except SnapshotError:
        outcome["snapshot_error"] += 1
    peak = tracemalloc.get_traced_memory()[1] - base
    try:
        snap_read.describe(snap_read.read_header(path), path)
    except SnapshotError:
        pass
    return peak


def test_fuzzed_snapshots_fail_cleanly_with_bounded_memory(llm, healthy, tmp_path):
    rng = random.Random(SEED)
    raw = healthy.read_bytes()
    lz4raw = lz4_variant(raw)
    (tmp_path / "lz4.kvs").write_bytes(lz4raw)
    want = continuation(llm, healthy)
    assert continuation(llm, tmp_path / "lz4.kvs")  # the lz4 variant is a valid file
    free = llm.stats().tiers["device"].blocks_free
    cases = (byte_damage(raw, rng, 30, 60) + byte_damage(lz4raw, rng, 10, 30)
             + header_lies(raw, rng, 150) + chunk_internals(raw, lz4raw, rng, 60))
    kv_bytes = llm.runtime.kv_bytes_per_token * llm.runtime.max_model_len
    outcome = {"restored": 0, "snapshot_error": 0}
    worst = (0.0, "")
    tracemalloc.start()
    try:
        for i, (name, data) in enumerate(cases):
            path = tmp_path / f"case{i}.kvs"
            path.write_bytes(data)
            peak = try_case(llm, path, outcome)  # anything but SnapshotError fails here
            # the file's size 4 times, one session's KV, and a fixed 2 MiB for the objects
            # of a restored session (messages, tokens, its Session) and the reader's ring
            bound = 4 * len(data) + kv_bytes + 2 * MiB
            assert peak <= bound, (name, peak, bound)
            worst = max(worst, (peak / bound, name))
            path.unlink()
    finally:
        tracemalloc.stop()
    print(f"\n{len(cases)} cases: {outcome}, worst peak {worst[0]:.0%} of its bound ({worst[1]})")
    assert outcome["restored"] + outcome["snapshot_error"] == len(cases)
    assert outcome["snapshot_error"] >= 0.8 * len(cases)
    llm.check_integrity()  # no reference leaked, the pool is back to its baseline
    assert llm.stats().tiers["device"].blocks_free == free
    assert continuation(llm, healthy) == want  # and the engine still serves, exactly


# Runs in a subprocess per batch: restores each file and reports the peak RSS it added
# (VmHWM reset through /proc/self/clear_refs before each). A 64 MiB allocation first
# shows that the measurement sees memory.
RSS = r"""
import json, sys
from kvsession import LLM, SnapshotError

def hwm_reset():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

def measure(fn):
    hwm_reset()
    base = status("VmRSS:")
    fn()
    return status("VmHWM:") - base

llm = LLM(sys.argv[1], kv_cache_memory="8MiB", max_model_len=512, enable_prefix_caching=False)
llm.restore(sys.argv[2], session_id="warm").close()  # imports, threads, buffers
out = {"control": measure(lambda: bytearray(64 << 20))}
for path in sys.argv[3:]:
    def attempt():
        try:
            llm.restore(path, session_id="case").close()
            out[path] = "restored"
        except SnapshotError as e:
            out[path] = str(e)
    out[path] = [measure(attempt), out.get(path)]
llm.close()
print(json.dumps(out))
"""


def amplification_cases(raw: bytes) -> dict[str, bytes]:
    """Files of about 24 MiB (the reported case) whose header is built to blow up."""
    payload, h = parts(raw)
    n = 24 * MiB

    def header_with(field: str, value_json: bytes) -> bytes:
        hb = json.dumps({**h, field: "@@"}, separators=(",", ":")).encode()
        return assemble(payload, hb.replace(b'"@@"', value_json))

    msg = b'{"role":"u","content":""},'
    lz4raw = lz4_variant(raw)
    declared = chunk_bytes(lz4raw)
    declared[-1] = lz4.frame.compress(bytes(300 * MiB))  # the reported 1 MiB -> 286 MiB
    fitting = chunk_bytes(lz4raw)
    fitting[-1] = lz4.frame.compress(bytes(MiB))  # as small as a block, inflates 125x
    return {
        "messages": header_with("messages", b"[" + msg * (n // len(msg)) + msg[:-1] + b"]"),
        "empty dicts": header_with("messages", b"[" + b"{}," * (n // 3) + b"{}]"),
        "nesting": header_with("unknown_field", b"[" * (n // 2) + b"]" * (n // 2)),
        "tokens": header_with("token_ids", b"[" + b"0," * (n // 2) + b"0]"),
        "flat sampling": header_with("sampling", b'{"a":[' + b"0," * (n // 2) + b"0]}"),
        "system": header_with("system", b'"' + b"a" * n + b'"'),
        "chunks": header_with("chunks", b"[" + b",".join(
            b'{"offset":12,"length":1,"raw_length":1,"crc32":0}' for _ in range(n // 52))
            + b"]"),
        "lz4 bomb": with_chunks(lz4raw, declared, raw_length=300 * MiB),
        "lz4 bomb in a block": with_chunks(lz4raw, fitting),
    }


def test_large_crafted_headers_and_bombs_stay_bounded_in_rss(llama_dir, healthy, tmp_path):
    raw = healthy.read_bytes()
    files = {}
    for name, data in amplification_cases(raw).items():
        files[name] = tmp_path / (name.replace(" ", "_") + ".kvs")
        files[name].write_bytes(data)
    big = tmp_path / "over_cap.kvs"  # claims a header over the cap: sparse, never read
    with open(big, "wb") as f:
        f.write(fmt.MAGIC + struct.pack("<I", fmt.FORMAT_VERSION))
        f.seek(fmt.MAX_HEADER_BYTES + MiB)
        f.write(struct.pack("<QI", fmt.MAX_HEADER_BYTES + 1, 0) + fmt.END_MAGIC)
    files["over cap"] = big
    out = subprocess.run([sys.executable, "-c", RSS, str(llama_dir), str(healthy),
                          *map(str, files.values())], capture_output=True, text=True,
                         timeout=300)
    if out.returncode != 0 and "clear_refs" in out.stderr:
        pytest.skip("peak RSS cannot be reset here (/proc/self/clear_refs)")
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res.pop("control") >= 60 * MiB  # the measurement sees an allocation
    kv_bytes = 512 * 512  # one session's KV at this max_model_len
    report = []
    for name, path in files.items():
        peak, message = res[str(path)]
        size = len(raw) if name == "over cap" else path.stat().st_size
        report.append(f"{name}: +{peak / MiB:.1f} MiB for {size / MiB:.1f} MiB: "
                      f"{message.rpartition('kvs: ')[2]:.90}")
        assert message != "restored", name
        assert peak <= 4 * size + kv_bytes + 32 * MiB, report[-1]
    print("\n" + "\n".join(report))


NESTED = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize("field, value, match, inspect_fails", [
    ("block_hashes", lambda h: ["zz" * 32] * len(h["block_hashes"]), "block_hashes", True),
    ("block_hashes", lambda h: [x.upper() for x in h["block_hashes"]], "block_hashes", True),
    ("sampling", lambda h: {**h["sampling"], "temperature": "hot"}, "sampling", True),
    ("sampling", lambda h: {**h["sampling"], "max_tokens": True}, "sampling", True),
    ("sampling", lambda h: {**h["sampling"], "temperature": -1.0}, "temperature", False),
    ("messages", lambda h: [{"role": "user", "content": 5}], "messages", True),
    ("messages", lambda h: [{"role": "user", "content": [{"type": "text"}]}], "messages",
     True),
    ("messages", lambda h: "@@", "recursion", True),  # @@: deeply nested lists
    ("sampling", lambda h: "@@", "recursion", True),
    ("system", lambda h: 5, "system", True),
    ("created_unix_s", lambda h: 1e300, "created_unix_s", True),
    ("session_id", lambda h: "../../escape", "session_id", True),
    ("kv_dtype", lambda h: "bogus", "kv dtype", True),
    ("token_ids", lambda h: [10**6] * len(h["token_ids"]), "vocabulary", False),
])
def test_odd_header_values_are_snapshot_errors(llm, healthy, tmp_path, capsys, field, value,
                                               match, inspect_fails):
    """Each odd value, behind a valid checksum: restore raises a SnapshotError naming it,
    and `kvsession inspect` prints one line and exits 1 (or shows a header it can read)."""
    from kvsession.cli import main as cli_main

    payload, h = parts(healthy.read_bytes())
    hb = json.dumps({**h, field: value(h)}, separators=(",", ":")).encode()
    path = tmp_path / "odd.kvs"
    path.write_bytes(assemble(payload, hb.replace(b'"@@"', NESTED)))
    free = llm.stats().tiers["device"].blocks_free
    with pytest.raises(SnapshotError, match=match):
        llm.restore(path, session_id="odd")
    assert llm.stats().tiers["device"].blocks_free == free
    assert cli_main(["inspect", str(path)]) == (1 if inspect_fails else 0)
    out = capsys.readouterr()
    if inspect_fails:
        assert out.err.startswith("error: SnapshotError: ") and out.err.count("\n") == 1
    else:
        assert "session:         healthy" in out.out
