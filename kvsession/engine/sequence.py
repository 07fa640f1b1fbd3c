"""One request's state while the engine works on it: tokens, blocks, progress, output.

A Sequence is owned by the engine thread: only the scheduler and the loop mutate it. Its
block table (`blocks`) is written by the KVCacheManager only.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch

from kvsession.cache.block_pool import Block
from kvsession.cache.hashing import Salt
from kvsession.cache.manager import HolderKind
from kvsession.params import SamplingParams
from kvsession.validation import SEED_RANGE

if TYPE_CHECKING:
    from kvsession.model.tokenizer import IncrementalText

_ids = itertools.count()


class Grammar(Protocol):
    """A request's structured-output state (kvsession.structured.GrammarState)."""

    @property
    def terminated(self) -> bool: ...

    def accept(self, token_id: int) -> None: ...

    def fork(self) -> Grammar: ...

    def forced_tokens(self) -> list[int]: ...

    def valid_prefix(self, token_ids: list[int]) -> int: ...


def completion_seed(seed: int, index: int) -> int:
    """Completion `index` of a seeded request draws from seed + index (vLLM's rule), wrapped
    into the range torch.Generator accepts."""
    lo, hi = SEED_RANGE
    return (seed + index - lo) % (hi - lo + 1) + lo


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    holder_kind: ClassVar[HolderKind] = HolderKind.SEQUENCE
    token_ids: list[int]
    params: SamplingParams
    max_model_len: int
    eos_token_ids: frozenset[int] = frozenset()
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    blocks: tuple[Block, ...] = ()
    block_hashes: list[bytes] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in `blocks`
    num_cached_tokens: int = -1   # prompt tokens served by the prefix cache (-1: not admitted)
    num_prompt_computed: int = 0  # prompt tokens computed, recomputation after preemption too
    num_preemptions: int = 0
    retain_blocks: bool = False  # on finish, hand the block references to the caller
    # an engine-internal computation (a pin's prefill), not a request: stats() counts its
    # prefill work but not it, its latency or its sampled token
    internal: bool = False
    no_remote: bool = False  # a remote prefill failed: compute this one locally
    # lower is more urgent (as vLLM): it orders admission and preemption (the scheduler)
    priority: int = 0
    # prompt tokens whose KV a remote prefill worker wrote (after the KV this sequence
    # already had: prefix hits or a session's earlier turns); 0: prefilled here
    num_remote_tokens: int = 0
    # called on the engine thread when the sequence ends: on_finish(seq, succeeded)
    on_finish: object = None
    # called on the engine thread after each layer of the step that completes the prompt,
    # with the layer index: that layer's KV for the whole prompt is written (remote prefill
    # streams it out while the next layer computes)
    on_layer_done: object = None
    generator: torch.Generator | None = None
    index: int = 0  # which of its request's completions (SamplingParams.n) this is
    # a request's completions in index order, shared by all of them (set when n > 1 forks)
    group: list[Sequence] | None = None
    grammar: Grammar | None = None  # structured output: the matcher's state
    # speculation (engine/drafts.py): the tokens proposed to follow this sequence's tokens,
    # verified in its next forward pass and then cleared; never in token_ids, never hashed
    draft_token_ids: list[int] = field(default_factory=list)
    drafting: object = None  # the drafter's per-sequence state (engine/drafts.py)
    num_forward_passes: int = 0  # steps that computed some of this sequence's tokens
    num_accepted_drafts: int = 0  # drafted tokens the verification kept
    salt: Salt | None = None  # params.cache_salt, after the public pinned prefix it starts with
    # prompt_logprobs: prompt position -> {token_id: logprob} (recomputation overwrites)
    prompt_logprobs: dict[int, dict[int, float]] = field(default_factory=dict)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_text_len: int | None = None  # output text is cut here when a stop string matched
    _checked_text_len: int = 0  # output text already searched for stop strings
    # the output's text as it grows, for stop strings (made at the first check)
    _stop_text: IncrementalText | None = field(default=None, repr=False)
    _stop_fed: int = 0  # output ids given to _stop_text
    arrival_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)
        if self.salt is None and self.params.cache_salt is not None:
            self.salt = Salt(self.params.cache_salt)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(
                completion_seed(self.params.seed, self.index))

    @property
    def fork_pending(self) -> bool:
        """n > 1 and the completions have not been forked off yet (at the first sample)."""
        return self.params.n > 1 and self.group is None

    def spawn(self, index: int) -> Sequence:
        """Completion `index` of this request, at the point where this one has computed its
        prompt and not yet sampled: same prompt, params and timing; its own generator
        (seed + index) and grammar state. It holds no blocks (the scheduler forks them)."""
        child = Sequence(token_ids=self.token_ids[: self.num_prompt_tokens], params=self.params,
                         max_model_len=self.max_model_len, eos_token_ids=self.eos_token_ids,
                         index=index, arrival_time=self.arrival_time,
                         priority=self.priority,
                         grammar=None if self.grammar is None else self.grammar.fork())
        child.block_hashes = list(self.block_hashes)
        child.salt = self.salt
        child.num_cached_tokens = self.num_cached_tokens
        child.first_scheduled_time = self.first_scheduled_time
        child.prompt_logprobs = self.prompt_logprobs
        return child

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    def append_token(self, token_id: int, logprobs: dict[int, float] | None) -> None:
        if self.grammar is not None:
            self.grammar.accept(token_id)  # raises if the mask let a wrong token through
        self.token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
        now = time.perf_counter()
        if self.first_token_time is None:
            self.first_token_time = now

    def check_finished(self, new_text: Callable[[], IncrementalText]) -> bool:
        """Set `finish_reason` if the last appended token ends the request. `new_text`
        makes the IncrementalText the output's text grows in (needed only for stop
        strings: each token is decoded once, not the whole output at every step).

        Before `min_tokens` outputs only a completed structured format ends a request (the
        sampler masks EOS and stop ids then, unless the format allows nothing else). A stop
        string counts only if it ends in text added since the last check (vLLM): one that
        was complete before min_tokens is part of the output."""
        p, last = self.params, self.token_ids[-1]
        early = self.num_output_tokens < p.min_tokens
        if self.grammar is not None and self.grammar.terminated:
            self.finish_reason = "stop"  # the format is complete and took its stop token
        elif not early and (last in p.stop_ids
                            or (not p.ignore_eos and last in self.eos_token_ids)):
            self.finish_reason = "stop"
        elif p.stop_strings:
            if self._stop_text is None:
                self._stop_text = new_text()
            self._stop_text.extend(self.token_ids[self.num_prompt_tokens + self._stop_fed:])
            self._stop_fed = self.num_output_tokens
            text = self._stop_text.text  # (an incomplete UTF-8 character is held back)
            seen = self._checked_text_len
            self._checked_text_len = len(text)
            cut = [i for s in p.stop_strings
                   if (i := text.find(s, max(0, seen - len(s) + 1))) >= 0]
            if cut and not early:
                self.stop_text_len = min(cut)
                self.finish_reason = "stop"
        if self.finish_reason is None and (self.num_output_tokens >= p.max_tokens
                                           or self.num_tokens >= self.max_model_len):
            self.finish_reason = "length"
        return self.finish_reason is not None
