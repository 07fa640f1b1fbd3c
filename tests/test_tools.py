"""Tool calling: the three families' formats (detected from the chat template, rendered,
parsed back), tools / tool_choice validation, OpenAI message shapes, and forced calls that
are valid whatever the weights (tiny random models, temperature 1)."""

from __future__ import annotations

import json

import pytest

from kvsession.errors import ConfigError
from kvsession.model.tokenizer import Tokenizer, check_messages
from kvsession.testing import CHAT_TEMPLATES
from kvsession.tools import (
    ToolCall,
    ToolChoice,
    ToolFormat,
    ToolSpec,
    detect_tool_format,
    parse_tool_calls,
)

FAMILIES = {"hermes": ToolFormat.HERMES, "llama3": ToolFormat.LLAMA3_JSON,
            "mistral": ToolFormat.MISTRAL}
READ = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the project",
    "parameters": {"type": "object", "properties": {
        "path": {"type": "string", "minLength": 1, "maxLength": 12},
        "encoding": {"enum": ["utf-8", "latin-1"]},
        "lines": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
                  "maxItems": 3}},
        "required": ["path"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers",
    "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": -100, "maximum": 100},
        "b": {"type": "number", "minimum": 0, "maximum": 1},
        "note": {"type": "string", "maxLength": 6}},
        "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [READ, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def tokenizers(model_dirs):
    return {fam: Tokenizer(model_dirs("llama", chat_template=fam)) for fam in FAMILIES}


def assistant_call(*calls, content=None):
    return {"role": "assistant", "content": content, "tool_calls": [
        {"id": f"call{i:05d}", "type": "function",
         "function": {"name": name, "arguments": args}}
        for i, (name, args) in enumerate(calls)]}


def rendered_reply(tok: Tokenizer, message: dict) -> str:
    """What the template writes for `message` after the generation prompt, end of turn cut."""
    history = [{"role": "system", "content": "You are an agent."},
               {"role": "user", "content": "Read main.py"}]
    before = tok.render_chat(history, True, tools=TOOLS)
    after = tok.render_chat([*history, message], False, tools=TOOLS)
    assert after.startswith(before)
    return after[len(before):].rstrip("\n").removesuffix("<|im_end|>")


# ---- formats ---------------------------------------------------------------------------------

def test_format_is_detected_from_the_template(tokenizers, model_dirs):
    for fam, fmt in FAMILIES.items():
        assert detect_tool_format(tokenizers[fam].chat_template) is fmt
    assert detect_tool_format(CHAT_TEMPLATES["chatml"]) is None
    # a Llama 3.0-style template: header markers but no `tools` -> no tool format
    assert detect_tool_format("{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
                              "<|end_header_id|>{% endfor %}") is None
    assert detect_tool_format(None) is None
    chatml = Tokenizer(model_dirs("llama"))
    with pytest.raises(ConfigError, match="never renders `tools`"):
        ToolSpec.from_args(TOOLS, "auto", chatml)
    assert ToolSpec.from_args(None, "auto", chatml) is None  # no tools: nothing to check


@pytest.mark.parametrize("fam", FAMILIES)
def test_rendered_call_parses_back(tokenizers, fam):
    tok = tokenizers[fam]
    spec = ToolSpec.from_args(TOOLS, "auto", tok)
    assert spec.format is FAMILIES[fam] and spec.choice is ToolChoice.AUTO
    calls = [("read_file", {"path": "src/<a>.py", "lines": [1, 20]}),
             ("add", {"a": -3, "b": 0.5, "note": "é\"x"})]
    # Llama 3 writes one call per message; JSON-text arguments (OpenAI) render as dicts
    calls = calls[:1] if fam == "llama3" else calls
    message = assistant_call(*[(n, json.dumps(a)) for n, a in calls])
    content, parsed = spec.parse(rendered_reply(tok, message))
    assert content == ""
    assert [(c.name, c.arguments) for c in parsed] == calls
    assert all(c.id.startswith("call") for c in parsed) if fam != "mistral" else \
        [c.id for c in parsed] == ["call00000", "call00001"][:len(calls)]  # ids kept


@pytest.mark.parametrize("fmt, text, content, calls", [
    (ToolFormat.HERMES, 'Let me look.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n'
     '</tool_call>', "Let me look.", [("add", {"a": 1})]),
    (ToolFormat.HERMES, '<tool_call>{"name": "add", "arguments": "{\\"a\\": 2}"}',  # unclosed
     "", [("add", {"a": 2})]),
    (ToolFormat.HERMES, "no call here", "no call here", []),
    (ToolFormat.LLAMA3_JSON, '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; '
     '{"name": "read_file", "arguments": {"path": "x"}}', "",
     [("add", {"a": 1}), ("read_file", {"path": "x"})]),
    (ToolFormat.LLAMA3_JSON, ' {"name": "add"}', "", [("add", {})]),
    (ToolFormat.MISTRAL, '[{"name": "add", "arguments": {"a": 1}}]', "",  # marker not decoded
     [("add", {"a": 1})]),
    (ToolFormat.MISTRAL, 'ok [TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]read_file[ARGS]{}',
     "ok", [("add", {"a": 1}), ("read_file", {})]),
    # the markup inside a string argument (a file about tool calls) is the argument's
    (ToolFormat.HERMES, '<tool_call>{"name": "read_file", "arguments": {"path": '
     '"</tool_call>"}}</tool_call>\n<tool_call>{"name": "add", "arguments": {}}</tool_call>',
     "", [("read_file", {"path": "</tool_call>"}), ("add", {})]),
    (ToolFormat.MISTRAL, '[TOOL_CALLS]read_file[ARGS]{"path": "[TOOL_CALLS]x"}'
     '[TOOL_CALLS][{"name": "add", "arguments": {"a": "[TOOL_CALLS]"}}]', "",
     [("read_file", {"path": "[TOOL_CALLS]x"}), ("add", {"a": "[TOOL_CALLS]"})]),
    # an escaped lone surrogate is no character (no UTF-8 response could carry it): U+FFFD;
    # a pair is one character
    (ToolFormat.HERMES, '<tool_call>{"name": "add", "arguments": {"a": "\\ud800x", '
     '"\\udc00": ["\\ud83d\\ude00"]}}</tool_call>', "",
     [("add", {"a": "\ufffdx", "\ufffd": ["\U0001f600"]})]),
])
def test_parse_forms(fmt, text, content, calls):
    got_content, got = parse_tool_calls(text, fmt, {"add", "read_file"})
    assert got_content == content and [(c.name, c.arguments) for c in got] == calls
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in got if fmt !=
               ToolFormat.MISTRAL)
    assert all(len(c.id) == 9 and c.id.isalnum() for c in got if fmt == ToolFormat.MISTRAL)


@pytest.mark.parametrize("fmt, text", [
    (ToolFormat.HERMES, '<tool_call>\n{"name": "add", "arguments": {"a": 1}\n</tool_call>'),
    (ToolFormat.HERMES, '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'),
    (ToolFormat.HERMES, '<tool_call>\n{"name": "add", "arguments": [1]}\n</tool_call>'),
    (ToolFormat.HERMES, '<tool_call>\n{"name": "add"} {"name": "add"}\n</tool_call>'),
    (ToolFormat.LLAMA3_JSON, '{"name": "add", "parameters": {"a": 1}} and more text'),
    (ToolFormat.LLAMA3_JSON, '{"answer": 42}'),
    (ToolFormat.MISTRAL, '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}'),
    (ToolFormat.MISTRAL, "[TOOL_CALLS][]"),
    (ToolFormat.HERMES, '<tool_call>{"name": "add", "arguments": {}} trailing</tool_call>'),
    (ToolFormat.MISTRAL, '[TOOL_CALLS]add[ARGS]{"a": 1} then text'),
    # NaN / Infinity are not JSON (the call could not be sent back in a message)
    (ToolFormat.HERMES, '<tool_call>{"name": "add", "arguments": {"a": NaN}}</tool_call>'),
    (ToolFormat.LLAMA3_JSON, '{"name": "add", "parameters": {"a": -Infinity}}'),
])
def test_malformed_markup_stays_content(fmt, text):
    assert parse_tool_calls(text, fmt, {"add", "read_file"}) == (text, [])


def test_tool_call_to_dict_is_the_openai_shape_and_renders(tokenizers):
    call = ToolCall("call_1", "add", {"a": 1, "b": 0.25})
    d = call.to_dict()
    assert d == {"id": "call_1", "type": "function",
                 "function": {"name": "add", "arguments": '{"a": 1, "b": 0.25}'}}
    msg = {"role": "assistant", "content": None, "tool_calls": [d]}
    (checked,) = check_messages([msg])
    assert checked["content"] == "" and checked["tool_calls"][0]["function"]["arguments"] == \
        {"a": 1, "b": 0.25}
    assert d["function"]["arguments"] == '{"a": 1, "b": 0.25}'  # the caller's dict untouched


# ---- validation ------------------------------------------------------------------------------

@pytest.mark.parametrize("tools, choice, match", [
    ("read_file", "auto", "tools must be None or a list"),
    ([{"type": "function"}], "auto", r"tools\[0\] must be"),
    ([READ, {"type": "code_interpreter"}], "auto", r"tools\[1\] must be"),
    ([{"type": "function", "function": {"name": "a b"}}], "auto",
     r"tools\[0\]\.function\.name"),
    ([READ, READ], "auto", r"tools\[1\]\.function\.name 'read_file' is used"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], "auto",
     r"tools\[0\]\.function\.parameters must be a JSON schema"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
     "auto", "must describe an object"),
    ([{"type": "function", "function": {"name": "f", "paramters": {}}}], "auto",
     r"unknown fields \['function.paramters'\]"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"x": (1, 2)}}}], "auto",
     r"tools\[0\] must hold JSON values"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], "auto",
     "description must be a string"),
    (TOOLS, "always", "tool_choice must be 'auto', 'none', 'required'"),
    (TOOLS, "named", "tool_choice must be"),
    (TOOLS, {"type": "function", "function": {"name": "write_file"}},
     "names the function 'write_file', which is not among the tools"),
    (TOOLS, {"type": "function", "name": "add"}, "tool_choice must be"),
    (None, "required", "tool_choice='required' needs tools"),
    (None, {"type": "function", "function": {"name": "add"}}, "not among the tools"),
])
def test_bad_tools_and_tool_choice(tokenizers, tools, choice, match):
    with pytest.raises(ConfigError, match=match):
        ToolSpec.from_args(tools, choice, tokenizers["hermes"])


def test_uncompilable_schema_names_the_tool(tokenizers):
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "(unclosed"}}}}}
    # refused where the tools enter, whatever the tool_choice (with "auto" the schema is
    # never compiled, and a bad pattern went unnoticed)
    for choice in ("required", "auto"):
        with pytest.raises(ConfigError, match=r"tools\[1\]\.function\.parameters has an "
                                              r"invalid regular expression"):
            ToolSpec.from_args([ADD, bad], choice, tokenizers["hermes"])


@pytest.mark.parametrize("messages, match", [
    ([{"role": "assistant", "content": None, "tool_calls": []}], "non-empty list"),
    ([{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}],
     "only an 'assistant' message makes tool calls"),
    ([assistant_call(("add", "{not json"))], r"\['arguments'\] must be a JSON object"),
    ([assistant_call(("add", "[1, 2]"))], r"\['arguments'\] must be a JSON object"),
    ([{"role": "assistant", "content": None,
       "tool_calls": [{"type": "function", "function": {"arguments": {}}}]}],
     r"\['name'\] must be a non-empty string"),
    ([{"role": "tool", "tool_call_id": 7, "content": "x"}], "tool_call_id'] must be a string"),
    ([{"role": "assistant", "content": None}], r"messages\[0\]\['content'\] must be"),
])
def test_bad_openai_message_shapes(messages, match):
    with pytest.raises(ConfigError, match=match):
        check_messages(messages)


def test_session_messages_stay_text_only():
    # sessions snapshot text fields only (for now): tool_calls there is refused, not dropped
    with pytest.raises(ConfigError, match="must be a string"):
        check_messages([assistant_call(("add", {}))], text_only=True)


# ---- generation ------------------------------------------------------------------------------

CONVERSATION = [{"role": "system", "content": "You are an agent."},
                {"role": "user", "content": "Read main.py"}]


@pytest.fixture(scope="module")
def llms(model_dirs):
    """family -> an LLM on a tiny random model with that family's template (built lazily)."""
    from kvsession import LLM

    built = {}

    def get(fam):
        if fam not in built:
            built[fam] = LLM(model_dirs("llama", chat_template=fam), kv_cache_memory="32MiB",
                             max_model_len=1024)
        return built[fam]

    yield get
    for llm in built.values():
        llm.close()


@pytest.mark.parametrize("fam", FAMILIES)
def test_forced_calls_are_valid_whatever_the_weights(llms, fam):
    jsonschema = pytest.importorskip("jsonschema")
    from kvsession import SamplingParams

    llm = llms(fam)
    params = SamplingParams(n=30, seed=0, temperature=1.0, max_tokens=160)
    for choice, names in (("required", {"read_file", "add"}),
                          ({"type": "function", "function": {"name": "read_file"}},
                           {"read_file"})):
        (out,) = llm.chat(CONVERSATION, params, tools=TOOLS, tool_choice=choice,
                          use_tqdm=False)
        assert len(out.outputs) == 30
        seen = set()
        for c in out.outputs:
            assert c.finish_reason == "stop" and c.text == ""
            (call,) = c.tool_calls  # exactly one call: the grammar allows one
            jsonschema.validate(call.arguments, SCHEMAS[call.name])
            seen.add(call.name)
        assert seen == names  # "required" picked both tools across the seeded samples
        assert out.tool_calls == out.outputs[0].tool_calls


def test_auto_parses_calls_and_none_leaves_them(llms):
    from kvsession import SamplingParams, StructuredOutput

    llm = llms("hermes")
    reply = ('Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 0.5}}\n'
             '</tool_call>')
    # the reply is forced with a grammar, so tool_choice alone decides what is parsed
    forced = SamplingParams(max_tokens=80, temperature=0.0,
                            structured=StructuredOutput(grammar=f"root ::= {json.dumps(reply)}"))
    (auto,) = llm.chat(CONVERSATION, forced, tools=TOOLS, use_tqdm=False)
    assert auto.text == "Let me check."
    assert [(c.name, c.arguments) for c in auto.tool_calls] == [("add", {"a": 2, "b": 0.5})]
    assert auto.tool_calls[0].id.startswith("call_")
    (none,) = llm.chat(CONVERSATION, forced, tools=TOOLS, tool_choice="none", use_tqdm=False)
    assert none.text == reply and none.tool_calls == []
    assert none.prompt == auto.prompt  # "none" renders the tools too: same prompt, same KV
    # random weights under "auto" write no call: the text is the output, as with "none"
    sampled = SamplingParams(max_tokens=40, temperature=1.0, seed=3)
    (a,) = llm.chat(CONVERSATION, sampled, tools=TOOLS, use_tqdm=False)
    (n,) = llm.chat(CONVERSATION, sampled, tools=TOOLS, tool_choice="none", use_tqdm=False)
    assert a.tool_calls == [] and a.text == n.text and a.token_ids == n.token_ids
    # without tools nothing is parsed and the template renders no tools
    (plain,) = llm.chat(CONVERSATION, forced, use_tqdm=False)
    assert plain.text == reply and plain.tool_calls == [] and "<tools>" not in plain.prompt


def test_parallel_tool_calls_false_keeps_the_first_call(llms):
    """OpenAI's parallel_tool_calls=False: a reply has at most one call, the first (the
    weights may write more: they are not cut short, the reply keeps one), in chat, achat,
    stream and astream alike; the default keeps them all."""
    import asyncio

    from kvsession import SamplingParams, StructuredOutput

    llm = llms("hermes")
    reply = ('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 0.5}}\n</tool_call>\n'
             '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>')
    forced = SamplingParams(max_tokens=400, temperature=0.0,
                            structured=StructuredOutput(grammar=f"root ::= {json.dumps(reply)}"))

    def calls(out):
        return [(c.name, c.arguments) for c in out.tool_calls]

    both = [("add", {"a": 2, "b": 0.5}), ("read_file", {"path": "a.py"})]
    (out,) = llm.chat(CONVERSATION, forced, tools=TOOLS, use_tqdm=False)
    assert calls(out) == both
    (one,) = llm.chat(CONVERSATION, forced, tools=TOOLS, parallel_tool_calls=False,
                      use_tqdm=False)
    assert calls(one) == both[:1] and one.token_ids == out.token_ids
    stream = llm.stream(messages=CONVERSATION, sampling_params=forced, tools=TOOLS,
                        parallel_tool_calls=False)
    assert "".join(c.text for c in stream) == reply  # the deltas are the raw text
    assert calls(stream.output) == both[:1]

    async def run_async():
        (a,) = await llm.achat(CONVERSATION, forced, tools=TOOLS, parallel_tool_calls=False)
        s = llm.astream(messages=CONVERSATION, sampling_params=forced, tools=TOOLS,
                        parallel_tool_calls=False)
        async for _ in s:
            pass
        return a, s.output

    for o in asyncio.run(run_async()):
        assert calls(o) == both[:1]
    with pytest.raises(ConfigError, match="parallel_tool_calls"):
        llm.chat(CONVERSATION, forced, tools=TOOLS, parallel_tool_calls="no")
    with pytest.raises(ConfigError, match="parallel_tool_calls needs a conversation"):
        llm.stream("a prompt", forced, parallel_tool_calls=False)


def test_forced_call_conflicts_and_bad_template_kwargs(llms):
    from kvsession import SamplingParams, StructuredOutput

    llm = llms("hermes")
    fmt = SamplingParams(structured=StructuredOutput(json_object=True))
    with pytest.raises(ConfigError, match="structured must be None with tool_choice='required'"):
        llm.chat(CONVERSATION, fmt, tools=TOOLS, tool_choice="required")
    llm.chat(CONVERSATION, SamplingParams(max_tokens=2, structured=fmt.structured),
             tools=TOOLS, use_tqdm=False)  # "auto" leaves the format to the caller
    with pytest.raises(ConfigError, match="chat_template_kwargs"):
        llm.chat(CONVERSATION, chat_template_kwargs=["enable_thinking"])
    with pytest.raises(ConfigError, match="may not set"):
        llm.chat(CONVERSATION, chat_template_kwargs={"tools": TOOLS})
    with pytest.raises(ConfigError, match="tools needs a conversation"):
        llm.stream("hi", tools=TOOLS)
    with pytest.raises(ConfigError, match="tool_choice needs a conversation"):
        llm.stream("hi", tool_choice="required")
    with pytest.raises(ConfigError, match="did you mean 'tool_choice'"):
        llm.chat(CONVERSATION, tool_choise="auto")
    (out,) = llm.chat(CONVERSATION, SamplingParams(max_tokens=2),
                      chat_template_kwargs={"enable_thinking": False}, use_tqdm=False)
    assert len(out.token_ids) == 2


@pytest.mark.parametrize("fam", FAMILIES)
def test_openai_message_shapes_render(llms, fam):
    from kvsession import SamplingParams

    llm = llms(fam)
    conversation = [*CONVERSATION, assistant_call(("read_file", '{"path": "main.py"}')),
                    {"role": "tool", "tool_call_id": "call00000", "content": "print(1)"}]
    (out,) = llm.chat(conversation, SamplingParams(max_tokens=160, temperature=0.0),
                      tools=TOOLS, tool_choice="required", use_tqdm=False)
    assert '"arguments": {"path": "main.py"}' in out.prompt or \
        '"parameters": {"path": "main.py"}' in out.prompt
    assert "print(1)" in out.prompt and len(out.tool_calls) == 1


def test_streaming_with_tools_ends_with_the_same_output(llms):
    import asyncio

    from kvsession import SamplingParams

    llm = llms("mistral")
    params = SamplingParams(max_tokens=160, temperature=1.0, seed=11)
    kwargs = {"tools": TOOLS, "tool_choice": "required"}
    (ref,) = llm.chat(CONVERSATION, params, use_tqdm=False, **kwargs)
    stream = llm.stream(messages=CONVERSATION, sampling_params=params, **kwargs)
    raw = "".join(c.text for c in stream)
    assert raw.startswith("[TOOL_CALLS][") and raw == llm.tokenizer.decode(ref.token_ids)
    out = stream.output
    assert out.text == ref.text == "" and out.token_ids == ref.token_ids
    assert [(c.name, c.arguments) for c in out.tool_calls] == \
        [(c.name, c.arguments) for c in ref.tool_calls]

    async def both():
        s = llm.astream(messages=CONVERSATION, sampling_params=params, **kwargs)
        deltas = [c.text async for c in s]
        (a,) = await llm.achat(CONVERSATION, params, **kwargs)
        return "".join(deltas), s.output, a

    araw, aout, achat = asyncio.run(both())
    assert araw == raw
    for o in (aout, achat):
        assert o.token_ids == ref.token_ids and o.text == ""
        assert [(c.name, c.arguments) for c in o.tool_calls] == \
            [(c.name, c.arguments) for c in ref.tool_calls]


def test_mistral_control_token_marker_is_left_out_of_forced_calls(model_dirs, tmp_path):
    """A real Mistral tokenizer has [TOOL_CALLS] as a special token (dropped by decoding,
    never matched by the grammar as text): the forced call is then the bare JSON list,
    which the parser takes."""
    import shutil

    from tokenizers import Tokenizer as HFTokenizer

    src = model_dirs("llama", chat_template="mistral")
    plain = ToolSpec.from_args(TOOLS, "required", Tokenizer(src))
    assert not plain.bare and plain.grammar().count('"[TOOL_CALLS][{') == 2
    shutil.copytree(src, tmp_path / "m")
    hf = HFTokenizer.from_file(str(tmp_path / "m" / "tokenizer.json"))
    hf.add_special_tokens(["[TOOL_CALLS]"])
    hf.save(str(tmp_path / "m" / "tokenizer.json"))
    tok = Tokenizer(tmp_path / "m")
    spec = ToolSpec.from_args(TOOLS, "required", tok)
    assert spec.bare and "TOOL_CALLS" not in spec.grammar()
    assert spec.grammar().count('"[{\\"name\\": ') == 2
    text = tok.decode(tok.encode('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}]'))
    assert text.startswith("[{")  # the marker is gone after decoding ...
    assert [(c.name, c.arguments) for c in spec.parse(text)[1]] == [("add", {"a": 1})]


def test_mistral_special_markers_are_read_from_the_token_ids(model_dirs, tmp_path):
    """Decoding drops special markers: content before a call, or the name[ARGS]{...} form,
    left calls as content. The parser reads the token ids with the markers put back."""
    import shutil

    from tokenizers import Tokenizer as HFTokenizer

    shutil.copytree(model_dirs("llama", chat_template="mistral"), tmp_path / "m")
    hf = HFTokenizer.from_file(str(tmp_path / "m" / "tokenizer.json"))
    hf.add_special_tokens(["[TOOL_CALLS]", "[ARGS]"])
    hf.save(str(tmp_path / "m" / "tokenizer.json"))
    tok = Tokenizer(tmp_path / "m")
    spec = ToolSpec.from_args(TOOLS, "auto", tok)
    for written, content in (('Sure.[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}]',
                              "Sure."),
                             ('[TOOL_CALLS]add[ARGS]{"a": 1}', "")):
        ids = tok.encode(written, add_special_tokens=False)
        got_content, calls = spec.parse_output(ids, tok.decode(ids))
        assert (got_content, [(c.name, c.arguments) for c in calls]) == (
            content, [("add", {"a": 1})]), written
    ids = tok.encode("no call [here]", add_special_tokens=False)
    assert spec.parse_output(ids, tok.decode(ids)) == (tok.decode(ids), [])


def test_stop_strings_and_ids_do_not_cut_a_forced_call(llms):
    """The grammar ends a forced call: a stop string or id inside it (a Hermes call holds
    '\\n' and '{') would leave text that is no call, ended as "stop"."""
    from kvsession import SamplingParams

    llm = llms("hermes")
    brace = llm.tokenizer.encode("{")[-1]
    params = SamplingParams(n=6, seed=0, temperature=1.0, max_tokens=160,
                            stop=["\n", '"'], stop_token_ids=[brace])
    (out,) = llm.chat(CONVERSATION, params, tools=TOOLS, tool_choice="required",
                      use_tqdm=False)
    for c in out.outputs:
        assert c.finish_reason == "stop" and len(c.tool_calls) == 1, c.text


def test_an_empty_tools_list_is_no_tools_in_a_session(llms):
    """llm.session(tools=[]) and turns sending tools=[] (what the server passes on for a
    request with "tools": []) agree: no tools, no refusal."""
    llm = llms("hermes")
    s = llm.session(tools=[])
    try:
        assert s.send("hi", tools=[], max_tokens=2).token_ids
    finally:
        s.close()


def test_call_ids_the_model_repeats_are_made_unique():
    text = ('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}, "id": "abcdefghi"}, '
            '{"name": "add", "arguments": {"a": 2}, "id": "abcdefghi"}]')
    _, calls = parse_tool_calls(text, ToolFormat.MISTRAL, {"add"})
    assert calls[0].id == "abcdefghi" and calls[1].id != "abcdefghi"
    assert len(calls[1].id) == 9 and calls[1].id.isalnum()
