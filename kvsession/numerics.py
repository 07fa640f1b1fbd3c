"""How much a lower-precision KV cache changes the model: `kv_numerics` (tests and
`bench/fp8_capacity.py` use it). It drives the engine side directly (a `Runtime`), feeding a
fixed token sequence teacher-forced through the real runner, KV pool and block tables."""

from __future__ import annotations

import random

import torch

from kvsession.cache.block_pool import blocks_for
from kvsession.cache.kv_pool import KVPool
from kvsession.config import KV_DTYPES, EngineConfig
from kvsession.engine.scheduler import ScheduledSeq
from kvsession.engine.sequence import Sequence
from kvsession.llm import LLM
from kvsession.params import SamplingParams
from kvsession.runtime import Runtime


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _forced(model_dir, kv_dtype: str, tokens: list[int], num_prompt_tokens: int, kw: dict,
            shadow_dtype: torch.dtype | None = None):
    """Logits of `tokens` (prompt, then one token per step) on a `kv_dtype` cache; with a
    shadow dtype, also each layer's attention output recomputed from the same q/k/v through
    a shadow cache of that dtype: [(layer, out, shadow out)]."""
    pairs: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    rt = Runtime(EngineConfig.from_args(model_dir, kv_cache_dtype=kv_dtype, **kw))
    try:
        kv, bs, model = rt.kv_pool, rt.config.block_size, rt.model
        if shadow_dtype is not None:
            shadow = KVPool(kv.num_layers, kv.num_blocks, bs, kv.num_kv_heads, kv.head_dim,
                            shadow_dtype, kv.k.device)
            attend = model.attention_fn

            def recording(q, k, v, layer_kv, meta):
                o = attend(q, k, v, layer_kv, meta)
                layer = len(pairs) % kv.num_layers
                o2 = attend(q, k, v, shadow.layer(layer), meta)
                pairs.append((layer, o.float().flatten(1), o2.float().flatten(1)))
                return o

            model.attention_fn = recording

        def run():
            runner = rt.engine.runner
            seq = Sequence(token_ids=tokens[:num_prompt_tokens], params=SamplingParams(),
                           max_model_len=rt.info.max_model_len)
            rt.manager.allocate_slots(seq, blocks_for(len(tokens), bs))
            try:
                logits = [runner.run([ScheduledSeq(seq, num_prompt_tokens)])]
                seq.num_computed_tokens = num_prompt_tokens
                for t in tokens[num_prompt_tokens:-1]:  # feed the fixed continuation
                    seq.token_ids.append(t)
                    logits.append(runner.run([ScheduledSeq(seq, 1)]))
                    seq.num_computed_tokens += 1
            finally:
                rt.manager.release(seq)
            return torch.cat(logits)

        return rt.call(run).result(), pairs
    finally:
        rt.close()


def kv_numerics(model_dir, kv_cache_dtype: str, num_prompt_tokens: int = 512,
                num_decode_tokens: int = 64, seed: int = 0) -> dict:
    """How much a `kv_cache_dtype` cache changes the model, against a float32 cache, on the
    same weights and tokens (a random prompt, then the float32 model's greedy continuation).

    - attention_rel_l2_per_layer: each layer's attention output computed from the *same*
      q/k/v through a shadow `kv_cache_dtype` cache vs the float32 cache (the error the
      cache itself adds in that layer), relative L2 over every prompt and decoded position;
    - logits_rel_l2: end to end, a whole run on the `kv_cache_dtype` cache vs the float32
      run, relative L2 over the logits of the last prompt token and every decoded token;
    - top1_agreement of those logits (random weights give flat distributions: informative,
      not a gate)."""
    total = num_prompt_tokens + num_decode_tokens
    kw = dict(kv_cache_memory="64MiB", max_model_len=total + 16, enable_prefix_caching=False)
    rng = random.Random(seed)
    with LLM(model_dir, kv_cache_dtype="float32", **kw) as ref:
        prompt = [rng.randrange(ref.runtime.spec.vocab_size) for _ in range(num_prompt_tokens)]
        gen = ref.generate(prompt_token_ids=[prompt], use_tqdm=False, sampling_params=(
            SamplingParams(max_tokens=num_decode_tokens, temperature=0.0, ignore_eos=True)))
    tokens = prompt + gen[0].token_ids
    ref_logits, pairs = _forced(model_dir, "float32", tokens, num_prompt_tokens, kw,
                                shadow_dtype=KV_DTYPES[kv_cache_dtype])
    logits, _ = _forced(model_dir, kv_cache_dtype, tokens, num_prompt_tokens, kw)
    num_layers = 1 + max(layer for layer, _, _ in pairs)
    per_layer = []
    for layer in range(num_layers):
        want = torch.cat([o for i, o, _ in pairs if i == layer])
        got = torch.cat([o for i, _, o in pairs if i == layer])
        per_layer.append(_rel(got, want))
    return {
        "kv_cache_dtype": kv_cache_dtype,
        "num_tokens": total,
        "attention_rel_l2_per_layer": per_layer,
        "logits_rel_l2": _rel(logits, ref_logits),
        "logits_rel_l2_worst_step": max(
            _rel(a, b) for a, b in zip(logits, ref_logits, strict=True)),
        "top1_agreement": float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()),
    }
