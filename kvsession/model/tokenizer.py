"""Tokenizer and chat template: `tokenizers` for text <-> ids, sandboxed jinja2 for chats.

Both checkpoint layouts load: the chat template from `chat_template.jinja` (current) or from
`tokenizer_config.json["chat_template"]` (classic, a string or a list of named templates);
BPE merges as pairs or as space-joined strings (the `tokenizers` library reads both).
"""

from __future__ import annotations

import hashlib
import json
import math
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from kvsession.errors import ConfigError, ModelLoadError
from kvsession.model.config import read_json
from kvsession.validation import check_unicode

try:  # tokenizers >= 0.21
    from tokenizers.decoders import DecodeStream as _DecodeStream
except ImportError:  # older: IncrementalText decodes every id again
    _DecodeStream = None


class IncrementalText:
    """The text of a list of output ids that only grows: `extend(new ids)` returns the text
    they add, and `text` is all of it, equal to decoding every id at once (but an
    incomplete UTF-8 character at the end, held back until its last byte arrives).

    Why: streams, stop strings and chat deltas need the text after every token; decoding
    the whole output again each time costs O(n) per token, O(n^2) over a generation (the
    tiny test tokenizer: ~190 us per token averaged over 4,096 tokens, ~380 us at the
    end). tokenizers' DecodeStream decodes each new id against a few ids before it
    (~0.6 us a token; ~1.8 us through DeltaText, bench/detokenize.py). Where tokenizers
    has no DecodeStream, the whole output is decoded again (the old cost)."""

    def __init__(self, tok: _HFTokenizer, skip_special_tokens: bool = True,
                 markers: dict[int, str] | None = None):
        """`markers`: special token ids whose text is put back where they occur (decoding
        drops special tokens; a tool-call parser reads them: ToolSpec.decode_marked), the
        ids between them decoded as separate runs, as decode_marked decodes them."""
        self._tok, self._skip, self._markers = tok, skip_special_tokens, markers or {}
        self._run: list[int] = []  # the current run's ids (only without DecodeStream)
        self._stream = self._new_stream()
        self._before = ""  # the text of the runs and markers before the current run
        self.text = ""

    def _new_stream(self):
        return None if _DecodeStream is None else _DecodeStream(
            skip_special_tokens=self._skip)

    def extend(self, ids) -> str:
        """Append `ids`; the text they complete (possibly "")."""
        start = len(self.text)
        for i in ids:
            if i in self._markers:  # a run ends, the marker's text, a new run
                self._before, self._run = self.text + self._markers[i], []
                self.text, self._stream = self._before, self._new_stream()
            elif self._stream is not None:
                if (piece := self._stream.step(self._tok, i)) is not None:
                    self.text += piece
            else:  # no DecodeStream: the run decoded again
                self._run.append(i)
                text = self._before + self._tok.decode(
                    self._run, skip_special_tokens=self._skip).rstrip("\ufffd")
                if text.startswith(self.text):  # never retract text given out
                    self.text = text
        return self.text[start:]


# nesting allowed in a message's extra fields (tool calls, metadata); deeper is a mistake
MAX_MESSAGE_DEPTH = 16


def _check_json(value, where: str, depth: int = 0) -> None:
    """A message field must survive a JSON round trip: sessions write their messages into
    snapshots (at save, and when an idle session spills to disk on the engine thread)."""
    if depth > MAX_MESSAGE_DEPTH:
        raise ConfigError(f"{where} is nested more than {MAX_MESSAGE_DEPTH} levels deep")
    if isinstance(value, str):
        check_unicode(where, value)
        return
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, int):
        if not -(2**63) <= value < 2**64:
            raise ConfigError(f"{where} must be a JSON value; the int {value} is out of range")
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(f"{where} must be a JSON value, got {value!r}")
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check_json(item, f"{where}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        for k, item in value.items():
            if not isinstance(k, str):
                raise ConfigError(f"{where} keys must be strings, got {k!r}")
            _check_json(item, f"{where}[{k!r}]", depth + 1)
        return
    raise ConfigError(f"{where} must be a JSON value (str, int, float, bool, None, list or "
                      f"dict with str keys), got {type(value).__name__} {value!r:.60}")


def message_content(content, where: str) -> str:
    """A message's content as text: a string, or OpenAI-style text parts joined."""
    if isinstance(content, str):
        return check_unicode(where, content)
    if isinstance(content, list) and content and all(
            isinstance(part, dict) and part.get("type") == "text"
            and isinstance(part.get("text"), str) for part in content):
        # as vLLM joins text parts
        return check_unicode(where, "\n".join(part["text"] for part in content))
    raise ConfigError(f"{where} must be a string or a non-empty list of "
                      f"{{'type': 'text', 'text': str}} parts, got {content!r:.80}")


def _tool_calls(calls, where: str) -> list[dict]:
    """An assistant message's OpenAI `tool_calls`, each {"id", "type": "function",
    "function": {"name", "arguments"}}, with `arguments` as a dict (JSON text is parsed):
    chat templates index into it (the HF convention)."""
    if not isinstance(calls, list) or not calls:
        raise ConfigError(f"{where} must be a non-empty list of {{'id', 'type': 'function', "
                          f"'function': {{'name', 'arguments'}}}} dicts, got {calls!r:.80}")
    out = []
    for i, call in enumerate(calls):
        w = f"{where}[{i}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or call.get("type", "function") != "function":
            raise ConfigError(f"{w} must be {{'id', 'type': 'function', 'function': "
                              f"{{'name', 'arguments'}}}}, got {call!r:.80}")
        if not isinstance(call.get("id", ""), str):
            raise ConfigError(f"{w}['id'] must be a string, got {call['id']!r:.80}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ConfigError(f"{w}['function']['name'] must be a non-empty string, "
                              f"got {fn.get('name')!r:.80}")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise ConfigError(f"{w}['function']['arguments'] must be a JSON object (a "
                                  f"dict or its JSON text), got text that is not JSON: "
                                  f"{e}") from None
        if not isinstance(args, dict):
            raise ConfigError(f"{w}['function']['arguments'] must be a JSON object (a dict "
                              f"or its JSON text), got {args!r:.80}")
        _check_json(args, f"{w}['function']['arguments']", 3)
        out.append({**call, "type": "function", "function": {**fn, "arguments": args}})
    return out


def check_messages(messages, what: str = "messages", text_only: bool = False) -> list[dict]:
    """Validated copies of chat messages (the API edge: llm.chat, Session.send/add, the
    system prompt). Each is a dict with 'role' (a non-empty string) and 'content' (a string,
    or OpenAI-style text parts, joined here into one string); other fields must be JSON
    values, or with `text_only` (a session's messages: its snapshots hold text fields only)
    strings. Without `text_only` the OpenAI tool shapes are accepted: an assistant message
    with `tool_calls` (its content may be None or absent: rendered as "") whose arguments
    become dicts, and a tool result with a string `tool_call_id`. Errors name the message
    index and the field."""
    if not isinstance(messages, (list, tuple)):
        raise ConfigError(f"{what} must be a list of message dicts, got {messages!r:.80}")
    out = []
    for i, m in enumerate(messages):
        where = f"{what}[{i}]"
        if not isinstance(m, dict):
            raise ConfigError(f"{where} must be a dict with 'role' and 'content', "
                              f"got {m!r:.80}")
        calls = None if text_only else m.get("tool_calls")
        for key in ("role", "content"):
            if key not in m and not (key == "content" and calls is not None):
                raise ConfigError(f"{where} has no {key!r}: a message is a dict with 'role' "
                                  f"and 'content', got {m!r:.80}")
        role = m["role"]
        if not isinstance(role, str) or not role:
            raise ConfigError(f"{where}['role'] must be a non-empty string, got {role!r:.80}")
        if calls is not None and role != "assistant":
            raise ConfigError(f"{where} has tool_calls but role {role!r}: only an "
                              f"'assistant' message makes tool calls")
        if calls is not None and m.get("content") is None:
            content = ""  # OpenAI's content=None beside tool_calls; templates concatenate it
        else:
            content = message_content(m["content"], f"{where}['content']")
        for key, value in m.items():
            if not isinstance(key, str):
                raise ConfigError(f"{where} keys must be strings, got {key!r:.80}")
            if key in ("content", "tool_calls") and not (text_only and key == "tool_calls"):
                continue
            if text_only and not isinstance(value, str):
                raise ConfigError(f"{where}[{key!r}] must be a string (a session's messages "
                                  f"are saved in its snapshots, which hold text fields), "
                                  f"got {value!r:.80}")
            if key == "tool_call_id" and not isinstance(value, str):
                raise ConfigError(f"{where}['tool_call_id'] must be a string (the id of the "
                                  f"call this result answers), got {value!r:.80}")
            _check_json(value, f"{where}[{key!r}]", 1)
        msg = {**m, "content": content}
        if calls is not None:
            msg["tool_calls"] = _tool_calls(calls, f"{where}['tool_calls']")
        out.append(msg)
    return out


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _raise_exception(message: str):
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' `tojson` for chat templates: plain JSON text in the value's own key
    order. jinja2's built-in returns HTML-escaped Markup with sorted keys, and Markup turns
    `'<tool_call>' + args|tojson` (how Qwen templates write a call) into escaped text."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older tokenizer_config files
        return value.get("content")
    return value


def _json_object(path: Path) -> dict:
    """A checkpoint's optional JSON file ({} when absent); ModelLoadError if malformed."""
    return read_json(path) if path.is_file() else {}


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks the assistant's text
    with it (for training masks); rendering, it is its body."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class Tokenizer:
    """Encodes, decodes and renders chats for one checkpoint. Immutable after construction,
    safe to share between threads."""

    def __init__(self, model_dir: Path, config_eos_ids: list[int] | None = None,
                 chat_template: str | None = None):
        """chat_template: a template that replaces the checkpoint's (all of its named
        ones: `LLM(chat_template=...)`)."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            if (model_dir / "tokenizer.model").is_file():
                raise ModelLoadError(
                    f"{model_dir} has only tokenizer.model (SentencePiece); kvsession reads "
                    f"tokenizer.json: convert it once with transformers "
                    f"(AutoTokenizer.from_pretrained(dir).save_pretrained(dir) writes it)")
            raise ModelLoadError(f"missing file: {path}")
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as e:
            raise ModelLoadError(f"cannot read {path}: {e}") from None
        tcfg = _json_object(model_dir / "tokenizer_config.json")
        self.bos_token = _token_text(tcfg.get("bos_token"))
        self.eos_token = _token_text(tcfg.get("eos_token"))
        # name -> template: "default", and "tool_use" where the checkpoint names one (chosen
        # when tools are given, as transformers chooses)
        self.templates = {"default": chat_template} if chat_template is not None else \
            self._find_templates(model_dir, tcfg)
        self.chat_template = self.templates.get("default")
        # the template a request with tools renders with (its tool-call format is read
        # from it)
        self.tool_template = self.templates.get("tool_use", self.chat_template)
        self.eos_token_ids = self._find_eos_ids(model_dir, config_eos_ids)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        # the extensions transformers' template environment has: {% break %} / {% continue %}
        # and {% generation %} (a template using them renders there, so it must here)
        self._env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True,
            extensions=[jinja2.ext.loopcontrols, _GenerationTag])
        self._env.globals["raise_exception"] = _raise_exception
        # as transformers provides it: templates (Llama 3.x) date their system turn with it
        self._env.globals["strftime_now"] = _strftime_now
        self._env.filters["tojson"] = _tojson
        compiled = {}
        for name, text in self.templates.items():
            try:
                compiled[name] = self._env.from_string(text) if text else None
            except jinja2.TemplateError as e:
                what = "the chat template" if chat_template is not None else \
                    "the checkpoint's chat template"
                which = f" (the one named {name!r})" if len(self.templates) > 1 else ""
                raise ModelLoadError(f"{what} does not compile{which}: "
                                     f"{type(e).__name__}: {e}") from None
        self._template = compiled.get("default")
        self._tool_template = compiled.get("tool_use", self._template)
        self.digest = hashlib.sha256(path.read_bytes()).hexdigest()
        # every template the engine may render with (stored sessions must agree on all)
        self.template_digest = hashlib.sha256(
            (self.chat_template or "").encode() if set(self.templates) <= {"default"}
            else json.dumps(self.templates, sort_keys=True).encode()).hexdigest()

    @staticmethod
    def _find_templates(model_dir: Path, tcfg: dict) -> dict[str, str | None]:
        """The checkpoint's templates by name: chat_template.jinja (current layout), or
        tokenizer_config.json's chat_template, a string or a list of named ones
        (`[{"name": "default", ...}, {"name": "tool_use", ...}]`, as Hermes ships). A list
        without "default" takes its first as the default."""
        jinja = model_dir / "chat_template.jinja"
        if jinja.is_file():
            try:
                return {"default": jinja.read_text()}
            except UnicodeDecodeError as e:
                raise ModelLoadError(f"{jinja} is not UTF-8 text: {e}") from None
        tpl = tcfg.get("chat_template")
        if isinstance(tpl, list):  # [{"name": "default", "template": "..."}, ...]
            named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in named.items()):
                raise ModelLoadError(f"tokenizer_config.json: named chat templates must be "
                                     f"{{'name': str, 'template': str}}, got {tpl!r:.80}")
            if named and "default" not in named:
                named["default"] = next(iter(named.values()))
            return named or {"default": None}
        if tpl is not None and not isinstance(tpl, str):
            raise ModelLoadError(f"tokenizer_config.json: chat_template must be a string, "
                                 f"got {tpl!r:.80}")
        return {"default": tpl}

    def _find_eos_ids(self, model_dir: Path, config_eos_ids: list[int] | None) -> frozenset[int]:
        """transformers' order: generation_config.json's eos_token_id, else config.json's
        (both may be a list: Llama 3.1 stops on three), else the tokenizer's eos_token."""
        def listed(name: str) -> list:
            eos = _json_object(model_dir / name).get("eos_token_id")
            return eos if isinstance(eos, list) else [] if eos is None else [eos]

        ids = listed("generation_config.json") or list(config_eos_ids or ()) \
            or listed("config.json")
        if not ids and self.eos_token is not None:
            tid = self._tok.token_to_id(self.eos_token)
            ids += [tid] if tid is not None else []
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ModelLoadError(f"eos_token_id must be a token id or a list of them, "
                                 f"got {ids!r:.80}")
        return frozenset(ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; ConfigError if it is not valid Unicode (a lone surrogate)."""
        return self._tok.encode(check_unicode("the text to tokenize", text),
                                add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def incremental_text(self, skip_special_tokens: bool = True,
                         markers: dict[int, str] | None = None) -> IncrementalText:
        """The text of a growing list of ids, decoded as it grows (IncrementalText)."""
        return IncrementalText(self._tok, skip_special_tokens, markers)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None,
                    chat_template_kwargs: dict | None = None) -> str:
        """The conversation as the model's chat template writes it (sandboxed jinja2).
        `tools` is passed as the `tools` variable HF templates use (None: not defined);
        `chat_template_kwargs` (e.g. {"enable_thinking": False}) are further variables."""
        # a named "tool_use" template renders requests with tools (transformers' choice)
        template = self._tool_template if tools else self._template
        if template is None:
            raise ConfigError("this checkpoint has no chat template; use generate() instead, "
                              "or pass one: LLM(chat_template=...)")
        messages = check_messages(messages)
        extra = dict(chat_template_kwargs or {})
        reserved = {"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"}
        clash = sorted(reserved & extra.keys())
        if clash:
            raise ConfigError(f"chat_template_kwargs may not set {clash}: pass them as "
                              f"arguments")
        if tools is not None:
            extra["tools"] = tools
        try:
            return template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra)
        except TemplateError as e:
            raise ConfigError(f"the chat template rejected the conversation: {e}") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None,
                    chat_template_kwargs: dict | None = None) -> list[int]:
        # Templates write their own special tokens (bos included), as HF apply_chat_template.
        return self.encode(self.render_chat(messages, add_generation_prompt, tools,
                                            chat_template_kwargs),
                           add_special_tokens=False)
