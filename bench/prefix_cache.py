"""Prefix cache on vs off on the mid-size CPU model.

1. Shared prefix: requests = one 2,048-token system prompt + a unique 64-token suffix, sent
   one after another (the first warms the cache). Reports TTFT and prefill tokens computed
   per request with caching on and off; target TTFT ratio (off / on) >= 10x.
2. Zero reuse: a batch of unrelated prompts; reports wall time with caching on vs off
   (interleaved runs); target overhead <= 3%.
Writes bench/results/prefix_cache.json; `--plot` draws bench/results/prefix_cache.png.
"""

from __future__ import annotations

import argparse
import random
import statistics

from common import compare, mid_model, pyplot, save_figure, write_result

from kvsession import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--plot", action="store_true")
    args = ap.parse_args()
    path = mid_model()
    rng = random.Random(0)
    system = [rng.randrange(32000) for _ in range(2048)]
    suffixes = [[rng.randrange(32000) for _ in range(64)] for _ in range(args.requests + 1)]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    kw = dict(kv_cache_memory="1GiB", max_model_len=4096)
    llm_on, llm_off = LLM(path, **kw), LLM(path, enable_prefix_caching=False, **kw)

    shared = {}
    for name, llm in (("on", llm_on), ("off", llm_off)):
        llm.generate(prompt_token_ids=[system + suffixes[0]], sampling_params=one,
                     use_tqdm=False)  # warm-up / cache fill
        ttfts, computed = [], []
        for suffix in suffixes[1:]:
            out = llm.generate(prompt_token_ids=[system + suffix], sampling_params=one,
                               use_tqdm=False)[0]
            ttfts.append(out.metrics.ttft_s)
            computed.append(len(out.prompt_token_ids) - out.num_cached_tokens)
        shared[name] = {"ttft_s": ttfts, "ttft_median_s": statistics.median(ttfts),
                        "prefill_tokens": computed}
    ttft_ratio = shared["off"]["ttft_median_s"] / shared["on"]["ttft_median_s"]

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    def batch(llm):
        # every run sends prompts never seen before (the same sequence for on and off)
        fresh = random.Random(1)

        def run():
            prompts = [[fresh.randrange(32000) for _ in range(fresh.randint(64, 512))]
                       for _ in range(16)]
            llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        return run

    t_on, t_off = compare([batch(llm_on), batch(llm_off)], repeat=5)
    overhead = t_on / t_off - 1
    llm_on.close()
    llm_off.close()
    print(f"shared 2048-token prefix: TTFT median on {shared['on']['ttft_median_s'] * 1e3:.1f} "
          f"ms, off {shared['off']['ttft_median_s'] * 1e3:.1f} ms -> {ttft_ratio:.1f}x "
          f"(target >= 10x); prefill tokens per request on {shared['on']['prefill_tokens'][0]}"
          f", off {shared['off']['prefill_tokens'][0]}")
    print(f"zero reuse: caching on {t_on:.3f} s vs off {t_off:.3f} s -> overhead "
          f"{overhead * 100:+.1f}% (target <= 3%)")
    write_result("prefix_cache", {"shared_prefix": shared, "ttft_ratio": ttft_ratio,
                                  "zero_reuse": {"on_s": t_on, "off_s": t_off,
                                                 "overhead": overhead}})
    if args.plot:
        plt = pyplot()

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for name in ("off", "on"):
            ax.plot([t * 1e3 for t in shared[name]["ttft_s"]], marker="o",
                    label=f"prefix caching {name}")
        ax.set_xlabel("request")
        ax.set_ylabel("TTFT (ms)")
        ax.set_yscale("log")
        ax.set_title("2,048-token shared system prompt + 64-token suffix")
        ax.legend()
        save_figure(fig, "prefix_cache")


if __name__ == "__main__":
    main()
