"""Decode against llama.cpp in paired rounds: kvsession and llama.cpp each loaded once, in a
process of its own, on the same random-weight checkpoints as bench/real_shapes.py (the
exact Qwen3-0.6B and Llama-3.2-1B configs; llama.cpp's GGUF made by its own converter from
the same safetensors), then asked for decode rounds in turn:

    kvsession bf16 (dtype="auto")      against  llama.cpp bf16
    kvsession int8 (quantization=int8) against  llama.cpp q8_0

Why paired: this VM's DRAM read rate moves between ~30 and ~85 GB/s from one phase of a
run to the next, and a batch-1 step follows it (it streams every weight), so two engines
measured minutes apart compare two machines (bench/real_shapes.py runs each engine in its
own child, one after the other: llama.cpp's batch-1 rate on the same GGUF read 25.9 and
33.1 tok/s in two runs of this session). Here each round runs both engines back to back,
their order alternating from round to round (ABBA: a drift within a round weighs on both
sides alike), with a bandwidth sample before each; the ratio is taken per round, and the
report is the median of the rounds' ratios with their range.

A round at batch B: the decode seconds of N steps of B sequences (decode_rates.decode_s:
8 + N tokens minus 8, greedy, eos ignored; the same prompts every round). Ratio: llama.cpp's
seconds / kvsession's (over 1: kvsession faster). x bound: a step's time against the bytes
it reads (kvsession's weight bytes, the GGUF's size) at the rate of the sample before it.

    python bench/vs_llama_cpp.py --llama-cpp-python /path/to/python \\
        --llama-cpp-src /path/to/llama.cpp [--rounds 8] [--plot]

(the two llama.cpp arguments as bench/real_shapes.py takes them). Writes
bench/results/vs_llama_cpp.json (`--name` another), with the CPU's vector capability (the
kernels take other paths with AVX512 and with AVX2 only), and with --plot a figure;
docs/benchmarks.md has the tables.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch
from common import RoundsProcess, pyplot, save_figure, write_result
from decode_rates import BATCHES
from real_shapes import LLAMA_CPP, Bandwidth, arguments, checkpoint, gguf

BENCH = Path(__file__).resolve().parent
PAIRS = {"kvsession bf16": "llama.cpp bf16", "kvsession int8": "llama.cpp q8_0"}
TIMEOUT_S = 900  # a load (a first compile included) or a round


def children(model: Path, ours: str, theirs: str, args) -> tuple[RoundsProcess, dict,
                                                                RoundsProcess, dict]:
    """Both engines loaded, one after the other (a load must not slow the other's), each
    with the facts it said when ready."""
    common = ["--decode-tokens", str(args.decode_tokens), "--answer-rounds"]
    a = RoundsProcess(str(BENCH / "real_shapes.py"), [
        "--child", str(model), ours, "--kv-cache-memory", args.kv_cache_memory, *common],
        TIMEOUT_S)
    facts_a = a.read()
    b = RoundsProcess(str(BENCH / "llama_cpp_child.py"), [
        str(gguf(model, LLAMA_CPP[theirs], args.llama_cpp_src)), "--threads",
        str(torch.get_num_threads()), *common], TIMEOUT_S, python=args.llama_cpp_python)
    facts_b = b.read()
    facts_b["weight_bytes"] = gguf(model, LLAMA_CPP[theirs], args.llama_cpp_src).stat().st_size
    return a, facts_a, b, facts_b


def paired(model: Path, ours: str, theirs: str, bw: Bandwidth, args) -> dict:
    """The pair's rounds: per batch, each engine's seconds, bandwidth and x bound per
    round, and the ratios."""
    a, facts_a, b, facts_b = children(model, ours, theirs, args)
    engines = {ours: (a, facts_a), theirs: (b, facts_b)}
    rounds: dict = {batch: [] for batch in BATCHES}
    try:
        for r in range(args.rounds):
            for batch in BATCHES:
                row = {}
                order = [ours, theirs] if r % 2 == 0 else [theirs, ours]
                for engine in order:
                    proc, facts = engines[engine]
                    rate = bw.sample_now()
                    seconds = proc.ask(batch)["elapsed_s"]
                    step_s = seconds / args.decode_tokens
                    row[engine] = {"seconds": seconds, "bandwidth_gb_s": rate / 1e9,
                                   "x_bound": step_s / (facts["weight_bytes"] / rate)}
                row["ratio"] = row[theirs]["seconds"] / row[ours]["seconds"]
                rounds[batch].append(row)
    finally:
        for proc in (a, b):
            proc.ask(None)
            proc.close()
    out: dict = {"facts": {ours: facts_a, theirs: facts_b}, "rounds": rounds}
    for batch, rows in rounds.items():
        ratios = [row["ratio"] for row in rows]
        out[f"b{batch}"] = {
            "ratio_median": statistics.median(ratios), "ratio_range": [min(ratios),
                                                                       max(ratios)],
            "rounds_ahead": sum(x >= 1 for x in ratios),
            **{engine: {
                "tok_s_median": statistics.median(
                    batch * args.decode_tokens / row[engine]["seconds"] for row in rows),
                "x_bound_median": statistics.median(row[engine]["x_bound"] for row in rows)}
               for engine in (ours, theirs)}}
    return out


def main() -> None:
    ap = arguments(rounds=8, llama_cpp_required=True)
    ap.description = __doc__.split("\n")[0]
    ap.add_argument("--pairs", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    ap.add_argument("--name", default="vs_llama_cpp",
                    help="the result's name (bench/results/NAME.json and .png): a run on "
                    "another CPU kind beside the first, e.g. vs_llama_cpp_avx2")
    args = ap.parse_args()
    bw = Bandwidth()
    results: dict = {}
    for shape in args.shapes:
        model = checkpoint(shape)
        results[shape] = {}
        for ours in args.pairs:
            theirs = PAIRS[ours]
            res = results[shape][ours] = paired(model, ours, theirs, bw, args)
            for batch in BATCHES:
                s = res[f"b{batch}"]
                lo, hi = s["ratio_range"]
                print(f"{shape:13s} {ours:15s} vs {theirs:15s} b{batch}: "
                      f"{s[ours]['tok_s_median']:6.1f} vs {s[theirs]['tok_s_median']:6.1f} "
                      f"tok/s, ratio {s['ratio_median']:.2f}x ({lo:.2f}-{hi:.2f}, ahead in "
                      f"{s['rounds_ahead']}/{args.rounds}); x bound {s[ours]['x_bound_median']:.2f}"
                      f" vs {s[theirs]['x_bound_median']:.2f}", flush=True)
    print(f"DRAM read bandwidth over the run's samples: best {bw.best / 1e9:.1f} GB/s, "
          f"median {statistics.median(bw.samples) / 1e9:.1f}")
    write_result(args.name, {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "decode_tokens": args.decode_tokens, "rounds": args.rounds,
        "bandwidth_best_gb_s": bw.best / 1e9,
        "bandwidth_median_gb_s": statistics.median(bw.samples) / 1e9, "shapes": results})
    if args.plot:
        plot(results, args.name)


def plot(results: dict, name: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (shape, pairs) in zip(axes[0], results.items(), strict=True):
        labels, x = [], 0
        for ours, res in pairs.items():
            for batch in BATCHES:
                ratios = [row["ratio"] for row in res["rounds"][batch]]
                ax.scatter([x] * len(ratios), ratios, s=14, alpha=0.6)
                ax.hlines(statistics.median(ratios), x - 0.3, x + 0.3, color="black")
                labels.append(f"{ours.split()[-1]} b{batch}")
                x += 1
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_yscale("log")  # a round the machine disturbed must not flatten the rest
        ax.set_xticks(range(len(labels)), labels)
        ax.set_ylabel("llama.cpp s / kvsession s (>1: kvsession faster)")
        ax.set_title(f"{shape}: decode, paired rounds")
    save_figure(fig, name)


if __name__ == "__main__":
    main()
