"""The model's own defaults (#47 item 5): a checkpoint's generation_config.json sampling
fields are the defaults of every request that does not set them (in-process and in the
server), `generation_config="none"` turns that off, and the conversational calls generate
until the end of the turn while generate() keeps 16 tokens."""

from __future__ import annotations

import json

import pytest

from kvsession import LLM, SamplingParams
from kvsession.errors import ModelLoadError
from kvsession.generation_defaults import GENERATE_MAX_TOKENS, read_generation_config
from kvsession.serve.process import ServerProcess
from kvsession.testing import make_tiny_model

MSGS = [{"role": "user", "content": "tell me about the river"}]
ENGINE = {"device": "cpu", "kv_cache_memory": "8MiB", "max_model_len": 96}


def write_gen(model_dir, **fields) -> None:
    """Replace the checkpoint's sampling fields (its eos ids stay)."""
    path = model_dir / "generation_config.json"
    gen = {k: v for k, v in json.loads(path.read_text()).items()
           if k in ("eos_token_id", "bos_token_id")}
    path.write_text(json.dumps({**gen, **fields}))


@pytest.fixture
def model(tmp_path):
    return make_tiny_model(tmp_path / "m", generation_config={"max_new_tokens": None})


def drained(stream):
    for _ in stream:
        pass
    return stream.output


def no_eos(llm: LLM) -> dict:
    """A logit_bias that bans the end-of-turn tokens (a random model may sample them)."""
    return {"logit_bias": {t: -100.0 for t in llm.tokenizer.eos_token_ids}}


# ---- reading the file ----------------------------------------------------------------------


def test_reads_the_sampling_fields_as_transformers_names_them(model):
    write_gen(model, do_sample=True, temperature=0.6, top_p=0.95, top_k=20, min_p=0.0,
              repetition_penalty=1.1, max_new_tokens=300, max_length=4096)
    assert read_generation_config(model) == {
        "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
        "repetition_penalty": 1.1, "max_tokens": 300}


@pytest.mark.parametrize("body", ['[1, 2]', '{"temperature": '])
def test_a_file_that_is_no_json_object_is_refused(model, body):
    (model / "generation_config.json").write_text(body)
    with pytest.raises(ModelLoadError, match="generation_config.json"):
        read_generation_config(model)


def test_do_sample_false_is_greedy_and_top_k_0_is_off(model):
    write_gen(model, do_sample=False, temperature=0.6, top_p=0.9, repetition_penalty=1.2)
    assert read_generation_config(model) == {"temperature": 0.0, "repetition_penalty": 1.2}
    write_gen(model, temperature=0.7, top_k=0)
    assert read_generation_config(model) == {"temperature": 0.7, "top_k": -1}
    (model / "generation_config.json").unlink()
    assert read_generation_config(model) == {}


@pytest.mark.parametrize("body, cause", [
    ('{"temperature": -1}', "temperature"),
    ('{"top_p": 0}', "top_p"),
    ('{"max_new_tokens": 0}', "max_tokens"),
])
def test_a_bad_file_is_a_model_load_error_naming_it(model, body, cause):
    (model / "generation_config.json").write_text(body)
    with pytest.raises(ModelLoadError, match=cause) as e:
        read_generation_config(model)
    assert "generation_config.json" in str(e.value)
    with pytest.raises(ModelLoadError, match="generation_config.json"):
        LLM(model, **ENGINE)
    # "none" does not read its sampling fields
    with LLM(model, generation_config="none", **ENGINE):
        pass


# ---- requests in-process -------------------------------------------------------------------


def test_the_checkpoints_sampling_is_every_unset_requests_default(model):
    """A checkpoint that samples greedily (top_k 1) makes a request without settings greedy;
    "none" falls back to SamplingParams' temperature 1; a caller's own value wins."""
    write_gen(model, do_sample=True, temperature=1.0, top_k=1)
    with LLM(model, **ENGINE) as llm, LLM(model, generation_config="none", **ENGINE) as plain:
        greedy = plain.chat(MSGS, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
        # a seed and max_tokens set, the sampling fields left to the checkpoint
        ours = llm.chat(MSGS, SamplingParams(seed=3, max_tokens=12), use_tqdm=False)
        theirs = plain.chat(MSGS, SamplingParams(seed=3, max_tokens=12), use_tqdm=False)
        assert ours[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids
        assert theirs[0].outputs[0].token_ids != greedy[0].outputs[0].token_ids
        # the caller's top_k wins over the checkpoint's
        mine = llm.chat(MSGS, SamplingParams(seed=3, max_tokens=12, top_k=-1), use_tqdm=False)
        assert mine[0].outputs[0].token_ids == theirs[0].outputs[0].token_ids
        # generate() takes the checkpoint's sampling too
        a = llm.generate("the river", SamplingParams(seed=3), use_tqdm=False)
        b = plain.generate("the river", SamplingParams(temperature=0.0), use_tqdm=False)
        assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids


def test_chat_and_stream_run_to_the_end_of_the_turn_generate_keeps_16(model):
    with LLM(model, **ENGINE) as llm:
        bias = no_eos(llm)
        out = llm.generate("the river", SamplingParams(**bias), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == GENERATE_MAX_TOKENS
        for call in (lambda p: llm.chat(MSGS, p, use_tqdm=False)[0],
                     lambda p: drained(llm.stream(messages=MSGS, sampling_params=p))):
            res = call(SamplingParams(**bias))
            # bounded by the context: the prompt and the reply fill max_model_len
            assert res.outputs[0].finish_reason == "length"
            assert len(res.prompt_token_ids) + len(res.outputs[0].token_ids) == 96
        # an explicit max_tokens still bounds it, and the end of turn still ends it
        assert len(llm.chat(MSGS, SamplingParams(max_tokens=5, **bias),
                            use_tqdm=False)[0].outputs[0].token_ids) == 5
        eos = llm.tokenizer.eos_token_ids
        ended = llm.chat(MSGS, SamplingParams(logit_bias={min(eos): 100.0}), use_tqdm=False)[0]
        assert ended.outputs[0].finish_reason == "stop"
        assert len(ended.outputs[0].token_ids) <= 1


def test_the_checkpoints_max_new_tokens_bounds_every_call(model):
    write_gen(model, max_new_tokens=7)
    with LLM(model, **ENGINE) as llm:
        bias = no_eos(llm)
        assert len(llm.generate("x", SamplingParams(**bias), use_tqdm=False)[0]
                   .outputs[0].token_ids) == 7
        assert len(llm.chat(MSGS, SamplingParams(**bias), use_tqdm=False)[0]
                   .outputs[0].token_ids) == 7
        with llm.session(sampling=SamplingParams(**bias)) as s:
            assert len(s.send("hi").token_ids) == 7


def test_a_session_turn_samples_as_the_checkpoint_says_else_greedy(model):
    """Sessions fall back to greedy, below the checkpoint's sampling; each turn runs to the
    end of the turn unless the session or the turn sets max_tokens."""
    with LLM(model, generation_config="none", **ENGINE) as plain:
        with plain.session() as s:
            greedy = s.send("hi", max_tokens=8).token_ids
        with plain.session() as s:
            hot = s.send("hi", max_tokens=8, temperature=1.5, seed=4).token_ids
        with plain.session(sampling=SamplingParams(**no_eos(plain))) as s:
            reply = s.send("hi")
            assert reply.finish_reason == "length"
            assert len(s.token_ids) == 96
    assert hot != greedy
    write_gen(model, do_sample=True, temperature=1.5)
    with LLM(model, **ENGINE) as llm, llm.session() as s:
        assert s.send("hi", max_tokens=8, seed=4).token_ids == hot


# ---- the server ----------------------------------------------------------------------------


def test_the_server_takes_the_checkpoints_defaults(model, tmp_path):
    """A request without sampling fields samples as the checkpoint says (greedy here, where
    OpenAI's default temperature is 1); `--generation-config none` restores OpenAI's."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    write_gen(model, do_sample=False)
    flags = ["--device", "cpu", "--kv-cache-memory", "8MiB", "--max-model-len", "96",
             "--host-cache-memory", "0"]
    with LLM(model, **ENGINE) as llm:
        greedy = llm.chat(MSGS, SamplingParams(max_tokens=10), use_tqdm=False)[0].outputs[0].text
    answers = {}
    for mode in ("auto", "none"):
        server = ServerProcess(model, *flags, "--generation-config", mode,
                               stderr_path=tmp_path / f"{mode}.stderr")
        try:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                                   timeout=60)
            answers[mode] = client.chat.completions.create(
                model=client.models.list().data[0].id, messages=MSGS, max_tokens=10,
                seed=11).choices[0].message.content
        finally:
            assert server.stop() == 0, server.stderr_tail()
    assert answers["auto"] == greedy
    assert answers["none"] != greedy
