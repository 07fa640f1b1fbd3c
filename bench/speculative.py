"""Drafts verified in one forward pass (engine/drafts.py), each part against the same engine
without them in the same run (paired: the two take turns, every round, so the load of the
shared cores hits both alike; medians of the per-round ratios with their range):

(a) forced tool calls with long keys (`tool_choice` naming a function whose parameters have
    long keys and enums): forward passes and latency with grammar-forced spans as drafts
    (jump-forward) against token-by-token constrained decoding (target >= 2x fewer passes);
    outputs checked identical;
(b) acceptance under control, with a replay drafter (kvsession.testing.ReplayLookup: the
    drafts are the model's own greedy output, so every one is kept; or random tokens, so
    none is): decode tokens/s at batch 1 and 8 (targets: >= 2.5x at batch 1 when drafts
    are kept, overhead <= 5% when none is);
(c) the agent workload (bench/agent_workload.py's 8 agents, mid-size model) with prompt
    lookup (`speculative_config` ngram, k=4) against without: makespan. The random model
    does not copy from its context as a trained one does, so this measures what drafting
    costs when it rarely pays (it must pause itself), not what it gains.

Mid-size random Llama (bench/common.mid_model), float32, CPU threads as the machine has.
Writes results/speculative.json and, with --plot, results/speculative.png.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from agent_workload import Agents, workload
from common import RESULTS, median_range, mid_model, pyplot, save_figure, write_result

from kvsession import LLM, SamplingParams, StructuredOutput
from kvsession.testing import HERMES_TEMPLATE, ReplayLookup

LONG_KEYS_TOOL = {"type": "function", "function": {
    "name": "file_the_quarterly_report",
    "description": "File a report.",
    "parameters": {"type": "object", "properties": {
        "name_of_the_department_filing_the_report": {
            "enum": ["research_and_development", "customer_operations"]},
        "number_of_incidents_in_the_quarter": {"type": "integer", "minimum": 0,
                                               "maximum": 9},
        "overall_status_of_the_department": {
            "enum": ["completed_successfully_without_issues", "failed_permanently"]}},
        "required": ["name_of_the_department_filing_the_report",
                     "number_of_incidents_in_the_quarter",
                     "overall_status_of_the_department"]}}}
FORCED = {"type": "function", "function": {"name": "file_the_quarterly_report"}}


# a trained model writes forced text in its tokenizer's own pieces (what its training data
# was tokenized into); a random one picks any piece the grammar allows. The bias on each
# text token's length emulates the trained preference (the longest piece that fits), so
# that the verified spans can be measured where the model agrees with them, beside the
# unbiased random model, the worst case
LENGTH_BIAS_PER_CHAR = 8.0


def length_bias(llm: LLM) -> dict[int, float]:
    tok = llm.tokenizer
    return {i: LENGTH_BIAS_PER_CHAR * len(tok.decode([i])) for i in range(tok.vocab_size)
            if tok.decode([i])}


def make_llm(**kw) -> LLM:
    return LLM(mid_model(), kv_cache_memory="1GiB", max_model_len=2048, max_num_seqs=16, **kw)


def forced_calls(llm: LLM, rounds: int, requests: int, bias: dict | None) -> dict:
    """(a): `requests` forced calls one after another, spans on and off in turn; `bias`:
    the logit bias of every request (length_bias, or None: the random model as it is)."""
    rng = random.Random(0)
    convs = [[{"role": "user", "content": f"report {i}: " + " ".join(
        rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(30))}]
        for i in range(requests)]
    params = SamplingParams(max_tokens=256, temperature=0.0, logit_bias=bias)
    drafter = llm._rt.drafter
    runs: list[dict] = []
    for r in range(rounds):
        row, texts = {}, {}
        for spans in ((False, True) if r % 2 == 0 else (True, False)):
            drafter.forced_spans = spans
            t0, passes, tokens = time.perf_counter(), 0, 0
            texts[spans] = []
            for conv in convs:
                out = llm.chat(conv, params, use_tqdm=False, tools=[LONG_KEYS_TOOL],
                               tool_choice=FORCED)[0]
                passes += out.metrics.forward_passes
                tokens += len(out.outputs[0].token_ids)
                texts[spans].append(out.outputs[0].token_ids)
            row[spans] = {"s": time.perf_counter() - t0, "passes": passes, "tokens": tokens}
        drafter.forced_spans = True
        assert texts[True] == texts[False], "jump-forward changed a forced call"
        runs.append({"passes_ratio": row[False]["passes"] / row[True]["passes"],
                     "latency_ratio": row[False]["s"] / row[True]["s"],
                     "passes": [row[False]["passes"], row[True]["passes"]],
                     "tokens": row[True]["tokens"],
                     "seconds": [row[False]["s"], row[True]["s"]]})
        model = "length-biased" if bias else "random"
        print(f"  (a) {model} model, round {r}: passes {row[False]['passes']} -> "
              f"{row[True]['passes']} "
              f"({runs[-1]['passes_ratio']:.2f}x fewer), latency "
              f"{runs[-1]['latency_ratio']:.2f}x", flush=True)
    return {"rounds": runs, "passes_ratio": median_range(runs, "passes_ratio"),
            "latency_ratio": median_range(runs, "latency_ratio")}


def schema_modes(llm: LLM, rounds: int, requests: int, bias: dict | None) -> dict:
    """(a'): the tool's parameters as a `json_schema` request, three ways in turn: token by
    token, verified spans (the default), and `jump_forward=True` (spans appended
    unverified, in xgrammar's tokenization): passes and latency."""
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 500) for _ in range(40)] for _ in range(requests)]
    schema = LONG_KEYS_TOOL["function"]["parameters"]
    drafter = llm._rt.drafter
    modes = {"token_by_token": (False, False), "verified": (True, False),
             "unverified": (True, True)}
    runs = []
    for r in range(rounds):
        row = {}
        for name in (list(modes) if r % 2 == 0 else list(reversed(modes))):
            spans, unverified = modes[name]
            drafter.forced_spans = spans
            params = SamplingParams(max_tokens=256, temperature=0.0, logit_bias=bias,
                                    structured=StructuredOutput(json_schema=schema,
                                                                jump_forward=unverified))
            t0 = time.perf_counter()
            outs = [llm.generate(prompt_token_ids=[p], sampling_params=params,
                                 use_tqdm=False)[0] for p in prompts]  # batch 1
            row[name] = {"s": time.perf_counter() - t0,
                         "passes": sum(o.metrics.forward_passes for o in outs),
                         "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                         "texts": [o.outputs[0].text for o in outs]}
        drafter.forced_spans = True
        base = row["token_by_token"]
        runs.append({name: {"passes_ratio": base["passes"] / x["passes"],
                            "latency_ratio": base["s"] / x["s"], "passes": x["passes"],
                            "tokens": x["tokens"], "same_text": x["texts"] == base["texts"]}
                     for name, x in row.items()})
        model = "length-biased" if bias else "random"
        print(f"  (a') {model} model, round {r}: passes " + ", ".join(
            f"{n} {x['passes']} ({base['s'] / x['s']:.2f}x latency)" for n, x in row.items()),
            flush=True)
    return {"rounds": runs, **{f"{name}_{key}": median_range([x[name] for x in runs], key)
                               for name in ("verified", "unverified")
                               for key in ("passes_ratio", "latency_ratio")}}


def replayed(llm: LLM, rounds: int, batch: int, k: int, accept: float,
             new_tokens: int = 128) -> dict:
    """(b): decode tokens/s with replayed drafts against none, `batch` requests at once."""
    rng = random.Random(batch)
    prompts = [[rng.randrange(100, 30000) for _ in range(200)] for _ in range(batch)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    drafter = llm._rt.drafter
    vocab = llm.runtime.spec.vocab_size

    def run(lookup) -> tuple[float, list]:
        drafter.replace_lookup(lookup)
        t0 = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        return time.perf_counter() - t0, outs

    _, base = run(None)
    known = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, base, strict=True)}
    runs = []
    for r in range(rounds):
        timed = {}
        for drafts in ((False, True) if r % 2 == 0 else (True, False)):
            lookup = ReplayLookup(known, k, vocab, accept=accept, seed=r) if drafts else None
            timed[drafts] = run(lookup)
        drafter.replace_lookup(None)
        same = [o.outputs[0].token_ids for o in timed[True][1]] == list(known.values())
        assert same, "drafts changed greedy output"
        kept = sum(o.metrics.accepted_draft_tokens for o in timed[True][1])
        runs.append({"speedup": timed[False][0] / timed[True][0],
                     "tok_s": [batch * new_tokens / timed[False][0],
                               batch * new_tokens / timed[True][0]],
                     "kept_per_token": kept / (batch * new_tokens),
                     "passes": timed[True][1][0].metrics.forward_passes})
    out = {"batch": batch, "k": k, "accept": accept, "rounds": runs,
           "speedup": median_range(runs, "speedup")}
    med = out["speedup"]
    print(f"  (b) batch {batch}, k={k}, drafts kept {accept:.0%}: {med[0]:.2f}x "
          f"({med[1]:.2f}-{med[2]:.2f}), {runs[-1]['tok_s'][0]:.0f} -> "
          f"{runs[-1]['tok_s'][1]:.0f} tok/s", flush=True)
    return out


def agent_makespan(rounds: int, sessions: int, turns: int) -> dict:
    """(c): the agent workload on two engines, with and without prompt lookup, each
    agent's turn t in one and then the other (order alternating), makespans summed."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    runs = []
    for r in range(rounds):
        llms = {False: make_llm(), True: make_llm(speculative_config=spec)}
        agents = {s: Agents(llm, *workload(llm.tokenizer, sessions, turns), "append", False)
                  for s, llm in llms.items()}
        total = dict.fromkeys(llms, 0.0)
        for t in range(turns):
            for s in ((False, True) if (t + r) % 2 == 0 else (True, False)):
                total[s] += agents[s].round(t)
        drafter = llms[True]._rt.drafter
        runs.append({"speedup": total[False] / total[True],
                     "makespan_s": [total[False], total[True]],
                     "proposed": drafter.proposed_tokens, "kept": drafter.accepted_tokens})
        for s in llms:
            agents[s].close()
            llms[s].close()
        print(f"  (c) round {r}: makespan {total[False]:.1f} s -> {total[True]:.1f} s "
              f"({runs[-1]['speedup']:.2f}x); drafts kept {drafter.accepted_tokens} of "
              f"{drafter.proposed_tokens}", flush=True)
    return {"rounds": runs, "speedup": median_range(runs, "speedup")}


def code_edits(rounds: int, sessions: int, turns: int) -> dict:
    """(d): sessions over a 40-line file (its text in the first message); each turn's reply
    re-emits six consecutive lines of it with one word changed, as an edit does. A random
    model does not copy, so the reply's text is given by a regex and the length bias
    (length_bias) makes the model write it in the tokenizer's pieces, as a trained one
    writes text it copies: what prompt lookup then drafts from the context is what the
    model writes. Grammar-forced spans are off in both engines (forced_spans=False), so
    every draft is prompt lookup's; with it (k=8) against without, makespan in paired
    turns."""
    rng = random.Random(7)
    words = ["alpha", "beta", "gamma", "delta", "value", "index", "count", "total",
             "result", "item", "name", "path", "data", "list", "file", "line"]
    spec = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4}
    runs = []
    for r in range(rounds):
        files = [["".join(rng.choice(words) + " " for _ in range(8)).strip()
                  for _ in range(40)] for _ in range(sessions)]
        llms = {False: make_llm(), True: make_llm(speculative_config=spec)}
        bias = length_bias(llms[False])
        convs = {}
        for s, llm in llms.items():
            llm._rt.drafter.forced_spans = False
            convs[s] = [llm.session(sampling=SamplingParams(temperature=0.0, max_tokens=400,
                                                            logit_bias=bias))
                        for _ in range(sessions)]
        total = dict.fromkeys(llms, 0.0)
        kept = 0
        for t in range(turns):
            edits = []
            for i in range(sessions):
                start = rng.randrange(0, 34)
                lines = list(files[i][start:start + 6])
                j = rng.randrange(6)
                lines[j] = lines[j].replace(lines[j].split()[0], rng.choice(words), 1)
                edits.append((start, "\n".join(lines)))
            for s in ((False, True) if (t + r) % 2 == 0 else (True, False)):
                t0 = time.perf_counter()
                for i, sess in enumerate(convs[s]):
                    start, edit = edits[i]
                    msg = (("here is the file:\n" + "\n".join(files[i]) + "\n") if t == 0
                           else "") + f"rewrite lines {start} to {start + 5}"
                    reply = sess.send(msg, structured=StructuredOutput(regex=edit))
                    assert reply.text == edit, reply.text
                    kept += reply.metrics.accepted_draft_tokens if s else 0
                total[s] += time.perf_counter() - t0
        runs.append({"speedup": total[False] / total[True],
                     "makespan_s": [total[False], total[True]], "kept": kept})
        for s in llms:
            for sess in convs[s]:
                sess.close()
            llms[s].close()
        print(f"  (d) round {r}: makespan {total[False]:.1f} s -> {total[True]:.1f} s "
              f"({runs[-1]['speedup']:.2f}x), drafts kept {kept}", flush=True)
    return {"rounds": runs, "speedup": median_range(runs, "speedup")}


def plot(result: dict) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels, vals, lows, highs = [], [], [], []
    parts = [("(a) forced calls: passes", result["forced"]["passes_ratio"]),
             ("(a) forced calls: latency", result["forced"]["latency_ratio"])]
    parts += [(f"(b) b{x['batch']} kept {x['accept']:.0%}", x["speedup"])
              for x in result["replay"]]
    if "agents" in result:
        parts.append(("(c) agent makespan", result["agents"]["speedup"]))
    if "code_edits" in result:
        parts.append(("(d) code edits makespan", result["code_edits"]["speedup"]))
    for label, (med, lo, hi) in parts:
        labels.append(label)
        vals.append(med)
        lows.append(med - lo)
        highs.append(hi - med)
    ax.barh(labels, vals, xerr=[lows, highs], color="tab:blue")
    ax.axvline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("without drafts / with drafts (higher is better)")
    ax.invert_yaxis()
    fig.tight_layout()
    save_figure(fig, "speculative")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--parts", default="abcd",
                    help="which parts to run (a: forced spans, b: replayed drafts, c: agent "
                         "workload, d: code edits); the others are kept from the last JSON")
    ap.add_argument("--requests", type=int, default=6, help="(a): forced calls per round")
    ap.add_argument("--k", type=int, default=8, help="(b): drafts per step")
    ap.add_argument("--sessions", type=int, default=8, help="(c): agents")
    ap.add_argument("--turns", type=int, default=4, help="(c), (d): turns")
    ap.add_argument("--edit-sessions", type=int, default=2, help="(d): sessions")
    ap.add_argument("--plot", action="store_true")
    args = ap.parse_args()
    last = RESULTS / "speculative.json"
    result: dict = json.loads(last.read_text()) if last.is_file() else {}
    for key in ("benchmark", "machine", "torch", "threads", "time"):
        result.pop(key, None)  # write_result sets them anew
    result["rounds"] = args.rounds
    if "a" in args.parts or "b" in args.parts:
        llm = make_llm(chat_template=HERMES_TEMPLATE)  # a template that renders tools
        if "a" in args.parts:
            print("(a) forced tool calls with long keys, batch 1", flush=True)
            bias = length_bias(llm)
            result["forced"] = forced_calls(llm, args.rounds, args.requests, bias)
            result["forced_random"] = forced_calls(llm, args.rounds, args.requests, None)
            print("(a') the same keys as a json_schema request: token by token / verified / "
                  "unverified", flush=True)
            result["schema"] = schema_modes(llm, args.rounds, args.requests, bias)
            result["schema_random"] = schema_modes(llm, args.rounds, args.requests, None)
        if "b" in args.parts:
            print("(b) replayed drafts", flush=True)
            result["replay"] = [replayed(llm, args.rounds, b, args.k, a)
                                for b in (1, 8) for a in (1.0, 0.0)]
        llm.close()
    if "c" in args.parts:
        print("(c) agent workload, prompt lookup k=4", flush=True)
        result["agents"] = agent_makespan(args.rounds, args.sessions, args.turns)
    if "d" in args.parts:
        print("(d) code-edit trace, prompt lookup k=8", flush=True)
        result["code_edits"] = code_edits(args.rounds, args.edit_sessions, args.turns)
    write_result("speculative", result)
    if args.plot:
        plot(result)


if __name__ == "__main__":
    main()
