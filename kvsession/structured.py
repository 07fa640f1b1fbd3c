"""Structured output through xgrammar (the grammar engine vLLM and SGLang use).

`GrammarCompiler` (one per LLM, built on the first structured request) turns a
`StructuredOutput` into an xgrammar `CompiledGrammar` for this checkpoint's tokenizer and
keeps the result (keyed by the format; the tokenizer is fixed per compiler), so a format is
compiled once. A bad format is a ConfigError naming the field, raised in the caller's thread
at submission. Each structured request carries a `GrammarState` (a matcher); every step the
sampler fills one token bitmask for the batch's structured rows and applies it to the
logits with xgrammar's `apply_token_bitmask_inplace`, so rows without a format are
untouched and batch together with them. A format ends its request when the matcher accepts
the stop token (EOS) it allows once the format is complete.

xgrammar is an optional dependency (`pip install 'kvsession[structured]'`); it is imported
only when a structured request arrives.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from pathlib import Path

import torch

from kvsession.errors import ConfigError
from kvsession.json_schema import SUBSCHEMA_LISTS, SUBSCHEMA_MAPS, SUBSCHEMA_ONE, subschemas
from kvsession.params import StructuredOutput

# compiled grammars kept per LLM (each holds a token-mask cache; a few MB for big vocabularies)
CACHE_SIZE = 64


# one character of a JSON string as written: any Unicode scalar value but the control
# characters, '"' (\x22) and '\\' (\x5c), or an escape (one decoded character each)
STRING_CHAR = ('([ !#-\\x5b\\x5d-\ud7ff\ue000-\U0010ffff]|\\\\["\\\\/bfnrt]'
               # \u escapes of scalar values only: a lone surrogate is no character
               '|\\\\u([0-9a-cA-Ce-fE-F][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2}))')
# keywords xgrammar compiles but does not enforce (measured with its matcher: outputs that
# break them end as "stop"): refused, as vLLM refuses them for xgrammar
_UNENFORCED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas",
               "dependencies", "contains", "minContains", "maxContains")


def refuse_unenforced(node, where: str, path: str = "") -> None:
    """ConfigError naming the first keyword of `node` (a JSON schema) that xgrammar would
    compile without enforcing, and where it is: the output could break it and still end as
    "stop", where every output must validate."""
    if not isinstance(node, dict):
        return
    at = path or "/"
    for key in _UNENFORCED:
        if key in node:
            raise ConfigError(f"{where} uses {key!r} (at {at}), which the grammar engine "
                              f"(xgrammar) does not enforce")
    required, props = node.get("required"), node.get("properties")
    if isinstance(required, list):
        missing = [r for r in required if not (isinstance(props, dict) and r in props)]
        if missing:  # (xgrammar writes only listed properties: the output would lack it)
            raise ConfigError(f"{where} requires {missing[0]!r} (at {at}) without listing it "
                              f"in 'properties': the grammar engine (xgrammar) could never "
                              f"write it; list it there")
    if isinstance(node.get("oneOf"), list) and "discriminator" not in node:
        raise ConfigError(f"{where} uses 'oneOf' (at {at}), which the grammar engine "
                          f"(xgrammar) enforces as 'anyOf' (an output valid under two of its "
                          f"schemas would break it): use 'anyOf', or a 'discriminator'")
    step = node.get("multipleOf")
    if isinstance(step, float) and not step.is_integer():
        raise ConfigError(f"{where} uses a fractional 'multipleOf' ({step}, at {at}), which "
                          f"the grammar engine (xgrammar) does not enforce")
    if isinstance(node.get("pattern"), str) and re.search(r"\(\?<?[=!]", node["pattern"]):
        raise ConfigError(f"{where} uses a lookaround in 'pattern' (at {at}), which the "
                          f"grammar engine (xgrammar) drops")
    if node.get("uniqueItems") is True:
        raise ConfigError(f"{where} uses 'uniqueItems' (at {at}), which the grammar engine "
                          f"(xgrammar) does not enforce")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        raise ConfigError(f"{where} uses 'allOf' with {len(node['allOf'])} schemas (at "
                          f"{at}); the grammar engine (xgrammar) takes one")
    if ("minLength" in node or "maxLength" in node) and ("pattern" in node or
                                                          "format" in node):
        raise ConfigError(f"{where} bounds a string's length beside a pattern or format (at "
                          f"{at}), which the grammar engine (xgrammar) ignores: put the "
                          f"length into the pattern")
    for suffix, sub in subschemas(node):
        refuse_unenforced(sub, where, path + suffix)


def checked_schema(schema, where: str):
    """`schema` as it is given to xgrammar: refuse_unenforced, then
    bounded_strings_as_patterns."""
    refuse_unenforced(schema, where)
    return bounded_strings_as_patterns(schema)


def _is_length(v) -> bool:
    return v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0)


def bounded_strings_as_patterns(node):
    """Work around xgrammar's length-bounded strings (mlc-ai/xgrammar#800, open as of
    0.2.9): `minLength`/`maxLength` compile to a character class that admits raw control
    characters, which JSON forbids (`json.loads` rejects the output), and no escapes. Its
    `pattern` path is JSON-string aware, so such a string (without a pattern or format of its
    own) gets the equivalent pattern: same lengths, valid JSON. The class is written as
    positive ranges of literal characters (STRING_CHAR): xgrammar's negated classes also
    admit overlong and surrogate UTF-8 byte sequences, which decode to U+FFFD runs. Only
    subschemas are rewritten (a property named "default" is one; an enum's values are
    data); a string among several types (`["string", "null"]`) becomes one branch of an
    anyOf per type. Returns a rewritten copy; the input is not changed."""
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for k, v in node.items():
        if k in SUBSCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: bounded_strings_as_patterns(sub) for name, sub in v.items()}
        elif k in SUBSCHEMA_LISTS and isinstance(v, list):
            out[k] = [bounded_strings_as_patterns(sub) for sub in v]
        elif k in SUBSCHEMA_ONE and isinstance(v, dict):
            out[k] = bounded_strings_as_patterns(v)
    lo, hi = out.get("minLength"), out.get("maxLength")
    if (lo is None and hi is None) or "pattern" in out or "format" in out or \
            not (_is_length(lo) and _is_length(hi)):
        return out
    kind = out.get("type")
    if kind == "string":
        out.pop("minLength", None)
        out.pop("maxLength", None)
        out["pattern"] = f"^{STRING_CHAR}{{{lo or 0},{'' if hi is None else hi}}}$"
    elif isinstance(kind, list) and "string" in kind:
        rest = {k: v for k, v in out.items() if k != "type"}
        out = {"anyOf": [bounded_strings_as_patterns({**rest, "type": t}) if t == "string"
                         else {k: v for k, v in rest.items()
                               if k not in ("minLength", "maxLength")} | {"type": t}
                         for t in kind]}
    return out


def xgrammar_module():
    """xgrammar, imported on first use (ConfigError naming the extra without it)."""
    try:
        import xgrammar
    except ImportError as e:
        raise ConfigError(f"structured output needs xgrammar: pip install "
                          f"'kvsession[structured]' ({e})") from None
    return xgrammar


class GrammarState:
    """One request's position in its grammar (engine thread only)."""

    def __init__(self, matcher_class, compiled):
        self._matcher_class, self._compiled = matcher_class, compiled
        self.matcher = matcher_class(compiled)
        self.num_accepted = 0

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def accept(self, token_id: int) -> None:
        if not self.matcher.accept_token(int(token_id)):
            raise RuntimeError(f"token {token_id} does not continue the structured format")
        self.num_accepted += 1

    def forced_tokens(self) -> list[int]:
        """The tokens the format allows as the only continuation from here (not accepted
        yet); stop and special tokens are never among them."""
        return self.matcher.find_jump_forward_tokens()

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many leading `token_ids` the format accepts from here, one after another (a
        draft is cut there before it is verified: a token the mask would refuse is never
        computed, let alone kept). The state is left as it was (xgrammar's rollback)."""
        n = 0
        for t in token_ids:
            if self.matcher.is_terminated() or not self.matcher.accept_token(int(t)):
                break
            n += 1
        if n:
            self.matcher.rollback(n)
        return n

    def fork(self) -> GrammarState:
        """A fresh state for another completion of the same request. Completions are forked
        before their first token, so the start state is the right one (and this needs no
        matcher copy, which older xgrammar releases lack)."""
        if self.num_accepted:
            raise RuntimeError("a grammar state is forked only before its first token")
        return GrammarState(self._matcher_class, self._compiled)


class GrammarCompiler:
    """Compiles formats for one tokenizer, caching the results; thread-safe."""

    def __init__(self, tokenizer_file: Path, vocab_size: int, stop_token_ids):
        xgr = xgrammar_module()
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast  # xgrammar depends on transformers

        if not stop_token_ids:
            raise ConfigError("structured output needs an EOS token (the format ends with "
                              "it), and this checkpoint declares none")
        hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(tokenizer_file)))
        # vocab_size is the model's (the logits' width), which may exceed the tokenizer's
        self.info = xgr.TokenizerInfo.from_huggingface(
            hf, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids))
        self.vocab_size = vocab_size
        self._xgr = xgr
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        self._cache: OrderedDict[StructuredOutput, object] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0
        self.compile_s = 0.0  # total time spent compiling (bench/structured.py reads it)

    def compile(self, fmt: StructuredOutput):
        with self._lock:
            hit = self._cache.get(fmt)
            if hit is not None:
                self._cache.move_to_end(fmt)
                return hit
        t0 = time.perf_counter()
        compiled = self._compile(fmt)  # outside the lock: other formats compile meanwhile
        with self._lock:
            self.compile_s += time.perf_counter() - t0
            self.num_compiled += 1
            self._cache[fmt] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, fmt: StructuredOutput):
        c = self._compiler
        schema = None if fmt.json_schema is None else checked_schema(
            json.loads(fmt.json_schema), "structured.json_schema")
        try:
            if schema is not None:
                # compact separators, no free whitespace: a random (or bad) model cannot pad
                # the document with whitespace until max_tokens;
                # ensure_ascii=False: STRING_CHAR reaches xgrammar as literal characters (its
                # regex parser knows no \U escape)
                return c.compile_json_schema(json.dumps(schema, ensure_ascii=False),
                                             any_whitespace=False,
                                             separators=(",", ":"))
            if fmt.json_object:
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                             separators=(",", ":"), strict_mode=False)
            if fmt.regex is not None:
                return c.compile_regex(fmt.regex)
            return c.compile_grammar(fmt.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            # xgrammar reports "[time] file.cc:line: message": keep the message
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            msg = msg.split(": ", 1)[1] if msg.startswith("[") and ": " in msg else msg
            raise ConfigError(f"structured.{fmt.kind} does not compile: {msg}") from None

    def new_state(self, fmt: StructuredOutput) -> GrammarState:
        if fmt.jump_forward and not hasattr(self._xgr.GrammarMatcher,
                                            "find_jump_forward_tokens"):
            raise ConfigError("structured.jump_forward needs xgrammar >= 0.2 "
                              "(find_jump_forward_tokens)")
        compiled = self.compile(fmt)
        return GrammarState(self._xgr.GrammarMatcher, compiled)


class BatchMask:
    """The step's token bitmask: one row per sampled sequence, filled for the rows with a
    format, applied to those rows only. The buffer is reused while the batch size allows."""

    def __init__(self):
        self._buf: torch.Tensor | None = None

    def apply(self, logits: torch.Tensor, states: dict[int, GrammarState]) -> dict[int, Exception]:
        """Mask `logits` (CPU, float32 [rows, vocab]) in place: row r keeps only the tokens
        states[r] allows. Returns the rows whose state failed (they are left unmasked and
        must not be sampled)."""
        if not logits.is_contiguous():  # the CPU kernel indexes rows as if contiguous
            raise ValueError("the logits to mask must be a contiguous [rows, vocab] tensor")
        xgr = xgrammar_module()
        rows, vocab = logits.shape
        words = (vocab + 31) // 32
        if self._buf is None or self._buf.shape[0] < rows or self._buf.shape[1] != words:
            self._buf = xgr.allocate_token_bitmask(max(rows, 8), vocab)
        mask = self._buf[:rows]
        failed: dict[int, Exception] = {}
        ok = []
        for r, state in states.items():
            try:
                state.matcher.fill_next_token_bitmask(mask, r)
                ok.append(r)
            except Exception as e:  # this request fails alone
                failed[r] = e
        if ok:
            xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=vocab, indices=ok)
        return failed
