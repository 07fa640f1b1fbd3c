"""kvsession vs transformers `generate` on the same random mid-size weights, same process,
float32 on CPU, greedy: decode tokens/s at batch 1 and batch 8 (mixed prompt lengths) and
prefill tokens/s at 512 and 2048 tokens. Prints ratios (kvsession / transformers) and writes
bench/results/decode_vs_hf.json; `--plot` draws bench/results/decode_vs_hf.png.

Targets: batch 8 mixed >= 1.5x, batch 1 decode >= 1.0x.
"""

from __future__ import annotations

import argparse
import random

import torch
from common import compare, mid_model, pyplot, save_figure, write_result

from kvsession import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--plot", action="store_true")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    path = mid_model()
    rng = random.Random(0)
    n_new = args.new_tokens
    mixed = [[rng.randrange(32000) for _ in range(n)] for n in (16, 300, 64, 200, 32, 128, 8, 256)]
    single = [mixed[0]]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    llm = LLM(path, kv_cache_memory="2GiB", max_model_len=4096, enable_prefix_caching=False)

    def ours(prompts, max_tokens=n_new):
        p = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return lambda: llm.generate(prompt_token_ids=prompts, sampling_params=p, use_tqdm=False)

    def theirs(prompts, max_tokens=n_new):
        width = max(len(p) for p in prompts)  # left padding, as HF batch generation needs
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

        def run():
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
    llm.close()
    for name, r in results.items():
        print(f"{name:22s} kvsession {r['kvsession_tok_s']:9.1f} tok/s   transformers "
              f"{r['hf_tok_s']:9.1f} tok/s   ratio {r['ratio']:.2f}x")
    write_result("decode_vs_hf", {"model": "mid-size llama (hidden 512, 8 layers, vocab 32000)",
                                  "new_tokens": n_new, "results": results})
    if args.plot:
        plt = pyplot()

        fig, ax = plt.subplots(figsize=(7, 3.5))
        names = list(results)
        ax.bar(names, [results[n]["ratio"] for n in names], color="#3b7dd8")
        ax.axhline(1.0, color="gray", lw=1, ls="--")
        ax.set_ylabel("kvsession / transformers (x)")
        ax.set_title("Throughput vs transformers, CPU float32, mid-size model")
        save_figure(fig, "decode_vs_hf")


if __name__ == "__main__":
    main()
