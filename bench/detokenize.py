"""Detokenization per token of a long generation: what a stream (and a stop string's check,
and a chat reply's split) pays for the text after each new token, over a 4,096-token
output, before and after IncrementalText (model/tokenizer.py):

    before: the whole output decoded again at every token (IncrementalText without
            tokenizers' DecodeStream: what DeltaText and Sequence.check_finished did)
    after:  each token decoded once against a few before it (DecodeStream)

Both through DeltaText (outputs.py) with a stop string (its hold-back included), on the
tiny model's byte-level BPE tokenizer, ids drawn from its word pieces; paired rounds (the
two ways alternate), medians with their range. The cost per token is reported at the end
of the output too (the last 256 tokens): before grows with the length, after does not.

    python bench/detokenize.py [--tokens 4096] [--rounds 5] [--plot]

Writes bench/results/detokenize.json (and .png with --plot); docs/benchmarks.md has it.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

from common import pyplot, save_figure, write_result

from kvsession.model import tokenizer as tokenizer_module
from kvsession.model.tokenizer import Tokenizer
from kvsession.outputs import DeltaText
from kvsession.testing import make_tiny_model

TAIL = 256  # the last tokens, whose cost per token is reported apart


def per_token_s(tok: Tokenizer, ids: list[int], stream: bool) -> list[float]:
    """Each token's seconds through DeltaText, fed one token at a time."""
    saved = tokenizer_module._DecodeStream
    if not stream:
        tokenizer_module._DecodeStream = None
    try:
        text = DeltaText(tok.incremental_text(), ("</stop>",))
    finally:
        tokenizer_module._DecodeStream = saved
    log: list[int] = []  # a sequence's log, growing a token at a time
    times = []
    for i in ids:
        log.append(i)
        t = time.perf_counter()
        text.update(log)
        times.append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--plot", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tok = Tokenizer(make_tiny_model(d))
    rng = random.Random(0)
    ids = [rng.randrange(256, tok.vocab_size) for _ in range(args.tokens)]
    rows: dict[str, list] = {"before": [], "after": []}
    curves: dict[str, list[float]] = {}
    for r in range(args.rounds):
        for way in (("before", "after") if r % 2 == 0 else ("after", "before")):
            times = per_token_s(tok, ids, way == "after")
            rows[way].append((statistics.fmean(times), statistics.fmean(times[-TAIL:])))
            curves[way] = times
    out: dict = {"tokens": args.tokens, "rounds": args.rounds}
    for way, samples in rows.items():
        mean_us = [m * 1e6 for m, _ in samples]
        tail_us = [t * 1e6 for _, t in samples]
        out[way] = {"per_token_us": statistics.median(mean_us),
                    "per_token_us_range": [min(mean_us), max(mean_us)],
                    "last_tokens_us": statistics.median(tail_us)}
        print(f"{way:6s}: {out[way]['per_token_us']:8.2f} us a token over {args.tokens} "
              f"({min(mean_us):.2f}-{max(mean_us):.2f}); the last {TAIL}: "
              f"{out[way]['last_tokens_us']:.2f} us a token")
    ratios = [b[0] / a[0] for b, a in zip(rows["before"], rows["after"], strict=True)]
    out["speedup_median"] = statistics.median(ratios)
    out["speedup_range"] = [min(ratios), max(ratios)]
    print(f"after is {out['speedup_median']:.0f}x cheaper per token "
          f"({min(ratios):.0f}-{max(ratios):.0f}x over the rounds)")
    write_result("detokenize", out)
    if args.plot:
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(6, 4))
        for way, times in curves.items():
            ax.plot(range(1, len(times) + 1), [t * 1e6 for t in times], label=way,
                    linewidth=0.6)
        ax.set_yscale("log")
        ax.set_xlabel("output tokens so far")
        ax.set_ylabel("detokenization per token (us)")
        ax.set_title("Stream detokenization: decode again vs DecodeStream")
        ax.legend()
        save_figure(fig, "detokenize")


if __name__ == "__main__":
    main()
