"""kvsession vs transformers on the same random mid-size weights, same process, float32 on
CPU, greedy; and a decode step against the limit the memory allows, measured in the run.

1. Throughput: decode tokens/s at batch 1 and batch 8 (mixed prompt lengths), prefill
   tokens/s at 512 and 2048 tokens, through `generate` on both sides.
2. Decode steps at batch 1 and 8, contexts 128 and 2,048: the time of one step (the
   difference between generating n+1 tokens and 1 from an already cached prompt, on both
   sides: prefill excluded), against the bandwidth bound = bytes the step must read
   (every projection weight once, plus each sequence's K/V) / DRAM read bandwidth (the best
   `sum` over a 1 GiB buffer sampled between that case's timings: this machine's speed
   drifts by up to ~1.7x over minutes). Targets: batch 1 <= 1.5x the
   bound, 2,048-token decode >= 0.8x the 128-token rate, >= 1.5x transformers everywhere.
3. Attention over a fragmented block table (2,048 tokens, blocks in random order) vs the
   same step on consecutive blocks, through the torch reference and the CPU kernel; and
   decode attention alone (the mid model's layer shape, 2,048 tokens per sequence, caches
   far larger than the CPU's caches) against a `sum` over the same bytes: batch 1 and 8,
   consecutive and scattered blocks, and 8 sequences sharing 1,024 leading tokens.
4. `--kernels`: the projection kernels on the model's weight shapes vs the same bound.
5. `--int8` (optional): weight-only int8 logits against float32, and its step time.

Writes bench/results/decode_vs_hf.json; `--plot` draws bench/results/decode_vs_hf.png.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import warnings

import torch
from common import Solo, compare, mid_model, pyplot, save_figure, timed_rounds, write_result

from kvsession import LLM, SamplingParams

ALONE_ROUNDS = 15  # paired rounds of kvsession alone per batch size
CASES = [(1, 128), (1, 2048), (8, 128), (8, 2048)]  # (batch, context tokens)


class Bandwidth:
    """DRAM read bandwidth: the best of many `sum`s over a buffer far larger than the
    caches, taken between the measured steps so that it sees the same machine state."""

    def __init__(self, nbytes: int = 1 << 30):
        self.buf = torch.ones(nbytes // 4)
        self.best = 0.0
        self.window_best = 0.0  # the best since start_window(): one measurement's

    def start_window(self) -> None:
        """Samples from now on also count towards `window_best` (this machine's speed
        drifts by up to ~1.7x over minutes: a bound is taken from the samples interleaved
        with the timings it bounds)."""
        self.window_best = 0.0

    def measure(self) -> float:
        """One sample's rate (bytes/s)."""
        t = time.perf_counter()
        self.buf.sum()
        rate = self.buf.numel() * 4 / (time.perf_counter() - t)
        self.best, self.window_best = max(self.best, rate), max(self.window_best, rate)
        return rate

    def sample(self) -> float:
        """A sample; the best rate so far."""
        self.measure()
        return self.best


def step_bytes(spec, batch: int, context: int) -> tuple[int, int]:
    """(weight bytes, K/V bytes) one float32 decode step reads: every projection and the
    output head once (the embedding row lookups are negligible), each sequence's cache."""
    h, hd, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    q, kv = spec.num_heads * hd, spec.num_kv_heads * hd
    per_layer = h * (q + 2 * kv) + q * h + 2 * h * inter + inter * h
    weights = 4 * (spec.num_layers * per_layer + spec.vocab_size * h)
    return weights, 4 * 2 * spec.num_layers * kv * batch * context


def generate_fn(llm, solo, prompts: list[list[int]], n: int):
    """A callable generating n tokens greedily for `prompts` through kvsession."""
    p = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    def run():
        solo.ours()
        llm.generate(prompt_token_ids=prompts, sampling_params=p, use_tqdm=False)
    return run


def step_case(llm, hf, bw: Bandwidth, steps: int, prompts: list[list[int]]) -> dict:
    """One decode step of `prompts` (cached on both sides), kvsession and transformers."""
    from transformers import DynamicCache

    batch, context = len(prompts), len(prompts[0])
    solo = Solo(llm)

    def ours(n):
        return generate_fn(llm, solo, prompts, n)

    ids = torch.tensor(prompts)
    cache = DynamicCache()
    with torch.inference_mode():  # HF's cache holds the prompt but its last token
        hf(ids[:, :-1], past_key_values=cache, use_cache=True)

    def theirs(n):
        def run():
            solo.theirs()
            extra = cache.get_seq_length() - (context - 1)
            if extra:  # back to the prompt (this transformers crops by a negative count)
                cache.crop(-extra)
            with torch.inference_mode():
                hf.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                            max_new_tokens=n, do_sample=False, pad_token_id=0)
        return run

    ours(1)()  # caches the prompts (prefix caching): every later run decodes only
    bw.start_window()
    t1, tn, h1, hn = compare([ours(1), ours(steps + 1), theirs(1), theirs(steps + 1)], 5,
                             between=bw.sample)
    ms, hf_ms = (tn - t1) / steps * 1e3, (hn - h1) / steps * 1e3
    wbytes, kvbytes = step_bytes(llm.runtime.spec, batch, context + steps // 2)
    r = {"batch": batch, "context": context, "step_ms": ms, "hf_step_ms": hf_ms,
         "tok_s": batch / ms * 1e3, "hf_tok_s": batch / hf_ms * 1e3,
         "weight_bytes": wbytes, "kv_bytes": kvbytes, "ratio_vs_hf": hf_ms / ms,
         "bandwidth_gb_s": bw.window_best / 1e9,
         "bound_ms": (wbytes + kvbytes) / bw.window_best * 1e3}
    r["ratio_to_bound"] = ms / r["bound_ms"]
    print(f"decode step batch {batch} ctx {context:5d}: {ms:6.2f} ms = "
          f"{r['ratio_to_bound']:.2f}x the bound ({r['bound_ms']:.2f} ms at "
          f"{r['bandwidth_gb_s']:.1f} GB/s), transformers {hf_ms:6.2f} ms "
          f"({r['ratio_vs_hf']:.2f}x)", flush=True)
    return r


def decode_steps(llm, hf, bw: Bandwidth, steps: int, rng) -> dict:
    out, prompts = {}, {}
    for batch, context in CASES:
        prompts[batch, context] = [[rng.randrange(32000) for _ in range(context)]
                                   for _ in range(batch)]
        out[f"batch{batch}_ctx{context}"] = step_case(llm, hf, bw, steps,
                                                      prompts[batch, context])
    # kvsession alone: both contexts of a batch timed in paired rounds, each round after a
    # bandwidth sample (the engine's OpenMP workers released first, as before transformers'
    # runs, so that none still spins on a core while `sum` runs); the step against the bound
    # of its own round, and the long/short rate of each round, then the medians over the
    # rounds: this machine's speed drifts by up to ~1.7x over minutes (the cases above run
    # minutes apart), and transformers' runs between kvsession's make the engine's
    # ThreadGovernor re-measure its thread count. Their prompts are still cached.
    solo = Solo(llm)
    med = statistics.median
    rates: list[float] = []  # bytes/s, one per round of the batch size being timed

    def sample_bandwidth():
        solo.theirs()
        rates.append(max(bw.measure() for _ in range(2)))

    for b in (1, 8):
        nbytes = {c: out[f"batch{b}_ctx{c}"]["weight_bytes"]
                  + out[f"batch{b}_ctx{c}"]["kv_bytes"] for c in ("128", "2048")}
        rates.clear()
        times = timed_rounds([generate_fn(llm, solo, prompts[b, int(c)], n) for c in nbytes
                              for n in (1, steps + 1)], ALONE_ROUNDS,
                             before_round=sample_bandwidth)
        rounds = []
        for t, rate in zip(times, rates, strict=True):
            ms = {"128": (t[1] - t[0]) / steps * 1e3, "2048": (t[3] - t[2]) / steps * 1e3}
            rounds.append({"bandwidth_gb_s": rate / 1e9, "step_ms": ms,
                           "ratio_to_bound": {c: ms[c] / (nbytes[c] / rate * 1e3) for c in ms},
                           "long_vs_short": ms["128"] / ms["2048"]})
        out[f"batch{b}_alone_rounds"] = rounds
        out[f"batch{b}_long_vs_short"] = med(r["long_vs_short"] for r in rounds)
        for c in nbytes:
            case = out[f"batch{b}_ctx{c}"]
            rate = med(r["bandwidth_gb_s"] for r in rounds)
            ms = med(r["step_ms"][c] for r in rounds)
            case.update(alone_step_ms=ms, alone_bandwidth_gb_s=rate,
                        alone_bound_ms=nbytes[c] / rate / 1e6,
                        alone_ratio_to_bound=med(r["ratio_to_bound"][c] for r in rounds))
            print(f"decode step batch {b} ctx {c:>5}, kvsession alone (medians of "
                  f"{len(rounds)} rounds): {ms:6.2f} ms = {case['alone_ratio_to_bound']:.2f}x "
                  f"the bound of its round ({case['alone_bound_ms']:.2f} ms at {rate:.1f} GB/s)",
                  flush=True)
        lo = sorted(r["long_vs_short"] for r in rounds)
        print(f"batch {b}: 2,048-token decode at {out[f'batch{b}_long_vs_short']:.2f}x the "
              f"128-token rate (median of {len(rounds)} paired rounds, range "
              f"{lo[0]:.2f}-{lo[-1]:.2f}; target >= 0.8)", flush=True)
    return out


class Direct:
    """A model with its own KV pool, driven without the engine (explicit block tables):
    for what the engine does not expose (a fragmented table, another weight format)."""

    def __init__(self, path, weight_format: str = "float", num_blocks: int = 320,
                 backend=None):
        from kvsession.cache.kv_pool import KVPool
        from kvsession.config import AttentionBackend
        from kvsession.kernels.reference import Workspace
        from kvsession.model.config import load_model_spec
        from kvsession.model.llama import LlamaModel
        from kvsession.model.loader import load_weights

        self.spec = spec = load_model_spec(path)
        cpu = torch.device("cpu")
        self.model = LlamaModel(spec, load_weights(path, spec, torch.float32, cpu), 4096,
                                weight_format)
        self.kv = KVPool(spec.num_layers, num_blocks, 16, spec.num_kv_heads, spec.head_dim,
                         torch.float32, cpu)
        self.ws = Workspace()
        self.backend = backend or AttentionBackend.TORCH

    def run(self, tokens: list[int], start: int, table: torch.Tensor) -> torch.Tensor:
        """One sequence's `tokens` at positions start...: float32 logits of the last."""
        from kvsession.attention import AttentionMetadata

        n, bs = len(tokens), self.kv.block_size
        pos = torch.arange(start, start + n)
        meta = AttentionMetadata(
            slot_mapping=table[0, pos // bs] * bs + pos % bs, block_tables=table,
            query_start_loc=[0, n], seq_lens=[start + n],
            seq_lens_tensor=torch.tensor([start + n]), decode_only=n == 1,
            softmax_scale=self.model.softmax_scale, workspace=self.ws, all_slots_valid=True,
            backend=self.backend)
        return self.model.logits(self.model.forward(torch.tensor(tokens), pos, self.kv,
                                                    meta)[-1:])


def fragmented(path, bw: Bandwidth, context: int = 2048) -> dict:
    """One model step (batch 1) over 2,048 cached tokens whose blocks are consecutive or in
    random order, through the torch reference (runs in place, else gathered chunks) and
    the CPU kernel (every block read in place through the table)."""
    from kvsession.config import AttentionBackend

    nblocks = -(-(context + 1) // 16)
    d = Direct(path, num_blocks=2 * nblocks)
    d.kv.k.normal_()
    d.kv.v.normal_()
    tables = {"in_place": torch.arange(nblocks)[None],
              "fragmented": torch.randperm(2 * nblocks, generator=torch.Generator().manual_seed(0))
              [:nblocks][None]}
    backends = {"torch": AttentionBackend.TORCH, "cpu kernel": AttentionBackend.CPU}

    def step(table, backend):
        def run():
            d.backend = backend
            d.run([7], context, table)
        return run

    cases = [(t, b) for b in backends for t in tables]
    t = compare([step(tables[a], backends[b]) for a, b in cases], 5, between=bw.sample)
    wbytes, kvbytes = step_bytes(d.spec, 1, context)
    bound = (wbytes + kvbytes) / bw.best
    out = {f"{a} ({b})": {"step_ms": x * 1e3, "ratio_to_bound": x / bound}
           for (a, b), x in zip(cases, t, strict=True)}
    print("model step, 2,048 tokens: " + ", ".join(
        f"{k} {v['step_ms']:.2f} ms ({v['ratio_to_bound']:.2f}x bound)" for k, v in out.items()))
    return out


def attention_alone(spec, context: int = 2048, layers: int = 8) -> dict:
    """Decode attention by itself, per layer, against the limit the memory sets: a `sum`
    over the same K/V bytes, timed interleaved. `layers` caches (as a model's) so that
    each read comes from DRAM, as in a step."""
    from kvsession.kernels import cpu_decode, reference

    fn = cpu_decode.load()
    if fn is None:
        return {}
    bs, kvh, dim = 16, spec.num_kv_heads, spec.head_dim
    per_seq = context // bs
    num_blocks = 2 * 8 * per_seq
    caches = [(torch.randn(num_blocks, bs, kvh, dim), torch.randn(num_blocks, bs, kvh, dim))
              for _ in range(layers)]
    g = torch.Generator().manual_seed(0)
    scattered = torch.randperm(num_blocks, generator=g)
    shared = per_seq // 2
    cases = {  # name: table [batch, blocks]
        "batch 1, consecutive": torch.arange(per_seq)[None],
        "batch 1, scattered": scattered[:per_seq][None],
        "batch 8, scattered": scattered[:8 * per_seq].view(8, per_seq),
        "batch 8, 1,024 tokens shared": torch.cat(
            [scattered[:shared].expand(8, shared),
             scattered[shared: shared + 8 * (per_seq - shared)].view(8, -1)], dim=1),
    }
    scale = dim ** -0.5
    flush = torch.ones(1 << 25)  # 128 MiB, written before each timing: no cache warm from
    out = {}                     # the previous one (the contiguous copies fit the L3)
    for name, table in cases.items():
        batch = table.shape[0]
        lens = torch.full((batch,), context)
        q = torch.randn(batch, spec.num_heads, dim)
        unique = table.unique()
        nbytes = 2 * unique.numel() * bs * kvh * dim * 4
        share = reference.shared_prefix_blocks(table, lens, bs)
        views = [(k[unique], v[unique]) for k, v in caches]  # the same bytes, contiguous
        t_sum, t_kernel, t_torch = compare([
            _layers(layers, lambda k, v, _: (k.sum(), v.sum()), views, None),
            _layers(layers, lambda k, v, a: cpu_decode.paged_attention(fn, *a[:1], k, v, *a[1:]),
                    caches, (q, table, lens, scale, share)),
            _layers(layers, lambda k, v, a: reference.paged_attention(a[0], k, v, *a[1:4]),
                    caches, (q, table, lens, scale)),
        ], 7, between=lambda: flush.add_(1.0))
        r = {"kernel_us": t_kernel / layers * 1e6, "torch_us": t_torch / layers * 1e6,
             "sum_us": t_sum / layers * 1e6, "bytes": nbytes,
             "kernel_gb_s": nbytes * layers / t_kernel / 1e9,
             "kernel_vs_sum": t_kernel / t_sum, "torch_vs_kernel": t_torch / t_kernel}
        out[name] = r
        print(f"attention alone, {name}: kernel {r['kernel_us']:.0f} us/layer "
              f"({r['kernel_gb_s']:.1f} GB/s, {r['kernel_vs_sum']:.2f}x a sum over the same "
              f"bytes), torch reference {r['torch_us']:.0f} us ({r['torch_vs_kernel']:.2f}x "
              f"the kernel)", flush=True)
    return out


def _layers(layers: int, f, caches, args):
    """A callable running f(k, v, args) over each layer's (k, v) in turn."""
    def run():
        for k, v in caches[:layers]:
            f(k, v, args)
    return run


def int8(path, bw: Bandwidth, prompt_len: int = 256, decode: int = 64) -> dict:
    """Weight-only int8 (optional): logits against float32 on the same tokens (a random
    prompt, then float32's greedy continuation, teacher-forced into both), and the decode
    step time of each at a 128-token context."""
    fp, q8 = Direct(path), Direct(path, "int8")
    rng = random.Random(1)
    tokens = [rng.randrange(fp.spec.vocab_size) for _ in range(prompt_len)]
    nblocks = -(-max(prompt_len + decode, 129) // 16)
    table = torch.arange(nblocks)[None]
    a, b = fp.run(tokens, 0, table), q8.run(tokens, 0, table)
    rel, agree = [], []
    for i in range(decode):
        rel.append(float((b - a).norm() / a.norm()))
        agree.append(int(a.argmax()) == int(b.argmax()))
        tokens.append(int(a.argmax()))
        pos = prompt_len + i
        a, b = fp.run(tokens[-1:], pos, table), q8.run(tokens[-1:], pos, table)
    t = compare([lambda: fp.run([5], 128, table), lambda: q8.run([5], 128, table)], 5,
                between=bw.sample)
    wbytes, kvbytes = step_bytes(fp.spec, 1, 128)
    out = {"logits_rel_l2_mean": statistics.mean(rel), "logits_rel_l2_max": max(rel),
           "top1_agreement": sum(agree) / len(agree), "float32_step_ms": t[0] * 1e3,
           "int8_step_ms": t[1] * 1e3, "speedup": t[0] / t[1],
           "int8_bound_ms": (wbytes / 4 + kvbytes) / bw.best * 1e3}
    print(f"int8 weights: logits rel. L2 mean {out['logits_rel_l2_mean']:.4f} max "
          f"{out['logits_rel_l2_max']:.4f}, top-1 agreement {out['top1_agreement']:.3f}; "
          f"step {out['int8_step_ms']:.2f} ms vs float32 {out['float32_step_ms']:.2f} ms "
          f"({out['speedup']:.2f}x), int8 bound {out['int8_bound_ms']:.2f} ms")
    return out


def packed_rows(ws: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `ws` laid out as the model lays them (a RowsBuffer): one allocation, in
    this order."""
    from kvsession.model.linear import Linear, RowsBuffer

    buffer = RowsBuffer([w.numel() for w in ws], ws[0].dtype)
    return [Linear(w, None, "both", rows_buffer=buffer).rows for w in ws]


def kernels(spec, bw: Bandwidth) -> dict:
    """The model's projections (every layer, then the head) in each weight layout."""
    import torch.nn.functional as F

    h, hd, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    shapes = [(spec.num_heads * hd + 2 * spec.num_kv_heads * hd, h),
              (h, spec.num_heads * hd), (2 * inter, h), (h, inter)] * spec.num_layers
    ws = [torch.randn(s) * 0.02 for s in shapes + [(spec.vocab_size, h)]]
    nbytes = sum(w.numel() * 4 for w in ws)
    from kvsession.model.onerow import compile_region, row_product

    # the product of the one-token regions (model/onerow.py)
    rows_compiled = compile_region(row_product)
    layouts = {
        "F.linear [out, in]": (ws, lambda x, w: F.linear(x, w)),
        "x @ W^T, [in, out]": ([w.t().contiguous() for w in ws], torch.mm),
        "oneDNN prepacked": ([torch.ops.mkldnn._reorder_linear_weight(w, None) for w in ws],
                             lambda x, p: torch.ops.mkldnn._linear_pointwise(
                                 x, p, None, "none", [], "")),
    }
    out = {}
    for rows in (1, 8, 64, 512):
        xs = {n: torch.randn(rows, n) for n in {s[1] for s in shapes} | {h}}
        if rows == 1:  # one token: the inductor-compiled pass over [out, in]; the same
            # weights as one allocation in step order, as the model lays them out (a RowsBuffer)
            one = lambda x, w: rows_compiled(x[0], w, None)  # noqa: E731
            layouts["inductor (w * x).sum(-1), [out, in]"] = (ws, one)
            layouts["inductor, one buffer"] = (packed_rows(ws), one)
        else:
            layouts.pop("inductor (w * x).sum(-1), [out, in]", None)
            layouts.pop("inductor, one buffer", None)

        def chain(weights, fn, xs=xs):
            def run():
                for w, s in zip(weights, shapes + [(spec.vocab_size, h)], strict=True):
                    fn(xs[s[1]], w)
            return run

        t = compare([chain(*v) for v in layouts.values()], 5, between=bw.sample)
        bound = nbytes / bw.best
        out[rows] = {k: x / bound for k, x in zip(layouts, t, strict=True)}
        print(f"projections, {rows:3d} rows (x bound {bound * 1e3:.2f} ms): " + ", ".join(
            f"{k} {v:.2f}x" for k, v in out[rows].items()), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32, help="decode steps per step timing")
    ap.add_argument("--kernels", action="store_true", help="also time the projection kernels")
    ap.add_argument("--int8", action="store_true", help="also weight-only int8 (optional)")
    ap.add_argument("--plot", action="store_true")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)

    path = mid_model()
    rng = random.Random(0)
    bw = Bandwidth()
    n_new = args.new_tokens
    mixed = [[rng.randrange(32000) for _ in range(n)] for n in (16, 300, 64, 200, 32, 128, 8, 256)]
    single = [mixed[0]]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    llm = LLM(path, kv_cache_memory="2GiB", max_model_len=4096, enable_prefix_caching=False)

    solo = Solo(llm)

    def ours(prompts, max_tokens=n_new):
        p = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

        def run():
            solo.ours()
            llm.generate(prompt_token_ids=prompts, sampling_params=p, use_tqdm=False)
        return run

    def theirs(prompts, max_tokens=n_new):
        width = max(len(p) for p in prompts)  # left padding, as HF batch generation needs
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

        def run():
            solo.theirs()
            with torch.inference_mode():
                hf.generate(ids, attention_mask=mask, max_new_tokens=max_tokens,
                            do_sample=False, pad_token_id=0)
        return run

    results = {}
    cases = {
        "decode_batch1": (single, n_new),
        "decode_batch8_mixed": (mixed, n_new * len(mixed)),
    }
    for name, (prompts, tokens) in cases.items():
        t_ours, t_hf = compare([ours(prompts), theirs(prompts)])
        results[name] = {"kvsession_tok_s": tokens / t_ours, "hf_tok_s": tokens / t_hf,
                         "ratio": t_hf / t_ours}
    for n in (512, 2048):
        prompt = [[rng.randrange(32000) for _ in range(n)]]
        t_ours, t_hf = compare([ours(prompt, 1), theirs(prompt, 1)], 2)
        results[f"prefill_{n}"] = {"kvsession_tok_s": n / t_ours, "hf_tok_s": n / t_hf,
                                   "ratio": t_hf / t_ours}
    for name, r in results.items():
        print(f"{name:22s} kvsession {r['kvsession_tok_s']:9.1f} tok/s   transformers "
              f"{r['hf_tok_s']:9.1f} tok/s   ratio {r['ratio']:.2f}x", flush=True)
    spec = llm.runtime.spec
    llm.close()
    # decode steps from a cached prompt: prefix caching on, so a repeated prompt is not
    # prefilled again
    llm = LLM(path, kv_cache_memory="1GiB", max_model_len=4096, max_num_seqs=8)
    # which one-token path start-up measured faster (model/llama.py warm_up)
    one_token = "compiled regions" if llm._rt.model.one_row is not None else "Linear kernels"
    print(f"one-token steps run through the {one_token}", flush=True)
    steps = decode_steps(llm, hf, bw, args.steps, rng)
    llm.close()
    frag = fragmented(path, bw)
    alone = attention_alone(spec)
    kern = kernels(spec, bw) if args.kernels else None
    q8 = int8(path, bw) if args.int8 else None
    print(f"DRAM read bandwidth (best in the run): {bw.best / 1e9:.1f} GB/s")
    write_result("decode_vs_hf", {"model": "mid-size llama (hidden 512, 8 layers, vocab 32000)",
                                  "new_tokens": n_new, "results": results,
                                  "read_bandwidth_gb_s": bw.best / 1e9, "one_token_path": one_token,
                                  "decode_steps": steps,
                                  "fragmented_table": frag, "attention_alone": alone,
                                  "kernels": kern, "int8": q8})
    if args.plot:
        plt = pyplot()

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
        names = list(results)
        ax1.bar(names, [results[n]["ratio"] for n in names], color="#3b7dd8")
        ax1.axhline(1.0, color="gray", lw=1, ls="--")
        ax1.set_ylabel("kvsession / transformers (x)")
        ax1.set_title("Throughput vs transformers")
        ax1.tick_params(axis="x", labelrotation=20)
        labels = [f"b{b} ctx{c}" for b, c in CASES]
        rows = [steps[f"batch{b}_ctx{c}"] for b, c in CASES]
        x = range(len(rows))
        ax2.bar([i - 0.27 for i in x], [r["alone_bound_ms"] for r in rows], 0.27,
                label="bound", color="#999999")
        ax2.bar(list(x), [r["alone_step_ms"] for r in rows], 0.27, label="kvsession",
                color="#3b7dd8")
        ax2.bar([i + 0.27 for i in x], [r["hf_step_ms"] for r in rows], 0.27,
                label="transformers", color="#e07b39")
        ax2.set_xticks(list(x), labels)
        ax2.set_ylabel("ms per decode step")
        ax2.set_title(f"Decode step vs bandwidth bound ({bw.best / 1e9:.0f} GB/s)")
        ax2.legend()
        save_figure(fig, "decode_vs_hf")


if __name__ == "__main__":
    main()
