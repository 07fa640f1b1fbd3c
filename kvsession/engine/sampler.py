"""Turns one step's logits into tokens, row by row, each with its request's parameters.

Processing order, transformers' (`GenerationMixin._get_logits_processor`), which vLLM's
matches for the parts both have:
  1. logit_bias (SequenceBiasLogitsProcessor with single-token biases),
  2. repetition_penalty over prompt and output tokens (RepetitionPenaltyLogitsProcessor),
  3. presence / frequency penalties over output tokens (OpenAI's definition, as vLLM),
  4. the structured-output mask (xgrammar; the whole batch's bitmask in one call),
  5. min_tokens: EOS and stop ids masked (MinNewTokensLengthLogitsProcessor) unless the
     format allows nothing else (a format's end beats min_tokens: the output stays valid),
then greedy is the argmax of those logits; otherwise temperature, top-k, top-p, min_p
(TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper) and one
multinomial draw. A request with `seed` draws from its own torch.Generator, so its tokens do
not depend on what else is in the batch. Logprobs are taken from the unmodified model
distribution (log_softmax of the raw logits, vLLM's default).

Rows are independent: a row that cannot be sampled (NaN logits, a format that allows no
token, anything raised while sampling it) yields its exception in place of a token, and the
engine fails that request alone; the other rows are sampled exactly as without it.
"""

from __future__ import annotations

import numpy as np
import torch

from kvsession.engine.sequence import Sequence
from kvsession.errors import KVSessionError
from kvsession.structured import BatchMask

Sampled = tuple[int, dict[int, float] | None]


class SamplingFailed(KVSessionError, FloatingPointError):
    """One request's logits cannot be sampled (NaN, or no finite probability mass: e.g. a
    structured format whose language is empty allows no token)."""


def _format_hint(seq: Sequence) -> str:
    return "" if seq.grammar is None else \
        " (its structured format allows no token here: can its language match anything?)"


def _needs_processing(seq: Sequence) -> bool:
    p = seq.params
    return bool(p.logit_bias or p.penalized or seq.grammar is not None
                or seq.num_output_tokens < p.min_tokens)


def apply_penalties(x: torch.Tensor, seq: Sequence) -> None:
    """logit_bias, then the three penalties, in place on one row."""
    p = seq.params
    if p.logit_bias:
        ids, bias = zip(*p.logit_bias, strict=True)
        x[list(ids)] += torch.tensor(bias, dtype=x.dtype)
    if p.repetition_penalty != 1.0:
        # transformers: gather the logits of every token seen, scale by sign, scatter back
        # (a repeated id is written twice with the same value)
        ids = torch.tensor(seq.token_ids, dtype=torch.long)
        score = x.gather(0, ids)
        score = torch.where(score < 0, score * p.repetition_penalty,
                            score / p.repetition_penalty)
        x.scatter_(0, ids, score)
    if p.presence_penalty or p.frequency_penalty:
        out = seq.output_token_ids
        if out:
            counts = torch.bincount(torch.tensor(out, dtype=torch.long),
                                    minlength=x.shape[-1])[: x.shape[-1]].to(x.dtype)
            x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(x.dtype)


def _nan_rows(x: torch.Tensor) -> set[int]:
    """Rows of x (float32, CPU) holding a NaN. One summing pass (NaN propagates; so does
    inf - inf, which is why a flagged row is checked exactly) instead of a full boolean
    tensor; in numpy, whose small reductions start no threads: torch's sum, isnan and
    nonzero took ~0.1 ms of every decode step (~1.5%) on the AMD bench machine."""
    a = x.numpy()
    with np.errstate(invalid="ignore"):  # inf - inf in the sum is expected, not a warning
        sums = a.sum(axis=-1)
    return {int(r) for r in np.flatnonzero(np.isnan(sums)) if np.isnan(a[r]).any()}


def apply_min_tokens(x: torch.Tensor, seq: Sequence) -> None:
    """Before min_tokens outputs, EOS (unless ignored) and stop ids cannot be sampled."""
    p = seq.params
    if seq.num_output_tokens >= p.min_tokens:
        return
    banned = set(p.stop_ids) | (set() if p.ignore_eos else set(seq.eos_token_ids))
    banned = [t for t in banned if t < x.shape[-1]]
    if not banned:
        return
    kept = x[banned].clone()
    x[banned] = float("-inf")
    if seq.grammar is not None and not bool(torch.isfinite(x).any()):
        x[banned] = kept  # the format is complete: its stop token is the only way on


def distribution(x: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """The normalised probabilities a non-greedy row draws from (processed logits in)."""
    p = seq.params
    # shifted so the largest is 0 before dividing: the tempered logits are <= 0, so a
    # small temperature can only push the others towards -inf (probability 0), never
    # the top one to inf (which would make softmax NaN)
    x = (x - x.max()) / p.temperature
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
    if p.min_p > 0.0:
        # relative to the top token, which therefore always stays
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    total = probs.sum()
    if not bool(torch.isfinite(probs).all()) or not float(total) > 0:
        # e.g. a +inf logit (inf - inf), or a format that allows no token
        raise SamplingFailed(f"the logits of request {seq.seq_id} give no valid "
                             f"distribution at temperature {p.temperature}"
                             + _format_hint(seq))
    return probs / total


class Sampler:
    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed)  # for unseeded requests
        self.mask = BatchMask()

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]
                 ) -> list[Sampled | Exception]:
        """logits: float32 [len(seqs), vocab] on any device. Returns, per row, (token,
        logprobs) or the exception that row raised."""
        # contiguous: the runner's CPU logits are a transposed view ((w @ h.T).T), on which
        # row-wise reductions run several times slower than the copy costs, and xgrammar's
        # CPU kernel indexes rows as if they were contiguous. That copy (or the one off the
        # device) is processed in place: no second copy of the batch's logits per step.
        x = logits.float().cpu().contiguous()
        rows = [r for r, seq in enumerate(seqs) if _needs_processing(seq)]
        if rows and x.data_ptr() == logits.data_ptr():
            x = x.clone()  # never the caller's tensor (a fork samples its row again)
        nan_rows = _nan_rows(x)
        # logprobs come from the unprocessed distribution: keep those rows as they were
        raw = {r: x[r].clone() for r in rows if seqs[r].params.logprobs is not None}
        x, errors = self.process(x, seqs, rows)
        # numpy's argmax (same answer: the first maximum, the first NaN) is vectorised: over
        # a 32,000-token vocabulary ~5 us where torch's CPU argmax took ~35-50 (AMD bench
        # machine), in every greedy decode step
        a = x.numpy()  # the same memory
        greedy = a.argmax(-1).tolist() if any(s.params.greedy for s in seqs) else []
        out: list[Sampled | Exception] = []
        for row, seq in enumerate(seqs):
            try:
                if row in nan_rows:
                    raise SamplingFailed(f"the model produced NaN logits for request "
                                         f"{seq.seq_id}")
                if row in errors:
                    raise errors[row]
                p = seq.params
                if p.greedy:
                    token = greedy[row]
                    if not a[row, token] > -np.inf:  # +inf is a fine argmax
                        raise SamplingFailed(f"no token of request {seq.seq_id} is allowed"
                                             + _format_hint(seq))
                else:
                    gen = seq.generator or self.generator
                    token = int(torch.multinomial(distribution(x[row], seq), 1, generator=gen))
                out.append((token, self._logprobs(raw.get(row, x[row]), token, p.logprobs)))
            except Exception as e:  # this request fails; the batch goes on
                out.append(e)
        return out

    def process(self, x: torch.Tensor, seqs: list[Sequence], rows: list[int] | None = None
                ) -> tuple[torch.Tensor, dict[int, Exception]]:
        """Steps 1-5 of the module doc, in place on `x` (contiguous float32 [len(seqs),
        vocab]) for `rows` (default: those that need any); returns x and the rows that
        failed on the way."""
        if rows is None:
            rows = [r for r, seq in enumerate(seqs) if _needs_processing(seq)]
        errors: dict[int, Exception] = {}
        for r in rows:
            try:
                apply_penalties(x[r], seqs[r])
            except Exception as e:
                errors[r] = e
        states = {r: seqs[r].grammar for r in rows
                  if seqs[r].grammar is not None and r not in errors}
        if states:
            errors.update(self.mask.apply(x, states))
        for r in rows:
            if r not in errors:
                try:
                    apply_min_tokens(x[r], seqs[r])
                except Exception as e:
                    errors[r] = e
        return x, errors

    @staticmethod
    def _logprobs(logits: torch.Tensor, token: int, k: int | None) -> dict[int, float] | None:
        if k is None:
            return None
        lp = torch.log_softmax(logits, dim=-1)
        return top_logprobs(lp, token, k)


def top_logprobs(lp: torch.Tensor, token: int, k: int) -> dict[int, float]:
    """{token_id: logprob} of the k most likely tokens of one log-softmax row, plus `token`."""
    out = {}
    k = min(k, lp.shape[-1])  # a vocabulary smaller than the request's k: all of it
    if k > 0:
        top = torch.topk(lp, k)
        out = dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
    out[token] = float(lp[token])
    return out
