"""Wrong types and unknown keywords are ConfigErrors that name the argument, before any work."""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsession import ConfigError, SamplingParams
from kvsession.config import ENGINE_ARG_NAMES, EngineConfig
from kvsession.params import SAMPLING_ARG_NAMES
from kvsession.validation import check_bool, check_float, check_int, check_str, reject_unknown


@pytest.mark.parametrize("call, bad", [
    (lambda: check_int("n", True), "True"),
    (lambda: check_int("n", 1.0), "1.0"),
    (lambda: check_int("n", "1"), "'1'"),
    (lambda: check_int("n", None), "None"),
    (lambda: check_int("n", 0, min_value=1), ">= 1"),
    (lambda: check_int("n", 9, min_value=0, max_value=8), r"\[0, 8\]"),
    (lambda: check_float("x", False), "False"),
    (lambda: check_float("x", "0.5"), "'0.5'"),
    (lambda: check_float("x", None), "None"),
    (lambda: check_float("x", math.nan), "nan"),
    (lambda: check_float("x", 10**400), "a number"),
    (lambda: check_float("x", 0.0, min_value=0.0, min_inclusive=False), r"> 0\.0"),
    (lambda: check_float("x", 1.0, max_value=1.0, max_inclusive=False), r"< 1\.0"),
    (lambda: check_bool("b", 1), "True or False"),
    (lambda: check_str("s", b"x"), "a string"),
    (lambda: check_str("s", "", non_empty=True), "non-empty"),
])
def test_checks_reject(call, bad):
    with pytest.raises(ConfigError, match=bad) as e:
        call()
    assert str(e.value).split()[0] in "n x b s"  # the message starts with the argument's name


def test_checks_accept_and_canonicalise():
    assert check_int("n", None, allow_none=True) is None
    assert check_float("x", 3) == 3.0 and type(check_float("x", 3)) is float
    assert check_float("x", None, allow_none=True) is None
    assert check_float("x", 1.0, min_value=0.0, max_value=1.0) == 1.0
    assert check_bool("b", False) is False and check_str("s", "", allow_none=True) == ""


def test_reject_unknown_messages():
    reject_unknown("f()", {}, ["a"])
    with pytest.raises(ConfigError, match=r"^LLM\(\) got an unknown keyword argument "
                       r"'tempreature'; did you mean 'temperature'\?$"):
        reject_unknown("LLM()", {"tempreature": 1}, ["temperature", "top_p"])
    with pytest.raises(ConfigError, match="'zzz'; accepted: temperature, top_p$"):
        reject_unknown("LLM()", {"zzz": 1}, ["temperature", "top_p"])
    with pytest.raises(ConfigError, match=r"arguments 'zzz', 'top_pp' \(did you mean 'top_p'"):
        reject_unknown("LLM()", {"zzz": 1, "top_pp": 1}, ["temperature", "top_p"])


# ---- EngineConfig.from_args (the arguments of LLM(...)) ----

@pytest.mark.parametrize("name, value", [
    ("gpu_memory_utilization", "0.5"), ("gpu_memory_utilization", None),
    ("gpu_memory_utilization", 0), ("gpu_memory_utilization", True),
    ("max_num_seqs", True), ("max_num_seqs", 4.0), ("max_num_batched_tokens", "64"),
    ("seed", True), ("seed", 1.5), ("seed", 2**64),
    ("spill_after_s", "x"), ("spill_after_s", -1), ("spill_after_s", math.nan),
    ("spill_after_s", math.inf),
    ("remote_prefill_timeout_s", None), ("remote_prefill_timeout_s", 0),
    ("remote_prefill_timeout_s", math.inf),
    ("enable_prefix_caching", "yes"), ("enable_prefix_caching", 1),
    ("max_pinned_fraction", None), ("max_pinned_fraction", "0.5"),
    ("max_model_len", True), ("max_model_len", 1), ("max_model_len", 64.0),
    ("block_size", True), ("block_size", 2048), ("block_size", 24),
    ("kv_cache_memory", 0), ("kv_cache_memory", True), ("kv_cache_memory", 1.5e6),
    ("host_cache_memory", -1), ("host_cache_memory", None), ("host_cache_memory", "9" * 400),
    ("session_dir", 3), ("device", None), ("dtype", 3), ("kv_cache_dtype", ["fp8"]),
    ("remote_prefill", None), ("attention_backend", True),
    ("prefill_worker", 5), ("prefill_worker", ["tcp://h:1", 2]),
])
def test_engine_args_bad_values_name_the_argument(llama_dir, name, value):
    with pytest.raises(ConfigError, match=name) as e:
        EngineConfig.from_args(llama_dir, **{name: value})
    if not isinstance(value, list):  # a bad list item is reported on its own
        assert repr(value)[:20] in str(e.value)


@pytest.mark.parametrize("kwargs, suggestion", [
    ({"gpu_memory_utilisation": 0.5}, "gpu_memory_utilization"),
    ({"max_num_seq": 4}, "max_num_seqs"),
    ({"prefill_workers": "tcp://h:1"}, "prefill_worker"),
    ({"enable_prefix_cache": False}, "enable_prefix_caching"),
    ({"kv_cache_memory_bytes": 10**6}, "kv_cache_memory"),
])
def test_engine_args_misspelt_keyword_suggests(llama_dir, kwargs, suggestion):
    with pytest.raises(ConfigError, match=rf"LLM\(\) got an unknown keyword argument "
                       rf"'{next(iter(kwargs))}'; did you mean '{suggestion}'\?"):
        EngineConfig.from_args(llama_dir, **kwargs)


def test_engine_args_unknown_keyword_lists_accepted(tmp_path):
    # rejected before the model path is even looked at
    with pytest.raises(ConfigError, match="'tensor_parallel_size'; accepted: device, dtype"):
        EngineConfig.from_args(tmp_path / "missing", tensor_parallel_size=2)


def test_engine_args_keyword_only_and_names_match_signature(llama_dir):
    with pytest.raises(TypeError):
        EngineConfig.from_args(llama_dir, "cpu")
    params = inspect.signature(EngineConfig.from_args).parameters
    assert ENGINE_ARG_NAMES == tuple(params)[1:-1] and "model" not in ENGINE_ARG_NAMES


def test_engine_args_accept_ints_for_floats_and_keep_defaults(llama_dir):
    cfg = EngineConfig.from_args(llama_dir, gpu_memory_utilization=1, max_pinned_fraction=0,
                                 spill_after_s=5, remote_prefill_timeout_s=2, device="cpu")
    assert cfg.gpu_memory_utilization == 1.0 and type(cfg.gpu_memory_utilization) is float
    assert cfg.spill_after_s == 5.0 and type(cfg.spill_after_s) is float
    assert cfg.remote_prefill_timeout_s == 2.0 and cfg.max_pinned_fraction == 0.0
    d = EngineConfig.from_args(str(llama_dir), device="cpu")
    assert (d.block_size, d.max_num_seqs, d.max_num_batched_tokens, d.gpu_memory_utilization,
            d.host_cache_memory_bytes, d.enable_prefix_caching, d.max_pinned_fraction,
            d.spill_after_s, d.remote_prefill_timeout_s, d.seed, d.prefill_workers) == (
        16, 64, 2048, 0.90, 4 * 2**30, True, 0.5, None, 30.0, 0, ())
    assert EngineConfig.from_args(llama_dir, prefill_worker="tcp://h:1").prefill_workers == (
        "tcp://h:1",)


# ---- SamplingParams ----

BAD_SAMPLING = [
    ("max_tokens", True), ("max_tokens", 0), ("max_tokens", 5.0), ("max_tokens", "5"),
    ("max_tokens", None),
    ("temperature", "0.7"), ("temperature", None), ("temperature", True), ("temperature", -1.0),
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", 1e39),
    ("repetition_penalty", 1e-39), ("repetition_penalty", 0.0), ("repetition_penalty", 1e7),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", "1"), ("top_p", None),
    ("top_k", 0), ("top_k", -2), ("top_k", True), ("top_k", 5.0),
    ("seed", True), ("seed", 1.0), ("seed", "1"), ("seed", -(2**63) - 1),
    ("logprobs", 21), ("logprobs", -1), ("logprobs", True), ("logprobs", 1.0),
    ("cache_salt", 3), ("cache_salt", b"salt"),
    ("ignore_eos", 1), ("ignore_eos", None), ("ignore_eos", "false"),
    ("stop", ""), ("stop", [""]), ("stop", 5), ("stop", ["ok", 5]), ("stop", {"x"}),
    ("stop_token_ids", [-1]), ("stop_token_ids", [True]), ("stop_token_ids", [1.0]),
    ("stop_token_ids", [2**64]), ("stop", ["ok\ud800"]),
    ("stop_token_ids", 5), ("stop_token_ids", "12"),
]


@pytest.mark.parametrize("name, value", BAD_SAMPLING)
def test_sampling_bad_values_name_the_argument(name, value):
    with pytest.raises(ConfigError, match=rf"^{name} must be"):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("name, value", BAD_SAMPLING)
def test_with_overrides_validates_values(name, value):
    with pytest.raises(ConfigError, match=rf"^{name} must be"):
        SamplingParams(max_tokens=3).with_overrides(**{name: value})


@pytest.mark.parametrize("name, suggestion", [
    ("max_token", "max_tokens"), ("tempreature", "temperature"), ("topp", "top_p"),
    ("stop_token_id", "stop_token_ids"), ("logprob", "logprobs"),
    ("stop_strings", "stop"), ("stop_ids", "stop_token_ids"), ("max_new_tokens", "max_tokens"),
])
@pytest.mark.parametrize("how", ["constructor", "with_overrides"])
def test_sampling_misspelt_keyword_suggests(name, suggestion, how):
    owner = r"SamplingParams\(\)" if how == "constructor" else r"with_overrides\(\)"
    with pytest.raises(ConfigError, match=rf"{owner} got an unknown keyword argument "
                       rf"'{name}'; did you mean '{suggestion}'\?"):
        (SamplingParams if how == "constructor" else SamplingParams().with_overrides)(
            **{name: 1})


def test_sampling_unknown_keyword_lists_accepted():
    with pytest.raises(ConfigError, match="'typical_p'; accepted: max_tokens, temp"):
        SamplingParams(typical_p=0.5)


def test_sampling_signature_matches_fields():
    params = inspect.signature(SamplingParams).parameters
    init_fields = [f for f in dataclasses.fields(SamplingParams) if f.init]
    assert SAMPLING_ARG_NAMES == tuple(f.name for f in init_fields) == tuple(params)[:-1]
    assert all(params[f.name].default == f.default for f in init_fields)
    assert all(p.kind is p.KEYWORD_ONLY for p in list(params.values())[:-1])


def test_sampling_positive_cases():
    assert SamplingParams() == SamplingParams(max_tokens=16, temperature=1.0, top_p=1.0,
                                              top_k=-1, ignore_eos=False)
    p = SamplingParams(temperature=0, top_p=1, logprobs=20, seed=0, cache_salt="t",
                       stop=["a", "b"], stop_token_ids=[2, 0])
    assert type(p.temperature) is float and type(p.top_p) is float and p.greedy
    assert p.stop_strings == ("a", "b") and p.stop_ids == frozenset({0, 2})
    assert p == SamplingParams(temperature=0.0, top_p=1.0, logprobs=20, seed=0,
                               cache_salt="t", stop=("a", "b"), stop_token_ids=(2, 0))
    assert hash(p) == hash(dataclasses.replace(p)) and "stop=('a', 'b')" in repr(p)
    assert SamplingParams(stop="x").stop == "x" and SamplingParams(stop="x").stop_strings == ("x",)
    assert SamplingParams(stop=[]).stop_strings == () and SamplingParams().stop_ids == frozenset()
    assert SamplingParams(top_k=1, temperature=0.8).greedy


def test_replace_and_with_overrides_copy():
    base = SamplingParams(max_tokens=4, temperature=0.0, stop=["x"])
    r = dataclasses.replace(base, max_tokens=9)
    assert (r.max_tokens, r.temperature, r.stop_strings) == (9, 0.0, ("x",))
    o = base.with_overrides(temperature=1, stop_token_ids=[7])
    assert (o.max_tokens, o.temperature, o.stop_strings, o.stop_ids) == (4, 1.0, ("x",), {7})
    assert base.with_overrides() == base and base.max_tokens == 4
    with pytest.raises(ConfigError, match="max_tokens"):
        dataclasses.replace(base, max_token=9)


_ANY = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=4),
                 st.binary(max_size=2), st.lists(st.one_of(st.integers(), st.text(max_size=3),
                                                           st.none(), st.floats()), max_size=3),
                 st.tuples(st.integers()), st.dictionaries(st.text(max_size=2), st.integers(),
                                                           max_size=2))
_NAMES = st.one_of(st.sampled_from(SAMPLING_ARG_NAMES + ("stop_strings", "stop_ids", "self")),
                   st.text(min_size=1, max_size=12))


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_NAMES, _ANY, max_size=5))
def test_sampling_any_kwargs_construct_or_config_error(kwargs):
    try:
        p = SamplingParams(**kwargs)
    except ConfigError:
        return
    hash(p)
    assert p == dataclasses.replace(p) == p.with_overrides()


# ---- calls on an LLM and a Session ----

@pytest.fixture(scope="module")
def llm(llama_dir):
    from kvsession import LLM

    with LLM(llama_dir, kv_cache_memory="4MiB", max_model_len=128) as llm:
        yield llm


@pytest.fixture
def sess(llm):
    s = llm.session(sampling=SamplingParams(max_tokens=2, temperature=0.0))
    yield s
    s.close()


USER = {"role": "user", "content": "hi"}
BAD_CALLS = [
    # generate
    ("ids float", lambda llm, s: llm.generate(prompt_token_ids=[[1.5]], use_tqdm=False),
     r"prompt token ids must be ints, got \[1\.5\]"),
    ("ids flat float", lambda llm, s: llm.generate(prompt_token_ids=[1, 2.0], use_tqdm=False),
     "prompt token ids must be ints"),
    ("ids bool", lambda llm, s: llm.generate(prompt_token_ids=[[True]], use_tqdm=False),
     r"prompt token ids must be ints, got \[True\]"),
    ("ids int", lambda llm, s: llm.generate(prompt_token_ids=5, use_tqdm=False),
     "^prompt_token_ids must be a list"),
    ("ids ragged", lambda llm, s: llm.generate(prompt_token_ids=[[1], 2], use_tqdm=False),
     r"^prompt_token_ids\[1\] must be a list"),
    ("prompts int", lambda llm, s: llm.generate(5, use_tqdm=False), "^prompts must be"),
    ("prompts dict", lambda llm, s: llm.generate({"a": 1}, use_tqdm=False), "^prompts must be"),
    ("sampling_params str", lambda llm, s: llm.generate("hi", "x", use_tqdm=False),
     "^sampling_params must be None, one SamplingParams or a list of 1, got 'x'"),
    ("sampling_params int", lambda llm, s: llm.generate("hi", 5, use_tqdm=False),
     "^sampling_params must be"),
    ("sampling_params count", lambda llm, s: llm.generate(
        ["a", "b"], [SamplingParams()], use_tqdm=False), "a list of 2"),
    ("use_tqdm", lambda llm, s: llm.generate("hi", use_tqdm="no"), "^use_tqdm must be"),
    ("generate kw", lambda llm, s: llm.generate("hi", max_tokens=3),
     r"^generate\(\) got an unknown keyword argument 'max_tokens'; did you mean "
     r"'sampling_params'\?"),
    # chat
    ("chat str", lambda llm, s: llm.chat("hi", use_tqdm=False), "^messages must be a list"),
    ("chat None", lambda llm, s: llm.chat(None, use_tqdm=False), "^messages must be a list"),
    ("chat content int", lambda llm, s: llm.chat([USER, {"role": "user", "content": 5}],
                                                 use_tqdm=False),
     r"^messages\[1\]\['content'\] must be a string or a non-empty list of"),
    ("chat content None", lambda llm, s: llm.chat([{"role": "assistant", "content": None}],
                                                  use_tqdm=False),
     r"^messages\[0\]\['content'\] must be"),
    ("chat bad part", lambda llm, s: llm.chat([{"role": "user", "content": [
        {"type": "image_url", "image_url": "x"}]}], use_tqdm=False),
     r"^messages\[0\]\['content'\] must be"),
    ("chat role", lambda llm, s: llm.chat([{"role": 5, "content": "x"}], use_tqdm=False),
     r"^messages\[0\]\['role'\] must be a non-empty string, got 5"),
    ("chat empty role", lambda llm, s: llm.chat([{"role": "", "content": "x"}],
                                                use_tqdm=False), r"\['role'\] must be"),
    ("chat no content", lambda llm, s: llm.chat([{"role": "user"}], use_tqdm=False),
     r"^messages\[0\] has no 'content'"),
    ("chat message int", lambda llm, s: llm.chat([[USER], [5]], use_tqdm=False),
     r"^messages\[1\]\[0\] must be a dict"),
    ("chat conversation int", lambda llm, s: llm.chat([[USER], 5], use_tqdm=False),
     r"^messages\[1\] must be a list of message dicts"),
    ("chat non-JSON field", lambda llm, s: llm.chat([{**USER, "meta": {1: "x"}}],
                                                    use_tqdm=False),
     r"^messages\[0\]\['meta'\] keys must be strings"),
    ("chat nan field", lambda llm, s: llm.chat([{**USER, "score": math.nan}], use_tqdm=False),
     r"^messages\[0\]\['score'\] must be a JSON value"),
    # a lone surrogate (json.loads('"\\ud800"')) is a str no tokenizer or log file takes
    ("chat surrogate", lambda llm, s: llm.chat([{"role": "user", "content": "a\ud800"}],
                                               use_tqdm=False),
     r"^messages\[0\]\['content'\] must be valid Unicode text, got a lone surrogate"),
    ("generate surrogate", lambda llm, s: llm.generate("x\udfff", use_tqdm=False),
     "must be valid Unicode text"),
    ("send surrogate", lambda llm, s: s.send("\ud800"), "must be valid Unicode text"),
    # a turn extends its session's KV, hashed under the session's salt: another salt would
    # publish the turn's blocks in the session's namespace
    ("send other salt", lambda llm, s: s.send("x", cache_salt="b"),
     r"^cache_salt must be the session's \(None\) in its turns, got 'b'"),
    ("session system surrogate", lambda llm, s: llm.session(system="\ud800"),
     "^system must be valid Unicode text"),
    ("chat add_generation_prompt", lambda llm, s: llm.chat(
        [USER], add_generation_prompt=1, use_tqdm=False), "^add_generation_prompt must be"),
    ("chat kw", lambda llm, s: llm.chat([USER], temperature=0),
     r"^chat\(\) got an unknown keyword argument 'temperature'"),
    # pin
    ("pin ttl str", lambda llm, s: llm.pin(list(range(20)), ttl_s="x"),
     "^ttl_s must be None or a finite number > 0.0, got 'x'"),
    ("pin ttl inf", lambda llm, s: llm.pin(list(range(20)), ttl_s=math.inf), "^ttl_s must be"),
    ("pin ttl nan", lambda llm, s: llm.pin(list(range(20)), ttl_s=math.nan), "^ttl_s must be"),
    ("pin prefix int", lambda llm, s: llm.pin(5), "^prefix must be a string or a list"),
    ("pin prefix floats", lambda llm, s: llm.pin([0.5] * 20), "prompt token ids must be ints"),
    # session / restore
    ("session pin_system", lambda llm, s: llm.session(pin_system="yes"),
     "^pin_system must be True or False, got 'yes'"),
    ("session system", lambda llm, s: llm.session(system=5), "^system must be None or a string"),
    ("session sampling", lambda llm, s: llm.session(sampling={"max_tokens": 2}),
     "^sampling must be None or a SamplingParams"),
    ("session id", lambda llm, s: llm.session(session_id=5), "^session_id must match"),
    ("session kw", lambda llm, s: llm.session(sytem="x"),
     r"^session\(\) got an unknown keyword argument 'sytem'; did you mean 'system'\?"),
    ("restore int", lambda llm, s: llm.restore(5), "^path must be a file path"),
    ("restore None", lambda llm, s: llm.restore(None), "^path must be a file path"),
    # a Session
    ("send int", lambda llm, s: s.send(5), "^message must be a string, a message dict"),
    ("send empty list", lambda llm, s: s.send([]), "^message must be"),
    ("send content int", lambda llm, s: s.send({"role": "user", "content": 5}),
     r"^message\[0\]\['content'\] must be a string"),
    ("send second message", lambda llm, s: s.send([USER, {"role": None, "content": "x"}]),
     r"^message\[1\]\['role'\] must be a non-empty string"),
    ("send non-JSON field", lambda llm, s: s.send({**USER, "extra": float("nan")}),
     r"^message\[0\]\['extra'\] must be a JSON value"),
    ("send stop_strings", lambda llm, s: s.send("hi", stop_strings=["x"]),
     "did you mean 'stop'"),
    ("send max_tokens bool", lambda llm, s: s.send("hi", max_tokens=True), "^max_tokens must"),
    ("send temperature None", lambda llm, s: s.send("hi", temperature=None),
     "^temperature must"),
    ("stream content", lambda llm, s: list(s.stream({"role": "user", "content": b"x"})),
     r"^message\[0\]\['content'\]"),
    ("asend content", lambda llm, s: __import__("asyncio").run(s.asend({"role": "user"})),
     r"^message\[0\] has no 'content'"),
    ("add role", lambda llm, s: s.add(5, "x"), "^role must be a non-empty string"),
    ("add content", lambda llm, s: s.add("tool", {"x": 1}), "^content must be a string"),
    ("suspend str", lambda llm, s: s.suspend(expected_idle_s="x"),
     "^expected_idle_s must be None or a number >= 0.0, got 'x'"),
    ("suspend negative", lambda llm, s: s.suspend(expected_idle_s=-1), "^expected_idle_s"),
    ("suspend nan", lambda llm, s: s.suspend(expected_idle_s=math.nan), "^expected_idle_s"),
    ("suspend bool", lambda llm, s: s.suspend(expected_idle_s=True), "^expected_idle_s"),
    ("fork id", lambda llm, s: s.fork(session_id=5), "^session_id must match"),
    ("save int", lambda llm, s: s.save(5), "^path must be a file path"),
    ("save empty", lambda llm, s: s.save(""), "^path must be a file path"),
    ("close delete", lambda llm, s: s.close(delete="x"), "^delete must be True or False"),
]


@pytest.mark.parametrize("call, match", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_calls_are_config_errors_that_change_nothing(llm, sess, call, match):
    sess.send("hello")
    before = (sess.messages, sess.num_cached_tokens, len(llm.sessions()), llm.stats().num_requests)
    with pytest.raises(ConfigError, match=match):
        call(llm, sess)
    assert sess.state == "idle" and sess.stats.turns == 1
    assert (sess.messages, sess.num_cached_tokens, len(llm.sessions()),
            llm.stats().num_requests) == before


def test_good_call_shapes_are_accepted(llm):
    import numpy as np

    g = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    want = llm.chat([{"role": "user", "content": "one\ntwo"}], g, use_tqdm=False)[0]
    parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "one"},
                                                   {"type": "text", "text": "two"}]}],
                     g, use_tqdm=False)[0]
    assert parts.prompt == want.prompt and parts.token_ids == want.token_ids
    ids = want.prompt_token_ids
    assert llm.generate(prompt_token_ids=tuple(np.array(ids)), sampling_params=g,
                        use_tqdm=False)[0].token_ids == want.token_ids
    assert llm.generate([], g, use_tqdm=False) == []
    with llm.session(system="be brief", sampling=g) as s:
        s.add("tool", [{"type": "text", "text": "result"}])
        s.send({"role": "user", "content": "hi", "name": "bob"})
        assert s.messages[1] == {"role": "tool", "content": "result"}
        assert s.messages[2] == {"role": "user", "content": "hi", "name": "bob"}
        assert s.suspend(expected_idle_s=0) in ("keep", "host", "drop")
