"""The agent workload (bench/agent_workload.py's conversations: a shared system prompt, each
turn a ~128-token user or tool message and a 32-token reply) two ways, at 8 and 32
concurrent conversations:

- in process: one kvsession Session per conversation, driven from one thread each (in a
  fresh process per run, as bench/agent_workload.py does);
- over HTTP: `python -m kvsession serve` in a subprocess, one thread per conversation
  with the official `openai` client, stateless as every OpenAI client is (each turn re-sends
  the whole conversation; the server maps it back onto the conversation's session).

Each side runs `--repeat` times, interleaved, on conversations of their own (HTTP: a fresh
server each time); the best runs are compared. At the concurrency levels in --peers-at
(default 8), the same conversations also run once through the transformers peers of
bench/agent_workload.py, in this process: `generate` re-sending the whole history each turn
(naive, what a transformers-based OpenAI server does) and carrying `past_key_values` (its
best case); the ratios of their makespans to kvsession's over HTTP are reported. Reports the
makespan ratio HTTP / in process (target: overhead <= 15%), the engine's TTFT p50 / p99 on
both sides (over HTTP from the server's /metrics), the client's time to the first streamed
text (a random model often writes bytes that are not yet valid UTF-8, which a stream holds
back: an upper bound on the HTTP TTFT), CPU seconds of the serving process, and the share of
prompt tokens the server reports as cached. The same conversations also run through the
Responses API (previous_response_id: each turn sends only its new message) and Anthropic's
Messages API (`--apis`): a row each, makespan and TTFT against in process. The engine TTFT
over HTTP is estimated from the server's /metrics histogram (Prometheus' histogram_quantile:
linear within a bucket). Writes bench/results/server.json (+ server.png with --plot).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

from agent_workload import HFPeer, turn_messages
from common import in_threads, model_path, pyplot, save_figure, text_of, write_result

from kvsession import LLM, SamplingParams
from kvsession.metrics import percentile
from kvsession.serve.process import ServerProcess

NEW_TOKENS = 32


def engine_kwargs(args) -> dict:
    return {"device": "cpu", "kv_cache_memory": args.kv_cache_memory,
            "max_model_len": args.max_model_len, "max_num_seqs": 64}


def engine_flags(kw: dict) -> list[str]:
    return [x for k, v in kw.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def process_cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system) of this process, or of process `pid`."""
    if pid is None:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def in_process(model: Path, kw: dict, system: str, convs: list[list[dict]]) -> dict:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    ttfts: list[float] = []
    with LLM(model, **kw) as llm:
        def agent(i: int) -> None:
            with llm.session(system=system, sampling=params) as s:
                for msg in convs[i]:
                    ttfts.append(s.send(msg).metrics.ttft_s)
        llm.session(system=system).close()  # warm-up: the shared system prompt's first pin
        cpu = process_cpu_s()
        makespan = in_threads(agent, len(convs))
        cpu = process_cpu_s() - cpu
    return {"makespan_s": makespan, "cpu_s": cpu, "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p99_s": percentile(ttfts, 99), "turns": len(ttfts)}


def engine_ttft(url: str) -> tuple[float, float]:
    """The server's engine TTFT p50 / p99, estimated from its /metrics histogram
    (kvsession_request_ttft_seconds, every request of this fresh server) as Prometheus'
    histogram_quantile does: linear within the bucket the quantile falls in."""
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    buckets = [(float(le), float(n)) for le, n in re.findall(
        r'^kvsession_request_ttft_seconds_bucket\{le="([^"]+)"\} (\S+)$', text, re.M)]
    return tuple(histogram_quantile(buckets, q) for q in (0.5, 0.99))


def histogram_quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """The q-quantile of cumulative (upper bound, count) buckets, linear within a bucket
    (the +Inf bucket: its lower bound)."""
    total = buckets[-1][1]
    rank, lower, below = q * total, 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = bound, count
    return lower


APIS = ("chat", "responses", "messages")


def over_http(model: Path, kw: dict, system: str, convs: list[list[dict]],
              api: str = "chat") -> dict:
    """One run against a fresh server (its metrics hold this run only), through `api`:
    chat completions (stateless: each turn re-sends the conversation), Responses (each turn
    sends its new message with previous_response_id) or Anthropic Messages (stateless, the
    `anthropic` client). The workload's tool turns are user messages in the last two (no
    call of theirs to answer)."""
    server = ServerProcess(model, *engine_flags(kw))
    try:
        return _over_api(server, model.name, system, convs, api)
    finally:
        server.stop()


def _over_api(server: ServerProcess, model_name: str, system: str, convs: list[list[dict]],
              api: str) -> dict:
    from openai import OpenAI

    url, ttfts, prompt, cached = server.url, [], [0], [0]
    lock = threading.Lock()

    def chat_turns(i: int) -> None:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
        messages = [{"role": "system", "content": system}]
        for msg in convs[i]:
            messages.append(msg)
            t0, first, text = time.perf_counter(), None, []
            for chunk in client.chat.completions.create(
                    model=model_name, messages=messages, max_tokens=NEW_TOKENS, temperature=0,
                    stream=True, stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True}):
                if chunk.choices and chunk.choices[0].delta.content:
                    first = first or time.perf_counter()
                    text.append(chunk.choices[0].delta.content)
                if chunk.usage is not None:
                    with lock:
                        prompt[0] += chunk.usage.prompt_tokens
                        cached[0] += chunk.usage.prompt_tokens_details.cached_tokens
            ttfts.append((first or time.perf_counter()) - t0)
            messages.append({"role": "assistant", "content": "".join(text)})

    def responses_turns(i: int) -> None:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
        prev = None
        for msg in convs[i]:
            t0, first = time.perf_counter(), None
            for e in client.responses.create(
                    model=model_name, instructions=system, input=msg["content"],
                    previous_response_id=prev, max_output_tokens=NEW_TOKENS, temperature=0,
                    stream=True, extra_body={"ignore_eos": True}):
                if e.type == "response.output_text.delta":
                    first = first or time.perf_counter()
                elif e.type == "response.completed":
                    prev = e.response.id
                    with lock:
                        prompt[0] += e.response.usage.input_tokens
                        cached[0] += e.response.usage.input_tokens_details.cached_tokens
            ttfts.append((first or time.perf_counter()) - t0)

    def messages_turns(i: int) -> None:
        import anthropic

        client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0,
                                     timeout=600)
        history: list[dict] = []
        for msg in convs[i]:
            history.append({"role": "user", "content": msg["content"]})
            t0, first = time.perf_counter(), None
            with client.messages.stream(model=model_name, system=system, messages=history,
                                        max_tokens=NEW_TOKENS,
                                        extra_body={"temperature": 0, "ignore_eos": True}) as st:
                text = []
                for piece in st.text_stream:
                    first = first or time.perf_counter()
                    text.append(piece)
                usage = st.get_final_message().usage
            with lock:
                prompt[0] += usage.input_tokens + usage.cache_read_input_tokens + \
                    usage.cache_creation_input_tokens
                cached[0] += usage.cache_read_input_tokens
            ttfts.append((first or time.perf_counter()) - t0)
            history.append({"role": "assistant", "content": "".join(text)})

    OpenAI(base_url=f"{url}/v1", api_key="unused").chat.completions.create(
        model=model_name, max_tokens=1, messages=[{"role": "system", "content": system},
                                                  {"role": "user", "content": "warm up"}])
    cpu = process_cpu_s(server.proc.pid)
    turns = {"chat": chat_turns, "responses": responses_turns, "messages": messages_turns}
    makespan = in_threads(turns[api], len(convs))
    cpu = process_cpu_s(server.proc.pid) - cpu
    p50, p99 = engine_ttft(url)
    return {"makespan_s": makespan, "cpu_s": cpu, "ttft_p50_s": p50, "ttft_p99_s": p99,
            "client_first_text_p50_s": percentile(ttfts, 50),
            "client_first_text_p99_s": percentile(ttfts, 99), "turns": len(ttfts),
            "cached_share": cached[0] / max(prompt[0], 1)}


def transformers_peers(args, n: int) -> dict:
    """The run-0 conversations of `n` agents through transformers (one conversation after
    another each round, as bench/agent_workload.py runs them): makespan and TTFTs."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvsession.model.tokenizer import Tokenizer

    path = model_path(args.model)
    tok = Tokenizer(path)
    system, convs = workload(args, n, 0)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    out = {}
    for name, carry in (("hf_naive", False), ("hf_best", True)):
        peer = HFPeer(hf, tok, system, convs, carry, raw_replies=True)
        makespan = sum(peer.round(t) for t in range(args.turns))
        ttfts = [x for row in peer.accounting()["ttft_s"] for x in row]
        out[name] = {"makespan_s": makespan, "ttft_p50_s": percentile(ttfts, 50),
                     "ttft_p99_s": percentile(ttfts, 99),
                     "prefill_tokens": peer.accounting()["prefill_tokens"]}
        print(f"{n:3d} conversations: transformers {name} {makespan:.1f} s", flush=True)
    return out


def workload(args, n: int, run: int) -> tuple[str, list[list[dict]]]:
    """(system prompt, n conversations) of one run: the same in the parent and the child;
    each run's conversations are its own (no run reuses another's cache)."""
    from kvsession.model.tokenizer import Tokenizer

    tok = Tokenizer(model_path(args.model))
    system = "You are a coding agent. " + text_of(tok, random.Random(1), args.system_tokens)
    # (tool turns as user messages: no call of the replies' to answer, which the chat
    # API refuses a tool message for; the same in every API and in process)
    convs = [[{"role": "user", "content": f"run {run}: {m['content']}"} for m in c]
             for c in turn_messages(tok, n, args.turns)]
    return system, convs


def in_process_fresh(args, n: int, run: int) -> dict:
    """in_process() in a fresh process: this one's thread pools (the HTTP clients') and
    OpenMP state would otherwise slow the engine thread (see common.Solo)."""
    cmd = [sys.executable, __file__, "--model", args.model, "--turns", str(args.turns),
           "--system-tokens", str(args.system_tokens), "--kv-cache-memory",
           args.kv_cache_memory, "--max-model-len", str(args.max_model_len),
           "--once", str(n), str(run)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=3600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", choices=["mid", "tiny"], default="mid")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-tokens", type=int, default=1024)
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3, help="interleaved runs of each side")
    ap.add_argument("--peers-at", type=int, nargs="*", default=[8],
                    help="concurrency levels also run through the transformers peers")
    ap.add_argument("--apis", nargs="+", default=list(APIS), choices=APIS,
                    help="the HTTP APIs run beside in-process (a row each)")
    ap.add_argument("--plot", action="store_true")
    ap.add_argument("--once", type=int, nargs=2, help=argparse.SUPPRESS)  # child: n, run
    args = ap.parse_args()
    model, kw = model_path(args.model), engine_kwargs(args)
    if args.once:
        system, convs = workload(args, *args.once)
        print(json.dumps(in_process(model, kw, system, convs)))
        return
    results = {}
    for n in args.concurrency:
        local_runs, api_runs = [], {api: [] for api in args.apis}
        # interleaved repeats: machine noise hits every side alike; the best of each is
        # compared
        for r in range(args.repeat):
            local_runs.append(in_process_fresh(args, n, r))
            system, convs = workload(args, n, r)
            for api in args.apis:
                api_runs[api].append(over_http(model, kw, system, convs, api))
        local = min(local_runs, key=lambda x: x["makespan_s"])
        best = {api: min(runs, key=lambda x: x["makespan_s"]) for api, runs in api_runs.items()}
        http = best.get("chat") or next(iter(best.values()))
        results[str(n)] = {"in_process": local, "http": http,
                           "makespan_ratio": http["makespan_s"] / local["makespan_s"],
                           "in_process_makespans_s": [x["makespan_s"] for x in local_runs],
                           "http_makespans_s": [x["makespan_s"] for x in api_runs.get(
                               "chat", next(iter(api_runs.values())))],
                           "apis": {api: {**b, "makespan_ratio": b["makespan_s"]
                                          / local["makespan_s"]} for api, b in best.items()}}
        for api, b in results[str(n)]["apis"].items():
            print(f"{n:3d} conversations, {api:9s}: makespan x{b['makespan_ratio']:.3f} of "
                  f"in process; engine TTFT p50/p99 {b['ttft_p50_s'] * 1e3:.0f}/"
                  f"{b['ttft_p99_s'] * 1e3:.0f} ms (in process {local['ttft_p50_s'] * 1e3:.0f}/"
                  f"{local['ttft_p99_s'] * 1e3:.0f}); cached {b['cached_share']:.0%}",
                  flush=True)
        print(f"{n:3d} conversations x {args.turns} turns: makespan in process "
              f"{local['makespan_s']:.2f} s, over HTTP {http['makespan_s']:.2f} s "
              f"(x{results[str(n)]['makespan_ratio']:.3f}); CPU in process "
              f"{local['cpu_s']:.1f} s, server {http['cpu_s']:.1f} s; engine TTFT p50/p99 "
              f"in process {local['ttft_p50_s'] * 1e3:.0f}/{local['ttft_p99_s'] * 1e3:.0f} ms, "
              f"HTTP {http['ttft_p50_s'] * 1e3:.0f}/{http['ttft_p99_s'] * 1e3:.0f} ms (client: "
              f"first text {http['client_first_text_p50_s'] * 1e3:.0f}/"
              f"{http['client_first_text_p99_s'] * 1e3:.0f} ms); cached "
              f"{http['cached_share']:.0%} of the prompt tokens", flush=True)
    for n in args.peers_at:  # after every kvsession run: transformers stays in this process
        if str(n) not in results:
            continue
        res = results[str(n)]
        res["transformers"] = transformers_peers(args, n)
        for name in ("hf_naive", "hf_best"):
            res[f"http_speedup_vs_{name}"] = (res["transformers"][name]["makespan_s"]
                                              / res["http"]["makespan_s"])
        print(f"{n:3d} conversations: kvsession over HTTP is "
              f"{res['http_speedup_vs_hf_naive']:.1f}x transformers naive, "
              f"{res['http_speedup_vs_hf_best']:.2f}x transformers with past_key_values "
              f"(makespan)", flush=True)
    write_result("server", {"model": args.model, "turns": args.turns,
                            "system_tokens": args.system_tokens, "new_tokens": NEW_TOKENS,
                            "repeat": args.repeat,
                            "engine": kw, "results": results,
                            "target_makespan_ratio": 1.15})
    if args.plot:
        plot(results, args)


def plot(results: dict, args) -> None:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    levels = list(results)
    x = range(len(levels))
    for off, (key, label) in zip((-0.3, -0.1), (("in_process", "in process (Session)"),
                                               ("http", "HTTP (stateless OpenAI clients)")),
                                 strict=True):
        a.bar([i + off for i in x], [results[n][key]["makespan_s"] for n in levels], 0.2,
              label=label)
        b.errorbar([i + off for i in x], [results[n][key]["ttft_p50_s"] * 1e3 for n in levels],
                   yerr=[[0] * len(levels),
                         [(results[n][key]["ttft_p99_s"] - results[n][key]["ttft_p50_s"]) * 1e3
                          for n in levels]], fmt="o", capsize=4, label=label)
    peers = [i for i, n in enumerate(levels) if "transformers" in results[n]]
    for off, (key, label) in zip((0.1, 0.3), (("hf_naive", "transformers naive"),
                                              ("hf_best", "transformers past_key_values")),
                                 strict=True):
        a.bar([i + off for i in peers],
              [results[levels[i]]["transformers"][key]["makespan_s"] for i in peers], 0.2,
              label=label)
    b.set_yscale("log")
    for ax, title in ((a, "makespan (s)"), (b, "engine TTFT p50 (dot) to p99 (ms)")):
        ax.set_xticks(list(x), [f"{n} conversations" for n in levels])
        ax.set_title(title)
    a.legend(fontsize=8)
    fig.suptitle(f"agent workload, {args.turns} turns, {args.system_tokens}-token system prompt")
    save_figure(fig, "server")


if __name__ == "__main__":
    main()
