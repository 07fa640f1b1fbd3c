"""Agent workload: 8 sessions x 6 turns sharing a 1,024-token system prompt; each turn adds
~128 tokens (user / tool message) and generates 32. Same mid-size random model, four ways:

- kvsession, history="append" (the default): one Session per agent, driven concurrently
  from 8 threads; the session's token log is the truth, a turn computes the template's
  delta for the new message plus one token;
- kvsession, history="template": the same, re-rendering the conversation every turn;
- transformers naive: each turn re-sends the whole history to `generate`;
- transformers best case: each conversation carries its own `past_key_values`.

Replies are greedy with a logit bias on the tokenizer's 512 text ids (the same bias in
every engine): the random model's own 32,000-id vocabulary would mostly produce ids the
tokenizer cannot decode, replies that vanish from a re-rendered conversation. With text
replies, re-rendering re-tokenises them differently, as with a real BPE model (template
history diverges inside every reply; the naive peer re-sends them). `--raw-replies` runs
the unbiased workload of results before history="append".

Reports prompt tokens computed / ideal for both history modes (ideal: the tokens each turn
adds, plus the shared system prompt once; target <= 1.01 in append mode) and vs the exact
minimum (what any prefix cache must recompute given the prompts the mode builds), makespan
ratios of append-history sessions (targets: >= 5x vs naive, >= 1.5x vs best case) and vs
template history, per-turn TTFT p50/p95. JSON + `--plot`; `--quick` runs each mode once.

The kvsession side runs in fresh processes (thread pools, allocator and scheduler state are
per process: a slow mode decided at start-up would hide inside one process): `--runs`
(default 5) with append history and `--template-runs` (default 2) with template history,
interleaved, each with the process's user CPU and the engine thread's CPU; the best run of
each mode is the one compared, and the spread of the append runs (largest deviation from
the median, target <= 15%) says whether identical runs take the same time. The cores may be
shared: the load average is recorded before and after each part.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import threading
import time

import torch
from common import mid_model, pyplot, save_figure, text_of, write_result

from kvsession import LLM, SamplingParams
from kvsession.history import ChatRenderer
from kvsession.metrics import percentile
from kvsession.session import common_prefix_len

NEW_TOKENS = 32
# added to the logits of the tokenizer's own text tokens: the random model's vocabulary
# (32,000 ids) is far larger than its tokenizer's (512), and a reply of ids the tokenizer
# cannot decode would vanish from any re-rendered conversation
REPLY_BIAS = 100.0


def reply_vocab(tokenizer) -> list[int]:
    """The token ids that decode to text (the tokenizer's, less its special tokens)."""
    return [i for i in range(tokenizer.vocab_size) if tokenizer.decode([i])]


def turn_messages(tokenizer, sessions: int, turns: int) -> list[list[dict]]:
    rng = random.Random(0)
    out = []
    for i in range(sessions):
        msgs = []
        for t in range(turns):
            role = "user" if t % 2 == 0 else "tool"
            msgs.append({"role": role, "content": f"agent {i} turn {t}: "
                         + text_of(tokenizer, rng, 120)})
        out.append(msgs)
    return out


def run_kvsession(llm, system, convs, history: str, raw_replies: bool = False):
    """Drive one session per agent from its own thread. Accounting per turn, from the
    session's token log (`s.token_ids`: the turn's prompt then its reply):

    - computed: `Reply.prefill_tokens`;
    - ideal: the tokens the turn adds: its prompt minus everything the session had computed
      before it (the previous prompt and reply, less the reply's last token, which no step
      has written KV for yet); on a first turn, the prompt after the shared system prompt.
      In append history that is exactly the template's delta for the new message plus one
      token; in template history it is what the turn adds after re-rendering;
    - exact minimum: the prompt minus its longest common prefix with the KV held before the
      turn (the system prompt's whole blocks on a first turn): what any prefix cache must
      recompute for this prompt.

    The system prompt is computed once for every session (the pin made by the first
    session); its length counts once in the ideal, and the engine's own count of prompt
    tokens computed (`llm.stats().prefill_tokens`, which includes that pin) is the total."""
    bias = None if raw_replies else dict.fromkeys(reply_vocab(llm.tokenizer), REPLY_BIAS)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
                            logit_bias=bias)
    turns = len(convs[0])
    ttfts = [[None] * turns for _ in convs]
    computed = [[0] * turns for _ in convs]
    ideal = [[0] * turns for _ in convs]
    exact_min = [[0] * turns for _ in convs]
    diverged = [0] * len(convs)

    def agent(i):
        with llm.session(system=system, sampling=params, history=history) as s:
            held = system_ids[:pinned]  # tokens whose KV the session can use
            for t, msg in enumerate(convs[i]):
                before = len(s.token_ids)
                r = s.send(msg)
                prompt = s.token_ids[:len(s.token_ids) - len(r.token_ids)]
                ttfts[i][t] = r.metrics.ttft_s
                computed[i][t] = r.prefill_tokens
                ideal[i][t] = len(prompt) - (before - 1 if t else len(system_ids))
                exact_min[i][t] = len(prompt) - min(common_prefix_len(held, prompt),
                                                    len(prompt) - 1)
                diverged[i] += r.diverged_at is not None
                held = s.token_ids[:-1]

    system_ids = ChatRenderer(llm.tokenizer).system_prefix(system)
    pinned = len(system_ids) // llm.config.block_size * llm.config.block_size
    engine0 = llm.stats().prefill_tokens
    t0 = time.perf_counter()
    threads = [threading.Thread(target=agent, args=(i,)) for i in range(len(convs))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    makespan = time.perf_counter() - t0
    engine = llm.stats().prefill_tokens - engine0
    replies = sum(map(sum, computed))
    per_turn = [sum(col) for col in zip(*computed, strict=True)]
    return {"history": history, "makespan_s": makespan, "ttft_s": ttfts,
            # every prompt token the engine computed: the system pin and every turn
            "prefill_tokens": engine,
            "reply_prefill_tokens": replies,  # sum of Reply.prefill_tokens
            "system_prefix_tokens": len(system_ids),
            "system_pin_computed_tokens": engine - replies,
            "ideal_tokens": sum(map(sum, ideal)) + len(system_ids),
            "exact_min_tokens": sum(map(sum, exact_min)) + len(system_ids),
            "turn_ideal_tokens": sum(map(sum, ideal)),
            "prefill_per_turn": per_turn,
            "ideal_per_turn": [sum(col) for col in zip(*ideal, strict=True)],
            "turns_above_ideal": sum(c > d for row_c, row_d in zip(computed, ideal, strict=True)
                                     for c, d in zip(row_c, row_d, strict=True)),
            "turns_diverged": sum(diverged)}


class FirstTokenClock:
    """A logits processor that notes when the first token's logits exist (= TTFT)."""

    def __init__(self):
        self.t = None

    def __call__(self, input_ids, scores):
        if self.t is None:
            self.t = time.perf_counter()
        return scores


class VocabBias:
    """A logits processor adding REPLY_BIAS to the same ids as kvsession's logit_bias."""

    def __init__(self, ids: list[int], vocab: int):
        self.bias = torch.zeros(vocab)
        self.bias[ids] = REPLY_BIAS

    def __call__(self, input_ids, scores):
        return scores + self.bias


def run_hf(model, tokenizer, system, convs, carry_cache: bool, raw_replies: bool = False):
    from transformers import DynamicCache, LogitsProcessorList

    ttfts = [[None] * len(c) for c in convs]
    computed = 0
    state = [None] * len(convs)  # best case: (token ids so far, cache)
    bias = VocabBias(reply_vocab(tokenizer), model.config.vocab_size)
    histories = [[{"role": "system", "content": system}] for _ in convs]
    r0, load0 = resource.getrusage(resource.RUSAGE_SELF), os.getloadavg()[0]
    t0 = time.perf_counter()
    for t in range(len(convs[0])):  # round-robin: the agents interleave
        for i, conv in enumerate(convs):
            histories[i].append(conv[t])
            if carry_cache and state[i] is not None:
                prev_ids, cache = state[i]
                turn = tokenizer.encode_chat(histories[i][-1:])  # this turn's tokens
                ids = prev_ids + tokenizer.encode("<|im_end|>\n", add_special_tokens=False) \
                    + turn
            else:
                ids, cache = tokenizer.encode_chat(histories[i]), None
                if carry_cache:
                    cache = DynamicCache()
            computed += len(ids) - (cache.get_seq_length() if cache is not None else 0)
            clock = FirstTokenClock()
            procs = [clock] if raw_replies else [clock, bias]
            start = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(
                    1, len(ids), dtype=torch.long), past_key_values=cache,
                    max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                    logits_processor=LogitsProcessorList(procs))
            ttfts[i][t] = clock.t - start
            gen = out[0, len(ids):].tolist()
            histories[i].append({"role": "assistant", "content": tokenizer.decode(gen)})
            if carry_cache:
                state[i] = (ids + gen, cache)
    makespan, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    return {"makespan_s": makespan, "ttft_s": ttfts, "prefill_tokens": computed,
            "user_cpu_s": r1.ru_utime - r0.ru_utime, "loadavg_1m": [load0, os.getloadavg()[0]]}


def thread_cpu_s(native_id: int) -> float:
    """CPU seconds (user + system) a thread of this process has used so far."""
    with open(f"/proc/self/task/{native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def kvsession_once(sessions: int, turns: int, history: str, raw_replies: bool) -> dict:
    """One kvsession run in this process, with its CPU use and the machine's load."""
    path = mid_model()
    llm = LLM(path, kv_cache_memory="2GiB", max_model_len=4096, max_num_seqs=16)
    tok = llm.tokenizer
    system = "You are a coding agent. " + text_of(tok, random.Random(1), 1010)
    convs = turn_messages(tok, sessions, turns)
    engine = llm._rt._loop._thread.native_id
    r0, e0, s0 = resource.getrusage(resource.RUSAGE_SELF), thread_cpu_s(engine), \
        llm._rt.engine.num_steps
    load0 = os.getloadavg()[0]
    out = run_kvsession(llm, system, convs, history, raw_replies)
    r1, e1 = resource.getrusage(resource.RUSAGE_SELF), thread_cpu_s(engine)
    out |= {"user_cpu_s": r1.ru_utime - r0.ru_utime, "sys_cpu_s": r1.ru_stime - r0.ru_stime,
            "engine_thread_cpu_s": e1 - e0, "steps": llm._rt.engine.num_steps - s0,
            "loadavg_1m": [load0, os.getloadavg()[0]]}
    llm.close()
    return out


def kvsession_runs(sessions: int, turns: int, plan: list[str], raw_replies: bool
                   ) -> list[dict]:
    """One kvsession run per entry of `plan` (a history mode), each in a fresh process."""
    out = []
    for i, history in enumerate(plan):
        proc = subprocess.run([sys.executable, __file__, "--once", "--sessions", str(sessions),
                               "--turns", str(turns), "--history", history]
                              + (["--raw-replies"] if raw_replies else []),
                              capture_output=True, text=True, check=True, timeout=1800)
        out.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        r = out[-1]
        print(f"kvsession run {i + 1}/{len(plan)} ({history}): makespan {r['makespan_s']:.2f} s,"
              f" user CPU {r['user_cpu_s']:.2f} s, engine thread "
              f"{r['engine_thread_cpu_s']:.2f} s, {r['steps']} steps, prompt tokens computed "
              f"{r['prefill_tokens']} / ideal {r['ideal_tokens']}, load "
              f"{r['loadavg_1m'][0]:.1f} -> {r['loadavg_1m'][1]:.1f}", flush=True)
    return out


def summary(r):
    flat = [x for row in r["ttft_s"] for x in row]
    return {"ttft_p50_s": percentile(flat, 50), "ttft_p95_s": percentile(flat, 95)}


def best_of(runs: list[dict]) -> dict:
    """The fastest run (the one compared), the median and the spread of the makespans."""
    spans = [r["makespan_s"] for r in runs]
    median = statistics.median(spans)
    best = min(runs, key=lambda r: r["makespan_s"])
    return {"best": {**best, **summary(best)}, "median_s": median,
            "spread": max(abs(x - median) for x in spans) / median}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--runs", type=int, default=5,
                    help="kvsession runs with history='append' (fresh processes)")
    ap.add_argument("--template-runs", type=int, default=2,
                    help="kvsession runs with history='template', interleaved with those")
    ap.add_argument("--quick", action="store_true",
                    help="one run of each history mode (about half the time)")
    ap.add_argument("--plot", action="store_true")
    ap.add_argument("--once", action="store_true", help=argparse.SUPPRESS)  # one run, JSON
    ap.add_argument("--history", default="append", help=argparse.SUPPRESS)  # with --once
    ap.add_argument("--raw-replies", action="store_true",
                    help="no logit bias: replies of ids the tokenizer cannot decode (the "
                         "workload before history='append'; they vanish when re-rendered)")
    args = ap.parse_args()
    if args.once:
        print(json.dumps(kvsession_once(args.sessions, args.turns, args.history,
                                        args.raw_replies)))
        return
    if args.quick:
        args.runs, args.template_runs = 1, 1
    from transformers import AutoModelForCausalLM

    path = mid_model()
    t_start, load = time.perf_counter(), {"start": os.getloadavg()}
    # interleaved, so that a change in the machine's load hits both modes alike
    plan = ["append"] * args.runs
    for k in range(args.template_runs):
        plan.insert(min(len(plan), 2 * k + 1), "template")
    runs = kvsession_runs(args.sessions, args.turns, plan, args.raw_replies)
    load["after_kvsession"] = os.getloadavg()
    modes = {h: best_of([r for r in runs if r["history"] == h]) for h in ("append",
                                                                           "template")}
    for h, m in modes.items():
        spans = [round(r["makespan_s"], 2) for r in runs if r["history"] == h]
        print(f"kvsession {h} makespans {spans}: best {m['best']['makespan_s']:.2f} s, median "
              f"{m['median_s']:.2f} s, spread +-{m['spread'] * 100:.0f}% of the median"
              + (" (target <= 15%)" if h == "append" else ""))
    ours, tmpl = modes["append"]["best"], modes["template"]["best"]
    from kvsession.model.tokenizer import Tokenizer

    tok = Tokenizer(path)
    system = "You are a coding agent. " + text_of(tok, random.Random(1), 1010)
    convs = turn_messages(tok, args.sessions, args.turns)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    naive = run_hf(hf, tok, system, convs, carry_cache=False,
                   raw_replies=args.raw_replies)
    load["after_hf_naive"] = os.getloadavg()
    best = run_hf(hf, tok, system, convs, carry_cache=True,
                  raw_replies=args.raw_replies)
    load["after_hf_best"] = os.getloadavg()
    result = {
        "sessions": args.sessions, "turns": args.turns, "cpu_count": os.cpu_count(),
        "replies": "any model id" if args.raw_replies else "tokenizer text ids (logit bias)",
        # 1-, 5- and 15-minute load averages: the cores are shared with other work
        "loadavg": load,
        "kvsession": ours,  # history="append" (the default)
        "kvsession_template": tmpl,
        "kvsession_runs": [{k: v for k, v in r.items() if k != "ttft_s"} for r in runs],
        "kvsession_makespan_median_s": modes["append"]["median_s"],
        "kvsession_makespan_spread": modes["append"]["spread"],
        "kvsession_template_makespan_median_s": modes["template"]["median_s"],
        "hf_naive": {**naive, **summary(naive)},
        "hf_best": {**best, **summary(best)},
        "makespan_ratio_vs_naive": naive["makespan_s"] / ours["makespan_s"],
        "makespan_ratio_vs_best": best["makespan_s"] / ours["makespan_s"],
        "makespan_ratio_vs_template": tmpl["makespan_s"] / ours["makespan_s"],
        "makespan_ratio_template_vs_naive": naive["makespan_s"] / tmpl["makespan_s"],
        # CPU seconds used (the process's, all threads): less sensitive than wall time to
        # other work on shared cores
        "cpu_ratio_vs_naive": naive["user_cpu_s"] / ours["user_cpu_s"],
        "cpu_ratio_vs_best": best["user_cpu_s"] / ours["user_cpu_s"],
        "prefill_vs_ideal": ours["prefill_tokens"] / ours["ideal_tokens"],
        "prefill_vs_exact_min": ours["prefill_tokens"] / ours["exact_min_tokens"],
        "turn_prefill_vs_ideal": ours["reply_prefill_tokens"] / ours["turn_ideal_tokens"],
        "prefill_vs_ideal_template": tmpl["prefill_tokens"] / tmpl["ideal_tokens"],
        "prefill_vs_exact_min_template": tmpl["prefill_tokens"] / tmpl["exact_min_tokens"],
        "wall_s": time.perf_counter() - t_start,
    }
    result["targets"] = {
        "prefill_vs_ideal <= 1.01": result["prefill_vs_ideal"] <= 1.01,
        "makespan_ratio_vs_naive >= 5": result["makespan_ratio_vs_naive"] >= 5.0,
        "makespan_ratio_vs_best >= 1.5": result["makespan_ratio_vs_best"] >= 1.5,
        "kvsession_makespan_spread <= 0.15": result["kvsession_makespan_spread"] <= 0.15}
    for name in ("kvsession", "kvsession_template", "hf_naive", "hf_best"):
        r = result[name]
        print(f"{name:18s} makespan {r['makespan_s']:7.2f} s  user CPU {r['user_cpu_s']:6.1f} s"
              f"  TTFT p50 "
              f"{r['ttft_p50_s'] * 1e3:7.1f} ms  p95 {r['ttft_p95_s'] * 1e3:7.1f} ms  "
              f"prompt tokens computed {r['prefill_tokens']}")
    print(f"makespan (append history): {result['makespan_ratio_vs_naive']:.1f}x vs naive "
          f"(target >= 5x), {result['makespan_ratio_vs_best']:.2f}x vs best case "
          f"(target >= 1.5x), {result['makespan_ratio_vs_template']:.2f}x vs template history")
    print(f"prompt tokens computed / ideal: append {result['prefill_vs_ideal']:.4f} "
          f"(target <= 1.01; turns alone {result['turn_prefill_vs_ideal']:.4f}), template "
          f"{result['prefill_vs_ideal_template']:.3f}; / exact minimum: append "
          f"{result['prefill_vs_exact_min']:.3f}, template "
          f"{result['prefill_vs_exact_min_template']:.3f}")
    print("load average (1/5/15 min): " + ", ".join(
        f"{k} {'/'.join(f'{x:.1f}' for x in v)}" for k, v in load.items())
        + f" on {os.cpu_count()} cores; wall {result['wall_s']:.0f} s")
    write_result("agent_workload", result)
    if args.plot:
        plot(result, args.sessions, args.turns)


def plot(result: dict, sessions: int, turns: int) -> None:
    plt = pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.9), gridspec_kw={"width_ratios": [3, 2]})
    names = (("kvsession", "kvsession, append history"),
             ("kvsession_template", "kvsession, template history"),
             ("hf_best", "HF past_key_values"), ("hf_naive", "HF naive re-send"))
    for name, label in names:
        per_turn = list(zip(*result[name]["ttft_s"], strict=True))
        ax.plot(range(1, turns + 1), [statistics.median(x) * 1e3 for x in per_turn],
                marker="o", label=label)
    ax.set_xticks(range(1, turns + 1))
    ax.set_xlabel("turn")
    ax.set_ylabel("median TTFT (ms)")
    ax.set_yscale("log")
    ax.set_title(f"{sessions} agents x {turns} turns, 1,024-token system prompt")
    ax.legend(fontsize=8)
    spans = [result[name]["makespan_s"] for name, _ in names]
    bars = bx.barh([label for _, label in names], spans, color=[f"C{i}" for i in range(4)])
    ratios = [result["prefill_vs_ideal"], result["prefill_vs_ideal_template"]]
    for i, (bar, x) in enumerate(zip(bars, spans, strict=True)):
        note = f"{x:.1f} s"
        if i < 2:
            note += f", {ratios[i]:.3f}x ideal tokens"
        bx.text(x, bar.get_y() + bar.get_height() / 2, " " + note, va="center", fontsize=8)
    bx.set_xlim(0, max(spans) * 1.6)
    bx.invert_yaxis()
    bx.set_xlabel("makespan (s)")
    bx.set_title(f"{result['makespan_ratio_vs_naive']:.1f}x vs naive, "
                 f"{result['makespan_ratio_vs_best']:.2f}x vs past_key_values")
    save_figure(fig, "agent_workload")


if __name__ == "__main__":
    main()
