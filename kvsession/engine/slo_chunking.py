"""SLO-aware chunking: how many tokens of a long prompt a step may take once the user sets
`llm.slo`, so that decodes keep their time-per-output-token target and a request arriving
meanwhile its time-to-first-token target.

What a step costs is measured: its decodes' pure step (`StallRatio.pure_step_s`) plus what
its prompt tokens add, fitted per token and per attention pair (`costmodel.PromptCost`:
over a long context a chunk's token costs several times a short prompt's, and more the
further into the document it is).

Beside decodes, a long prompt takes what the TPOT target leaves (`tpot_s` less the pure
step), plus the credit below. Where that is less than a block of tokens (over a 15k-token
context on the 2-core bench CPU a 16-token chunk adds ~100 ms to a ~60 ms step), the long
prompt sits the step out (`held_steps`) and the time the step leaves unused is banked
(`credit_s`, while holding only); when the bank and the step's room pay for a block, the
block runs. A request's TPOT is its mean over its decode steps, so one slower step among
faster ones keeps it: the document progresses at the rate the target leaves, where the
previous rule gave it the caps' whole chunk (hundreds of tokens, each step seconds long)
and the decodes missed their target on every step. A step that runs longer than predicted
leaves a debt (negative credit, floored at HORIZON_STEPS targets), paid by the next holds.
Out of reach (the decodes alone take the target, or a block would take more than
HORIZON_STEPS steps' room to pay for): holding would only starve the long prompt, so it
takes what a step alone may (below), the step counted (`unmet_steps`,
`llm.stats().slo_unmet_steps`; logged once). Before, it took the caps' whole chunk (512
tokens over a 15k-token context: ~2 s on the bench CPU), and a moment's slow decode steps
(the bench measured a pure step at 260 ms against a 250 ms target, ~50 ms typical) made
every request arriving then wait seconds.

Alone (nothing decodes): a step of prompts only is what a request arriving meanwhile waits
for before its own step. It lasts at most 1 / ALONE_SHARE of the TTFT target, so an arrival
waits at most that for the engine (the scheduler's top-up gives a long prompt alone the
rest of the budget otherwise: 2,048 tokens over an 8k-15k context take 4-7 s a step on the
bench CPU, and turns arriving meanwhile waited for all of it).

Engine thread only: the scheduler asks (`ChunkLimit`), the engine reports each step's time
(`observe`), and the targets are posted to the engine thread when `llm.slo` is set.
"""

from __future__ import annotations

import logging
import math

from kvsession import costmodel

log = logging.getLogger("kvsession")

# the steps over which a held long prompt's block is paid for: a request's TPOT averages its
# decode steps (an agent's short reply: a handful), so a block costing more than this many
# steps' room would break the target of every reply it lands in
HORIZON_STEPS = 8
# a step of prompts alone takes at most 1 / ALONE_SHARE of the TTFT target: an arrival waits
# for it, then for its own step (its prompt beside the decodes, within the TPOT target).
# Measured (bench/goodput.py, 3 rounds): the agents' TTFT p99 at 1.5-2.9x their idle value,
# against a TTFT target of 4x
ALONE_SHARE = 4


class SloChunking:
    def __init__(self, stall: costmodel.StallRatio):
        self.stall = stall
        self.cost = costmodel.PromptCost()
        self.ttft_s: float | None = None  # the targets; None until `llm.slo` is set
        self.tpot_s: float | None = None
        self.credit_s = 0.0
        self._holding = False  # the last answer held a long prompt back
        self.unmet_steps = 0
        self.held_steps = 0
        self._warned = False

    def set_target(self, ttft_s: float | None, tpot_s: float | None) -> None:
        """Engine thread: the targets (None or inf: none)."""
        self.ttft_s = None if ttft_s is None or math.isinf(ttft_s) else ttft_s
        self.tpot_s = None if tpot_s is None or math.isinf(tpot_s) else tpot_s
        self.credit_s, self._holding = 0.0, False

    def observe(self, num_decodes: int, prompt_tokens: int, key_reads: int,
                seconds: float) -> None:
        """Engine thread, after each step: its decodes, prompt tokens, their attention
        pairs (`costmodel.key_reads`) and its time."""
        fixed = self.stall.pure_step_s(max(num_decodes, 1))
        if prompt_tokens > 0 and fixed is not None:
            self.cost.observe(prompt_tokens, key_reads, seconds - fixed)
        if self.tpot_s is not None and num_decodes > 0:
            # banked while holding only: room left while no long prompt waited is gone
            top = HORIZON_STEPS * self.tpot_s if self._holding else 0.0
            self.credit_s = max(-HORIZON_STEPS * self.tpot_s,
                                min(self.credit_s + self.tpot_s - seconds, top))
        self._holding = False

    def prefill_tokens(self, num_decodes: int, min_tokens: int, context_tokens: int
                       ) -> int | None:
        """The tokens a long prompt `context_tokens` into its prefill may take in a step
        with `num_decodes` decodes: at least `min_tokens`, or 0 (it sits this step out);
        None: no limit (no target, or nothing measured yet)."""
        if num_decodes <= 0:  # past a one-decode step's time: the weights read once
            return self._within_ttft(min_tokens, context_tokens,
                                     self.stall.pure_step_s(1) or 0.0)
        if self.tpot_s is None:
            return None
        pure = self.stall.pure_step_s(num_decodes)
        least_s = self.cost.seconds(min_tokens, context_tokens)
        if pure is None or least_s is None:
            return None
        room = self.tpot_s - pure
        if room <= 0 or least_s > HORIZON_STEPS * room:
            self._unmet(min_tokens, num_decodes, pure, least_s)
            return self._within_ttft(min_tokens, context_tokens, pure)
        n = self.cost.tokens_within(room + self.credit_s, context_tokens)
        if n is None:
            return None
        if n >= min_tokens:
            return n
        self._holding = True
        self.held_steps += 1
        return 0

    def _within_ttft(self, min_tokens: int, context_tokens: int, fixed_s: float
                     ) -> int | None:
        """The tokens that keep a step with `fixed_s` of other work within 1 / ALONE_SHARE of
        the TTFT target (a request arriving meanwhile waits for the step); at least
        `min_tokens`; None: no TTFT target, or nothing measured yet."""
        if self.ttft_s is None:
            return None
        n = self.cost.tokens_within(self.ttft_s / ALONE_SHARE - fixed_s, context_tokens)
        return None if n is None else max(n, min_tokens)

    def _unmet(self, min_tokens: int, num_decodes: int, pure: float, least_s: float) -> None:
        self.unmet_steps += 1
        if not self._warned:
            self._warned = True
            log.warning("the TPOT target (%.1f ms) leaves no room for %d prompt tokens beside "
                        "%d decodes within %d steps (a pure decode step takes %.1f ms, the "
                        "tokens add %.1f ms): the target is out of reach here, long prompts "
                        "take what a quarter of the TTFT target holds "
                        "(stats().slo_unmet_steps)",
                        self.tpot_s * 1e3, min_tokens, num_decodes, HORIZON_STEPS,
                        pure * 1e3, least_s * 1e3)
