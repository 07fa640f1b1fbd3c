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
    ("remote_prefill_timeout_s", None), ("remote_prefill_timeout_s", 0),
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
    ("temperature", math.nan),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", "1"), ("top_p", None),
    ("top_k", 0), ("top_k", -2), ("top_k", True), ("top_k", 5.0),
    ("seed", True), ("seed", 1.0), ("seed", "1"), ("seed", -(2**63) - 1),
    ("logprobs", 21), ("logprobs", -1), ("logprobs", True), ("logprobs", 1.0),
    ("cache_salt", 3), ("cache_salt", b"salt"),
    ("ignore_eos", 1), ("ignore_eos", None), ("ignore_eos", "false"),
    ("stop", ""), ("stop", [""]), ("stop", 5), ("stop", ["ok", 5]), ("stop", {"x"}),
    ("stop_token_ids", [-1]), ("stop_token_ids", [True]), ("stop_token_ids", [1.0]),
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
    with pytest.raises(ConfigError, match="'presence_penalty'; accepted: max_tokens, temp"):
        SamplingParams(presence_penalty=0.5)


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
