"""Restore overlap: a session's KV read back from disk while four requests decode.

A session with a 6,144-token history is persisted (`session_dir`, durability "turn"), the
LLM closed and opened again, and the session resumed: its KV is only on disk (its log's
segments and snapshot). Four streamed requests decode (each token's arrival time recorded);
once each has produced 16 tokens, the session's next turn is sent, and its KV is read back
from disk while they decode. Reported per round: the worst inter-token gap of the four
between the turn's submission and its first token, over their median gap before it (the
step time). Target: <= 2x.

Configurations, each in a fresh process:
- sync: the revision before session loads moved to the copier (`--baseline`, run from a
  worktree): the whole restore runs on the engine thread, one stall;
- copier: this tree: the bytes move on the copier thread, the batch keeps decoding.

Median over `--rounds` rounds (the order alternating) with the range. JSON + `--plot`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import MID_SIZE, pyplot, save_figure, write_result
from shared_tiers import baseline_tree

ROOT = Path(__file__).resolve().parents[1]
BASELINE = "5d2a8b2"  # session loads on the engine thread
HISTORY_TOKENS, NUM_DECODERS, DECODE_TOKENS, WARM_TOKENS = 6144, 4, 400, 16


def long_model() -> Path:
    """The mid-size model with room for an 8k context (built once)."""
    from kvsession.testing import make_tiny_model

    path = Path.home() / ".cache" / "kvsession" / "bench-mid-llama-8k"
    if not (path / "config.json").is_file():
        make_tiny_model(path, arch="llama", **{**MID_SIZE, "max_position_embeddings": 8192})
    return path


def run_one(model: Path) -> dict:
    import kvsession
    from kvsession import LLM, SamplingParams

    print(f"kvsession from {Path(kvsession.__file__).parent}", flush=True)
    bpt = 2 * MID_SIZE["num_hidden_layers"] * MID_SIZE["num_key_value_heads"] \
        * MID_SIZE["head_dim"] * 4
    root = tempfile.mkdtemp(prefix="kvsession-overlap-")
    kw = dict(session_dir=root, max_model_len=8192, host_cache_memory=0,
              kv_cache_memory=(HISTORY_TOKENS + 2 * NUM_DECODERS * 512 + 1024) * bpt)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    with LLM(model, **kw) as llm:
        history = llm.tokenizer.decode(list(range(100, 100 + HISTORY_TOKENS)))
        with llm.session(session_id="agent", sampling=one) as s:
            s.send(history)
    with LLM(model, **kw) as llm:
        s = llm.session(session_id="agent", sampling=one)  # resumed: its KV is on disk
        params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True)
        times: list[list[float]] = [[] for _ in range(NUM_DECODERS)]
        warm = threading.Barrier(NUM_DECODERS + 1)

        def decode(i: int) -> None:
            with llm.stream(f"request {i}: " + "tell me more " * 16, params) as stream:
                for _ in stream:
                    times[i].append(time.perf_counter())
                    if len(times[i]) == WARM_TOKENS:
                        warm.wait(120)
        threads = [threading.Thread(target=decode, args=(i,)) for i in range(NUM_DECODERS)]
        for t in threads:
            t.start()
        warm.wait(120)
        t_send = time.perf_counter()
        r = s.send("And the next step?")
        t_first = t_send + r.metrics.ttft_s
        restored_from = r.restored_from
        for t in threads:
            t.join()
        s.close()
    before, during = [], []
    for ts in times:
        for a, b in zip(ts, ts[1:], strict=False):
            if b <= t_send:
                before.append(b - a)
            elif a < t_first:
                during.append(b - a)
    step = statistics.median(before)
    worst = max(during) if during else 0.0
    return {"restored_from": restored_from, "ttft_s": r.metrics.ttft_s, "median_step_s": step,
            "worst_gap_s": worst, "worst_over_step": worst / step,
            "gaps_during": len(during)}


def child(tree: Path, model: Path) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(ROOT / "bench")])}
        subprocess.run([sys.executable, __file__, "--one", "--model", str(model), "--out",
                        out.name], env=env, check=True, cwd=tree)
        return json.loads(Path(out.name).read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline", default=BASELINE)
    ap.add_argument("--plot", action="store_true")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        args.out.write_text(json.dumps(run_one(args.model)))
        return
    model = long_model()
    trees = {"sync": baseline_tree(args.baseline), "copier": ROOT}
    configs = tuple(trees)
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    for r in range(args.rounds):
        order = configs if r % 2 == 0 else configs[::-1]
        for c in order:
            res = child(trees[c], model)
            runs[c].append(res)
            print(f"round {r + 1} {c:6s} restored from {res['restored_from']}, TTFT "
                  f"{res['ttft_s'] * 1e3:.0f} ms, step {res['median_step_s'] * 1e3:.1f} ms, "
                  f"worst gap {res['worst_gap_s'] * 1e3:.1f} ms = "
                  f"{res['worst_over_step']:.2f}x", flush=True)

    def med(c, key):
        xs = [x[key] for x in runs[c]]
        return statistics.median(xs), min(xs), max(xs)
    summary = {c: {k: med(c, k) for k in ("ttft_s", "median_step_s", "worst_gap_s",
                                          "worst_over_step")} for c in configs}
    for c in configs:
        m, lo, hi = summary[c]["worst_over_step"]
        print(f"{c}: worst gap during the restore / median step = {m:.2f}x "
              f"(range {lo:.2f}-{hi:.2f}; target <= 2x), TTFT "
              f"{summary[c]['ttft_s'][0] * 1e3:.0f} ms")
    write_result("restore_overlap", {"baseline": args.baseline, "rounds": runs,
                                     "summary": summary, "history_tokens": HISTORY_TOKENS,
                                     "decoders": NUM_DECODERS})
    if args.plot:
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(5, 4))
        ax.bar(configs, [summary[c]["worst_over_step"][0] for c in configs])
        ax.axhline(2.0, color="gray", linestyle="--", label="target")
        ax.set_title("worst decode gap during a 6k-token disk restore / step")
        ax.legend()
        save_figure(fig, "restore_overlap")


if __name__ == "__main__":
    main()
