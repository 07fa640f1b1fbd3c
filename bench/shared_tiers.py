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

`--workload disk`: the mixed trace (48 RAG requests) over a host tier too small for the
documents (8,192 tokens) and a `session_dir` (the agents' logs and segments written behind
their turns, as a durable deployment writes them). Configurations:
- host: the host tier alone below the device;
- host_disk: plus the disk cache (`disk_cache_memory`, 65,536 tokens): what the host evicts
  after it was used twice goes there, any request's miss is looked up there.
Reports prompt tokens computed, hits per tier, TTFT p50 / p99, and the disk's write
amplification: bytes written to session_dir (cache slots, segments, snapshots) / KV bytes
the run produced (prompt tokens computed + tokens generated, times bytes per token), with
the cache's share.

`--workload ahead`: the disk workload's trace and tiers, two engines: at_eviction, the
revision before copies ahead of eviction (`--baseline-ahead`: every device block the device
evicts is copied to the host, and every host block the host evicts to the disk cache, as the
eviction happens, on the engine thread while the step waits); ahead, this tree (the copier
copies the next victims before). Reports blocks copied at eviction and ahead per tier,
TTFT p50 / p99, prompt tokens computed.
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
# the last revision that copied every push-down (device -> host, host -> disk cache) as the
# eviction happened, on the engine thread
BASELINE_AHEAD = "5c1d03a"
SYSTEM_TOKENS, MESSAGE_TOKENS, REPLY_TOKENS = 512, 128, 16
NUM_DOCS, DOC_TOKENS, QUESTION_TOKENS, RAG_GAP_S, RAG_IN_FLIGHT = 10, 2048, 64, 0.8, 4
TOOL_MEDIAN_S = 0.4
# per workload: agents, turns, RAG requests, device, host and disk cache tokens, tool-wait
# tail, and each configuration's (engine: "this" tree or "baseline" / "baseline_order",
# host tier, disk: None, "dir" (a session_dir) or "cache" (and the disk cache))
WORKLOADS = {
    "mixed": {"agents": 8, "turns": 6, "rag": 32, "device": 8192, "host": 65536,
              "sigma": 1.2, "cap_s": 6.0,
              "configs": {"device": ("this", False, None), "private": ("baseline", True, None),
                          "shared": ("this", True, None)}},
    "agents": {"agents": 16, "turns": 8, "rag": 0, "device": 8192, "host": 4096,
               "sigma": 1.5, "cap_s": 8.0,
               "configs": {"last_use": ("baseline_order", True, None),
                           "expected": ("this", True, None)}},
    "disk": {"agents": 8, "turns": 6, "rag": 48, "device": 8192, "host": 8192,
             "disk_cache": 65536, "sigma": 1.2, "cap_s": 6.0,
             "configs": {"host": ("this", True, "dir"), "host_disk": ("this", True, "cache")}},
    "ahead": {"agents": 8, "turns": 6, "rag": 48, "device": 8192, "host": 8192,
              "disk_cache": 65536, "sigma": 1.2, "cap_s": 6.0,
              "configs": {"at_eviction": ("baseline_ahead", True, "cache"),
                          "ahead": ("this", True, "cache")}},
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
    _, with_host, disk = spec["configs"][config]
    host = spec["host"] * bpt if with_host else 0
    disk_kw = {}
    if disk is not None:
        disk_kw["session_dir"] = tempfile.mkdtemp(prefix="kvsession-bench-")
    if disk == "cache":
        # slots carry a header and 4 KiB padding: the budget counts them
        disk_kw["disk_cache_memory"] = spec["disk_cache"] * bpt * 5 // 4
    llm = LLM(model, kv_cache_memory=spec["device"] * bpt, host_cache_memory=host,
              max_model_len=4096, **disk_kw)
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
    host_stats, disk_stats = st.tiers["host"], st.tiers["disk"]
    cache_written = getattr(disk_stats, "cache_bytes_written", 0)
    llm.close()
    produced = (st.prefill_tokens + st.generated_tokens) * bpt  # KV bytes the run made
    all_s = [t for _, t in ttfts]
    return {"config": config, "makespan_s": makespan, "prefill_tokens": st.prefill_tokens,
            "device_hit_tokens": st.prefix.hit_tokens,
            "host_hit_tokens": getattr(host_stats, "hit_tokens", None),
            "host_bytes_written": getattr(host_stats, "bytes_written", None),
            # device blocks copied to the host as they were evicted (the step waiting) and
            # ahead of it, on the copier
            "host_copied_at_eviction": getattr(host_stats, "blocks_copied_at_eviction", None),
            "host_copied_ahead": getattr(host_stats, "blocks_copied_ahead", None),
            "disk_copied_at_eviction": getattr(disk_stats, "blocks_copied_at_eviction", None),
            "disk_copied_ahead": getattr(disk_stats, "blocks_copied_ahead", None),
            # bytes written to the host / KV bytes the run produced (its prompt tokens
            # computed and tokens generated): the host tier's write amplification
            "host_write_amplification": getattr(host_stats, "bytes_written", 0) / produced,
            "disk_hit_tokens": getattr(disk_stats, "hit_tokens", None),
            "disk_write_amplification": getattr(disk_stats, "bytes_written", 0) / produced,
            "disk_cache_write_amplification": cache_written / produced,
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


def two_bars(summary: dict, left: tuple[str, str, float], right: tuple[str, str, float],
             name: str) -> None:
    """Two bar panels over the configurations: (summary key, title, scale) each."""
    configs = list(summary)
    fig, axes = pyplot().subplots(1, 2, figsize=(8, 4))
    for ax, (key, title, scale) in zip(axes, (left, right), strict=True):
        ax.bar(configs, [summary[c][key][0] * scale for c in configs])
        ax.set_title(title)
    save_figure(fig, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workload", choices=WORKLOADS, default="mixed")
    ap.add_argument("--baseline", default=BASELINE, help="git revision of 'private'")
    ap.add_argument("--baseline-order", default=BASELINE_ORDER,
                    help="git revision of 'last_use'")
    ap.add_argument("--baseline-ahead", default=BASELINE_AHEAD,
                    help="git revision of 'at_eviction'")
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
    engines = {"this": ROOT, "baseline": args.baseline, "baseline_order": args.baseline_order,
               "baseline_ahead": args.baseline_ahead}
    trees = {c: engines[e] if e == "this" else baseline_tree(engines[e])
             for c, (e, *_) in spec["configs"].items()}
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    for r in range(args.rounds):
        k = r % len(configs)
        for c in configs[k:] + configs[:k]:
            res = child(args.workload, c, trees[c], model)
            runs[c].append(res)
            print(f"round {r + 1} {c:8s} makespan {res['makespan_s']:.1f} s, prefill "
                  f"{res['prefill_tokens']} tokens, hits device {res['device_hit_tokens']} "
                  f"host {res['host_hit_tokens']} disk {res.get('disk_hit_tokens')}, TTFT p50 "
                  f"{res['ttft_p50_s'] * 1e3:.0f} "
                  f"p99 {res['ttft_p99_s'] * 1e3:.0f} ms", flush=True)

    def med(c, key):
        xs = [x[key] for x in runs[c] if x[key] is not None]
        return (statistics.median(xs), min(xs), max(xs)) if xs else (None, None, None)
    summary = {c: {k: med(c, k) for k in ("makespan_s", "prefill_tokens",
                                          "device_hit_tokens", "host_hit_tokens",
                                          "ttft_p50_s", "ttft_p99_s", "rag_ttft_p99_s",
                                          "agent_ttft_p99_s", "disk_hit_tokens",
                                          "disk_write_amplification",
                                          "disk_cache_write_amplification",
                                          "host_copied_at_eviction", "host_copied_ahead",
                                          "disk_copied_at_eviction", "disk_copied_ahead")}
               for c in configs}
    if args.workload == "disk":
        h, hd = summary["host"], summary["host_disk"]
        fewer = h["prefill_tokens"][0] / hd["prefill_tokens"][0]
        print(f"disk cache: prompt tokens computed {hd['prefill_tokens'][0]} vs "
              f"{h['prefill_tokens'][0]} without ({fewer:.2f}x fewer), disk hits "
              f"{hd['disk_hit_tokens'][0]} tokens, TTFT p99 "
              f"{hd['ttft_p99_s'][0] * 1e3:.0f} vs {h['ttft_p99_s'][0] * 1e3:.0f} ms; write "
              f"amplification {hd['disk_write_amplification'][0]:.2f} (cache "
              f"{hd['disk_cache_write_amplification'][0]:.2f}) vs "
              f"{h['disk_write_amplification'][0]:.2f}")
        write_result("disk_cache", {"rounds": runs, "summary": summary,
                                    "workload": {k: v for k, v in spec.items()
                                                 if k != "configs"}})
        if args.plot:
            two_bars(summary, ("prefill_tokens", "prompt tokens computed", 1),
                     ("ttft_p99_s", "TTFT p99 ms", 1e3), "disk_cache")
        return
    if args.workload == "ahead":
        at, ah = summary["at_eviction"], summary["ahead"]
        print(f"copies ahead: TTFT p50 {ah['ttft_p50_s'][0] * 1e3:.0f} vs "
              f"{at['ttft_p50_s'][0] * 1e3:.0f} ms, p99 {ah['ttft_p99_s'][0] * 1e3:.0f} vs "
              f"{at['ttft_p99_s'][0] * 1e3:.0f} ms, prompt tokens {ah['prefill_tokens'][0]} vs "
              f"{at['prefill_tokens'][0]}; blocks copied at eviction / ahead: host "
              f"{ah['host_copied_at_eviction'][0]:.0f} / {ah['host_copied_ahead'][0]:.0f}, "
              f"disk {ah['disk_copied_at_eviction'][0]:.0f} / {ah['disk_copied_ahead'][0]:.0f}")
        write_result("clean_ahead", {"baseline_ahead": args.baseline_ahead, "rounds": runs,
                                     "summary": summary,
                                     "workload": {k: v for k, v in spec.items()
                                                  if k != "configs"}})
        if args.plot:
            two_bars(summary, ("ttft_p50_s", "TTFT p50 ms", 1e3),
                     ("ttft_p99_s", "TTFT p99 ms", 1e3), "clean_ahead")
        return
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
            two_bars(summary, ("makespan_s", "makespan s", 1),
                     ("agent_ttft_p99_s", "agent turn TTFT p99 ms", 1e3), "expected_return")
        return
    fewer = summary["device"]["prefill_tokens"][0] / summary["shared"]["prefill_tokens"][0]
    p99 = {c: summary[c]["ttft_p99_s"][0] for c in configs}
    print(f"prompt tokens computed: device / shared = {fewer:.2f}x (target >= 2x)")
    print(f"TTFT p99: device {p99['device'] * 1e3:.0f} ms, private {p99['private'] * 1e3:.0f} "
          f"ms, shared {p99['shared'] * 1e3:.0f} ms (target: shared best)")
    at, ahead = (summary["shared"][k][0] for k in ("host_copied_at_eviction",
                                                   "host_copied_ahead"))
    if at is not None and ahead is not None:
        print(f"evicted device blocks copied to the host: {at:.0f} as they were evicted (the "
              f"step waiting), {ahead:.0f} ahead on the copier")
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
