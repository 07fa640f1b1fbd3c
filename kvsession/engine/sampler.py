"""Turns one step's logits into tokens, row by row, each with its request's parameters.

Greedy is argmax (temperature below SAMPLING_EPS, or top_k 1). Otherwise: temperature, then
top-k, then top-p over the tempered distribution, then one multinomial draw. A request with
`seed` draws from its own torch.Generator, so its tokens do not depend on what else is in
the batch. Logprobs are taken from the unmodified model distribution (log_softmax of the
raw logits).

Rows are independent: a row that cannot be sampled (NaN logits, anything raised while
sampling it) yields its exception in place of a token, and the engine fails that request
alone; the other rows are sampled exactly as without it.
"""

from __future__ import annotations

import torch

from kvsession.engine.sequence import Sequence

Sampled = tuple[int, dict[int, float] | None]


class SamplingFailed(FloatingPointError):
    """One request's logits cannot be sampled (NaN, or no finite probability mass)."""


class Sampler:
    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed)  # for unseeded requests

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]
                 ) -> list[Sampled | Exception]:
        """logits: float32 [len(seqs), vocab] on any device. Returns, per row, (token,
        logprobs) or the exception that row raised."""
        logits = logits.float().cpu()
        greedy = logits.argmax(dim=-1).tolist()
        has_nan = logits.isnan().any(dim=-1).tolist()
        out: list[Sampled | Exception] = []
        for row, seq in enumerate(seqs):
            try:
                if has_nan[row]:
                    raise SamplingFailed(f"the model produced NaN logits for request "
                                         f"{seq.seq_id}")
                p = seq.params
                token = greedy[row] if p.greedy else self._sample(logits[row], seq)
                out.append((token, self._logprobs(logits[row], token, p.logprobs)))
            except Exception as e:  # this request fails; the batch goes on
                out.append(e)
        return out

    def _sample(self, logits: torch.Tensor, seq: Sequence) -> int:
        p = seq.params
        # shifted so the largest is 0 before dividing: the tempered logits are <= 0, so a
        # small temperature can only push the others towards -inf (probability 0), never
        # the top one to inf (which would make softmax NaN)
        x = (logits - logits.max()) / p.temperature
        if 0 < p.top_k < x.shape[-1]:
            kth = torch.topk(x, p.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # keep the smallest set whose mass reaches top_p; the top token always stays
            # (explicitly: a top_p below float32's smallest value compares as 0, dropping all)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
            drop[0] = False
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0:
            # e.g. a +inf logit (inf - inf): refuse rather than draw from garbage
            raise SamplingFailed(f"the logits of request {seq.seq_id} give no valid "
                                 f"distribution at temperature {p.temperature}")
        gen = seq.generator or self.generator
        return int(torch.multinomial(probs, 1, generator=gen))

    @staticmethod
    def _logprobs(logits: torch.Tensor, token: int, k: int | None) -> dict[int, float] | None:
        if k is None:
            return None
        lp = torch.log_softmax(logits, dim=-1)
        out = {}
        k = min(k, lp.shape[-1])  # a vocabulary smaller than the request's k: all of it
        if k > 0:
            top = torch.topk(lp, k)
            out = dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
        out[token] = float(lp[token])
        return out
