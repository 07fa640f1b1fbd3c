"""Chat templates of real checkpoints: named templates (`default` + `tool_use`, as Hermes
ships) chosen as transformers chooses them, a template passed to `LLM(chat_template=...)`
(text or a file) or `--chat-template`, and a clear error for a checkpoint that ships only
a SentencePiece `tokenizer.model`."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest

from kvsession import LLM, ConfigError, ModelLoadError, SamplingParams
from kvsession.flags import add_llm_flags, llm_kwargs
from kvsession.model.tokenizer import Tokenizer
from kvsession.testing import CHATML_TEMPLATE, HERMES_TEMPLATE

MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "list files"}]
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}}]
KW = {"kv_cache_memory": "8MiB", "max_model_len": 512}


@pytest.fixture(scope="module")
def named_dir(model_dirs, tmp_path_factory):
    """A classic-layout checkpoint whose tokenizer_config.json names two templates."""
    d = tmp_path_factory.mktemp("named") / "m"
    shutil.copytree(model_dirs("qwen2", layout="classic"), d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "default", "template": CHATML_TEMPLATE},
                            {"name": "tool_use", "template": HERMES_TEMPLATE}]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def test_named_templates_are_chosen_as_transformers_does(named_dir, model_dirs):
    """tool_use renders a request with tools, default one without; the tool-call format
    is the tool_use template's; the stored identity covers both templates."""
    tok = Tokenizer(named_dir)
    chatml = Tokenizer(model_dirs("qwen2", layout="classic"))
    hermes = Tokenizer(named_dir, chat_template=HERMES_TEMPLATE)
    assert tok.render_chat(MSGS) == chatml.render_chat(MSGS)
    assert tok.render_chat(MSGS, tools=TOOLS) == hermes.render_chat(MSGS, tools=TOOLS)
    assert tok.render_chat(MSGS, tools=TOOLS) != chatml.render_chat(MSGS, tools=TOOLS)
    assert tok.render_chat(MSGS, tools=[]) == chatml.render_chat(MSGS)  # [] is no tools
    assert tok.template_digest not in (chatml.template_digest, hermes.template_digest)
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(named_dir)
    assert hf.apply_chat_template(MSGS, tools=TOOLS, tokenize=False,
                                  add_generation_prompt=True) == tok.render_chat(MSGS,
                                                                                 tools=TOOLS)


def test_tools_work_with_a_named_tool_use_template(named_dir):
    """With only `default` taken (as before), tools= was a ConfigError: the default
    template renders no tools."""
    with LLM(named_dir, **KW) as llm:
        out = llm.chat(MSGS, SamplingParams(max_tokens=120, temperature=0.0), tools=TOOLS,
                       tool_choice="required", use_tqdm=False)[0]
        (call,) = out.tool_calls
        assert call.name == "add" and set(call.arguments) == {"a", "b"}
        s = llm.session(system="be brief", tools=TOOLS)
        r = s.send("add these", tool_choice="required", max_tokens=120)
        assert r.tool_calls and r.tool_calls[0].name == "add"
        s.close()


def test_a_template_passed_to_the_llm_replaces_the_checkpoints(named_dir, tmp_path):
    f = tmp_path / "hermes.jinja"
    f.write_text(HERMES_TEMPLATE)
    for given in (HERMES_TEMPLATE, str(f), f):
        with LLM(named_dir, chat_template=given, **KW) as llm:
            assert llm.tokenizer.templates == {"default": HERMES_TEMPLATE}
            assert llm.tokenizer.render_chat(MSGS) == \
                Tokenizer(named_dir, chat_template=HERMES_TEMPLATE).render_chat(MSGS)
    with pytest.raises(ConfigError, match="neither a template .* nor a file"):
        LLM(named_dir, chat_template=str(tmp_path / "missing.jinja"), **KW)
    with pytest.raises(ConfigError, match="chat_template must be"):
        LLM(named_dir, chat_template=42, **KW)
    with pytest.raises(ModelLoadError, match="the chat template does not compile"):
        LLM(named_dir, chat_template="{% for %}", **KW)


def test_the_chat_template_flag(named_dir, tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text(HERMES_TEMPLATE)
    parser = argparse.ArgumentParser()
    add_llm_flags(parser, LLM)
    args = parser.parse_args(["--model", str(named_dir), "--chat-template", str(f)])
    assert llm_kwargs(args, LLM)["chat_template"] == str(f)


def test_a_sentencepiece_only_checkpoint_says_how_to_convert(named_dir, tmp_path):
    d = tmp_path / "sp"
    shutil.copytree(named_dir, d)
    (d / "tokenizer.json").unlink()
    (d / "tokenizer.model").write_bytes(b"\x0a\x00")  # (never read)
    with pytest.raises(ModelLoadError, match="only tokenizer.model .*SentencePiece.*"
                                             "save_pretrained"):
        LLM(d, **KW)
