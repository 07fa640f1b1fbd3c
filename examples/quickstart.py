"""Quickstart: batch generation and a chat on the built-in tiny random model."""

import tempfile

from kvsession import LLM, SamplingParams
from kvsession.testing import make_tiny_model

model = make_tiny_model(tempfile.mkdtemp())
with LLM(model, kv_cache_memory="32MiB", max_model_len=512) as llm:
    outs = llm.generate(["the agent reads a file", "run the tests"],
                        SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
    for o in outs:
        print(repr(o.text), o.finish_reason, f"ttft {o.metrics.ttft_s * 1e3:.1f} ms")
    reply = llm.chat([{"role": "user", "content": "hello"}], use_tqdm=False)[0]
    print(repr(reply.text))
    print(llm.stats().tiers["device"])
