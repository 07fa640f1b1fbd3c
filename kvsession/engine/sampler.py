"""Turns one step's logits into tokens, row by row, each with its request's parameters.

Greedy is argmax. Otherwise: temperature, then top-k, then top-p over the tempered
distribution, then one multinomial draw. A request with `seed` draws from its own
torch.Generator, so its tokens do not depend on what else is in the batch. Logprobs are
taken from the unmodified model distribution (log_softmax of the raw logits).
"""

from __future__ import annotations

import torch

from kvsession.engine.sequence import Sequence


class Sampler:
    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed)  # for unseeded requests

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]
                 ) -> list[tuple[int, dict[int, float] | None]]:
        """logits: float32 [len(seqs), vocab] on any device. Returns (token, logprobs)."""
        logits = logits.float().cpu()
        greedy = logits.argmax(dim=-1).tolist()
        out = []
        for row, seq in enumerate(seqs):
            p = seq.params
            token = greedy[row] if p.greedy else self._sample(logits[row], seq)
            out.append((token, self._logprobs(logits[row], token, p.logprobs)))
        return out

    def _sample(self, logits: torch.Tensor, seq: Sequence) -> int:
        p = seq.params
        x = logits / p.temperature
        if 0 < p.top_k < x.shape[-1]:
            kth = torch.topk(x, p.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # keep the smallest set whose mass reaches top_p (the top token always stays)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        gen = seq.generator or self.generator
        return int(torch.multinomial(probs, 1, generator=gen))

    @staticmethod
    def _logprobs(logits: torch.Tensor, token: int, k: int | None) -> dict[int, float] | None:
        if k is None:
            return None
        lp = torch.log_softmax(logits, dim=-1)
        out = {}
        if k > 0:
            top = torch.topk(lp, k)
            out = dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
        out[token] = float(lp[token])
        return out
