"""Tool calls in sessions: forced calls valid whatever the weights, parsed into
`Reply.tool_calls`, kept in the session's messages and token log (append history), results
added with their call id, all surviving a snapshot and a resume."""

from __future__ import annotations

import functools

import jsonschema
import pytest
from llms import tiny_llm

from kvsession import ConfigError, SamplingParams
from oracle import expected_turn

G = SamplingParams(max_tokens=120, temperature=0.0)
LS = {"type": "function", "function": {
    "name": "list_files", "description": "List the files of a directory",
    "parameters": {"type": "object", "properties": {
        "path": {"type": "string", "minLength": 1, "maxLength": 8}},
        "required": ["path"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [LS, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


new_llm = functools.partial(tiny_llm, kv_cache_memory="16MiB", max_model_len=2048)


@pytest.mark.parametrize("family", ["hermes", "llama3", "mistral"])
def test_session_tool_loop_in_append_history(model_dirs, family):
    with new_llm(model_dirs("llama", chat_template=family)) as llm:
        s = llm.session(system="You are an agent.", sampling=G, tools=TOOLS)
        before = s.token_ids
        r = s.send("What is in src?", tool_choice="required")
        assert len(r.tool_calls) >= 1
        for call in r.tool_calls:
            jsonschema.validate(call.arguments, SCHEMAS[call.name])
        forced = G.with_overrides(structured=None)  # the oracle: the log, generated again
        assert s.messages[-1]["tool_calls"] == [c.to_dict() for c in r.tool_calls]
        for call in r.tool_calls:
            s.add("tool", f"result of {call.name}", tool_call_id=call.id)
        before = s.token_ids
        r2 = s.send("And now?", tool_choice={"type": "function", "function": {"name": "add"}})
        assert [c.name for c in r2.tool_calls] == ["add"]
        jsonschema.validate(r2.tool_calls[0].arguments, SCHEMAS["add"])
        # the forced turn equals generating from the log with the same constraint
        spec_params = llm_params_for(llm, "add")
        assert r2.token_ids == expected_turn(llm, s, before, r2, spec_params)
        assert r2.prefill_tokens == len(s.token_ids) - len(r2.token_ids) - len(before) + 1
        before = s.token_ids
        r3 = s.send("Thanks", tool_choice="none")
        assert r3.tool_calls == [] and r3.token_ids == expected_turn(llm, s, before, r3,
                                                                      forced)


def llm_params_for(llm, name: str) -> SamplingParams:
    from kvsession.tools import ToolSpec

    spec = ToolSpec.from_args(TOOLS, {"type": "function", "function": {"name": name}},
                              llm.tokenizer)
    return spec.constrain(G)


def test_tool_calls_survive_snapshot_and_resume(model_dirs, tmp_path):
    d = model_dirs("llama", chat_template="hermes")
    sd = tmp_path / "sd"
    with new_llm(d, session_dir=sd) as llm:
        s = llm.session(session_id="agent", system="You are an agent.", sampling=G,
                        tools=TOOLS)
        r = s.send("List src", tool_choice="required")
        s.add("tool", '{"files": ["a.py"]}', tool_call_id=r.tool_calls[0].id)
        messages, log = s.messages, s.token_ids
        s.save(tmp_path / "agent.kvs")
    with new_llm(d, session_dir=sd) as llm:
        s = llm.session(session_id="agent")
        assert s.messages == messages and s.token_ids == log
        r2 = s.send("And then?", tool_choice="required")  # tools came back with it
        assert r2.tool_calls
        copy = llm.restore(tmp_path / "agent.kvs", session_id="copy")
        assert copy.messages == messages
        assert copy.send("And then?", tool_choice="required").token_ids == r2.token_ids


def test_tools_per_turn_need_template_history(model_dirs):
    with new_llm(model_dirs("llama", chat_template="hermes")) as llm:
        s = llm.session(sampling=G, tools=[LS])
        with pytest.raises(ConfigError, match="history='template'"):
            s.send("hi", tools=TOOLS)
        assert s.messages == []  # nothing changed
        t = llm.session(sampling=G, history="template")
        r = t.send("add these", tools=TOOLS, tool_choice="required")
        assert r.tool_calls and r.token_ids == llm.chat(
            t.messages[:-1], llm_params_for_required(llm), tools=TOOLS,
            use_tqdm=False)[0].token_ids
        with pytest.raises(ConfigError, match="tool_choice"):
            t.send("x", tools=TOOLS, tool_choice="sometimes")
        with pytest.raises(ConfigError):
            llm.session(tools=[{"type": "function", "function": {"name": "bad name!"}}])


def llm_params_for_required(llm) -> SamplingParams:
    from kvsession.tools import ToolSpec

    return ToolSpec.from_args(TOOLS, "required", llm.tokenizer).constrain(G)


def test_a_template_without_tools_refuses_them(llama_dir):
    with new_llm(llama_dir) as llm, pytest.raises(ConfigError, match="tools"):
        llm.session(tools=TOOLS)
