"""Drafts: tokens proposed to follow a decoding sequence, computed in its next forward pass
and kept only as far as the model agrees with them (the verification is the engine's:
engine/loop.py). Two sources, one verification:

- **jump-forward**: where a request's structured format admits one continuation only (a
  tool call's markup, a schema's keys, the rest of an enum value), xgrammar's tokens for it;
- **prompt lookup** (`LLM(speculative_config={"method": "ngram", ...})`): the tokens that
  followed the latest earlier occurrence of the sequence's last n tokens, anywhere in its
  prompt, which for a session turn is the whole conversation (earlier replies and tool
  results included), n from `prompt_lookup_max` down to `prompt_lookup_min`.

A draft is cut where the request's format would refuse a token (it is never computed), and
where max_tokens or max_model_len would end the request anyway. A lookup draft's length
follows what the sequence's verifications keep (a forced span is certain text, proposed
whole): FIRST_DRAFT_TOKENS at first, twice as many after one that
kept every draft, one more than was kept after one that refused some (a sequence whose
drafts are refused probes with one token, which costs its step almost nothing).

**It pays for itself.** Each draft token is computed whether or not it is kept, and every
sequence of the step waits for it, so a sequence drafts only while what it keeps pays for
what its drafts add to the step: with `a` tokens kept and `k` proposed per verification
(exponential averages), `B` decoding sequences, the step time `t` of B decodes and `c` what
one more token adds to such a step (both measured by the engine: `StallRatio.pure_step_s`,
`StallRatio.token_s`), the drafts gain `a` tokens and cost the batch `k c`, in which it
would have made `B k c / t` tokens; they pay when `a t > B k c` (at batch 1: `1 + a` tokens
in `t + k c` beat one in `t`). On a CPU where a batch-8 decode step is already bound by
compute (a token adds nearly its share of the step) drafting stops paying at large batches,
as it should. When it does not pay, the sequence stops drafting for `backoff` of its decode
steps, then tries once more; the backoff doubles while drafting keeps not paying
(MIN_BACKOFF_STEPS to MAX_BACKOFF_STEPS). Until the engine has measured `c` drafting is
assumed to pay.

Engine thread only (the scheduler asks for drafts, the engine reports what was kept).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvsession.config import SpeculativeConfig
from kvsession.engine.sequence import Sequence

# the longest grammar-forced span proposed at once (a tool call's fixed markup and long
# keys fit; a longer one continues in the next step)
JUMP_FORWARD_MAX_TOKENS = 32
# the exponential averages of kept and proposed tokens weigh the newest verification so
ACCEPT_ALPHA = 0.3
# a sequence's first draft: at most this many tokens (then twice as many after each
# verification that kept them all). Drafts that are all refused cost their step's every
# sequence their tokens, and a first verification of 8 refused drafts beside 7 other decodes
# (a 72-token step where a decode step is bound by compute on the 2-core CPU) cost the
# replayed-random-drafts benchmark ~10% at batch 8; starting at 2 costs kept drafts two
# verifications (2, 4, then 8)
FIRST_DRAFT_TOKENS = 2
# decode steps a sequence goes without drafts after drafting did not pay: the first time,
# and at most (each further miss doubles it). Every probe is a mixed step for the whole
# batch: with drafts that are always refused, 8 cost batch-8 decoding 7% (0.89-0.96x in 3
# rounds, bench/speculative.py), 16 cost it 3% (0.96-0.99x)
MIN_BACKOFF_STEPS, MAX_BACKOFF_STEPS = 16, 256


class StepCosts(Protocol):
    """What steps cost, as the engine measured them (costmodel.StallRatio)."""

    token_s: float | None

    def pure_step_s(self, num_decodes: int) -> float | None: ...


def pays(kept: float, proposed: float, step_s: float | None, token_s: float | None,
         num_decodes: int = 1) -> bool:
    """Whether verifying `proposed` drafts a step to keep `kept` of them makes a step of
    `num_decodes` decodes (`step_s` long) make more tokens per second:
    kept * step_s > num_decodes * proposed * token_s (module doc). Unknown costs: assumed
    to, unless nothing was kept."""
    if kept <= 0:
        return False
    if step_s is None or token_s is None:
        return True
    return kept * step_s > max(num_decodes, 1) * proposed * token_s


@dataclass
class DraftState:
    """One sequence's drafting: its tokens as an array (appended to as it grows), what its
    verifications kept, and how long it goes without drafts."""

    tokens: np.ndarray | None = None  # (made at the first lookup: spans alone need none)
    length: int = 0
    kept: float | None = None  # exponential average of drafted tokens kept per verification
    proposed: float | None = None  # and of those proposed
    pause_steps: int = 0  # decode steps left without drafts
    backoff_steps: int = MIN_BACKOFF_STEPS  # the next pause, if drafting does not pay
    max_draft: int = FIRST_DRAFT_TOKENS  # the longest draft to propose next

    def sync(self, token_ids: list[int]) -> np.ndarray:
        """The sequence's tokens so far (a view); the new ones copied in."""
        n = len(token_ids)
        if self.tokens is None or n > len(self.tokens):
            grown = np.empty(max(2 * n, 64), dtype=np.int64)
            if self.tokens is not None:
                grown[:self.length] = self.tokens[:self.length]
            self.tokens = grown
        if n > self.length:
            self.tokens[self.length:n] = token_ids[self.length:]
            self.length = n
        return self.tokens[:n]


def lookup(tokens: np.ndarray, max_tokens: int, n_max: int, n_min: int) -> list[int]:
    """The tokens that followed an earlier occurrence of the last n tokens of `tokens`, for
    the largest n in n_min..n_max that occurs: up to `max_tokens` of them, from the latest
    occurrence with that many after it, else the latest one (a shorter draft).

        tokens:  ... a b c [d e f g] ... x a b c      (last n = 3 tokens: a b c)
                        ^ the occurrence's continuation: d e f g (max_tokens = 4)

    One vectorised comparison over the whole sequence (positions holding its last token),
    then the candidates are narrowed one token further back at a time."""
    length = len(tokens)
    if length < 2 or max_tokens <= 0:
        return []
    # candidates i < length - 1 whose token i equals the last token: an n-gram ending at i
    cand = np.flatnonzero(tokens[:length - 1] == tokens[length - 1])
    n = 1
    while n < n_max and len(cand):
        back = cand[cand >= n]
        back = back[tokens[back - n] == tokens[length - 1 - n]]
        if not len(back):
            break
        cand, n = back, n + 1
    if n < n_min or not len(cand):
        return []
    full = cand[cand + max_tokens < length]
    i = int(full[-1] if len(full) else cand[-1])
    return tokens[i + 1: i + 1 + max_tokens].tolist()


class Lookup(Protocol):
    """Where a sequence's drafts come from when its format forces nothing."""

    def __call__(self, seq: Sequence, max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens proposed to follow `seq`'s tokens."""


class PromptLookup:
    """The n-gram drafts of `speculative_config` (`lookup` over the sequence's tokens, kept
    as an array in its DraftState)."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config

    def __call__(self, seq: Sequence, max_tokens: int) -> list[int]:
        if seq.drafting is None:
            seq.drafting = DraftState()
        c = self.config
        return lookup(seq.drafting.sync(seq.token_ids), min(max_tokens, c.num_speculative_tokens),
                      c.prompt_lookup_max, c.prompt_lookup_min)


class Drafter:
    """Proposes each decoding sequence's drafts (module doc) and learns from what its
    verifications kept. `config`: prompt lookup's (None: grammar-forced spans only)."""

    def __init__(self, config: SpeculativeConfig | None, costs: StepCosts):
        self.costs = costs
        self.lookup: Lookup | None = PromptLookup(config) if config is not None else None
        # grammar-forced spans as drafts (jump-forward); False: token by token, the
        # baseline the structured benchmark and the tests compare against
        self.forced_spans = True
        self.proposed_tokens = 0  # drafted tokens proposed (stats)
        self.accepted_tokens = 0  # of them kept

    def use_costs(self, costs: StepCosts) -> None:
        """Judge what pays by `costs` instead of the engine's measurements (a test counting
        passes exactly gives it a StallRatio never measured: drafting then always pays,
        whatever this machine's timings)."""
        self.costs = costs

    def replace_lookup(self, lookup: Lookup | None) -> None:
        """Draft from `lookup` instead (benchmarks and tests control acceptance with drafts
        they know the model will or will not take); None: grammar-forced spans only."""
        self.lookup = lookup

    def propose(self, seq: Sequence, num_decodes: int) -> list[int]:
        """Drafts for `seq`, a running sequence with one token left to compute, in a step
        with `num_decodes` decoding sequences; [] when it should not draft now."""
        grammar = seq.grammar
        if self.lookup is None and (grammar is None or not self.forced_spans):
            return []  # nothing to draft from (most requests without speculation)
        p = seq.params
        room = min(p.max_tokens - seq.num_output_tokens, seq.max_model_len - seq.num_tokens) - 1
        if room <= 0 or seq.fork_pending:
            return []
        if p.structured is not None and p.structured.jump_forward:
            return []  # forced spans are appended unverified (StructuredOutput.jump_forward)
        state = seq.drafting
        if state is not None and state.pause_steps > 0:
            state.pause_steps -= 1
            return []
        if grammar is not None and self.forced_spans:
            # the text is certain, only its pieces may differ from the model's: whole spans
            forced = grammar.forced_tokens()[:min(room, JUMP_FORWARD_MAX_TOKENS)]
            if forced:
                return forced
        if self.lookup is None:
            return []
        room = min(room, FIRST_DRAFT_TOKENS if state is None else state.max_draft)
        draft = self.lookup(seq, room)[:room]
        if draft and grammar is not None:
            draft = draft[:grammar.valid_prefix(draft)]
        return draft

    def observe(self, seq: Sequence, proposed: int, kept: int, num_decodes: int) -> None:
        """A verification of `proposed` drafts kept `kept` of them: the sequence's averages,
        and a pause when drafting does not pay (module doc)."""
        self.proposed_tokens += proposed
        self.accepted_tokens += kept
        state = seq.drafting
        if state is None:
            state = seq.drafting = DraftState()
        state.max_draft = 2 * proposed if kept == proposed else kept + 1
        a = ACCEPT_ALPHA
        state.kept = kept if state.kept is None else a * kept + (1 - a) * state.kept
        state.proposed = proposed if state.proposed is None else (
            a * proposed + (1 - a) * state.proposed)
        if pays(state.kept, state.proposed, self.costs.pure_step_s(num_decodes),
                self.costs.token_s, num_decodes):
            state.backoff_steps = MIN_BACKOFF_STEPS
            return
        state.pause_steps = state.backoff_steps
        state.backoff_steps = min(2 * state.backoff_steps, MAX_BACKOFF_STEPS)
        state.kept = state.proposed = None  # the next try is judged on its own
