"""A request's way into the engine and back: its prompt and sampling parameters validated
against the model (token ids in the vocabulary, room to generate, what a session turn
cannot do), its structured format compiled (xgrammar, on first use), its cache salt
resolved against the pinned prefixes, all built into a `Sequence`; and a finished
Sequence (with its `n > 1` group) as the `RequestOutput` the caller gets. Caller threads
only: nothing here touches the engine's state."""

from __future__ import annotations

import numbers
import threading
from pathlib import Path

from kvsession.cache.hashing import Salt
from kvsession.cache.prefix import PinRegistry
from kvsession.engine.loop import request_metrics
from kvsession.engine.sequence import Sequence
from kvsession.errors import ConfigError
from kvsession.model.tokenizer import Tokenizer
from kvsession.outputs import CompletionOutput, RequestOutput
from kvsession.params import SamplingParams


class SequenceFactory:
    """Builds Sequences for one engine (its model's vocabulary and max_model_len, its
    tokenizer, its pinned prefixes) and reads them back as outputs."""

    def __init__(self, model_dir: Path, tokenizer: Tokenizer, vocab_size: int,
                 max_model_len: int, pins: PinRegistry):
        self.model_dir, self.tokenizer = Path(model_dir), tokenizer
        self.vocab_size, self.max_model_len, self.pins = vocab_size, max_model_len, pins
        self._grammars = None  # kvsession.structured.GrammarCompiler, on first use
        self._grammar_lock = threading.Lock()

    def validate_prompt(self, ids: list[int]) -> list[int]:
        if not ids:
            raise ConfigError("a prompt must have at least one token")
        # bool is an int to Python but never a token id; numpy ints are fine. Plain ints
        # are checked by type first: a session validates its whole history every turn, and
        # the ABC check alone took ~1.5 ms per 1,000 ids
        bad = [t for t in ids if type(t) is not int and (
            not isinstance(t, numbers.Integral) or isinstance(t, bool))]
        if bad:
            raise ConfigError(f"prompt token ids must be ints, got {bad[:5]!r:.80}")
        ids = [int(t) for t in ids]
        vocab = self.vocab_size
        bad = [] if 0 <= min(ids) and max(ids) < vocab else [
            t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ConfigError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ConfigError(
                f"prompt of {len(ids)} tokens leaves no room to generate within max_model_len="
                f"{self.max_model_len}")
        return list(ids)

    def validate_params(self, params: SamplingParams, retain_blocks: bool) -> None:
        """What SamplingParams cannot check alone: token ids against the vocabulary, the
        structured format against the tokenizer (compiled here, in the caller's thread),
        and what a session turn (retain_blocks) cannot do."""
        vocab = self.vocab_size
        bad = [t for t, _ in params.logit_bias or () if t >= vocab]
        if bad:
            raise ConfigError(f"logit_bias token ids {bad[:5]} are outside the vocabulary "
                              f"[0, {vocab})")
        if retain_blocks and params.n > 1:
            raise ConfigError(f"n must be 1 for a session turn (one reply), got {params.n}")
        if retain_blocks and params.prompt_logprobs is not None:
            raise ConfigError("prompt_logprobs must be None for a session turn (its prompt "
                              "is mostly cached KV, whose logits are not kept)")

    def grammars(self):
        """The structured-output compiler (built, and xgrammar imported, on first use)."""
        with self._grammar_lock:
            if self._grammars is None:
                from kvsession.structured import GrammarCompiler

                self._grammars = GrammarCompiler(self.model_dir / "tokenizer.json",
                                                 self.vocab_size,
                                                 self.tokenizer.eos_token_ids)
            return self._grammars

    def new(self, ids: list[int], params: SamplingParams,
            retain_blocks: bool = False, priority: int = 0) -> Sequence:
        self.validate_params(params, retain_blocks)
        ids = self.validate_prompt(ids)
        grammar = None if params.structured is None else \
            self.grammars().new_state(params.structured)
        return Sequence(token_ids=ids, params=params, max_model_len=self.max_model_len,
                        eos_token_ids=self.tokenizer.eos_token_ids, retain_blocks=retain_blocks,
                        grammar=grammar, salt=self.salt_for(ids, params.cache_salt),
                        priority=priority)

    def salt_for(self, ids: list[int], cache_salt: str | None) -> Salt | None:
        """Layered isolation: a salted request shares the public pinned prefix it starts
        with (unsalted, computed once for every tenant) and nothing after it."""
        if cache_salt is None:
            return None
        pins = self.pins
        after = pins.salted_after(ids, cache_salt)  # as the tenant's own pin was hashed
        return Salt(cache_salt, pins.public_blocks(ids) if after is None else after)

    def completion(self, seq: Sequence) -> CompletionOutput:
        """One finished completion of a request: its text as decoded (cut at a stop
        string), its token ids, why it ended."""
        out_ids = seq.output_token_ids
        text = self.tokenizer.decode(out_ids)
        if seq.stop_text_len is not None:
            text = text[: seq.stop_text_len]
        return CompletionOutput(
            index=seq.index, text=text, token_ids=out_ids, finish_reason=seq.finish_reason,
            logprobs=seq.output_logprobs if seq.params.logprobs is not None else None)

    def output(self, seq: Sequence, prompt: str | None) -> RequestOutput:
        """A finished request (its `n` completions, the group of `seq`) as a RequestOutput."""
        members = seq.group or [seq]
        last = max(members, key=lambda m: m.finish_time or 0.0)
        prompt_lp = None
        if seq.params.prompt_logprobs is not None:
            prompt_lp = [None] + [seq.prompt_logprobs.get(i)
                                  for i in range(1, seq.num_prompt_tokens)]
        return RequestOutput(
            request_id=seq.seq_id, prompt=prompt, prompt_token_ids=seq.token_ids[
                : seq.num_prompt_tokens], outputs=[self.completion(m) for m in members],
            num_cached_tokens=max(seq.num_cached_tokens, 0), metrics=request_metrics(last),
            prompt_logprobs=prompt_lp)
