"""Public signatures are explicit (visible to help() and IDEs), and a misspelt keyword or a
wrong type is a ConfigError naming it, with a suggestion, before any memory is taken."""

from __future__ import annotations

import importlib.util
import inspect
import re

import pytest

from kvsession import LLM, SamplingParams, StructuredOutput
from kvsession.errors import ConfigError
from kvsession.llm import _LIVE
from kvsession.session import Session


def test_llm_parameters_are_explicit():
    params = inspect.signature(LLM.__init__).parameters
    for name in ("kv_cache_memory", "session_dir", "max_num_seqs", "kv_cache_dtype", "seed"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
    send = inspect.signature(LLM.session).parameters
    assert "system" in send and "session_id" in send


@pytest.mark.parametrize("kwargs, match", [
    ({"kv_cache_memroy": "1MiB"}, "did you mean 'kv_cache_memory'"),
    ({"max_num_seq": 4}, "did you mean 'max_num_seqs'"),
    ({"max_num_seqs": True}, "max_num_seqs"),
    ({"gpu_memory_utilization": "0.5"}, "gpu_memory_utilization"),
    ({"spill_after_s": "soon"}, "spill_after_s"),
    ({"max_model_len": None, "block_size": None}, "block_size"),
])
def test_llm_rejects_bad_arguments_before_building_anything(llama_dir, kwargs, match):
    live = len(_LIVE)
    with pytest.raises(ConfigError, match=match):
        LLM(llama_dir, **kwargs)
    assert len(_LIVE) == live  # nothing was built


def test_session_send_takes_explicit_overrides(llama_dir):
    params = inspect.signature(Session.send).parameters
    assert params["max_tokens"].kind is inspect.Parameter.KEYWORD_ONLY
    # every SamplingParams field a turn can take is a named keyword of send, asend and
    # stream (n and prompt_logprobs are refused for sessions), defaulting to "not given"
    fields = {n for n, p in inspect.signature(SamplingParams).parameters.items()
              if p.kind is inspect.Parameter.KEYWORD_ONLY} - {"n", "prompt_logprobs"}
    for fn in (Session.send, Session.asend, Session.stream):
        ps = inspect.signature(fn).parameters
        assert fields <= set(ps), (fn.__name__, fields - set(ps))
        assert all(ps[f].kind is inspect.Parameter.KEYWORD_ONLY and repr(ps[f].default) ==
                   "UNSET" for f in fields), fn.__name__
    with LLM(llama_dir, kv_cache_memory="4MiB", max_model_len=256) as llm:
        s = llm.session(sampling=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        with pytest.raises(ConfigError, match="did you mean 'stop'"):
            s.send("hi", stop_strings=["x"])
        with pytest.raises(ConfigError, match="max_tokens"):
            s.send("hi", max_tokens=True)
        with pytest.raises(ConfigError, match="temperature"):
            s.send("hi", temperature="hot")
        assert s.stats.turns == 0 and s.messages == []  # nothing was sent
        r = s.send("hi", max_tokens=2)
        assert len(r.token_ids) == 2 and s.sampling.max_tokens == 4
        assert len(s.send("again").token_ids) == 4  # the override lasted one turn
        if importlib.util.find_spec("xgrammar") is not None:  # the "structured" extra
            fmt = StructuredOutput(regex=r"[ab]{3}")
            r = s.send("pick", structured=fmt, max_tokens=8, ignore_eos=False)
            assert re.fullmatch(r"[ab]{3}", r.text), r.text
