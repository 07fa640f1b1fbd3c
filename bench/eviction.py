"""Eviction policies on replayed traces: LRU vs the cost-aware policy vs Belady's optimum.

1. Cache layer alone (fast, no model): each request's prompt is a chain of blocks; its
   longest cached prefix is hit (verified lookups in the real BlockPool), the rest is
   allocated (evicting by the policy), published with its chain parents and freed tail
   first, one request at a time. Belady's offline optimum is simulated on the same trace
   (evict the block whose next use is furthest away; deeper blocks first on ties, so no
   child outlives its prefix). Three seeded traces:
   (a) agents: shared system prompts + multi-turn sessions + one-off scans larger than
       the pool;
   (b) a trace in the Mooncake conversation format ({"timestamp", "input_length",
       "output_length", "hash_ids"}: chained block ids) generated with fixed seeds;
   (c) many tenants (Zipf popularity), each with a private system prompt;
   (d) conversations with think times (reuse is temporal: soon or never);
   and (a) again with a pool of 96 blocks, barely the active sessions' working set.
   Target: cost-aware >= 0.9 of Belady's token hit rate on each trace and never more than 1
   point below LRU.
2. The engine on the tiny model under memory pressure: trace (a) through `LLM.generate`
   with each policy; prompt tokens computed (lower is better).
Writes bench/results/eviction.json; `--plot` draws bench/results/eviction.png.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import random
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

from common import pyplot, save_figure, write_result

from kvsession.cache.block_pool import BlockPool
from kvsession.cache.eviction import BOTH_ORDERS, EvictionPolicy, Order
from kvsession.cache.identity import StorageIdentity

BS = 16
Trace = list[list[int]]  # per request: its block ids (a chain: equal prefixes, equal ids)


# ---- traces --------------------------------------------------------------------------------

def agents_trace(seed: int = 0, num_sessions: int = 32, turns: int = 6, active: int = 4,
                 scan_blocks: int = 48) -> Trace:
    """4 system prompts of 6 blocks; agent sessions run their turns in bursts, `active` at a
    time interleaved (an agent loop: turn, tool call, next turn); each turn re-sends the
    history plus 2-4 new blocks; every 5th request is a one-off scan (a document, a
    search result) with no reuse."""
    rng = random.Random(seed)
    ids = iter(range(10**9))
    systems = [[next(ids) for _ in range(6)] for _ in range(4)]
    pending = [list(rng.choice(systems)) for _ in range(num_sessions)]
    running: list[list] = []  # [history, turns left]
    trace: Trace = []
    while pending or running:
        while pending and len(running) < active:
            running.append([pending.pop(), turns])
        s = rng.choice(running)
        s[0] = s[0] + [next(ids) for _ in range(rng.randint(2, 4))]
        s[1] -= 1
        trace.append(list(s[0]))
        if s[1] == 0:
            running.remove(s)
        if len(trace) % 5 == 4:
            trace.append([next(ids) for _ in range(scan_blocks)])
    return trace


def mooncake_trace(seed: int = 1) -> list[dict]:
    return _mooncake(seed)[0]


def _mooncake(seed: int, num_conversations: int = 60, num_requests: int = 400,
              block_tokens: int = 512) -> tuple[list[dict], list[int], list[float]]:
    """Requests in the Mooncake trace format: conversations (Zipf 0.8 popularity) re-send
    their history (same hash_ids) plus new blocks; 30% share one of 3 system prompts.
    Also returns each request's conversation and the popularities (for the oracle)."""
    rng = random.Random(seed)
    ids = iter(range(10**9))
    systems = [[next(ids) for _ in range(rng.randint(2, 8))] for _ in range(3)]
    convs = [list(rng.choice(systems)) if rng.random() < 0.3 else [] for _ in
             range(num_conversations)]
    weights = [1.0 / (i + 1) ** 0.8 for i in range(num_conversations)]
    out, t, which = [], 0, []
    for _ in range(num_requests):
        c = rng.choices(range(num_conversations), weights)[0]
        which.append(c)
        convs[c] += [next(ids) for _ in range(rng.randint(1, 6))]
        t += rng.randint(10, 2000)
        out.append({"timestamp": t, "input_length": len(convs[c]) * block_tokens,
                    "output_length": rng.randint(16, 512), "hash_ids": list(convs[c])})
    return out, which, weights


def offline_replay(trace: Trace, capacity: int, price) -> float:
    """Token hit rate of an oracle policy: a block is identified by its chain (the tuple of
    ids up to it), as the hash chain does; each use of block k at request t re-prices it
    (`price` is called for every use, in trace order), and while the cache is over
    capacity the cheapest block that the current request does not use is evicted.
    `price(k, t, old)` also gets k's price while cached (None if it is not)."""
    keys = [[tuple(req[:i + 1]) for i in range(min(len(req), capacity))] for req in trace]
    cached: dict[tuple, tuple] = {}
    heap: list[tuple[tuple, tuple]] = []  # (price, key), lazily stale
    hit = total = 0
    for t, (req, ks) in enumerate(zip(trace, keys, strict=True)):
        n = 0
        while n < len(ks) and ks[n] in cached:
            n += 1
        hit += n
        total += len(req)
        for k in ks:
            cached[k] = price(k, t, cached.get(k))
            heapq.heappush(heap, (cached[k], k))
        mine, skipped = set(ks), []
        while len(cached) > capacity:
            entry = heapq.heappop(heap)
            if cached.get(entry[1]) != entry[0]:
                continue  # stale
            if entry[1] in mine:  # in use by this request
                skipped.append(entry)
                continue
            del cached[entry[1]]
        for entry in skipped:
            heapq.heappush(heap, entry)
    return hit / total


def popularity_oracle(trace: Trace, popularity: list[float], capacity: int) -> float:
    """The best an online policy can do on an independent-reference trace: it knows each
    request's true popularity and keeps the most popular content (deeper blocks first on
    ties). Belady also knows the order of future requests; this does not."""
    def price(k: tuple, t: int, old: tuple | None) -> tuple:
        return max(old[0] if old else 0.0, popularity[t]), -len(k)
    return offline_replay(trace, capacity, price)


def future_count_oracle(trace: Trace, capacity: int) -> float:
    """An oracle for traces whose reuse is temporal (d): it knows how many more requests
    will use each block (for a conversation: whether it comes back, and how many more
    turns), but not when. On a miss with a full cache it evicts the block with the fewest
    future uses, the least recently used among equals (deeper blocks first), so finished
    conversations go first. With exponential think times a live conversation returns at
    the same rate however long it has been idle, so what this knows beyond an online
    policy (which conversations are finished, how long the others will go on) is what
    recency and hit counts can only estimate: about the ceiling of an online policy here,
    as the popularity oracle is for (b)."""
    left = Counter(tuple(req[:i + 1]) for req in trace
                   for i in range(min(len(req), capacity)))

    def price(k: tuple, t: int, _old) -> tuple:
        left[k] -= 1
        return left[k], t, -len(k)
    return offline_replay(trace, capacity, price)


def tenants_trace(seed: int = 2, num_tenants: int = 40, num_requests: int = 1500) -> Trace:
    """Each tenant has a private 8-block system prompt; queries add 2-6 unique blocks;
    tenants are Zipf-popular."""
    rng = random.Random(seed)
    ids = iter(range(10**9))
    systems = [[next(ids) for _ in range(8)] for _ in range(num_tenants)]
    weights = [1.0 / (i + 1) for i in range(num_tenants)]
    return [systems[rng.choices(range(num_tenants), weights)[0]]
            + [next(ids) for _ in range(rng.randint(2, 6))] for _ in range(num_requests)]


def conversations_trace(seed: int = 1, num_requests: int = 400) -> Trace:
    """Conversations that start over time (Poisson, one every ~400 ms), 40% single-turn, the
    rest 1 + Exp(5) turns, each turn re-sending the history plus 1-6 new blocks after an
    exponential think time (mean 6 s) since the last one; 30% share one of 3 system
    prompts. Unlike (b), reuse is temporal: a conversation comes back soon or never, which
    only Belady knows in advance."""
    rng = random.Random(seed)
    ids = iter(range(10**9))
    systems = [[next(ids) for _ in range(rng.randint(2, 8))] for _ in range(3)]
    due: list[tuple[float, int, list[int], int]] = []  # (time, seq, history, turns left)
    t, seq, trace = 0.0, itertools.count(), []
    while len(trace) < num_requests:
        t += rng.expovariate(1 / 400)
        history = list(rng.choice(systems)) if rng.random() < 0.3 else []
        turns = 1 if rng.random() < 0.4 else 1 + int(rng.expovariate(1 / 5))
        heapq.heappush(due, (t, next(seq), history, turns))
        while due and due[0][0] <= t:
            at, _, history, left = heapq.heappop(due)
            history = history + [next(ids) for _ in range(rng.randint(1, 6))]
            trace.append(history)
            if left > 1:
                heapq.heappush(due, (at + rng.expovariate(1 / 6000), next(seq), history,
                                     left - 1))
    return trace[:num_requests]


# ---- replay through the cache layer ----------------------------------------------------------

def replay(trace: Trace, capacity: int, policy: EvictionPolicy,
           orders: tuple[Order, ...] = BOTH_ORDERS, followed: list | None = None) -> float:
    """Token hit rate of `trace` through a real BlockPool of `capacity` blocks (`orders`:
    the COST policy's orders; one order is that order alone, no shadows). `followed`
    collects the order the pool followed at each request."""
    pool = BlockPool(capacity, BS, eviction=policy, orders=orders)
    hasher = StorageIdentity("bench", "float32", BS).hasher()
    hit = total = 0
    for req in trace:
        tokens = [t for block in req for t in [block] * BS]
        hashes = hasher.extend([], tokens, len(tokens), None)
        pool.observe(hashes)  # as the scheduler does when it admits the prompt
        hits = []
        for i, h in enumerate(hashes[:capacity]):
            b = pool.lookup(h, tokens[i * BS:(i + 1) * BS])
            if b is None:
                break
            hits.append(b)
        pool.touch(hits)
        need = min(len(req), capacity) - len(hits)
        blocks = hits + pool.allocate(need)
        for i in range(len(hits), len(blocks)):
            pool.cache_full_block(blocks[i], hashes[i], tokens[i * BS:(i + 1) * BS],
                                  hashes[i - 1] if i else None)
        pool.free(blocks)
        hit += len(hits)
        total += len(req)
        if followed is not None and policy is EvictionPolicy.COST:
            followed.append(pool.free_queue.leader.value)
    pool.check_integrity()
    return hit / total


def belady(trace: Trace, capacity: int) -> float:
    """Token hit rate of the offline optimum: on a miss with a full cache, evict the block
    used furthest in the future (deepest first on ties, so no child outlives its prefix)."""
    uses: dict[tuple, list[int]] = defaultdict(list)
    for t, req in enumerate(trace):
        for i in range(min(len(req), capacity)):
            uses[tuple(req[:i + 1])].append(t)
    seen: dict[tuple, int] = defaultdict(int)

    def price(k: tuple, t: int, _old) -> tuple:
        seen[k] += 1
        later = uses[k]
        return -(later[seen[k]] if seen[k] < len(later) else float("inf")), -len(k)
    return offline_replay(trace, capacity, price)


def cache_layer(capacity_fraction: float = 0.15) -> dict:
    mooncake, which, weights = _mooncake(1)
    tight = [r[:60] for r in agents_trace(seed=3, num_sessions=16, turns=5, scan_blocks=48)]
    traces = {"agents": (agents_trace(), None), "agents_tight_pool": (tight, 96),
              "mooncake": ([r["hash_ids"] for r in mooncake], None),
              "tenants": (tenants_trace(), None),
              "conversations": (conversations_trace(), None)}
    out = {}
    for name, (trace, capacity) in traces.items():
        distinct = distinct_blocks(trace)
        capacity = capacity or pool_blocks(trace, capacity_fraction)
        lru = replay(trace, capacity, EvictionPolicy.LRU)
        followed: list[str] = []
        cost = replay(trace, capacity, EvictionPolicy.COST, followed=followed)
        alone = {o.value: replay(trace, capacity, EvictionPolicy.COST, (o,)) for o in Order}
        opt = belady(trace, capacity)
        out[name] = {"requests": len(trace), "capacity_blocks": capacity,
                     "distinct_blocks": distinct, "lru": lru, "cost": cost, "belady": opt,
                     "cost_vs_belady": cost / opt if opt else 1.0,
                     "cost_minus_lru_points": 100 * (cost - lru),
                     "met": cost >= 0.9 * opt and cost >= lru - 0.01,
                     "order_alone": alone,
                     "followed_frequency_share": followed.count("frequency") / len(followed)}
        extra = ""
        if name == "mooncake":
            oracle = popularity_oracle(trace, [weights[c] for c in which], capacity)
            out[name] |= {"popularity_oracle": oracle, "cost_vs_oracle": cost / oracle}
            extra = f"; popularity oracle {oracle:.3f} ({oracle / opt:.2f} of Belady)"
        print(f"{name:17s} capacity {capacity:5d} blocks: hit rate LRU {lru:.3f}, cost-aware "
              f"{cost:.3f} (recency order alone {alone['recency']:.3f}, frequency alone "
              f"{alone['frequency']:.3f}; followed frequency for "
              f"{out[name]['followed_frequency_share']:.0%} of requests), Belady {opt:.3f} -> "
              f"{cost / opt:.3f} of Belady, {100 * (cost - lru):+.1f} points vs LRU{extra}",
              flush=True)
    out["mooncake_sample"] = mooncake[:3]
    out["mooncake_seeds"] = mooncake_ceiling(capacity_fraction)
    out["conversations_seeds"] = conversations_seeds(capacity_fraction)
    return out


def conversations_seeds(capacity_fraction: float, seeds=range(1, 6)) -> list[dict]:
    """Trace (d) over several seeds: on some the cost-aware policy falls behind LRU (its
    hit-count lease keeps finished conversations' histories a few turnovers longer)."""
    rows = []
    for seed in seeds:
        trace = conversations_trace(seed)
        capacity = pool_blocks(trace, capacity_fraction)
        row = {"seed": seed} | versus(trace, capacity)
        oracle = future_count_oracle(trace, capacity)
        row |= {"future_count_oracle": oracle, "oracle_vs_belady": oracle / row["belady"],
                "cost_vs_oracle": row["cost"] / oracle}
        rows.append(row)
        print(f"conversations seed {seed}: LRU {row['lru']:.3f}, cost-aware {row['cost']:.3f}, "
              f"future-count oracle {oracle:.3f}, Belady {row['belady']:.3f}: "
              f"{row['cost_vs_belady']:.3f} of Belady (oracle {row['oracle_vs_belady']:.3f}), "
              f"{row['cost_minus_lru_points']:+.1f} points vs LRU", flush=True)
    return rows


def distinct_blocks(trace: Trace) -> int:
    """Distinct blocks of a trace (a block is its chain: the ids up to it)."""
    return len({tuple(r[:i + 1]) for r in trace for i in range(len(r))})


def pool_blocks(trace: Trace, capacity_fraction: float) -> int:
    """The pool a trace is replayed through: a fraction of its distinct blocks."""
    return max(64, int(distinct_blocks(trace) * capacity_fraction))


def versus(trace: Trace, capacity: int) -> dict:
    """LRU, the cost-aware policy and Belady on one trace and pool."""
    lru = replay(trace, capacity, EvictionPolicy.LRU)
    cost = replay(trace, capacity, EvictionPolicy.COST)
    opt = belady(trace, capacity)
    return {"capacity_blocks": capacity, "lru": lru, "cost": cost, "belady": opt,
            "cost_vs_belady": cost / opt, "cost_minus_lru_points": 100 * (cost - lru)}


def mooncake_ceiling(capacity_fraction: float, seeds=range(1, 6)) -> list[dict]:
    """The Mooncake-format trace picks each request's conversation independently (Zipf), so
    the best online policy keeps the most popular content: the popularity oracle is about
    the ceiling of any policy that does not know the future. Per seed: how close it comes
    to Belady, and the cost-aware policy to both."""
    rows = []
    for seed in seeds:
        reqs, which, weights = _mooncake(seed)
        trace = [r["hash_ids"] for r in reqs]
        capacity = pool_blocks(trace, capacity_fraction)
        row = versus(trace, capacity)
        lru, cost, opt = row["lru"], row["cost"], row["belady"]
        oracle = popularity_oracle(trace, [weights[c] for c in which], capacity)
        rows.append({"seed": seed, **row, "popularity_oracle": oracle,
                     "oracle_vs_belady": oracle / opt, "cost_vs_oracle": cost / oracle})
        print(f"mooncake seed {seed}: LRU {lru:.3f}, cost-aware {cost:.3f}, popularity oracle "
              f"{oracle:.3f}, Belady {opt:.3f}: oracle {oracle / opt:.3f} of Belady, "
              f"cost-aware {cost / opt:.3f} of Belady, {cost / oracle:.3f} of the oracle",
              flush=True)
    return rows


def trace_file(path: Path, num_requests: int, fractions=(0.05, 0.15, 0.3)) -> dict:
    """A trace file in the Mooncake format (JSONL with "hash_ids"), e.g. the public
    conversation trace of kvcache-ai/Mooncake (FAST25-release/traces/conversation_trace.jsonl;
    not shipped here: pass its path), replayed at several pool sizes: how the policies do
    on recorded rather than generated reuse."""
    with path.open() as f:
        trace = [json.loads(line)["hash_ids"] for line in itertools.islice(f, num_requests)]
    distinct = distinct_blocks(trace)
    rows = []
    for frac in fractions:
        row = {"capacity_fraction": frac} | versus(trace, pool_blocks(trace, frac))
        rows.append(row)
        print(f"{path.name} ({len(trace)} requests) pool {row['capacity_blocks']} blocks: LRU "
              f"{row['lru']:.3f}, cost-aware {row['cost']:.3f}, Belady {row['belady']:.3f}: "
              f"{row['cost_vs_belady']:.3f} of Belady, {row['cost_minus_lru_points']:+.1f} "
              "points vs LRU", flush=True)
    uses: dict[tuple, int] = defaultdict(int)
    for r in trace:
        for i in range(len(r)):
            uses[tuple(r[:i + 1])] += 1
    once = sum(1 for n in uses.values() if n == 1) / len(uses)
    print(f"{once:.0%} of the distinct blocks are used once", flush=True)
    return {"file": path.name, "requests": len(trace), "distinct_blocks": distinct,
            "total_blocks": sum(map(len, trace)), "used_once_share": once, "pools": rows}


# ---- the engine ------------------------------------------------------------------------------

def engine(num_blocks: int = 96) -> dict:
    """Trace (a), scaled to the tiny model, through LLM.generate with each policy."""
    from kvsession import LLM, SamplingParams
    from kvsession.testing import make_tiny_model

    trace = agents_trace(seed=3, num_sessions=16, turns=5, scan_blocks=num_blocks // 2)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "m")
        for policy in ("lru", "cost"):
            with LLM(model, kv_cache_memory=num_blocks * BS * 512, block_size=BS,
                     max_model_len=64 * BS, eviction_policy=policy,
                     host_cache_memory=0) as llm:
                vocab = llm.runtime.spec.vocab_size
                computed = prompt = 0
                for req in trace:
                    ids = [(b * 7 + j) % (vocab - 1) + 1 for b in req for j in range(BS)][
                        : 60 * BS]
                    o = llm.generate(prompt_token_ids=[ids], sampling_params=params,
                                     use_tqdm=False)[0]
                    prompt += len(ids)
                    computed += len(ids) - o.num_cached_tokens
                st = llm.stats()
                out[policy] = {"prompt_tokens": prompt, "computed_tokens": computed,
                               "hit_rate": st.prefix.hit_rate,
                               "evictions": st.prefix.evictions}
            print(f"engine {policy}: computed {computed} of {prompt} prompt tokens "
                  f"(hit rate {out[policy]['hit_rate']:.3f})", flush=True)
    out["computed_ratio_cost_vs_lru"] = out["cost"]["computed_tokens"] / \
        out["lru"]["computed_tokens"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--plot", action="store_true")
    ap.add_argument("--dump-mooncake", type=Path, help="write the generated trace (JSONL)")
    ap.add_argument("--trace-file", type=Path,
                    help="only replay this Mooncake-format JSONL (a recorded trace) at several "
                         "pool sizes; writes bench/results/eviction_trace_file.json")
    ap.add_argument("--requests", type=int, default=3000, help="with --trace-file: the first N")
    args = ap.parse_args()
    if args.dump_mooncake:
        args.dump_mooncake.write_text("".join(json.dumps(r) + "\n" for r in mooncake_trace()))
    if args.trace_file:
        write_result("eviction_trace_file", trace_file(args.trace_file, args.requests))
        return
    res = {"cache_layer": cache_layer(), "engine": engine()}
    write_result("eviction", res)
    if args.plot:
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(8, 3.8))
        names = ["agents", "agents_tight_pool", "mooncake", "tenants", "conversations"]
        cl = res["cache_layer"]
        bars = [("LRU", lambda x: x["lru"]),
                ("recency order alone", lambda x: x["order_alone"]["recency"]),
                ("frequency order alone", lambda x: x["order_alone"]["frequency"]),
                ("cost-aware (follows the better)", lambda x: x["cost"]),
                ("Belady", lambda x: x["belady"])]
        width = 0.8 / len(bars)
        for i, (label, get) in enumerate(bars):
            ax.bar([j + (i - (len(bars) - 1) / 2) * width for j in range(len(names))],
                   [get(cl[n]) for n in names], width, label=label)
        m = names.index("mooncake")
        ax.hlines(cl["mooncake"]["popularity_oracle"], m - 0.4, m + 0.4, colors="k",
                  linestyles="dashed", label="popularity oracle (mooncake)")
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel("token hit rate")
        ax.set_title("Eviction: cache-layer replay")
        ax.set_ylim(0, 0.85)
        ax.legend(fontsize=7, ncol=3, loc="upper center")
        save_figure(fig, "eviction")

if __name__ == "__main__":
    main()
