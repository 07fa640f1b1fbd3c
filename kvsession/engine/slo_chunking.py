"""SLO-aware chunking: how many tokens of long prompts a step that also decodes may take, so
that the decodes keep their time-per-output-token target (`llm.slo.tpot_s`, once the user
sets `llm.slo`).

A step's time is about its decodes' own (`StallRatio.pure_step_s`: measured pure decode
steps of as many decodes) plus what each prompt token adds to a step that decodes
(`StallRatio.token_s`, measured on such steps: over a long context a chunk's token costs
several times a short prompt's, so the prefill rate would size the chunk several times too
large); the limit is what the target leaves (`costmodel.slo_prefill_tokens`). Where
even one block of prompt tokens would break the target (the decodes alone are too slow, or
the target is below what the hardware does), the target is out of reach: the chunk is not
limited (the prefill caps alone apply: shrinking it would only slow the long prompt, the
step being slow anyway), and the step is counted (`unmet_steps`,
`llm.stats().slo_unmet_steps`; logged once). Measured (bench/goodput.py, 2-core CPU, 8-15k
token documents): a step with a 16-token chunk over a 15k context cost ~130 ms beyond its
decodes' step (gathering the long context's KV is per step, not per token), and limiting
to the minimum only stretched a document's prefill over ~1,000 such steps.

Engine thread only: the scheduler asks (`ChunkLimit`), the engine measures, and the target
is posted to the engine thread when `llm.slo` is set.
"""

from __future__ import annotations

import logging
import math

from kvsession import costmodel

log = logging.getLogger("kvsession")


class SloChunking:
    def __init__(self, stall: costmodel.StallRatio):
        self.stall = stall
        self.tpot_s: float | None = None  # the target; None until `llm.slo` is set
        self.unmet_steps = 0
        self._warned = False

    def set_target(self, tpot_s: float | None) -> None:
        """Engine thread: the decodes' TPOT target (None or inf: none)."""
        self.tpot_s = None if tpot_s is None or math.isinf(tpot_s) else tpot_s

    def prefill_tokens(self, num_decodes: int, min_tokens: int) -> int | None:
        """The long prompts' tokens a step with `num_decodes` decodes may take (at least
        `min_tokens`); None: no limit (no target, no decode, nothing measured yet, or the
        target out of reach even at `min_tokens`)."""
        if self.tpot_s is None or num_decodes <= 0:
            return None
        pure, token_s = self.stall.pure_step_s(num_decodes), self.stall.token_s
        if pure is None or token_s is None:
            return None
        n = costmodel.slo_prefill_tokens(self.tpot_s, pure, token_s)
        if n >= min_tokens:
            return n
        self.unmet_steps += 1
        if not self._warned:
            self._warned = True
            log.warning("the TPOT target (%.1f ms) leaves no room for %d prompt tokens beside "
                        "%d decodes (a pure decode step takes %.1f ms, a prompt token adds "
                        "%.2f ms): the target is out of reach here, long prompts keep the "
                        "prefill caps' chunk (stats().slo_unmet_steps)", self.tpot_s * 1e3,
                        min_tokens, num_decodes, pure * 1e3, token_s * 1e3)
        return None
