"""llama.cpp measured the way bench/real_shapes.py measures kvsession, in a process of its
own, through llama-cpp-python's low-level API (this file imports neither torch nor
kvsession: it runs under the Python that has llama_cpp installed).

    python llama_cpp_child.py MODEL.gguf --threads 2 --decode-tokens 32 --rounds 3

prints one JSON line: load_s, resident_bytes (RssAnon + RssFile growth over loading the
model and a context of --n-ctx tokens for 8 sequences), decode_b1_tok_s and decode_b8_tok_s
(medians of rounds: 8 + N tokens minus 8 tokens, each step one token per sequence through
llama_decode), prefill_512_s (one 512-token prompt in one batch). With --answer-rounds it
says it is ready (load_s, resident_bytes) and then answers decode rounds
(decode_rates.answer_decode_rounds) for bench/vs_llama_cpp.py.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import llama_cpp as L
from decode_rates import BATCHES, PREFILL_TOKENS, answer_decode_rounds, rates

SEQS = max(BATCHES)


def resident_bytes() -> int:
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return sum(int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "RssFile"))


class Engine:
    def __init__(self, path: str, threads: int, n_ctx: int):
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = L.llama_model_load_from_file(path.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, PREFILL_TOKENS, \
            PREFILL_TOKENS, SEQS
        cp.n_threads = cp.n_threads_batch = threads
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not make a context")
        self.batch = L.llama_batch_init(PREFILL_TOKENS, 0, SEQS)
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)

    def clear(self) -> None:
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)

    def decode(self, items: list[tuple[int, int, int]], logits_last_only: bool) -> None:
        """items: (token, position, sequence)."""
        b = self.batch
        b.n_tokens = len(items)
        for i, (tok, pos, seq) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
            b.seq_id[i][0] = seq
            b.logits[i] = 1 if (not logits_last_only or i == len(items) - 1) else 0
        if L.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def run(self, prompts: list[list[int]], new_tokens: int) -> float:
        """Prefill each prompt as its own sequence (its logits: the first new token), then
        `new_tokens - 1` steps of one token per sequence; the wall time of all of it."""
        self.clear()
        t = time.perf_counter()
        for seq, p in enumerate(prompts):
            self.decode([(tok, pos, seq) for pos, tok in enumerate(p)], True)
        for step in range(new_tokens - 1):
            self.decode([(7 + step % 100, len(p) + step, seq)
                         for seq, p in enumerate(prompts)], False)
        return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--answer-rounds", action="store_true",
                    help="answer decode rounds on stdin (bench/vs_llama_cpp.py)")
    args = ap.parse_args()
    before = resident_bytes()
    t = time.perf_counter()
    eng = Engine(args.model, args.threads, args.n_ctx)
    out = {"load_s": time.perf_counter() - t, "resident_bytes": resident_bytes() - before}
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1000, eng.n_vocab) for _ in range(n)]

    if args.answer_rounds:  # then the facts again, as the parent's report at the end
        answer_decode_rounds(eng.run, prompt, args.decode_tokens, out)
    else:
        out |= rates(eng.run, prompt, args.decode_tokens, args.rounds)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
