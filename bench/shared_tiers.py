"""Shared tiers: a mixed trace whose working set is ~4x the device pool, three ways.

The trace (seeded, the same for every configuration):
- 8 agents, each a Session with a shared 512-token system prompt, 6 turns of ~128-token
  user / tool messages and 16-token replies; between turns a tool wait drawn from a
  heavy-tailed distribution (lognormal, median 0.4 s, sigma 1.2, capped at 6 s), announced
  with `suspend(expected_idle_s=...)`;
- stateless RAG-style requests: 32 prompts, each one of 10 shared 2,048-token documents
  (Zipf popularity, exponent 1) plus a 64-token question, 16-token answers, arriving as a
  Poisson stream (mean gap 0.8 s), up to 4 in flight.

Device pool 8,192 tokens; documents (20k tokens) plus agents (~12k) are ~4x that. Host tier
64k tokens, no disk tier. Configurations, each in a fresh process:
- device: the device prefix cache alone (`host_cache_memory=0`);
- private: the engine before the host tier was content-indexed (`--baseline`, a git
  revision, run from a worktree): sessions spill to host blocks only they hold, a stateless
  request whose prefix the device evicted recomputes it;
- shared: this tree: the host tier indexed by content, what the device evicts kept there,
  any request's device miss looked up there.

Reports prompt tokens computed, tokens hit per tier, TTFT p50 / p99 (all requests: RAG and
agent turns) and the makespan, median over `--rounds` rounds (the order of the three
rotating each round) with their range. Targets: shared computes >= 2x fewer prompt tokens
than device, and its TTFT p99 is better than both. JSON + `--plot`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import MID_SIZE, mid_model, pyplot, save_figure, text_of, write_result

ROOT = Path(__file__).resolve().parents[1]
# the last revision whose host tier was session-private (before the content index landed)
BASELINE = "db28ed4"
CONFIGS = ("device", "private", "shared")

NUM_AGENTS, TURNS, SYSTEM_TOKENS, MESSAGE_TOKENS, REPLY_TOKENS = 8, 6, 512, 128, 16
NUM_DOCS, DOC_TOKENS, QUESTION_TOKENS, NUM_RAG, RAG_GAP_S, RAG_IN_FLIGHT = 10, 2048, 64, 32, \
    0.8, 4
DEVICE_TOKENS, HOST_TOKENS = 8192, 65536
TOOL_MEDIAN_S, TOOL_SIGMA, TOOL_CAP_S = 0.4, 1.2, 6.0


def trace(tokenizer, seed: int = 0) -> dict:
    """The workload, drawn once: agents' texts and tool waits, RAG prompts and arrivals."""
    rng = random.Random(seed)
    system = text_of(tokenizer, rng, SYSTEM_TOKENS)
    agents = [{"messages": [text_of(tokenizer, rng, MESSAGE_TOKENS) for _ in range(TURNS)],
               "waits": [min(TOOL_CAP_S, rng.lognormvariate(math.log(TOOL_MEDIAN_S),
                                                             TOOL_SIGMA))
                         for _ in range(TURNS)]} for _ in range(NUM_AGENTS)]
    docs = [[rng.randrange(4, 500) for _ in range(DOC_TOKENS)] for _ in range(NUM_DOCS)]
    weights = [1 / (i + 1) for i in range(NUM_DOCS)]
    rag, t = [], 0.0
    for _ in range(NUM_RAG):
        t += rng.expovariate(1 / RAG_GAP_S)
        doc = rng.choices(range(NUM_DOCS), weights)[0]
        rag.append({"at_s": t, "doc": doc,
                    "question": [rng.randrange(4, 500) for _ in range(QUESTION_TOKENS)]})
    return {"system": system, "agents": agents, "docs": docs, "rag": rag}


def run_one(config: str, model: Path) -> dict:
    """One configuration in this process (the caller chose which kvsession it imports)."""
    import kvsession
    from kvsession import LLM, SamplingParams

    print(f"{config}: kvsession from {Path(kvsession.__file__).parent}", flush=True)

    bpt = 2 * MID_SIZE["num_hidden_layers"] * MID_SIZE["num_key_value_heads"] \
        * MID_SIZE["head_dim"] * 4  # the mid model's float32 KV bytes per token
    host = 0 if config == "device" else HOST_TOKENS * bpt
    llm = LLM(model, kv_cache_memory=DEVICE_TOKENS * bpt, host_cache_memory=host,
              max_model_len=4096)
    w = trace(llm.tokenizer)
    params = SamplingParams(max_tokens=REPLY_TOKENS, temperature=0.0, ignore_eos=True)
    ttfts: list[tuple[str, float]] = []
    lock = threading.Lock()

    def agent(a: dict) -> None:
        with llm.session(system=w["system"], sampling=params) as s:
            for msg, wait in zip(a["messages"], a["waits"], strict=True):
                r = s.send(msg)
                with lock:
                    ttfts.append(("agent", r.metrics.ttft_s))
                s.suspend(expected_idle_s=wait)
                time.sleep(wait)  # the tool runs

    def rag_request(q: dict) -> None:
        out = llm.generate(prompt_token_ids=[w["docs"][q["doc"]] + q["question"]],
                           sampling_params=params, use_tqdm=False)[0]
        with lock:
            ttfts.append(("rag", out.metrics.ttft_s))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=agent, args=(a,)) for a in w["agents"]]
    for th in threads:
        th.start()
    with ThreadPoolExecutor(RAG_IN_FLIGHT) as pool:
        futures = []
        for q in w["rag"]:
            delay = q["at_s"] - (time.perf_counter() - t0)
            if delay > 0:
                time.sleep(delay)  # the trace's arrival time
            futures.append(pool.submit(rag_request, q))
        for f in futures:
            f.result()
    for th in threads:
        th.join()
    makespan = time.perf_counter() - t0
    st = llm.stats()
    host_stats = st.tiers["host"]
    llm.close()
    all_s = sorted(t for _, t in ttfts)

    def pct(xs, p):
        return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]
    return {"config": config, "makespan_s": makespan, "prefill_tokens": st.prefill_tokens,
            "device_hit_tokens": st.prefix.hit_tokens,
            "host_hit_tokens": getattr(host_stats, "hit_tokens", None),
            "host_bytes_written": getattr(host_stats, "bytes_written", None),
            "restores": dict(st.restores), "spills": dict(st.spills),
            "evictions_by_copy": dict(st.prefix.evictions_by_copy),
            "ttft_p50_s": pct(all_s, 50), "ttft_p99_s": pct(all_s, 99),
            "rag_ttft_p99_s": pct(sorted(t for k, t in ttfts if k == "rag"), 99),
            "agent_ttft_p99_s": pct(sorted(t for k, t in ttfts if k == "agent"), 99)}


def child(config: str, tree: Path, model: Path) -> dict:
    """`run_one` in a fresh process importing kvsession from `tree`."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(ROOT / "bench")])}
        subprocess.run([sys.executable, __file__, "--one", config, "--model", str(model),
                        "--out", out.name], env=env, check=True, cwd=tree)
        return json.loads(Path(out.name).read_text())


def baseline_tree(rev: str) -> Path:
    """A worktree of `rev` (kept between runs in ~/.cache/kvsession, outside the tree)."""
    path = Path.home() / ".cache" / "kvsession" / f"baseline-{rev}"
    if not (path / "kvsession").is_dir():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev],
                       check=True)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--baseline", default=BASELINE, help="git revision of 'private'")
    ap.add_argument("--plot", action="store_true")
    ap.add_argument("--one", choices=CONFIGS, help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        args.out.write_text(json.dumps(run_one(args.one, args.model)))
        return
    model = mid_model()
    trees = {"device": ROOT, "private": baseline_tree(args.baseline), "shared": ROOT}
    runs: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    for r in range(args.rounds):
        order = CONFIGS[r % 3:] + CONFIGS[:r % 3]
        for c in order:
            res = child(c, trees[c], model)
            runs[c].append(res)
            print(f"round {r + 1} {c:8s} makespan {res['makespan_s']:.1f} s, prefill "
                  f"{res['prefill_tokens']} tokens, hits device {res['device_hit_tokens']} "
                  f"host {res['host_hit_tokens']}, TTFT p50 {res['ttft_p50_s'] * 1e3:.0f} "
                  f"p99 {res['ttft_p99_s'] * 1e3:.0f} ms", flush=True)

    def med(c, key):
        xs = [x[key] for x in runs[c] if x[key] is not None]
        return (statistics.median(xs), min(xs), max(xs)) if xs else (None, None, None)
    summary = {c: {k: med(c, k) for k in ("makespan_s", "prefill_tokens",
                                          "device_hit_tokens", "host_hit_tokens",
                                          "ttft_p50_s", "ttft_p99_s", "rag_ttft_p99_s",
                                          "agent_ttft_p99_s")} for c in CONFIGS}
    fewer = summary["device"]["prefill_tokens"][0] / summary["shared"]["prefill_tokens"][0]
    p99 = {c: summary[c]["ttft_p99_s"][0] for c in CONFIGS}
    print(f"prompt tokens computed: device / shared = {fewer:.2f}x (target >= 2x)")
    print(f"TTFT p99: device {p99['device'] * 1e3:.0f} ms, private {p99['private'] * 1e3:.0f} "
          f"ms, shared {p99['shared'] * 1e3:.0f} ms (target: shared best)")
    write_result("shared_tiers", {"baseline": args.baseline, "rounds": runs,
                                  "summary": summary, "fewer_prefill_vs_device": fewer,
                                  "device_tokens": DEVICE_TOKENS, "host_tokens": HOST_TOKENS})
    if args.plot:
        plt = pyplot()
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        a1.bar(CONFIGS, [summary[c]["prefill_tokens"][0] for c in CONFIGS])
        a1.set_title("prompt tokens computed")
        for i, key in enumerate(("ttft_p50_s", "ttft_p99_s")):
            a2.bar([j + 0.4 * i for j in range(3)], [summary[c][key][0] * 1e3 for c in CONFIGS],
                   0.4, label=key[5:8])
        a2.set_xticks([j + 0.2 for j in range(3)], CONFIGS)
        a2.set_title("TTFT ms")
        a2.legend()
        save_figure(fig, "shared_tiers")


if __name__ == "__main__":
    main()
