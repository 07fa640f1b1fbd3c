"""Scale-out: `serve --replicas 2 --ray-address local` on the agent workload, affinity routing
vs random routing, and what moving a session to another replica costs.

Routing: N agents (default 8) x T turns share one system prompt; each turn adds a user /
tool message of about `--turn-tokens` and generates `--new-tokens` (greedy, ignore_eos).
Every agent is a stateless OpenAI client re-sending its whole conversation each turn, from
its own thread. The same workload runs against
- one engine (the single-process server): the minimum prompt tokens any deployment must
  compute, since one cache sees everything;
- two replicas with affinity routing (the default), target <= 1.1x that minimum;
- two replicas with random routing (`--routing random`), the baseline: >= 1.8x.
Then again with `--long-turns` (16) turns per conversation: random routing's cost grows with
a conversation's length (`random_routing_model`: at 6 turns and 2 replicas it cannot exceed
1.67x), affinity's does not. Agent loops run far more than 6 tool turns.
Prompt tokens computed: what the engines report (`llm.stats().prefill_tokens`, summed over
the replicas; it includes the system prompt's pin, once per replica that pinned it), and
the sum over requests of usage.prompt_tokens - cached_tokens (which counts a pinned system
prompt as cached); the prefix hit rate is cached / prompt tokens.

Migration: named sessions with a long history (`--history-tokens`) on two replicas sharing
one --session-dir. Their next turn (max_tokens=1: the time is the prefill) is timed when it
stays on its replica (sticky), after its replica was drained (it resumes from the snapshot
the drain wrote), after its replica was killed (SIGKILL: it resumes from its log and the KV
segments written behind), and against a re-prefill of a history of the same length on an
engine that has none of it.

`--quick` runs small sizes on the tiny model. JSON in bench/results/scale_out.json, `--plot`
draws bench/results/scale_out.png.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from common import model_path, pyplot, save_figure, text_of, write_result

from kvsession.serve.process import ServerProcess


def engine_flags(args) -> list[str]:
    return ["--device", "cpu", "--kv-cache-memory", args.kv_cache_memory, "--max-model-len",
            str(args.max_model_len), "--host-cache-memory", "0"]


def replica_flags(args, routing: str, session_dir: Path | None = None) -> list[str]:
    out = ["--replicas", "2", "--ray-address", "local", "--ray-num-cpus", "2",
           "--routing", routing, "--summary-interval-s", "0.5"]
    return out + (["--session-dir", str(session_dir)] if session_dir else [])


def workload(args) -> tuple[str, list[list[dict]]]:
    from kvsession.model.tokenizer import Tokenizer

    tok = Tokenizer(model_path(args.model))
    rng = random.Random(0)
    system = "You are a coding agent. " + text_of(tok, rng, args.system_tokens)
    convs = [[{"role": "user" if t % 2 == 0 else "tool",
               "content": f"agent {i} turn {t}: " + text_of(tok, rng, args.turn_tokens)}
              for t in range(args.turns)] for i in range(args.sessions)]
    return system, convs


def post(url: str, body: dict, timeout: float = 600) -> tuple[dict, dict, float]:
    """(response, headers, seconds) of a chat request."""
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out = json.loads(r.read())
        return out, dict(r.headers), time.perf_counter() - t0


def run_agents(server: ServerProcess, model: str, system: str, convs, new_tokens: int) -> dict:
    """Every agent re-sends its conversation each turn, all agents at once."""
    prompt, cached, replicas = [0], [0], {}
    lock = threading.Lock()

    def agent(i: int) -> None:
        messages = [{"role": "system", "content": system}]
        for msg in convs[i]:
            messages.append(msg)
            r, headers, _ = post(server.url, {
                "model": model, "messages": messages, "max_tokens": new_tokens,
                "temperature": 0, "ignore_eos": True})
            with lock:
                prompt[0] += r["usage"]["prompt_tokens"]
                cached[0] += r["usage"]["prompt_tokens_details"]["cached_tokens"]
                where = headers.get("x-kvsession-replica", "single")
                replicas[where] = replicas.get(where, 0) + 1
            messages.append(r["choices"][0]["message"])

    t0 = time.perf_counter()
    threads = [threading.Thread(target=agent, args=(i,)) for i in range(len(convs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=3600)
    return {"prompt_tokens": prompt[0], "cached_tokens": cached[0],
            "computed_tokens": prompt[0] - cached[0],
            "prefix_hit_rate": cached[0] / max(1, prompt[0]),
            "requests_per_replica": replicas, "makespan_s": time.perf_counter() - t0}


def metrics(url: str, prefix: str = "kvsession_router_") -> dict[str, float]:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(prefix) and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def engine_prefill_tokens(url: str, replicated: bool) -> int:
    """Prompt tokens the engines computed (llm.stats().prefill_tokens, pins included):
    the server's own, or the sum of the replicas' last summaries."""
    if not replicated:
        return int(metrics(url, "kvsession_prefill_tokens").get("kvsession_prefill_tokens", 0))
    return int(sum(v for k, v in metrics(url, "kvsession_replica_prefill_tokens").items()))


def warm_up(url: str, model: str) -> None:
    """One request that shares nothing with the workload (first-request costs)."""
    for i in range(2):
        post(url, {"model": model, "messages": [{"role": "user", "content": f"warm up {i}"}],
                   "max_tokens": 2, "temperature": 0})


def random_routing_model(turns: int, replicas: int, system_tokens: int,
                         conversation_tokens: int) -> float:
    """Expected prompt tokens computed under uniform random routing, over the one-engine
    minimum. A turn's new tokens (message and reply) are computed where that turn runs and
    again on every other replica that serves a later turn of the conversation (it prefills
    everything since the last turn it saw): replica r sees some of the k = T - t later turns
    with probability 1 - (1 - 1/N)^k. The system prompt is computed once per replica. So
    with 2 replicas and 6 turns the ratio is at most 1 + mean_t(1 - 2^-(6-t)) = 1.67 however
    small the system prompt: random routing's cost grows with the conversation's length."""
    extra = sum(1 - (1 - 1 / replicas) ** (turns - t) for t in range(1, turns + 1)) / turns
    return (replicas * system_tokens + conversation_tokens * (1 + (replicas - 1) * extra)) / (
        system_tokens + conversation_tokens)


def routing_part(args, tmp: Path) -> dict:
    model = model_path(args.model)
    system, convs = workload(args)
    out = {"turns": args.turns}
    for name, extra in (("single", []), ("affinity", replica_flags(args, "affinity")),
                        ("random", replica_flags(args, "random"))):
        server = ServerProcess(model, *engine_flags(args), *extra,
                               stderr_path=tmp / f"{name}.stderr", start_timeout_s=300)
        try:
            warm_up(server.url, model.name)
            time.sleep(1.5)  # the ingress's summaries catch up (polled every 0.5 s)
            before = engine_prefill_tokens(server.url, bool(extra))
            out[name] = run_agents(server, model.name, system, convs, args.new_tokens)
            time.sleep(1.5)
            out[name]["engine_prefill_tokens"] = engine_prefill_tokens(server.url,
                                                                       bool(extra)) - before
            if extra:
                out[name]["router"] = {k: v for k, v in metrics(server.url).items()
                                       if "decisions" in k or "requests_total" in k}
        finally:
            server.stop(timeout=120)
        print(name, json.dumps({k: v for k, v in out[name].items() if k != "router"}),
              flush=True)
    for name in ("affinity", "random"):
        for what in ("computed_tokens", "engine_prefill_tokens"):
            out[name][f"{what}_vs_single"] = out[name][what] / max(1, out["single"][what])
    # the system prompt's pin: computed by the engine, counted as cached by the usage
    single, rnd, aff = out["single"], out["random"], out["affinity"]
    pin = single["engine_prefill_tokens"] - single["computed_tokens"]
    rnd["model_vs_single"] = random_routing_model(args.turns, 2, pin,
                                                  single["engine_prefill_tokens"] - pin)
    print(f"{args.turns} turns: random routing {rnd['engine_prefill_tokens_vs_single']:.2f}x "
          f"the minimum (model {rnd['model_vs_single']:.2f}x), affinity "
          f"{aff['engine_prefill_tokens_vs_single']:.2f}x", flush=True)
    return out


def migration_part(args, tmp: Path) -> dict:
    """Sticky, drained-away, killed-away and re-prefill turn times on a long history."""
    from kvsession.model.tokenizer import Tokenizer

    model = model_path(args.model)
    tok = Tokenizer(model)
    rng = random.Random(7)
    server = ServerProcess(model, *engine_flags(args),
                           *replica_flags(args, "affinity", tmp / "sessions"),
                           stderr_path=tmp / "migration.stderr", start_timeout_s=300)
    times = {"sticky": [], "drained": [], "killed": [], "re_prefill": []}
    try:
        url, name = server.url, model.name
        sids = [f"mig-{i}" for i in range(args.migration_sessions)]
        hist = {sid: [{"role": "user", "content": text_of(tok, rng, args.history_tokens)}]
                for sid in sids}
        holder = {}

        def turn(sid: str, what: str | None = None) -> str:
            hist[sid].append({"role": "user", "content": f"next {len(hist[sid])}"})
            r, headers, dt = post(url, {"model": name, "messages": hist[sid], "max_tokens": 1,
                                        "temperature": 0, "session_id": sid})
            hist[sid].append(r["choices"][0]["message"])
            if what:
                times[what].append(dt)
            return headers["x-kvsession-replica"]

        for sid in sids:  # the long history, then one cached turn
            r, headers, _ = post(url, {"model": name, "messages": hist[sid], "max_tokens": 1,
                                       "temperature": 0, "session_id": sid})
            hist[sid].append(r["choices"][0]["message"])
            holder[sid] = turn(sid, "sticky")
        victim = holder[sids[0]]
        req = urllib.request.Request(f"{url}/admin/drain/{victim}", method="POST")
        drain = json.loads(urllib.request.urlopen(req, timeout=300).read())
        for sid in sids:
            holder[sid] = turn(sid, "drained" if holder[sid] == victim else "sticky")
        wait_ready(url, 2)
        victim = holder[sids[0]]
        pid = next(r["pid"] for r in health(url)["replicas"] if r["name"] == victim)
        os.kill(pid, signal.SIGKILL)
        for sid in sids:
            holder[sid] = turn(sid, "killed" if holder[sid] == victim else "sticky")
        for i in range(len(sids)):  # the same length, none of it cached anywhere
            msgs = [{"role": "user", "content": text_of(tok, rng, args.history_tokens)}]
            _, _, dt = post(url, {"model": name, "messages": msgs, "max_tokens": 1,
                                  "temperature": 0, "session_id": f"fresh-{i}"})
            times["re_prefill"].append(dt)
        router = metrics(url)
    finally:
        server.stop(timeout=120)
    med = {k: statistics.median(v) if v else None for k, v in times.items()}
    return {"history_tokens": args.history_tokens, "turn_s": times, "median_s": med,
            "drain": drain,
            "migrations": {k: v for k, v in router.items() if "migrations" in k}}


def health(url: str) -> dict:
    try:
        return json.loads(urllib.request.urlopen(f"{url}/health", timeout=10).read())
    except urllib.error.HTTPError as e:
        return json.loads(e.read())


def wait_ready(url: str, n: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while health(url).get("ready") != n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"replicas not ready: {health(url)}")
        time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", choices=["mid", "tiny"], default="mid")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--long-turns", type=int, default=16,
                    help="the routing part again with conversations this long (0: not)")
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--turn-tokens", type=int, default=96)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--history-tokens", type=int, default=1536)
    ap.add_argument("--migration-sessions", type=int, default=6)
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--quick", action="store_true", help="small sizes on the tiny model")
    ap.add_argument("--plot", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.model, args.turns, args.system_tokens, args.turn_tokens = "tiny", 4, 128, 48
        args.history_tokens, args.kv_cache_memory, args.max_model_len = 512, "64MiB", 1024
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvsession-scale-out-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    routing = routing_part(args, tmp)
    long = routing_part(argparse.Namespace(**(vars(args) | {"turns": args.long_turns})),
                        tmp) if args.long_turns else None
    migration = migration_part(args, tmp)
    result = {"config": {k: v for k, v in vars(args).items() if k != "plot"},
              "routing": routing, "routing_long": long, "migration": migration,
              "checks": {
                  "affinity_vs_single": routing["affinity"]["engine_prefill_tokens_vs_single"],
                  "affinity_target_max": 1.1,
                  "random_vs_single": routing["random"]["engine_prefill_tokens_vs_single"],
                  "random_target_min": 1.8,
                  "random_model_vs_single": routing["random"]["model_vs_single"],
                  **({f"{k}_{args.long_turns}_turns": v for k, v in (
                      ("affinity_vs_single", long["affinity"]["engine_prefill_tokens_vs_single"]),
                      ("random_vs_single", long["random"]["engine_prefill_tokens_vs_single"]),
                      ("random_model_vs_single", long["random"]["model_vs_single"]))}
                     if long else {}),
                  "affinity_usage_vs_single": routing["affinity"]["computed_tokens_vs_single"],
                  "random_usage_vs_single": routing["random"]["computed_tokens_vs_single"]}}
    write_result("scale_out", result)
    print(json.dumps(result["checks"]), json.dumps(migration["median_s"]))
    if args.plot:
        plot(result)


def plot(result: dict) -> None:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names, colors = ["single", "affinity", "random"], ["#888", "#2a7", "#c44"]
    sets = [r for r in (result["routing"], result.get("routing_long")) if r]
    width = 0.8 / len(names)
    for j, r in enumerate(sets):
        for i, n in enumerate(names):
            ratio = r[n]["engine_prefill_tokens"] / r["single"]["engine_prefill_tokens"]
            x = j + (i - 1) * width
            a.bar(x, ratio, width, color=colors[i], label=n if j == 0 else None)
            a.text(x, ratio, f"{ratio:.2f}x", ha="center", va="bottom", fontsize=8)
    a.axhline(1.1, color="#2a7", ls=":", lw=1)
    a.axhline(1.8, color="#c44", ls=":", lw=1)
    a.set_xticks(range(len(sets)), [f"{r['turns']} turns" for r in sets])
    a.set_ylim(0, 2.3)
    a.set_ylabel("prompt tokens computed / one engine's")
    a.legend(fontsize=8, loc="upper left")
    a.set_title(f"agent workload, {result['config']['sessions']} agents, 2 replicas "
                f"(dotted: targets)")
    med = result["migration"]["median_s"]
    kinds = [k for k in ("sticky", "drained", "killed", "re_prefill") if med.get(k)]
    b.bar(kinds, [med[k] * 1000 for k in kinds], color="#47a")
    b.set_ylabel("next-turn time, median (ms)")
    b.set_title(f"moving a {result['migration']['history_tokens']}-token session")
    save_figure(fig, "scale_out")


if __name__ == "__main__":
    main()
