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

`--workload agents`: which idle session moves when the device is short. 16 agents, 8 turns,
no RAG; the same heavy-tailed tool waits (sigma 1.5, capped at 8 s), announced; a host tier
of 4,096 tokens (what does not fit there is dropped and recomputed). Configurations:
- last_use: the revision before sessions kept their expected return (`--baseline-order`):
  reclaim spills the least recently used session;
- expected: this tree: the one expected back last per reload cost, keeps with a TTL.
Reports the makespan and TTFT p99 of agent turns, prompt tokens computed.
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
# the last revision whose host tier was session-private (before the content index landed),
# and the last whose reclaim ordered sessions by last use
BASELINE, BASELINE_ORDER = "db28ed4", "a26d440"
SYSTEM_TOKENS, MESSAGE_TOKENS, REPLY_TOKENS = 512, 128, 16
NUM_DOCS, DOC_TOKENS, QUESTION_TOKENS, RAG_GAP_S, RAG_IN_FLIGHT = 10, 2048, 64, 0.8, 4
TOOL_MEDIAN_S = 0.4
# per workload: agents, turns, RAG requests, device and host tokens, tool-wait tail, and
# each configuration's (engine: "this" tree or "baseline" / "baseline_order", host tier)
WORKLOADS = {
    "mixed": {"agents": 8, "turns": 6, "rag": 32, "device": 8192, "host": 65536,
              "sigma": 1.2, "cap_s": 6.0,
              "configs": {"device": ("this", False), "private": ("baseline", True),
                          "shared": ("this", True)}},
    "agents": {"agents": 16, "turns": 8, "rag": 0, "device": 8192, "host": 4096,
               "sigma": 1.5, "cap_s": 8.0,
               "configs": {"last_use": ("baseline_order", True),
                           "expected": ("this", True)}},
}


def trace(tokenizer, w: dict, seed: int = 0) -> dict:
    """The workload, drawn once: agents' texts and tool waits, RAG prompts and arrivals."""
    rng = random.Random(seed)
    system = text_of(tokenizer, rng, SYSTEM_TOKENS)
    agents = [{"messages": [text_of(tokenizer, rng, MESSAGE_TOKENS) for _ in range(w["turns"])],
               "waits": [min(w["cap_s"], rng.lognormvariate(math.log(TOOL_MEDIAN_S),
                                                             w["sigma"]))
                         for _ in range(w["turns"])]} for _ in range(w["agents"])]
    docs = [[rng.randrange(4, 500) for _ in range(DOC_TOKENS)] for _ in range(NUM_DOCS)]
    weights = [1 / (i + 1) for i in range(NUM_DOCS)]
    rag, t = [], 0.0
    for _ in range(w["rag"]):
        t += rng.expovariate(1 / RAG_GAP_S)
        doc = rng.choices(range(NUM_DOCS), weights)[0]
        rag.append({"at_s": t, "doc": doc,
                    "question": [rng.randrange(4, 500) for _ in range(QUESTION_TOKENS)]})
    return {"system": system, "agents": agents, "docs": docs, "rag": rag}


def run_one(workload: str, config: str, model: Path) -> dict:
    """One configuration in this process (the caller chose which kvsession it imports)."""
    import kvsession
    from kvsession import LLM, SamplingParams
    from kvsession.metrics import percentile

    print(f"{config}: kvsession from {Path(kvsession.__file__).parent}", flush=True)

    bpt = 2 * MID_SIZE["num_hidden_layers"] * MID_SIZE["num_key_value_heads"] \
        * MID_SIZE["head_dim"] * 4  # the mid model's float32 KV bytes per token
    spec = WORKLOADS[workload]
    host = spec["host"] * bpt if spec["configs"][config][1] else 0
    llm = LLM(model, kv_cache_memory=spec["device"] * bpt, host_cache_memory=host,
              max_model_len=4096)
    w = trace(llm.tokenizer, spec)
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
    all_s = [t for _, t in ttfts]
    return {"config": config, "makespan_s": makespan, "prefill_tokens": st.prefill_tokens,
            "device_hit_tokens": st.prefix.hit_tokens,
            "host_hit_tokens": getattr(host_stats, "hit_tokens", None),
            "host_bytes_written": getattr(host_stats, "bytes_written", None),
            # bytes written to the host / KV bytes the run produced (its prompt tokens
            # computed and tokens generated): the host tier's write amplification
            "host_write_amplification": getattr(host_stats, "bytes_written", 0)
            / ((st.prefill_tokens + st.generated_tokens) * bpt),
            "restores": dict(st.restores), "spills": dict(st.spills),
            "evictions_by_copy": dict(st.prefix.evictions_by_copy),
            "ttft_p50_s": percentile(all_s, 50), "ttft_p99_s": percentile(all_s, 99),
            "rag_ttft_p99_s": percentile([t for k, t in ttfts if k == "rag"], 99)
            if spec["rag"] else None,
            "agent_ttft_p99_s": percentile([t for k, t in ttfts if k == "agent"], 99)}


def child(workload: str, config: str, tree: Path, model: Path) -> dict:
    """`run_one` in a fresh process importing kvsession from `tree`."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(ROOT / "bench")])}
        subprocess.run([sys.executable, __file__, "--workload", workload, "--one", config,
                        "--model", str(model), "--out", out.name], env=env, check=True,
                       cwd=tree)
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
    ap.add_argument("--workload", choices=WORKLOADS, default="mixed")
    ap.add_argument("--baseline", default=BASELINE, help="git revision of 'private'")
    ap.add_argument("--baseline-order", default=BASELINE_ORDER,
                    help="git revision of 'last_use'")
    ap.add_argument("--plot", action="store_true")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        args.out.write_text(json.dumps(run_one(args.workload, args.one, args.model)))
        return
    model = mid_model()
    spec = WORKLOADS[args.workload]
    configs = tuple(spec["configs"])
    engines = {"this": ROOT, "baseline": args.baseline, "baseline_order": args.baseline_order}
    trees = {c: engines[e] if e == "this" else baseline_tree(engines[e])
             for c, (e, _) in spec["configs"].items()}
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    for r in range(args.rounds):
        k = r % len(configs)
        for c in configs[k:] + configs[:k]:
            res = child(args.workload, c, trees[c], model)
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
                                          "agent_ttft_p99_s")} for c in configs}
    if args.workload == "agents":
        lu, ex = summary["last_use"], summary["expected"]
        print(f"expected return vs last use: makespan {ex['makespan_s'][0]:.1f} / "
              f"{lu['makespan_s'][0]:.1f} s, agent TTFT p99 "
              f"{ex['agent_ttft_p99_s'][0] * 1e3:.0f} / {lu['agent_ttft_p99_s'][0] * 1e3:.0f} ms")
        write_result("expected_return", {"baseline_order": args.baseline_order,
                                         "rounds": runs, "summary": summary,
                                         "workload": {k: v for k, v in spec.items()
                                                      if k != "configs"}})
        if args.plot:
            plt = pyplot()
            fig, (a1, a2) = plt.subplots(1, 2, figsize=(8, 4))
            a1.bar(configs, [summary[c]["makespan_s"][0] for c in configs])
            a1.set_title("makespan s")
            a2.bar(configs, [summary[c]["agent_ttft_p99_s"][0] * 1e3 for c in configs])
            a2.set_title("agent turn TTFT p99 ms")
            save_figure(fig, "expected_return")
        return
    fewer = summary["device"]["prefill_tokens"][0] / summary["shared"]["prefill_tokens"][0]
    p99 = {c: summary[c]["ttft_p99_s"][0] for c in configs}
    print(f"prompt tokens computed: device / shared = {fewer:.2f}x (target >= 2x)")
    print(f"TTFT p99: device {p99['device'] * 1e3:.0f} ms, private {p99['private'] * 1e3:.0f} "
          f"ms, shared {p99['shared'] * 1e3:.0f} ms (target: shared best)")
    write_result("shared_tiers", {"baseline": args.baseline, "rounds": runs,
                                  "summary": summary, "fewer_prefill_vs_device": fewer,
                                  "device_tokens": spec["device"],
                                  "host_tokens": spec["host"]})
    if args.plot:
        plt = pyplot()
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        a1.bar(configs, [summary[c]["prefill_tokens"][0] for c in configs])
        a1.set_title("prompt tokens computed")
        for i, key in enumerate(("ttft_p50_s", "ttft_p99_s")):
            a2.bar([j + 0.4 * i for j in range(3)], [summary[c][key][0] * 1e3 for c in configs],
                   0.4, label=key[5:8])
        a2.set_xticks([j + 0.2 for j in range(3)], configs)
        a2.set_title("TTFT ms")
        a2.legend()
        save_figure(fig, "shared_tiers")


if __name__ == "__main__":
    main()
