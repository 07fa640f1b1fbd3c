"""Tool calling: `tools` / `tool_choice` validation, the checkpoint's tool-call format (read
off its chat template), calls parsed out of generated text, and decoding constrained to a
valid call.

Contract (the API edge, `llm.chat` / `achat` / `stream`, and sessions use exactly this):

    spec = ToolSpec.from_args(tools, tool_choice, tokenizer)      # -> ToolSpec | None
        tools: None, [] or a list of OpenAI tools {"type": "function", "function": {"name",
        "description", "parameters": JSON schema of an object}}; tool_choice: "auto" (None
        means it) | "none" | "required" | {"type": "function", "function": {"name": ...}}.
        None when no tools are given ("required" or a named function then: ConfigError).
        ConfigError naming the index and field for a bad tool, an unknown choice or name, or
        a chat template that never renders `tools` or writes calls in no known format.
    spec.format            ToolFormat (HERMES | LLAMA3_JSON | MISTRAL)
    spec.choice            ToolChoice (AUTO | NONE | REQUIRED | NAMED); spec.forced_name
    spec.template_tools    list[dict]: the validated tools, the chat template's `tools`
                           variable (rendered for every choice, "none" included, so the
                           prompt and its cached KV are the same whatever the choice)
    spec.constrain(params) -> SamplingParams: for REQUIRED / NAMED a copy whose `structured`
                           grammar admits exactly one call (any tool / the named one) in the
                           family's format, arguments valid under that tool's schema (the
                           sampler masks every step, so this holds whatever the weights);
                           otherwise `params` itself. ConfigError if `params` already carry
                           a structured format and a call is forced.
    spec.parse(text)       -> (content, [ToolCall]): the calls in the family's format and
                           the text before the first one. Malformed markup or an unknown tool
                           name: (text, []). NONE: (text, []). parallel_tool_calls=False: the
                           first call only (generation is not cut short: the weights decide
                           how many calls they write; the reply keeps one).
    spec.apply(output)     -> the RequestOutput with each completion's `tool_calls` filled
                           and its `text` replaced by the content.

`ToolCall.to_dict()` is the OpenAI shape of a call for an assistant message's `tool_calls`;
`kvsession.model.tokenizer.check_messages` accepts it back (arguments as JSON text or dict).
The grammar is composed with xgrammar (a JSON-schema grammar between the family's literal
call prefix and suffix); xgrammar is imported only when a call is forced.
"""

from __future__ import annotations

import enum
import functools
import json
import re
import secrets
import string
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from kvsession.errors import ConfigError
from kvsession.json_schema import check_patterns
from kvsession.params import SamplingParams, StructuredOutput
from kvsession.validation import check_bool

if TYPE_CHECKING:
    from kvsession.model.tokenizer import IncrementalText

# OpenAI's function names (a-z, A-Z, 0-9, _ and -, at most 64) plus '.', which vLLM allows;
# names go verbatim into the call grammar's literals, so nothing that needs escaping
NAME_RE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_TOOL_KEYS = ("type", "function")
_FUNCTION_KEYS = ("name", "description", "parameters", "strict")
# Mistral's templates require 9 alphanumeric characters in a tool call id
_MISTRAL_ID_CHARS = string.ascii_letters + string.digits
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # (json.loads joins the valid pairs)


def _not_json(name: str):
    raise ValueError(f"{name} is not JSON")  # (a ValueError: read as malformed markup)


# NaN and Infinity are not JSON: a call holding them could not be sent back in a message
_DECODER = json.JSONDecoder(parse_constant=_not_json)
# the separators the templates' `tojson` writes: forced calls look like rendered ones
_SEPARATORS = (", ", ": ")


class ToolFormat(enum.Enum):
    """How a family writes a call. `prefix`/`suffix` wrap one call's JSON arguments as the
    forced grammar writes it (the parsers accept more: several calls, other spacing)."""

    HERMES = "hermes"            # Hermes, Qwen2.5, Qwen3: <tool_call>\n{json}\n</tool_call>
    LLAMA3_JSON = "llama3_json"  # Llama 3.x: {"name": ..., "parameters": {...}}
    MISTRAL = "mistral"          # Mistral: [TOOL_CALLS][{"name": ..., "arguments": {...}}]

    def affixes(self, name: str, bare: bool = False) -> tuple[str, str]:
        """`bare`: without the Mistral marker (a special token for this tokenizer)."""
        if self is ToolFormat.HERMES:
            return f'<tool_call>\n{{"name": "{name}", "arguments": ', "}\n</tool_call>"
        if self is ToolFormat.LLAMA3_JSON:
            return f'{{"name": "{name}", "parameters": ', "}"
        marker = "" if bare else "[TOOL_CALLS]"
        return f'{marker}[{{"name": "{name}", "arguments": ', "}]"


class ToolChoice(enum.Enum):
    AUTO = "auto"
    NONE = "none"
    REQUIRED = "required"
    NAMED = "named"  # {"type": "function", "function": {"name": ...}}


# markers a template writes for each family, checked in this order (a Qwen template may also
# mention JSON "parameters"; a Llama 3 one never writes <tool_call>)
_MARKERS = (
    (ToolFormat.HERMES, ("<tool_call>",)),
    (ToolFormat.MISTRAL, ("[TOOL_CALLS]", "[AVAILABLE_TOOLS]")),
    (ToolFormat.LLAMA3_JSON, ("<|python_tag|>", "ipython", "<|start_header_id|>")),
)
_USES_TOOLS = re.compile(r"\btools\b")


def detect_tool_format(chat_template: str | None) -> ToolFormat | None:
    """The tool-call format a chat template writes, or None when it never renders `tools`
    (or writes calls in no format known here)."""
    if not chat_template or not _USES_TOOLS.search(chat_template):
        return None
    for fmt, markers in _MARKERS:
        if any(m in chat_template for m in markers):
            return fmt
    return None


@dataclass
class ToolCall:
    """One call the model made: `arguments` is the parsed JSON object."""

    id: str
    name: str
    arguments: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """The OpenAI shape, for an assistant message's `tool_calls` list."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name,
                             "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


def new_call_id(fmt: ToolFormat | None = None) -> str:
    """A fresh call id: OpenAI-like `call_<hex>`, or Mistral's 9 alphanumerics."""
    if fmt is ToolFormat.MISTRAL:
        return "".join(secrets.choice(_MISTRAL_ID_CHARS) for _ in range(9))
    return f"call_{secrets.token_hex(12)}"


def json_copy(value, where: str):
    """A deep copy through JSON; anything that does not survive the round trip unchanged
    (tuples, non-str keys, NaN, objects) is a ConfigError naming `where`."""
    try:
        copy = json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where} must hold JSON values only: {e}") from None
    except RecursionError:
        raise ConfigError(f"{where} is nested too deeply") from None
    if copy != value:
        raise ConfigError(f"{where} must hold JSON values only (dicts with str keys, lists, "
                          f"str, numbers, bool, None), got {value!r:.80}")
    return copy


def check_tools(tools) -> list[dict]:
    """Validated copies of OpenAI tools; ConfigError naming the index and field."""
    if not isinstance(tools, (list, tuple)):
        raise ConfigError(f"tools must be None or a list of {{'type': 'function', 'function': "
                          f"{{'name', 'description', 'parameters'}}}} dicts, got {tools!r:.80}")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or \
                not isinstance(tool.get("function"), dict):
            raise ConfigError(f"{where} must be {{'type': 'function', 'function': {{...}}}}, "
                              f"got {tool!r:.80}")
        fn = tool["function"]
        unknown = sorted(set(tool) - set(_TOOL_KEYS)) + sorted(
            f"function.{k}" for k in set(fn) - set(_FUNCTION_KEYS))
        if unknown:
            raise ConfigError(f"{where} has unknown fields {unknown}; accepted: type, "
                              f"function.{{{', '.join(_FUNCTION_KEYS)}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
            raise ConfigError(f"{where}.function.name must be 1-64 characters of a-z, A-Z, "
                              f"0-9, '_', '-' or '.', got {name!r:.80}")
        if name in seen:
            raise ConfigError(f"{where}.function.name {name!r} is used by an earlier tool")
        seen.add(name)
        if not isinstance(fn.get("description", ""), str):
            raise ConfigError(f"{where}.function.description must be a string, "
                              f"got {fn['description']!r:.80}")
        if not isinstance(fn.get("strict", False), bool):
            raise ConfigError(f"{where}.function.strict must be a bool, got {fn['strict']!r}")
        params = fn.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise ConfigError(f"{where}.function.parameters must be a JSON schema (a "
                                  f"dict), got {params!r:.80}")
            if params.get("type", "object") != "object":
                raise ConfigError(f"{where}.function.parameters must describe an object (the "
                                  f"call's arguments), got type {params['type']!r}")
        copy = json_copy(tool, where)  # (JSON values only, depth bounded: then walked)
        if params is not None:
            try:
                check_patterns(copy["function"]["parameters"], f"{where}.function.parameters")
            except RecursionError:
                raise ConfigError(f"{where}.function.parameters is nested too deeply") from None
        out.append(copy)
    return out


def check_tool_choice(tool_choice, names: list[str]) -> tuple[ToolChoice, str | None]:
    """(choice, forced name); an unknown choice or tool name is a ConfigError."""
    if tool_choice is None:
        return ToolChoice.AUTO, None
    if isinstance(tool_choice, str):
        try:
            choice = ToolChoice(tool_choice)
        except ValueError:
            choice = None
        if choice is None or choice is ToolChoice.NAMED:
            raise ConfigError(f"tool_choice must be 'auto', 'none', 'required' or "
                              f"{{'type': 'function', 'function': {{'name': ...}}}}, "
                              f"got {tool_choice!r}")
        if choice is ToolChoice.REQUIRED and not names:
            raise ConfigError("tool_choice='required' needs tools")
        return choice, None
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or \
            not isinstance(name, str):
        raise ConfigError(f"tool_choice must be 'auto', 'none', 'required' or {{'type': "
                          f"'function', 'function': {{'name': ...}}}}, got {tool_choice!r:.80}")
    if name not in names:
        raise ConfigError(f"tool_choice names the function {name!r}, which is not among the "
                          f"tools: {names}")
    return ToolChoice.NAMED, name


# ---- parsing -------------------------------------------------------------------------------

class _Malformed(Exception):
    """Markup that is not a valid call: the whole text stays content."""


def _arguments(value) -> dict:
    if value is None:
        return {}
    if isinstance(value, str):  # some models (and OpenAI messages) write the JSON as text
        try:
            value = _DECODER.decode(value)
        except ValueError:  # (JSONDecodeError, or NaN / Infinity)
            raise _Malformed from None
    if not isinstance(value, dict):
        raise _Malformed
    return _no_lone_surrogates(value)


def _no_lone_surrogates(value):
    """A `\\udxxx` escape alone (not one of a pair) decodes to a code point that no UTF-8
    text can carry (the response would fail to encode): U+FFFD in its place."""
    if isinstance(value, str):
        return _LONE_SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {_no_lone_surrogates(k): _no_lone_surrogates(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_no_lone_surrogates(v) for v in value]
    return value


def _call(obj, fmt: ToolFormat, names) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise _Malformed
    if names is not None and obj["name"] not in names:
        raise _Malformed
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters")
    call_id = obj.get("id")
    if not isinstance(call_id, str) or not call_id:
        call_id = new_call_id(fmt)
    return ToolCall(call_id, obj["name"], _arguments(args))


def _json_values(body: str, separators: str = "") -> list:
    """The JSON values that make up all of `body`, separated by whitespace (and any of
    `separators`, e.g. ';' between Llama 3 calls)."""
    dec, pos, out = _DECODER, 0, []
    while True:
        while pos < len(body) and (body[pos].isspace() or (out and body[pos] in separators)):
            pos += 1
        if pos == len(body):
            return out
        try:
            value, pos = dec.raw_decode(body, pos)
        except ValueError:  # (JSONDecodeError, or NaN / Infinity)
            raise _Malformed from None
        out.append(value)


_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_MISTRAL_MARK = "[TOOL_CALLS]"
_MISTRAL_NAMED = re.compile(r"\s*([A-Za-z0-9_.\-]{1,64})\[ARGS\]")


def _json_at(text: str, pos: int) -> tuple[object, int]:
    """The JSON value at `pos` (after whitespace) and where it ends. Markup is looked for
    only after a call's JSON: a string argument may hold the markup itself ("</tool_call>",
    "[TOOL_CALLS]"), which splitting on it first would cut."""
    try:
        return _DECODER.raw_decode(text, _skip_space(text, pos))
    except ValueError:  # (JSONDecodeError, or NaN / Infinity)
        raise _Malformed from None


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _parse_hermes(text: str, names) -> tuple[str, list[ToolCall]]:
    start = text.find(_HERMES_OPEN)
    if start < 0:
        return text, []
    calls, pos = [], start
    while pos >= 0:
        value, pos = _json_at(text, pos + len(_HERMES_OPEN))
        pos = _skip_space(text, pos)
        if text.startswith(_HERMES_CLOSE, pos):
            pos += len(_HERMES_CLOSE)
        elif pos < len(text):  # only the last call may be cut short (max_tokens, a stop)
            raise _Malformed
        calls.append(_call(value, ToolFormat.HERMES, names))
        pos = text.find(_HERMES_OPEN, pos)
    return text[:start], calls


def _parse_llama3(text: str, names) -> tuple[str, list[ToolCall]]:
    # <|python_tag|> is a special token: decoded output usually lacks it, leaving bare JSON
    start = text.find("<|python_tag|>")
    if start >= 0:
        content, body = text[:start], text[start + len("<|python_tag|>"):]
    elif text.lstrip().startswith("{"):
        content, body = "", text
    else:
        return text, []
    values = _json_values(body, separators=";")
    if not values:
        raise _Malformed
    return content, [_call(v, ToolFormat.LLAMA3_JSON, names) for v in values]


def _parse_mistral(text: str, names) -> tuple[str, list[ToolCall]]:
    start = text.find(_MISTRAL_MARK)
    if start >= 0:
        content, body = text[:start], text[start + len(_MISTRAL_MARK):]
    elif text.lstrip().startswith("[{"):  # [TOOL_CALLS] is a special token, often not decoded
        content, body = "", text
    else:
        return text, []
    calls, pos = [], 0
    # v0.3: one JSON list of calls; v11+ templates: name[ARGS]{json} after each marker
    while True:
        m = _MISTRAL_NAMED.match(body, pos)
        if m:
            args, pos = _json_at(body, m.end())
            calls.append(_call({"name": m.group(1), "arguments": args}, ToolFormat.MISTRAL,
                               names))
        else:
            value, pos = _json_at(body, pos)
            if not isinstance(value, list) or not value:
                raise _Malformed
            calls += [_call(v, ToolFormat.MISTRAL, names) for v in value]
        pos = _skip_space(body, pos)
        if pos == len(body):
            return content, calls
        if not body.startswith(_MISTRAL_MARK, pos):
            raise _Malformed
        pos += len(_MISTRAL_MARK)


_PARSERS = {ToolFormat.HERMES: _parse_hermes, ToolFormat.LLAMA3_JSON: _parse_llama3,
            ToolFormat.MISTRAL: _parse_mistral}


def parse_tool_calls(text: str, fmt: ToolFormat,
                     names=None) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a generated text in `fmt`; content is the text before the first
    call (trailing whitespace dropped). Malformed markup, or a name not in `names` (when
    given): (text, []), as vLLM's tool parsers."""
    try:
        content, calls = _PARSERS[fmt](text, names)
    except _Malformed:
        return text, []
    seen: set[str] = set()
    for i, c in enumerate(calls):  # ids the model wrote are kept, but made unique
        if c.id in seen:
            calls[i] = ToolCall(new_call_id(fmt), c.name, c.arguments)
        seen.add(calls[i].id)
    return (content.rstrip(), calls) if calls else (text, [])


# ---- constraint ----------------------------------------------------------------------------

def marker_is_special(tokenizer, marker: str) -> bool:
    """Whether `marker` is one special token of this tokenizer (decoding drops it)."""
    ids = tokenizer.encode(marker, add_special_tokens=False)
    return len(ids) == 1 and tokenizer.decode(ids) == ""


@functools.lru_cache(maxsize=64)
def call_grammar(fmt: ToolFormat, tools: tuple[tuple[int, str, str], ...],
                 bare: bool = False) -> str:
    """EBNF text of exactly one call of one of `tools` ((index in the request's tools, name,
    parameters schema as JSON text) each) in `fmt` (`bare`: see ToolFormat.affixes): the
    family's literal prefix, the
    arguments as xgrammar's grammar of the schema (written with the templates' separators,
    no free whitespace, so a random model cannot pad the call until max_tokens), the literal
    suffix. Cached: a session's turns reuse the same tools."""
    from kvsession.structured import checked_schema, xgrammar_module

    xgr = xgrammar_module()
    alternatives = []
    for index, name, schema_json in tools:
        schema = checked_schema(json.loads(schema_json),
                                f"tools[{index}].function.parameters")
        try:
            args = xgr.Grammar.from_json_schema(
                json.dumps(schema, ensure_ascii=False), any_whitespace=False,
                separators=_SEPARATORS)
        except (RuntimeError, ValueError, TypeError) as e:
            msg = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConfigError(f"tools[{index}].function.parameters is not a JSON schema "
                              f"xgrammar can compile: {msg}") from None
        prefix, suffix = fmt.affixes(name, bare)
        alternatives.append(xgr.Grammar.concat(
            xgr.Grammar.from_ebnf(f"root ::= {json.dumps(prefix)}"), args,
            xgr.Grammar.from_ebnf(f"root ::= {json.dumps(suffix)}")))
    grammar = alternatives[0] if len(alternatives) == 1 else xgr.Grammar.union(*alternatives)
    return str(grammar)


@dataclass(frozen=True)
class ToolSpec:
    """One request's tools, choice and the checkpoint's call format (see the module doc)."""

    template_tools: list[dict]
    format: ToolFormat
    choice: ToolChoice
    forced_name: str | None = None
    # Mistral's [TOOL_CALLS] is a control token in real checkpoints: xgrammar matches text,
    # not special tokens, so a forced call is the bare JSON list (which the parser takes, as
    # decoding drops the marker anyway); the tiny test tokenizer has it as plain text
    bare: bool = False
    # parallel_tool_calls=False: at most one call per reply (the first; as OpenAI's API)
    parallel: bool = True
    # (token id, text) of Mistral's markers that are special tokens of this tokenizer, and
    # the tokenizer: decoding drops them, so the parser reads the token ids with them put
    # back (content before a call, the name[ARGS]{...} form)
    markers: tuple[tuple[int, str], ...] = ()
    tokenizer: object = field(default=None, compare=False, repr=False)

    @classmethod
    def from_args(cls, tools, tool_choice, tokenizer,
                  parallel_tool_calls: bool = True) -> ToolSpec | None:
        check_bool("parallel_tool_calls", parallel_tool_calls)
        tools = None if tools is None else check_tools(tools)
        names = [t["function"]["name"] for t in tools or ()]
        choice, name = check_tool_choice(tool_choice, names)
        if not tools:
            return None
        fmt = detect_tool_format(tokenizer.tool_template)
        if fmt is None:
            raise ConfigError("tools were given but this checkpoint's chat template never "
                              "renders `tools` in a known tool-call format (Hermes/Qwen "
                              "<tool_call>, Llama 3 JSON, Mistral [TOOL_CALLS])")
        markers = tuple((tokenizer.encode(m, add_special_tokens=False)[0], m)
                        for m in ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")
                        if fmt is ToolFormat.MISTRAL and marker_is_special(tokenizer, m))
        bare = any(m == "[TOOL_CALLS]" for _, m in markers)
        return cls(tools, fmt, choice, name, bare, parallel_tool_calls, markers, tokenizer)

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.template_tools]

    @property
    def forced(self) -> bool:
        return self.choice in (ToolChoice.REQUIRED, ToolChoice.NAMED)

    def grammar(self) -> str:
        """The forced call's EBNF (REQUIRED: any tool; NAMED: that one)."""
        picked = tuple(
            (i, t["function"]["name"],
             # declared key order kept: xgrammar writes properties in schema order
             json.dumps(t["function"].get("parameters") or {"type": "object",
                                                            "properties": {}}))
            for i, t in enumerate(self.template_tools)
            if self.choice is ToolChoice.REQUIRED or t["function"]["name"] == self.forced_name)
        return call_grammar(self.format, picked, self.bare)

    def constrain(self, params: SamplingParams) -> SamplingParams:
        if not self.forced:
            return params
        if params.structured is not None:
            raise ConfigError(f"sampling_params.structured must be None with tool_choice="
                              f"{self.forced_name or self.choice.value!r} (no response_format "
                              f"either): the forced tool call is the output's format")
        # the grammar ends the output: a stop string or id inside the call (a '\n' in a
        # Hermes call, a '{') would cut it into text that is no call
        return params.with_overrides(structured=StructuredOutput(grammar=self.grammar()),
                                     stop=None, stop_token_ids=None)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.choice is ToolChoice.NONE:
            return text, []
        content, calls = parse_tool_calls(text, self.format, set(self.names))
        return content, calls if self.parallel else calls[:1]

    def parse_output(self, token_ids, text: str) -> tuple[str, list[ToolCall]]:
        """`parse` of a completion: its `text`, or where markers are special tokens, its
        token ids decoded with them (the text as generated when no call is found)."""
        if not self.markers:
            return self.parse(text)
        content, calls = self.parse(self.decode_marked(token_ids))
        return (content, calls) if calls else (text, [])

    def marked_text(self) -> IncrementalText:
        """decode_marked's text of a growing list of ids, decoded as it grows."""
        return self.tokenizer.incremental_text(markers=dict(self.markers))

    def decode_marked(self, token_ids) -> str:
        """`token_ids` decoded with the markers that are special tokens put back (decoding
        drops them; the parsers read them)."""
        marks, parts, run = dict(self.markers), [], []
        for t in token_ids:
            if t in marks:
                parts += [self.tokenizer.decode(run), marks[t]]
                run = []
            else:
                run.append(t)
        return "".join(parts) + self.tokenizer.decode(run)

    def apply(self, output):
        """`output` (a RequestOutput) with every completion's calls parsed out."""
        outs = []
        for c in output.outputs:
            content, calls = self.parse_output(c.token_ids, c.text)
            outs.append(replace(c, text=content, tool_calls=calls))
        return replace(output, outputs=outs)
