"""Structured output (xgrammar): every seeded random-weight sample under JSON schemas,
regexes and EBNF grammars is valid (the mask guarantees it whatever the weights); bad
formats are ConfigErrors at submission; formatted and plain requests batch together without
changing the plain ones; grammars compile once per format."""

from __future__ import annotations

import json
import re

import pytest
from internals import Internals
from llms import tiny_llm

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

from kvsession import (  # noqa: E402
    LLM,
    ConfigError,
    KVSessionError,
    SamplingParams,
    StructuredOutput,
)
from kvsession.structured import bounded_strings_as_patterns, checked_schema  # noqa: E402
from oracle import random_prompts  # noqa: E402

S = "string"
INT = "integer"
# 20 schemas: nested objects, arrays with bounds, enums, numbers with ranges, optional fields,
# references, patterns; each fits SCHEMA_BUDGET tokens
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": S, "maxLength": 6},
                                      "age": {"type": INT, "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "v": {"type": "null"}},
     "required": ["ok", "v"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "size": {"enum": [1, 2, 3, "xl"]}},
     "required": ["color", "size"]},
    {"type": "object", "properties": {"tags": {"type": "array", "minItems": 1, "maxItems": 3,
                                               "items": {"type": S, "maxLength": 4}}},
     "required": ["tags"]},
    {"type": "array", "items": {"type": INT, "minimum": -5, "maximum": 5},
     "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": -1.5, "maximum": 2.5},
                                      "y": {"type": "number", "exclusiveMinimum": 0,
                                            "maximum": 10}},
     "required": ["x", "y"]},
    {"type": "object", "properties": {
        "point": {"type": "object", "properties": {
            "x": {"type": INT, "minimum": 0, "maximum": 9},
            "y": {"type": INT, "minimum": 0, "maximum": 9}}, "required": ["x", "y"]},
        "label": {"type": S, "maxLength": 5}}, "required": ["point"]},
    {"type": "object", "properties": {"a": {"type": INT, "minimum": 0, "maximum": 3},
                                      "b": {"type": S, "minLength": 1, "maxLength": 3},
                                      "c": {"type": "boolean"}}, "required": ["a"]},
    {"type": "object", "properties": {
        "tool": {"const": "search"},
        "args": {"type": "object", "properties": {"q": {"type": S, "maxLength": 8},
                                                  "k": {"type": INT, "minimum": 1,
                                                        "maximum": 10}},
                 "required": ["q", "k"]}}, "required": ["tool", "args"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"id": {"type": INT, "minimum": 0, "maximum": 99},
                                         "done": {"type": "boolean"}},
        "required": ["id", "done"]}}}, "required": ["items"]},
    {"type": S, "maxLength": 10},
    {"type": INT, "minimum": 100, "maximum": 999},
    {"enum": ["yes", "no", None, True]},
    {"type": "object", "properties": {
        "kind": {"enum": ["a", "b"]},
        "n": {"anyOf": [{"type": INT, "minimum": 0, "maximum": 5}, {"type": "null"}]}},
     "required": ["kind", "n"]},
    {"type": "object", "properties": {"matrix": {
        "type": "array", "minItems": 1, "maxItems": 2,
        "items": {"type": "array", "minItems": 1, "maxItems": 2,
                  "items": {"type": INT, "minimum": 0, "maximum": 9}}}},
     "required": ["matrix"]},
    {"type": "object", "properties": {"code": {"type": S, "pattern": "^[A-Z]{2}[0-9]{3}$"}},
     "required": ["code"]},
    {"type": "object", "properties": {"p": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["p"]},
    {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "name": {"type": S, "minLength": 1, "maxLength": 4},
            "roles": {"type": "array", "maxItems": 2,
                      "items": {"enum": ["admin", "dev", "ops"]}}},
                 "required": ["name", "roles"]},
        "active": {"type": "boolean"}}, "required": ["user", "active"]},
    {"$defs": {"leaf": {"type": "object", "required": ["v"],
                        "properties": {"v": {"type": INT, "minimum": 0, "maximum": 9}}}},
     "type": "object", "properties": {"left": {"$ref": "#/$defs/leaf"},
                                      "right": {"$ref": "#/$defs/leaf"}},
     "required": ["left", "right"]},
    {"type": "object", "properties": {"opt1": {"type": INT, "minimum": 0, "maximum": 9},
                                      "opt2": {"type": S, "maxLength": 2},
                                      "opt3": {"enum": ["x"]}}},
]
SCHEMA_BUDGET = 96
SAMPLES = 10  # per schema: 200 in all

REGEXES = [r"[a-z]{3,8}", r"\d{3}-\d{4}", r"(yes|no|maybe)",
           r"[A-Z][a-z]{1,6}( [A-Z][a-z]{1,6}){0,2}", r"(0|[1-9][0-9]{0,3})\.[0-9]{2}",
           r"https?://[a-z]{2,8}\.(com|org)/[a-z0-9]{0,6}", r"[a-z]{1,6}@[a-z]{1,6}\.(com|net)",
           r"#[0-9a-f]{6}"]
NUM = "[1-9][0-9]{0,2}"
TERM = rf"({NUM}|\({NUM}(\*{NUM}){{0,2}}\))"
# EBNF grammars (xgrammar's dialect) with an equivalent Python regex to check outputs by
GRAMMARS = [
    ('root ::= expr\nexpr ::= term (("+" | "-") term){0,2}\n'
     'term ::= num | "(" num ("*" num){0,2} ")"\nnum ::= [1-9] [0-9]{0,2}',
     rf"{TERM}([+-]{TERM}){{0,2}}"),
    ('root ::= "call(" name ", " arg ")"\nname ::= "search" | "read" | "write"\n'
     'arg ::= "\\"" [a-z ]{1,10} "\\""', r'call\((search|read|write), "[a-z ]{1,10}"\)'),
    ('root ::= "[" item ("," item){0,3} "]"\nitem ::= "true" | "false" | [0-9]',
     r"\[(true|false|[0-9])(,(true|false|[0-9])){0,3}\]"),
    ('root ::= line{1,3}\nline ::= [a-z]{1,5} "=" [0-9]{1,3} "\\n"',
     r"([a-z]{1,5}=[0-9]{1,3}\n){1,3}"),
]


@pytest.fixture(scope="module")
def llm(llama_dir):
    with tiny_llm(llama_dir) as llm:
        yield llm


def sample(llm, fmt: StructuredOutput, count: int, max_tokens: int, seed: int, **kw):
    prompts = random_prompts(seed, [3 + 5 * (i % 4) for i in range(count)], 500)
    params = [SamplingParams(max_tokens=max_tokens, seed=seed * 1000 + i, structured=fmt, **kw)
              for i in range(count)]
    return llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_every_sample_validates_under_its_json_schema(llm, i):
    schema = SCHEMAS[i]
    jsonschema.Draft202012Validator.check_schema(schema)
    for out in sample(llm, StructuredOutput(json_schema=schema), SAMPLES, SCHEMA_BUDGET, i):
        assert out.finish_reason == "stop", out.text  # the format completed and ended it
        jsonschema.validate(json.loads(out.text), schema)  # strict JSON (no raw controls)
        assert out.token_ids[-1] in llm.tokenizer.eos_token_ids


def test_json_schema_as_text_equals_dict(llm):
    schema = SCHEMAS[0]
    a = sample(llm, StructuredOutput(json_schema=schema), 2, SCHEMA_BUDGET, 7)
    b = sample(llm, StructuredOutput(json_schema=json.dumps(schema, indent=2)), 2,
               SCHEMA_BUDGET, 7)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


@pytest.mark.parametrize("regex", REGEXES)
def test_every_sample_fully_matches_its_regex(llm, regex):
    for out in sample(llm, StructuredOutput(regex=regex), 8, 48, len(regex)):
        assert out.finish_reason == "stop" and re.fullmatch(regex, out.text), out.text


@pytest.mark.parametrize("grammar, equivalent", GRAMMARS)
def test_every_sample_is_in_its_ebnf_language(llm, grammar, equivalent):
    for out in sample(llm, StructuredOutput(grammar=grammar), 8, 48, len(grammar)):
        assert out.finish_reason == "stop" and re.fullmatch(equivalent, out.text), out.text


def test_json_object_outputs_are_objects(llm):
    outs = sample(llm, StructuredOutput(json_object=True), 12, 64, 3)
    done = [o for o in outs if o.finish_reason == "stop"]
    assert len(done) >= 3  # random weights: keys can be long, but several finish
    for o in done:
        assert isinstance(json.loads(o.text), dict)
    assert all(o.text.startswith("{") for o in outs)


def test_max_tokens_bounds_a_format_and_ignore_eos_does_not_extend_it(llm):
    fmt = StructuredOutput(json_schema=SCHEMAS[9])
    for out in sample(llm, fmt, 4, 5, 11):
        assert out.finish_reason == "length" and len(out.token_ids) == 5
    for out in sample(llm, fmt, 4, SCHEMA_BUDGET, 12, ignore_eos=True):
        # the format ends the request once complete (its stop token), ignore_eos or not
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SCHEMAS[9])


def test_formatted_and_plain_requests_batch_without_changing_the_plain_ones(llm):
    prompts = random_prompts(40, [6, 19, 33, 11, 25, 8], 500)
    plain = [SamplingParams(max_tokens=20, seed=5, ignore_eos=True),
             SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
             SamplingParams(max_tokens=18, temperature=0.7, top_k=40, seed=9, ignore_eos=True,
                            repetition_penalty=1.3)]
    formatted = [SamplingParams(max_tokens=SCHEMA_BUDGET, seed=1,
                                structured=StructuredOutput(json_schema=SCHEMAS[8])),
                 SamplingParams(max_tokens=48, temperature=0.0,
                                structured=StructuredOutput(regex=REGEXES[5])),
                 SamplingParams(max_tokens=48, seed=3,
                                structured=StructuredOutput(grammar=GRAMMARS[1][0]))]
    alone = [llm.generate(prompt_token_ids=[p], sampling_params=s, use_tqdm=False)[0]
             for p, s in zip(prompts, plain + formatted, strict=True)]
    mixed = llm.generate(prompt_token_ids=[prompts[i] for i in (0, 3, 1, 4, 2, 5)],
                         sampling_params=[(plain + formatted)[i] for i in (0, 3, 1, 4, 2, 5)],
                         use_tqdm=False)
    by_index = dict(zip((0, 3, 1, 4, 2, 5), mixed, strict=True))
    for i, a in enumerate(alone):
        assert by_index[i].token_ids == a.token_ids  # seeded and greedy: batch independent
    jsonschema.validate(json.loads(by_index[3].text), SCHEMAS[8])
    assert re.fullmatch(REGEXES[5], by_index[4].text)


def test_n_completions_each_follow_the_format(llm):
    out = sample(llm, StructuredOutput(json_schema=SCHEMAS[17]), 1, SCHEMA_BUDGET, 13,
                 n=4)[0]
    assert len(out.outputs) == 4 and len({c.text for c in out.outputs}) > 1
    for c in out.outputs:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), SCHEMAS[17])


@pytest.mark.parametrize("fmt, field", [
    (lambda: StructuredOutput(json_schema={"type": "nope"}), "structured.json_schema"),
    (lambda: StructuredOutput(json_schema={"type": "object", "properties": {
        "a": {"$ref": "#/missing"}}}), "structured.json_schema"),
    (lambda: StructuredOutput(regex="(unclosed"), "structured.regex"),
    (lambda: StructuredOutput(grammar='root ::= undefined_rule'), "structured.grammar"),
    (lambda: StructuredOutput(grammar='root ::= "a" |'), "structured.grammar"),
])
def test_a_format_that_does_not_compile_fails_at_submission_alone(llm, fmt, field):
    before = llm.stats().num_requests
    good = SamplingParams(max_tokens=3, temperature=0.0)
    bad = SamplingParams(max_tokens=3, structured=fmt())
    with pytest.raises(ConfigError, match=rf"^{re.escape(field)} does not compile: \S"):
        llm.generate(["a", "b"], [good, bad], use_tqdm=False)
    assert llm.stats().num_requests == before  # nothing of the call was submitted
    assert llm.generate("a", good, use_tqdm=False)[0].finish_reason == "length"


@pytest.mark.parametrize("kw, match", [
    ({}, "exactly one of"), ({"regex": "a", "grammar": "root ::= \"a\""}, "exactly one of"),
    ({"json_schema": "{not json"}, "structured.json_schema must be a JSON schema"),
    ({"json_schema": "[1, 2]"}, "structured.json_schema must be a JSON schema"),
    ({"json_schema": {"x": float("nan")}}, "JSON values only"),
    ({"json_schema": {"x": {1, 2}}}, "JSON values only"),
    ({"regex": ""}, "structured.regex must be None or a non-empty string"),
    ({"grammar": 5}, "structured.grammar must be"), ({"json_object": 1}, "json_object"),
    ({"schema": {}}, "did you mean 'json_schema'"),
])
def test_structured_output_validates_on_construction(kw, match):
    with pytest.raises(ConfigError, match=match):
        StructuredOutput(**kw)


def test_structured_output_is_frozen_hashable_and_compiled_once(llm):
    a = StructuredOutput(json_schema={"type": "object"})
    b = StructuredOutput(json_schema='{"type":   "object"}')
    assert a == b and hash(a) == hash(b) and a.kind == "json_schema"
    assert StructuredOutput(json_object=True).kind == "json_object"
    compiler = Internals(llm).grammars()
    fmt = StructuredOutput(regex=r"[ab]{1,3}")
    sample(llm, fmt, 2, 8, 1)
    compiled = compiler.num_compiled
    sample(llm, fmt, 2, 8, 2)
    sample(llm, StructuredOutput(regex=r"[ab]{1,3}"), 1, 8, 3)
    assert compiler.num_compiled == compiled


def test_bounded_strings_compile_as_json_aware_patterns():
    schema = {"type": "object", "properties": {
        "s": {"type": S, "minLength": 2, "maxLength": 5},
        "p": {"type": S, "maxLength": 3, "pattern": "^a+$"},
        "e": {"enum": [{"type": S, "maxLength": 1}]}}}
    out = bounded_strings_as_patterns(schema)
    assert "maxLength" not in out["properties"]["s"]
    assert out["properties"]["s"]["pattern"].endswith("{2,5}$")
    assert out["properties"]["p"] == schema["properties"]["p"]  # has its own pattern
    assert out["properties"]["e"] == schema["properties"]["e"]  # data, not a schema
    assert schema["properties"]["s"]["maxLength"] == 5  # the input is not changed


def test_bounded_strings_are_rewritten_wherever_a_subschema_is():
    """A property named like a data keyword is a subschema (rewritten); a string among
    several types becomes an anyOf branch of its own (rewritten)."""
    schema = {"type": "object", "properties": {
        "default": {"type": S, "maxLength": 3},
        "maybe": {"type": [S, "null"], "maxLength": 2, "description": "d"}}}
    out = bounded_strings_as_patterns(schema)
    assert out["properties"]["default"]["pattern"].endswith("{0,3}$")
    branches = out["properties"]["maybe"]["anyOf"]
    assert branches[0]["type"] == S and branches[0]["pattern"].endswith("{0,2}$")
    assert branches[1] == {"type": "null", "description": "d"}


@pytest.mark.parametrize("schema, keyword", [
    ({"type": "array", "items": {"type": INT}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "array", "contains": {"const": 7}}, "contains"),
    ({"type": INT, "not": {"const": 0}}, "not"),
    ({"type": "object", "properties": {"a": {"if": {"const": 1}, "then": {"const": 1}}}},
     "if"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"allOf": [{"type": INT, "minimum": 5}, {"type": INT, "maximum": 3}]}, "allOf"),
    ({"type": "object", "properties": {"s": {"type": S, "maxLength": 3,
                                             "pattern": "^[a-z]+$"}}}, "length"),
    # measured: 16 of 16 forced outputs lacked it (xgrammar writes listed properties only)
    ({"type": "object", "properties": {"city": {"type": S}}, "required": ["city", "unit"]},
     "requires 'unit'"),
    ({"oneOf": [{"type": INT}, {"type": "number"}]}, "oneOf"),  # compiled as anyOf
    ({"type": "number", "multipleOf": 0.25}, "multipleOf"),
    ({"type": S, "pattern": "^(?![a-m])[a-z]{2}$"}, "lookaround"),
])
def test_keywords_xgrammar_does_not_enforce_are_config_errors(llm, schema, keyword):
    """xgrammar compiles these without enforcing them (outputs that break them end as
    "stop"): refused at submission, naming the keyword and where (a forced tool's parameters
    go through the same check: checked_schema). A property only named like one is fine."""
    p = SamplingParams(max_tokens=8, structured=StructuredOutput(json_schema=schema))
    with pytest.raises(ConfigError, match=rf"^structured.json_schema .*{keyword}"):
        llm.generate("x", p, use_tqdm=False)
    with pytest.raises(ConfigError, match=rf"^tools\[0\].*{keyword}.*/properties/v"):
        checked_schema({"type": "object", "properties": {"v": schema}},
                       "tools[0].function.parameters")
    named = {"type": "object", "properties": {"not": {"type": INT}, "if": {"type": S}}}
    out = llm.generate("x", SamplingParams(max_tokens=40, structured=StructuredOutput(
        json_schema=named)), use_tqdm=False)[0]
    assert out.finish_reason == "length" or jsonschema.validate(json.loads(out.text), named) \
        is None


def test_a_format_that_allows_no_token_fails_as_a_kvsession_error(llm):
    """A grammar whose language is empty compiles; its request fails alone with a
    KVSessionError that names the format, and the engine serves on."""
    p = SamplingParams(max_tokens=4, structured=StructuredOutput(grammar="root ::= root"))
    with pytest.raises(KVSessionError, match="structured format allows no token"):
        llm.generate("x", p, use_tqdm=False)
    assert llm.generate("x", SamplingParams(max_tokens=2), use_tqdm=False)[0].token_ids


def test_mask_covers_a_vocabulary_larger_than_the_tokenizer(model_dirs):
    d = model_dirs("llama", vocab_size=640)  # ids 512..639 have no text
    with LLM(d, kv_cache_memory="4MiB", max_model_len=256) as big:
        fmt = StructuredOutput(json_schema=SCHEMAS[2])
        for out in sample(big, fmt, 6, 48, 21):
            assert all(t < 512 for t in out.token_ids)
            jsonschema.validate(json.loads(out.text), SCHEMAS[2])


LONG_KEYS = {"type": "object", "properties": {
    "description_of_the_result": {"type": INT, "minimum": 0, "maximum": 99},
    "status_of_the_request": {"enum": ["completed_successfully", "failed_permanently"]},
    "list_of_file_paths": {"type": "array", "maxItems": 2,
                           "items": {"enum": ["src/main.py", "tests/test_main.py"]}}},
    "required": ["description_of_the_result", "status_of_the_request", "list_of_file_paths"]}


def test_jump_forward_appends_forced_tokens_in_fewer_steps(llm):
    """`jump_forward=True`: forced tokens appended unverified, in xgrammar's tokenization,
    against token-by-token decoding (the drafter's verified forced spans off:
    test_speculative.py covers those)."""
    counts = {}
    drafter = Internals(llm).drafter
    for jf in (False, True):
        fmt = StructuredOutput(json_schema=LONG_KEYS, jump_forward=jf)
        steps = Internals(llm).steps
        drafter.forced_spans = jf
        try:
            outs = sample(llm, fmt, 4, 128, 30)
        finally:
            drafter.forced_spans = True
        counts[jf] = (Internals(llm).steps - steps, sum(len(o.token_ids) for o in outs))
        for o in outs:
            assert o.finish_reason == "stop"
            jsonschema.validate(json.loads(o.text), LONG_KEYS)
        assert [o.token_ids for o in sample(llm, fmt, 4, 128, 30)] == \
            [o.token_ids for o in outs]  # still seeded and reproducible
    (plain_steps, plain_tokens), (jf_steps, jf_tokens) = counts[False], counts[True]
    assert plain_steps >= plain_tokens // 4  # one token per request per step
    # the keys and enum tails came without a step each
    assert jf_steps < plain_steps / 2 and jf_steps < jf_tokens / 4
    # max_tokens still bounds a request whose forced tokens would pass it
    out = sample(llm, StructuredOutput(json_schema=LONG_KEYS, jump_forward=True), 1, 5, 31)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_jump_forward_with_logprobs_is_refused():
    with pytest.raises(ConfigError, match="structured.jump_forward must be False with logprobs"):
        SamplingParams(logprobs=1, structured=StructuredOutput(regex="a", jump_forward=True))


def test_a_string_escape_of_a_lone_surrogate_is_no_json_string_character():
    """Length-bounded strings are written as patterns of STRING_CHAR: a \\udxxx escape alone
    decodes to no character (its response could not be encoded as UTF-8), a pair to one."""
    import re

    from kvsession.structured import STRING_CHAR
    one = re.compile(STRING_CHAR)
    assert all(one.fullmatch(e) for e in ("a", "\\u00e9", "\\uD7FF", "\\uE000", "\\n"))
    assert not any(one.fullmatch(e) for e in ("\\ud800", "\\uDBFF", "\\udc00", "\\uDFFF"))
