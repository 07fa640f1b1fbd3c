"""Restore and spill overlap: a session's KV read back from disk, and later written to
disk again, while four requests decode.

A session with a 6,144-token history is persisted (`session_dir`, durability "turn"), the
LLM closed and opened again, and the session resumed: its KV is only on disk (its log's
segments and snapshot). Four streamed requests decode (each token's arrival time recorded);
once each has produced 16 tokens, the session's next turn is sent, and its KV is read back
from disk while they decode. Reported per round, over the four's median gap before it (the
step time): the worst inter-token gap while the session loads (from the turn's submission
to its first step: its queue time; target <= 2x), the worst up to its first token (its own
prefill step included), and, for reference, the worst while the same session's next turn
runs from the device (that step alone). Then the session is suspended for a long wait
(`suspend(expected_idle_s=1e6)`: no host tier, so its KV is written to its snapshot file):
the worst gap while that spill runs (the call's duration). The copier runs at nice 10 and,
while the engine has work, paces itself (kvsession/tiers/copier.py: COPIER_NICE,
PACE_RATIO): on this 2-core machine the decode's two threads and its memory bandwidth are
shared with it.

Configurations, each in a fresh process:
- sync: the revision before session loads moved to the copier (`--baseline`, run from a
  worktree): the whole restore, and the spill, run on the engine thread, one stall each;
- copier: this tree: the bytes move on the copier thread, the batch keeps decoding.

Median over `--rounds` rounds (the order alternating) with the range. JSON + `--plot`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import MID_SIZE, median_range, pyplot, save_figure, text_of, write_result
from shared_tiers import baseline_tree

ROOT = Path(__file__).resolve().parents[1]
BASELINE = "5d2a8b2"  # session loads on the engine thread
HISTORY_TOKENS, NUM_DECODERS, DECODE_TOKENS, WARM_TOKENS = 6144, 4, 600, 16


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
        tok = llm.tokenizer
        with llm.session(session_id="agent", sampling=one) as s:
            s.send(text_of(tok, random.Random(0), HISTORY_TOKENS))
        # the random model's replies biased to whole words: every token is a text delta,
        # so every token is a chunk with its own arrival time
        words = sorted(set(tok.encode(text_of(tok, random.Random(1), 200),
                                      add_special_tokens=False)))[:50]
    with LLM(model, **kw) as llm:
        s = llm.session(session_id="agent", sampling=one)  # resumed: its KV is on disk
        params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True,
                                logit_bias=dict.fromkeys(words, 100.0))
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
        r = s.send("And the next step?")  # its KV comes back from disk
        # the turn waited for its KV until its first step (queue time); then its own step
        t_loaded, t_first = t_send + r.metrics.queue_s, t_send + r.metrics.ttft_s
        t_again = time.perf_counter()
        r2 = s.send("And after that?")  # for reference: the same turn, its KV on the device
        t_again_first = t_again + r2.metrics.ttft_s
        t_spill = time.perf_counter()
        decision = s.suspend(expected_idle_s=1e6)  # its KV goes to its snapshot file
        t_spilled = time.perf_counter()
        for t in threads:
            t.join()
        s.close()
    gaps = [(a, b) for ts in times for a, b in zip(ts, ts[1:], strict=False)]
    step = statistics.median([b - a for a, b in gaps if b <= t_send])

    def worst(start: float, end: float, clip: bool = False) -> float:
        """The longest gap overlapping [start, end] (clip: only its part inside: a stall
        that goes on into the turn's own first step counts up to the step's start)."""
        return max((min(b, end) - max(a, start) if clip else b - a
                    for a, b in gaps if a < end and b > start), default=0.0)
    load_gap = worst(t_send, t_loaded, clip=True)
    turn_gap, device_gap = worst(t_send, t_first), worst(t_again, t_again_first)
    if max(ts[-1] for ts in times) < t_spilled:
        raise RuntimeError("the decoders ended before the spill did: raise DECODE_TOKENS")
    spill_gap = worst(t_spill, t_spilled)
    return {"restored_from": r.restored_from, "ttft_s": r.metrics.ttft_s,
            "spilled_to": decision, "spill_s": t_spilled - t_spill,
            "spill_gap_over_step": spill_gap / step,
            "load_s": r.metrics.queue_s, "median_step_s": step,
            "load_gap_over_step": load_gap / step, "turn_gap_over_step": turn_gap / step,
            "device_turn_gap_over_step": device_gap / step}


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
            print(f"round {r + 1} {c:6s} restored from {res['restored_from']} in "
                  f"{res['load_s'] * 1e3:.0f} ms, TTFT {res['ttft_s'] * 1e3:.0f} ms, step "
                  f"{res['median_step_s'] * 1e3:.1f} ms; worst gap / step: while loading "
                  f"{res['load_gap_over_step']:.2f}x, to the turn's first token "
                  f"{res['turn_gap_over_step']:.2f}x (the same turn from the device "
                  f"{res['device_turn_gap_over_step']:.2f}x); spill to "
                  f"{res['spilled_to']} in {res['spill_s'] * 1e3:.0f} ms, worst gap "
                  f"{res['spill_gap_over_step']:.2f}x", flush=True)

    def med(c, key):
        return median_range(runs[c], key)
    summary = {c: {k: med(c, k) for k in ("ttft_s", "load_s", "median_step_s",
                                          "load_gap_over_step", "turn_gap_over_step",
                                          "device_turn_gap_over_step", "spill_s",
                                          "spill_gap_over_step")} for c in configs}
    for c in configs:
        m, lo, hi = summary[c]["load_gap_over_step"]
        t, tlo, thi = summary[c]["turn_gap_over_step"]
        print(f"{c}: worst gap while the session loads / median step = {m:.2f}x (range "
              f"{lo:.2f}-{hi:.2f}; target <= 2x); up to its first token {t:.2f}x "
              f"({tlo:.2f}-{thi:.2f}; a turn from the device "
              f"{summary[c]['device_turn_gap_over_step'][0]:.2f}x), TTFT "
              f"{summary[c]['ttft_s'][0] * 1e3:.0f} ms; worst gap while it spills to disk "
              f"{summary[c]['spill_gap_over_step'][0]:.2f}x "
              f"({summary[c]['spill_gap_over_step'][1]:.2f}-"
              f"{summary[c]['spill_gap_over_step'][2]:.2f}), the spill "
              f"{summary[c]['spill_s'][0] * 1e3:.0f} ms")
    write_result("restore_overlap", {"baseline": args.baseline, "rounds": runs,
                                     "summary": summary, "history_tokens": HISTORY_TOKENS,
                                     "decoders": NUM_DECODERS})
    if args.plot:
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(5, 4))
        keys = ("load_gap_over_step", "turn_gap_over_step", "spill_gap_over_step")
        for i, key in enumerate(keys):
            ax.bar([j + 0.28 * i for j in range(len(configs))],
                   [summary[c][key][0] for c in configs], 0.28, label=key.split("_")[0])
        ax.set_xticks([j + 0.28 for j in range(len(configs))], configs)
        ax.axhline(2.0, color="gray", linestyle="--", label="target")
        ax.set_title("worst decode gap / step, 6k-token disk restore and spill")
        ax.legend()
        save_figure(fig, "restore_overlap")


if __name__ == "__main__":
    main()
