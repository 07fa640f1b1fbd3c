"""How bench/real_shapes.py and bench/vs_llama_cpp.py time an engine, shared by their
children (kvsession and transformers in this project's Python, llama.cpp in another:
standard library only)."""

from __future__ import annotations

import statistics

from child_protocol import answer_rounds

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
        samples = [batch * decode_tokens / decode_s(run, prompts, decode_tokens)
                   for _ in range(rounds)]
        out[f"decode_b{batch}_tok_s"] = statistics.median(samples)
        out[f"decode_b{batch}_range"] = [min(samples), max(samples)]
    prefill = [run([prompt(PREFILL_TOKENS)], 1) for _ in range(rounds + 1)][1:]
    out["prefill_512_s"] = statistics.median(prefill)
    return out


def decode_s(run, prompts: list[list[int]], decode_tokens: int) -> float:
    """The seconds of `decode_tokens` decode steps of `prompts` (a batch): 8 + N tokens
    minus 8 tokens, so that prefill and start-up cancel out."""
    short, long = run(prompts, WARM_TOKENS), run(prompts, WARM_TOKENS + decode_tokens)
    return max(long - short, 1e-9)


def answer_decode_rounds(run, prompt, decode_tokens: int, facts: dict) -> None:
    """A child of bench/vs_llama_cpp.py: answers each round {"round": batch} (one of
    BATCHES) with the decode seconds of `decode_tokens` steps at that batch (`decode_s`),
    the same prompts every round (each batch warmed up once before the child says it is
    ready, with `facts`: its load time, resident and weight bytes)."""
    prompts = {batch: [prompt(PROMPT_TOKENS) for _ in range(batch)] for batch in BATCHES}
    for batch in BATCHES:
        run(prompts[batch], WARM_TOKENS)  # compiling, first touches
    answer_rounds(lambda batch: decode_s(run, prompts[batch], decode_tokens), facts)
