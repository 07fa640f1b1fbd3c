"""FP8 capacity and numerics.

Fixed KV budget on the mid-size model; sessions = a shared pinned 1,024-token system prompt
+ 1,024 private tokens each, added until the device pool cannot hold another: maximum
concurrently resident sessions for bfloat16 vs fp8 KV (target ratio >= 1.9x), bytes per
token of each. Then the numerics of an fp8 cache against a float32 cache (tiny llama and
qwen3 configs, 512-token prompt + 64 decoded tokens). JSON result.
"""

from __future__ import annotations

import argparse
import random
import tempfile

from common import mid_model, text_of, write_result

from kvsession import LLM, CacheFullError, SamplingParams
from kvsession.numerics import kv_numerics
from kvsession.testing import make_tiny_model


def resident_sessions(path, kv_dtype: str, budget: str) -> dict:
    """Add sessions until one of them no longer has its whole KV on the device (the engine
    drops an idle session's KV to admit new work when there is no other tier)."""
    rng = random.Random(0)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    # host tier off: "resident" means on the device (otherwise idle sessions spill to DRAM)
    with LLM(path, kv_cache_dtype=kv_dtype, kv_cache_memory=budget, max_model_len=4096,
             host_cache_memory=0) as llm:
        system = text_of(llm.tokenizer, rng, 1024)
        sessions, held = [], []
        while True:
            s = llm.session(system=system, sampling=one)
            try:
                s.send(text_of(llm.tokenizer, rng, 1024))
            except CacheFullError:
                s.close()
                break
            sessions.append(s)
            held.append(s.num_cached_tokens)
            if any(x.num_cached_tokens < h for x, h in zip(sessions, held, strict=True)):
                break
        resident = len(sessions) - 1 if len(sessions) and any(
            x.num_cached_tokens < h for x, h in zip(sessions, held, strict=True)) \
            else len(sessions)
        dev = llm.stats().tiers["device"]
        tokens = sum(held[:resident])
        for s in sessions:
            s.close()
    return {"sessions": resident, "bytes_per_token": dev.bytes_per_token,
            "tokens_capacity": dev.tokens_capacity, "session_tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--budget", default="48MiB")
    args = ap.parse_args()
    path = mid_model()
    cap = {dtype: resident_sessions(path, dtype, args.budget) for dtype in ("bfloat16", "fp8")}
    ratio = cap["fp8"]["sessions"] / cap["bfloat16"]["sessions"]
    for dtype, r in cap.items():
        print(f"{dtype:9s} {r['bytes_per_token']:6d} bytes/token, {r['tokens_capacity']:6d} "
              f"tokens in {args.budget}: {r['sessions']} resident sessions")
    print(f"fp8 / bf16 resident sessions: {ratio:.2f}x (target >= 1.9x)")
    numerics = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ("llama", "qwen3"):
            d = make_tiny_model(f"{tmp}/{arch}", arch=arch)
            numerics[arch] = kv_numerics(d, "fp8", 512, 64)
            r = numerics[arch]
            print(f"{arch:6s} fp8 vs fp32 cache: attention rel L2 per layer "
                  f"{[round(x, 4) for x in r['attention_rel_l2_per_layer']]} (<= 0.03), "
                  f"logits rel L2 {r['logits_rel_l2']:.4f} (<= 0.02), "
                  f"top-1 agreement {r['top1_agreement']:.3f}")
    write_result("fp8_capacity", {"budget": args.budget, "capacity": cap,
                                  "session_ratio": ratio, "numerics": numerics})


if __name__ == "__main__":
    main()
