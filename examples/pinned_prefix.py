"""Pin a long system prompt: every request that starts with it skips its prefill.
Exits non-zero if a request recomputed the pinned blocks."""

import tempfile

from kvsession import LLM, SamplingParams
from kvsession.testing import make_tiny_model

model = make_tiny_model(tempfile.mkdtemp())
system = "You are a coding agent with these tools: " + ", ".join(
    f"tool_{i}(path)" for i in range(40))
with LLM(model, kv_cache_memory="32MiB", max_model_len=1024) as llm:
    pin = llm.pin(system, ttl_s=600)
    print(pin)
    outs = llm.generate([system + f" Task {i}: fix the bug." for i in range(4)],
                        SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    for o in outs:
        print(f"{len(o.prompt_token_ids)} prompt tokens, {o.num_cached_tokens} from cache")
        if o.num_cached_tokens < pin.num_tokens:
            raise SystemExit(f"the pinned prefix was recomputed: {o.num_cached_tokens} of "
                             f"{pin.num_tokens} tokens from cache")
    st = llm.stats()
    print(f"hit rate {st.prefix.hit_rate:.0%}, pinned blocks {st.tiers['device'].blocks_pinned}")
    pin.unpin()
