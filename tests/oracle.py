"""Test helpers: the transformers oracle and random prompts (importable: pythonpath=tests)."""

from __future__ import annotations

import random
import threading

import torch

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]


def hf_greedy(model_dir, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The oracle: transformers' greedy generate, one prompt at a time (no padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    # ignore eos like SamplingParams(ignore_eos=True); min_new_tokens would instead *suppress*
    # eos logits and change the argmax
    model.generation_config.eos_token_id = None
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                               do_sample=False, pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return outs


def random_prompts(seed: int, lengths: list[int], vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def expected_turn(llm, s, before: list[int], reply, params) -> list[int]:
    """The tokens a session's last turn must have produced: in append history, what
    `llm.generate` gives for the log before the turn plus the delta the turn appended (and
    the log must have been extended, never rewritten); in template history, what
    `llm.chat` gives for the full conversation."""
    if s.history == "template":
        return llm.chat(s.messages[:-1], params, use_tqdm=False)[0].token_ids
    log = s.token_ids
    prompt = log[: len(log) - len(reply.token_ids)]
    assert prompt[: len(before)] == before, "the turn rewrote the session's token log"
    return llm.generate(prompt_token_ids=[prompt], sampling_params=params,
                        use_tqdm=False)[0].token_ids


def sends_racing_a_close(session, close, **send_kw) -> tuple[list[str], list[Exception]]:
    """A thread sends on `session` in a loop; once three sends have returned, `close()` runs
    here. Returns (the messages whose send returned, in order; the exception that ended the
    loop: exactly one when the loop ended as it should)."""
    acked: list[str] = []
    errors: list[Exception] = []
    three = threading.Event()

    def sender():
        for k in range(10_000):
            try:
                session.send(f"turn {k}", **send_kw)
            except Exception as e:  # noqa: BLE001 - the caller asserts what ended the loop
                errors.append(e)
                return
            acked.append(f"turn {k}")
            if k == 2:
                three.set()

    t = threading.Thread(target=sender)
    t.start()
    assert three.wait(60), errors
    close()
    t.join(60)
    assert not t.is_alive()
    return acked, errors
