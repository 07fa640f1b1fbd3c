"""Shared helpers for the benchmark scripts: the mid-size model, timing, JSON results."""

from __future__ import annotations

import json
import platform
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from kvsession.testing import _WORDS, make_tiny_model

RESULTS = Path(__file__).resolve().parent / "results"
MID_SIZE = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=32000,
                max_position_embeddings=4096)


def mid_model(root: Path | None = None, dtype: str = "float32") -> Path:
    """The mid-size random Llama checkpoint every CPU benchmark uses (built once); `dtype`
    "bfloat16": the same weights rounded to bfloat16, a checkpoint of its own."""
    name = "bench-mid-llama" + ("" if dtype == "float32" else f"-{dtype}")
    path = (root or Path.home() / ".cache" / "kvsession") / name
    if not (path / "config.json").is_file():
        make_tiny_model(path, arch="llama", dtype=dtype, **MID_SIZE)
    return path


def model_path(name: str) -> Path:
    """A benchmark's model by name: "mid" (mid_model) or the tiny one (both built once)."""
    if name == "mid":
        return mid_model()
    path = Path.home() / ".cache" / "kvsession" / "bench-tiny-llama"
    if not (path / "config.json").is_file():
        make_tiny_model(path)
    return path


def timed_rounds(fns, repeat: int = 3, between=None, before_round=None) -> list[list[float]]:
    """Wall time of each function in each of `repeat` rounds, run interleaved (one warm-up
    each) so that machine noise hits all of them alike. `between`, if given, runs untimed
    before each timed call (e.g. a bandwidth sample taken in the same conditions);
    `before_round` before each round."""
    for fn in fns:
        fn()
    rounds = []
    for _ in range(repeat):
        if before_round is not None:
            before_round()
        times = []
        for fn in fns:
            if between is not None:
                between()
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        rounds.append(times)
    return rounds


def compare(fns, repeat: int = 3, between=None) -> list[float]:
    """Best wall time of each function over `repeat` interleaved rounds (`timed_rounds`)."""
    return [min(times) for times in zip(*timed_rounds(fns, repeat, between), strict=True)]


class Solo:
    """Keeps one thread's OpenMP workers alive at a time while a benchmark alternates
    between kvsession (its engine thread) and a peer or a measurement on this thread.

    libgomp stops spin-waiting once the worker threads of every thread that ran a parallel
    region outnumber the cores, and each parallel region then pays a wake-up (see
    kvsession.engine.runner.release_openmp_workers): whichever side ran second in the same
    process would be measured slowed down by the other's idle workers. Call `ours()`
    before timing kvsession and `theirs()` before timing anything on this thread."""

    def __init__(self, llm):
        from kvsession.engine.runner import release_openmp_workers

        self.llm, self.release = llm, release_openmp_workers

    def ours(self) -> None:
        self.release()  # this thread's workers (transformers, bandwidth samples)

    def theirs(self) -> None:
        self.llm._rt.call(self.release).result()  # the engine thread's workers


def write_result(name: str, data: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    data = {"benchmark": name, "machine": platform.machine(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            **data}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2))
    print(f"wrote {path}")
    return path


def median_range(runs: list[dict], key: str) -> tuple[float, float, float]:
    """(median, min, max) of `key` over rounds' results: what the reports print."""
    xs = [r[key] for r in runs]
    return statistics.median(xs), min(xs), max(xs)


def text_of(tokenizer, rng, num_tokens: int) -> str:
    """Words from the tiny tokenizer's corpus vocabulary, about `num_tokens` tokens long."""
    words: list[str] = []
    while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) < num_tokens:
        words.extend(rng.choice(_WORDS) for _ in range(max(1, (num_tokens - len(words)) // 3)))
    while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) > num_tokens:
        words.pop()
    return " ".join(words)


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (benchmarks draw PNGs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, name: str) -> None:
    """Lay out and write a benchmark's plot as bench/results/<name>.png."""
    RESULTS.mkdir(exist_ok=True)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=120)


class RoundsProcess:
    """The parent's handle on a child process that runs a workload round by round when
    asked (`script` with `argv`, run by `python`: this one, or another such as
    llama.cpp's; child_protocol.answer_rounds is its side): one JSON line per request on
    its stdin ({"round": t}; {"round": null} ends it), one JSON line back; every answer
    awaited with a timeout, the child's stderr kept for the error when it exits."""

    def __init__(self, script: str, argv: list[str], timeout_s: float,
                 python: str = sys.executable):
        self.timeout_s = timeout_s
        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([python, script, *argv], text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.err)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.lines.put(line)
        self.lines.put(None)  # end of output: the child exited

    def read(self) -> dict:
        try:
            line = self.lines.get(timeout=self.timeout_s)
        except queue.Empty:
            self.proc.kill()
            raise TimeoutError(f"no answer from the child in {self.timeout_s} s")\
                from None
        if line is None:
            self.err.seek(0)
            raise RuntimeError("the child exited:\n" + self.err.read()[-3000:])
        return json.loads(line)

    def ask(self, t: int | None) -> dict:
        self.proc.stdin.write(json.dumps({"round": t}) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=self.timeout_s)
        self.err.close()


def in_threads(fn, n: int) -> float:
    """fn(0), ..., fn(n - 1), each in a thread of its own: seconds until all are done."""
    threads = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0
