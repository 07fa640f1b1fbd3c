"""Structured output and n > 1 on the mid-size CPU model.

1. Decode overhead of a JSON-schema format at batch 1 and 8, token by token (the engine's
   verified forced spans off: bench/speculative.py measures those). The formatted run goes first;
   the plain run then generates exactly as many tokens per request (max_tokens = that
   request's formatted length, ignore_eos), so both runs have the same batch shape at every
   step and the wall-time difference is the format's cost (mask fill + apply + accept).
   Runs are interleaved, best of `--repeat`. Target: overhead <= 10% at batch 8. The same
   requests with `jump_forward=True` (forced tokens appended without a step) are reported
   beside them: output tokens, engine steps, tok/s.
2. Grammar compile time per schema (a fresh compiler, nothing cached) and a cache hit.
3. n=8 completions of one prompt vs 8 separate requests of it (submitted together, with and
   without the prefix cache): prompt tokens computed (stats().prefill_tokens), wall time.
Writes bench/results/structured.json.
"""

from __future__ import annotations

import argparse
import random
import time

from common import compare, mid_model, write_result

from kvsession import LLM, SamplingParams, StructuredOutput
from kvsession.structured import GrammarCompiler

# a schema whose documents are long enough to measure decode on (about 60-120 tokens)
SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 100000},
    "status": {"enum": ["ok", "failed", "retry"]},
    "tags": {"type": "array", "minItems": 4, "maxItems": 4,
             "items": {"type": "string", "minLength": 4, "maxLength": 10}},
    "score": {"type": "number", "minimum": 0, "maximum": 1},
    "owner": {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 3, "maxLength": 12},
        "admin": {"type": "boolean"}}, "required": ["name", "admin"]}},
    "required": ["id", "status", "tags", "score", "owner"]}
COMPILE_SCHEMAS = {
    "small_object": {"type": "object", "properties": {"a": {"type": "integer"}},
                     "required": ["a"]},
    "bench_schema": SCHEMA,
    "nested_arrays": {"type": "object", "properties": {"rows": {"type": "array", "items": {
        "type": "object", "properties": {"k": {"type": "string", "maxLength": 20},
                                         "v": {"type": "array", "items": {"type": "number"},
                                               "maxItems": 8}},
        "required": ["k", "v"]}, "maxItems": 16}}, "required": ["rows"]},
    "enum_100": {"enum": [f"value_{i}" for i in range(100)]},
}


def decode_overhead(llm: LLM, batch: int, repeat: int) -> dict:
    rng = random.Random(batch)
    prompts = [[rng.randrange(512) for _ in range(16)] for _ in range(batch)]
    fmt = StructuredOutput(json_schema=SCHEMA)
    llm._rt.drafter.forced_spans = False  # the mask's cost alone, a token a step
    structured = [SamplingParams(max_tokens=256, seed=i, structured=fmt) for i in range(batch)]
    lengths = [len(o.token_ids) for o in llm.generate(
        prompt_token_ids=prompts, sampling_params=structured, use_tqdm=False)]
    plain = [SamplingParams(max_tokens=n, seed=i, ignore_eos=True)
             for i, n in enumerate(lengths)]

    def run(params):
        return lambda: llm.generate(prompt_token_ids=prompts, sampling_params=params,
                                    use_tqdm=False)

    jump = StructuredOutput(json_schema=SCHEMA, jump_forward=True)
    jumping = [SamplingParams(max_tokens=256, seed=i, structured=jump) for i in range(batch)]
    steps = llm._rt.engine.num_steps
    jf_tokens = sum(len(o.token_ids) for o in llm.generate(
        prompt_token_ids=prompts, sampling_params=jumping, use_tqdm=False))
    jf_steps = llm._rt.engine.num_steps - steps
    t_fmt, t_plain, t_jf = compare([run(structured), run(plain), run(jumping)], repeat=repeat)
    tokens = sum(lengths)
    return {"batch": batch, "output_tokens": tokens, "lengths": lengths,
            "structured_tok_s": tokens / t_fmt, "plain_tok_s": tokens / t_plain,
            "structured_s": t_fmt, "plain_s": t_plain,
            "overhead": t_fmt / t_plain - 1.0,
            # jump-forward: other tokens (forced ones tokenized by xgrammar), fewer steps
            "jump_forward": {"output_tokens": jf_tokens, "steps": jf_steps, "s": t_jf,
                             "tok_s": jf_tokens / t_jf}}


def compile_times(model_dir, vocab_size: int, eos) -> dict:
    out = {}
    for name, schema in COMPILE_SCHEMAS.items():
        compiler = GrammarCompiler(model_dir / "tokenizer.json", vocab_size, eos)
        fmt = StructuredOutput(json_schema=schema)
        t = time.perf_counter()
        compiler.compile(fmt)
        cold = time.perf_counter() - t
        t = time.perf_counter()
        compiler.compile(fmt)
        out[name] = {"cold_ms": cold * 1e3, "cached_ms": (time.perf_counter() - t) * 1e3}
    t = time.perf_counter()
    GrammarCompiler(model_dir / "tokenizer.json", vocab_size, eos)
    out["tokenizer_info_ms"] = (time.perf_counter() - t) * 1e3
    return out


def fan_out(path, prompt_len: int, max_tokens: int) -> dict:
    rng = random.Random(7)
    prompt = [rng.randrange(512) for _ in range(prompt_len)]
    kw = dict(kv_cache_memory="512MiB", max_model_len=2048)
    out = {}
    for name, caching, n in (("n8", True, 8), ("separate_cached", True, 1),
                             ("separate_uncached", False, 1)):
        with LLM(path, enable_prefix_caching=caching, **kw) as llm:
            llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(
                max_tokens=2), use_tqdm=False)  # warm-up
            before = llm.stats().prefill_tokens
            t = time.perf_counter()
            if n == 8:
                res = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
                    n=8, max_tokens=max_tokens, seed=0, ignore_eos=True), use_tqdm=False)
                ttft = res[0].metrics.ttft_s
            else:
                res = llm.generate(prompt_token_ids=[prompt] * 8, sampling_params=[
                    SamplingParams(max_tokens=max_tokens, seed=i, ignore_eos=True)
                    for i in range(8)], use_tqdm=False)
                ttft = max(o.metrics.ttft_s for o in res)
            wall = time.perf_counter() - t
            out[name] = {"wall_s": wall, "last_ttft_s": ttft,
                         "prefill_tokens": llm.stats().prefill_tokens - before}
    return {"prompt_tokens": prompt_len, "max_tokens": max_tokens, **out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=1000)
    args = ap.parse_args()
    path = mid_model()
    with LLM(path, kv_cache_memory="512MiB", max_model_len=2048) as llm:
        decode = [decode_overhead(llm, b, args.repeat) for b in (1, 8)]
        vocab, eos = llm.runtime.spec.vocab_size, llm.tokenizer.eos_token_ids
    for d in decode:
        jf = d["jump_forward"]
        print(f"batch {d['batch']}: {d['structured_tok_s']:.1f} tok/s with the schema, "
              f"{d['plain_tok_s']:.1f} without: overhead {d['overhead']:+.1%}; "
              f"jump-forward {jf['tok_s']:.1f} tok/s ({jf['output_tokens']} tokens in "
              f"{jf['steps']} steps)")
    compile_ms = compile_times(path, vocab, eos)
    for name, c in compile_ms.items():
        print(f"compile {name}: {c}")
    fan = fan_out(path, args.prompt, 32)
    for name in ("n8", "separate_cached", "separate_uncached"):
        print(f"{name}: {fan[name]}")
    write_result("structured", {
        "model": "mid-size random Llama (8 layers, hidden 512, vocab 32000; its tokenizer "
                 "has 512 tokens, the rest of the vocabulary is masked by every format)",
        "decode": decode, "target_overhead_batch8": 0.10,
        "overhead_batch8_ok": decode[1]["overhead"] <= 0.10,
        "compile": compile_ms, "fan_out": fan})


if __name__ == "__main__":
    main()
