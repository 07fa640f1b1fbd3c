"""How bench/real_shapes.py times an engine, shared by its children (kvsession and
transformers in this project's Python, llama.cpp in another: standard library only)."""

from __future__ import annotations

import statistics

PROMPT_TOKENS = 32
PREFILL_TOKENS = 512
WARM_TOKENS = 8
BATCHES = (1, 8)


def rates(run, prompt, decode_tokens: int, rounds: int) -> dict:
    """Decode rates at each of BATCHES and the 512-token prefill time of an engine whose
    `run(prompts, n)` generates n tokens for each prompt (the first from the prefill) and
    returns the wall time; `prompt(n)` makes an n-token prompt. Decode: 8 + N tokens minus
    8 tokens (prefill and start-up cancel out), median of `rounds` (range kept)."""
    out = {}
    for batch in BATCHES:
        prompts = [prompt(PROMPT_TOKENS) for _ in range(batch)]
        run(prompts, WARM_TOKENS)  # warm-up (compiling, first touches)
        samples = []
        for _ in range(rounds):
            short, long = run(prompts, WARM_TOKENS), run(prompts, WARM_TOKENS + decode_tokens)
            samples.append(batch * decode_tokens / max(long - short, 1e-9))
        out[f"decode_b{batch}_tok_s"] = statistics.median(samples)
        out[f"decode_b{batch}_range"] = [min(samples), max(samples)]
    prefill = [run([prompt(PREFILL_TOKENS)], 1) for _ in range(rounds + 1)][1:]
    out["prefill_512_s"] = statistics.median(prefill)
    return out
