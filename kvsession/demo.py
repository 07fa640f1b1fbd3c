"""The demo behind `python -m kvsession demo`: many agents sharing a pinned system prompt,
tool-call pauses, a device pool small enough to force spills, then a process-style restart
that resumes every session from `session_dir`. Every number comes from `llm.stats()` and
`Reply` metrics; `run_demo` returns them so tests can check the printed summary."""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from kvsession.cache.kv_pool import kv_bytes_per_token
from kvsession.config import EngineConfig
from kvsession.llm import LLM
from kvsession.model.config import load_model_spec
from kvsession.params import SamplingParams

SYSTEM = ("You are a coding agent working in a repository. Tools: list_files(path), "
          "read_file(path), run_tests(), write_file(path, content). Answer with one tool "
          "call per turn and explain briefly.")
TASKS = ["find why the tests fail", "add a retry to the client", "document the cache",
         "speed up the loader", "fix the flaky test", "rename the config field",
         "add type hints", "remove dead code"]


def _tool_result(rng: random.Random, turn: int) -> str:
    files = rng.sample(["src/a.py", "src/b.py", "tests/test_a.py", "README.md", "setup.cfg"], 3)
    if turn % 2 == 0:
        return json.dumps({"files": files})
    return json.dumps({"status": "ok", "lines": rng.randint(10, 400)})


def _table(out, sessions, replies) -> None:
    out(f"  {'session':10s} {'state':7s} {'turns':>5s} {'computed':>9s} {'from cache':>10s} "
        f"{'last ttft':>9s}")
    for s in sessions:
        r = replies.get(s.session_id)
        ttft = f"{r.metrics.ttft_s * 1e3:7.1f}ms" if r else ""
        out(f"  {s.session_id:10s} {s.state:7s} {s.stats.turns:5d} "
            f"{s.stats.computed_tokens:9d} {s.stats.cached_tokens:10d} {ttft:>9s}")


def run_demo(model: Path, session_dir: Path, num_sessions: int = 6, num_turns: int = 3,
             out: Callable[[str], None] = lambda _: None, seed: int = 0) -> dict:
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=16, temperature=0.0)
    # a device pool for about half the sessions: the rest must spill to host and disk
    # the KV geometry from config.json alone (no weights loaded just to size the pool)
    cfg = EngineConfig.from_args(model)
    spec = load_model_spec(cfg.model)
    bpt = kv_bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim,
                             cfg.kv_cache_dtype)
    bs = cfg.block_size
    per_session_tokens = 150 + num_turns * 170
    device_blocks = 1024 // bs + max(1, num_sessions // 3) * (per_session_tokens // bs + 1)
    kw = dict(kv_cache_memory=device_blocks * bs * bpt,
              host_cache_memory=max(1, num_sessions // 4) * per_session_tokens * bpt,
              max_model_len=1024, session_dir=session_dir)
    ttft_warm, computed, stateless = [], 0, 0
    replies: dict = {}
    # each agent's conversation as a stateless engine receives it each turn: the whole
    # history so far, then the turn's message (replayed below, the same turns at once)
    prompts: list[list[list[dict]]] = [[] for _ in range(num_turns)]
    lock = threading.Lock()
    with LLM(model, **kw) as llm:
        out(f"phase 1: {num_sessions} agents x {num_turns} turns, device pool "
            f"{device_blocks} blocks ({device_blocks * bs} tokens), host tier "
            f"{kw['host_cache_memory'] // bpt} tokens, session_dir {session_dir}")
        sessions = [llm.session(system=SYSTEM, session_id=f"agent-{i}", sampling=params)
                    for i in range(num_sessions)]

        def send(i, turn):
            nonlocal computed
            s = sessions[i]
            msg = (f"Task: {TASKS[i % len(TASKS)]}." if turn == 0
                   else "Continue with the next step.")
            history = s.messages + [{"role": "user", "content": msg}]
            r = s.send(msg)  # (its KV restored first, if a suspend moved it)
            with lock:
                prompts[turn].append(history)
                replies[s.session_id] = r
                if turn:
                    ttft_warm.append(r.metrics.ttft_s)
                computed += r.prefill_tokens

        def wait_on_tool(i, turn):
            s = sessions[i]
            s.suspend(expected_idle_s=rng.choice([0.01, 120.0, 900.0]))
            s.add("tool", _tool_result(random.Random(i * 100 + turn), turn))

        # the turns' wall time: each turn every agent's send at once (restores included);
        # the tool waits between turns (suspends, spills) run while the tools would
        turns_s = 0.0
        for turn in range(num_turns):
            turns_s += _at_once([partial(send, i, turn) for i in range(num_sessions)])
            _at_once([partial(wait_on_tool, i, turn) for i in range(num_sessions)])
            st = llm.stats()
            out(f"\nafter turn {turn + 1}: spills host {st.spills['host']} disk "
                f"{st.spills['disk']}, restores host {st.restores['host']} disk "
                f"{st.restores['disk']}, recomputes {st.recomputes}, prefix hit rate "
                f"{st.prefix.hit_rate:.0%}")
            _table(out, sessions, replies)
        phase1 = llm.stats()
    # the same turns on a stateless engine (no sessions, no prefix cache), the same agents
    # at once each turn, the same model and pool: what sessions are compared with
    ttft_stateless, stateless_s = [], 0.0
    with LLM(model, kv_cache_memory=kw["kv_cache_memory"], max_model_len=1024,
             enable_prefix_caching=False) as cold:
        def replay(history, turn):
            nonlocal stateless
            r = cold.chat(history, params, use_tqdm=False)[0]
            with lock:
                stateless += len(r.prompt_token_ids)  # every token of it computed
                if turn:
                    ttft_stateless.append(r.metrics.ttft_s)

        for turn in range(num_turns):
            stateless_s += _at_once([partial(replay, h, turn) for h in prompts[turn]])
    # llm.close() persisted every live session to session_dir: now "restart"
    resumed, resumed_cached = 0, 0
    with LLM(model, **kw) as llm:
        ids = llm.sessions()
        out(f"\nphase 2: a new engine on the same session_dir finds {len(ids)} sessions")
        for sid in ids:
            s = llm.session(session_id=sid)
            r = s.send("Resume: what was the last tool result?")
            resumed += 1
            resumed_cached += r.cached_tokens
            computed += r.prefill_tokens
            stateless += r.prefill_tokens + r.cached_tokens
            s.close(delete=True)
        phase2 = llm.stats()
    summary = {
        "sessions": num_sessions, "turns": num_turns,
        "ttft_warm_p50_s": statistics.median(ttft_warm) if ttft_warm else 0.0,
        "ttft_stateless_p50_s": statistics.median(ttft_stateless) if ttft_stateless else 0.0,
        "turns_s": turns_s, "stateless_turns_s": stateless_s,
        "tokens_computed": computed, "tokens_stateless": stateless,
        "spills": {k: phase1.spills[k] + phase2.spills[k] for k in phase1.spills},
        "restores": {k: phase1.restores[k] + phase2.restores[k] for k in phase1.restores},
        "recomputes": phase1.recomputes + phase2.recomputes,
        "resumed_after_restart": resumed, "resumed_cached_tokens": resumed_cached,
        "stats": (phase1, phase2),
    }
    out(f"\nsummary: the same {num_sessions} agents x {num_turns} turns, at once each turn, "
        f"with sessions and on a stateless engine (same model, same pool)")
    out(f"  prompt tokens computed {computed} vs {stateless} stateless "
        f"({stateless / max(computed, 1):.1f}x fewer)")
    out(f"  every turn, end to end: {turns_s:.2f} s vs {stateless_s:.2f} s stateless "
        f"({stateless_s / max(turns_s, 1e-9):.2f}x)")
    if stateless_s < turns_s:
        out("    (this tiny model computes a whole prompt in milliseconds, about what loading "
            "suspended KV back from host and disk costs; on a real checkpoint the prompt "
            "tokens computed are the time)")
    if ttft_warm:
        out(f"  TTFT p50 of later turns: {summary['ttft_warm_p50_s'] * 1e3:.1f} ms vs "
            f"{summary['ttft_stateless_p50_s'] * 1e3:.1f} ms stateless")
    out(f"  spills: host {summary['spills']['host']}, disk {summary['spills']['disk']}; "
        f"restores: host {summary['restores']['host']}, disk {summary['restores']['disk']}; "
        f"recomputed instead of loaded: {summary['recomputes']}")
    out(f"  resumed after restart: {resumed} sessions, {resumed_cached} prompt tokens served "
        f"from their snapshots")
    return summary


def _at_once(calls: list[Callable[[], None]]) -> float:
    """Run `calls` each in a thread of its own; the seconds until all are done."""
    threads = [threading.Thread(target=call) for call in calls]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start
