"""Bad checkpoints raise ModelLoadError, bad arguments ConfigError, before memory is taken."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvsession import LLM, ConfigError, KVSessionError, ModelLoadError, SamplingParams
from kvsession.model.config import load_model_spec


def copy(src, tmp_path):
    return shutil.copytree(src, tmp_path / "m")


def edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def test_missing_weights(llama_dir, tmp_path):
    d = copy(llama_dir, tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="missing file"):
        LLM(d, kv_cache_memory="4MiB")


def test_missing_tokenizer(llama_dir, tmp_path):
    d = copy(llama_dir, tmp_path)
    (d / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        LLM(d, kv_cache_memory="4MiB")


def test_unsupported_architecture_lists_supported(llama_dir, tmp_path):
    d = copy(llama_dir, tmp_path)
    edit_config(d, architectures=["GPT2LMHeadModel"])
    # a bad argument (ConfigError, as the API has it) found while loading (ModelLoadError)
    for error in (ConfigError, ModelLoadError):
        with pytest.raises(error, match="Qwen3ForCausalLM"):
            LLM(d, kv_cache_memory="4MiB")


def test_misshaped_tensor_named(llama_dir, tmp_path):
    d = copy(llama_dir, tmp_path)
    w = load_file(str(d / "model.safetensors"))
    w["model.layers.1.self_attn.k_proj.weight"] = w["model.layers.1.self_attn.k_proj.weight"][:8]
    save_file(w, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"k_proj.*\(8, 64\).*expected \(32, 64\)"):
        LLM(d, kv_cache_memory="4MiB")


def test_missing_tensor_named(llama_dir, tmp_path):
    d = copy(llama_dir, tmp_path)
    w = load_file(str(d / "model.safetensors"))
    del w["model.layers.0.mlp.up_proj.weight"]
    save_file(w, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="model.layers.0.mlp.up_proj.weight"):
        LLM(d, kv_cache_memory="4MiB")


def test_corrupt_safetensors(llama_dir, tmp_path):
    d = copy(llama_dir, tmp_path)
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        LLM(d, kv_cache_memory="4MiB")


def test_unsupported_rope_type(llama_dir, tmp_path):
    d = copy(llama_dir, tmp_path)
    edit_config(d, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    with pytest.raises(ModelLoadError, match="yarn"):
        LLM(d, kv_cache_memory="4MiB")


def test_mistral_sliding_window_refused_unless_it_never_applies(model_dirs, tmp_path):
    d = copy(model_dirs("mistral"), tmp_path)
    edit_config(d, sliding_window=256)
    with pytest.raises(ModelLoadError, match="sliding_window=256"):
        LLM(d, kv_cache_memory="4MiB", max_model_len=512)
    with LLM(d, kv_cache_memory="4MiB", max_model_len=256) as llm:
        assert llm.runtime.max_model_len == 256


def _write_json(d, name, value):
    (d / name).write_text(json.dumps(value))


@pytest.mark.parametrize("break_it, match", [
    (lambda d: _write_json(d, "config.json", [1]), "config.json must hold a JSON object"),
    (lambda d: edit_config(d, num_attention_heads=0), "must be positive"),
    (lambda d: edit_config(d, num_hidden_layers=0), "must be positive"),
    (lambda d: edit_config(d, rope_parameters=None, rope_scaling=[1]), "rope scaling"),
    (lambda d: edit_config(d, quantization_config={"quant_method": "fp8"}),
     "quantized checkpoints are not supported.*fp8"),
    (lambda d: _write_json(d, "tokenizer_config.json", [1]), "tokenizer_config.json must"),
    (lambda d: (d / "tokenizer_config.json").write_bytes(b'{"a": "\xff"}'),
     "tokenizer_config.json is not valid JSON"),
    (lambda d: _write_json(d, "generation_config.json", [1]), "generation_config.json must"),
    (lambda d: _write_json(d, "generation_config.json", {"eos_token_id": "x"}),
     "eos_token_id must be a token id"),
    (lambda d: (d / "chat_template.jinja").write_text("{% for m in messages %}{{ m }"),
     "chat template does not compile"),
])
def test_malformed_checkpoint_files_are_model_load_errors(llama_dir, tmp_path, break_it,
                                                          match):
    d = copy(llama_dir, tmp_path)
    break_it(d)
    with pytest.raises(ModelLoadError, match=match):
        LLM(d, kv_cache_memory="4MiB")


def test_quantized_weights_are_refused(llama_dir, tmp_path):
    """Weights stored in a quantized dtype (fp8, int8) with no quantization_config: cast to
    float their values are garbage, so they are refused by name."""
    from safetensors.torch import load_file, save_file
    d = copy(llama_dir, tmp_path)
    tensors = load_file(d / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=rf"{name}.*float8_e4m3fn"):
        LLM(d, kv_cache_memory="4MiB")


def test_chat_templates_use_what_transformers_allows(llama_dir, tmp_path):
    """{% break %} / {% continue %} and {% generation %} render as under transformers."""
    d = copy(llama_dir, tmp_path)
    (d / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
        "{% generation %}<{{ m['role'] }}>{{ m['content'] }}{% endgeneration %}"
        "{% endfor %}")
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    with LLM(d, kv_cache_memory="4MiB") as llm:
        assert llm.tokenizer.render_chat(msgs, add_generation_prompt=False) == "<user>hi"


def test_rope_parameters_without_their_theta(llama_dir, tmp_path):
    """The current layout's rope_parameters may leave rope_theta at the top level: the
    scaling still applies (it was read as plain RoPE)."""
    d = copy(llama_dir, tmp_path)
    edit_config(d, rope_parameters={"rope_type": "linear", "factor": 2.0}, rope_theta=5e5)
    rope = load_model_spec(d).rope
    assert (rope.rope_type, rope.factor, rope.theta) == ("linear", 2.0, 5e5)


def test_eos_ids_follow_transformers(llama_dir, tmp_path):
    """generation_config.json's eos_token_id, else config.json's (a list too), else the
    tokenizer's eos_token."""
    d = copy(llama_dir, tmp_path)
    (d / "generation_config.json").unlink()
    edit_config(d, eos_token_id=[2, 0])
    with LLM(d, kv_cache_memory="4MiB") as llm:
        assert llm.tokenizer.eos_token_ids == {0, 2}


def test_a_mistral_config_without_a_window_has_mistrals_default(model_dirs, tmp_path):
    """transformers' MistralConfig applies a 4096 window when config.json has no
    sliding_window key: so does the check that refuses windows shorter than the context."""
    d = copy(model_dirs("mistral"), tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("sliding_window", None)
    cfg["max_position_embeddings"] = 8192
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="sliding_window=4096"):
        LLM(d, kv_cache_memory="64MiB", max_model_len=8192)


@pytest.mark.parametrize("kwargs, match", [
    ({"dtype": "float64"}, "dtype"),
    ({"kv_cache_dtype": "int4"}, "kv_cache_dtype"),
    ({"block_size": 24}, "block_size"),
    ({"kv_cache_memory": "lots"}, "kv_cache_memory"),
    # (None fits the budget: an explicit value that cannot is refused, naming it)
    ({"kv_cache_memory": "64KiB", "max_model_len": 4096}, "max_model_len=4096 does not fit"),
    ({"device": "tpu"}, "device"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"remote_prefill": "sometimes"}, "remote_prefill"),
    ({"attention_backend": "cudnn"}, "attention_backend"),
    ({"prefill_worker": "localhost:5555"}, "prefill_worker"),
    ({"max_pinned_fraction": 1.5}, "max_pinned_fraction"),
])
def test_config_errors_name_the_argument(llama_dir, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        LLM(llama_dir, **{"kv_cache_memory": "4MiB", **kwargs})


def test_model_dir_errors(tmp_path):
    with pytest.raises(ConfigError, match="not a directory"):
        LLM(tmp_path / "nope")
    with pytest.raises(ConfigError, match="config.json"):
        LLM(tmp_path)


def test_bad_requests(llama_dir):
    with LLM(llama_dir, kv_cache_memory="4MiB", max_model_len=64) as llm:
        with pytest.raises(ConfigError, match="vocabulary"):
            llm.generate(prompt_token_ids=[[1, 2, 10**6]], use_tqdm=False)
        with pytest.raises(ConfigError, match="max_model_len"):
            llm.generate(prompt_token_ids=[list(range(64))], use_tqdm=False)
        with pytest.raises(ConfigError, match="at least one token"):
            llm.generate(prompt_token_ids=[[]], use_tqdm=False)
        # the engine is unaffected
        out = llm.generate("hello", SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
        assert len(out[0].token_ids) == 3


@pytest.mark.parametrize("kwargs", [
    {"max_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_k": 0},
    {"logprobs": -2}, {"stop": [""]}, {"stop_token_ids": [-1]},
])
def test_sampling_params_validation(kwargs):
    with pytest.raises(ConfigError):
        SamplingParams(**kwargs)


def test_all_errors_derive_from_base():
    assert issubclass(ConfigError, KVSessionError) and issubclass(ModelLoadError, KVSessionError)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
@pytest.mark.parametrize("fields", [
    {"use_sliding_window": False, "sliding_window": 64},
    {"use_sliding_window": True, "sliding_window": 64},  # max_window_layers 28 > 2 layers
    {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1},
    {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0},
    {"use_sliding_window": True, "sliding_window": None, "max_window_layers": 0},
    {"use_sliding_window": True, "sliding_window": 64,
     "layer_types": ["full_attention", "full_attention"]},
    {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0,
     "layer_types": ["full_attention", "full_attention"]},
    {"use_sliding_window": True, "sliding_window": 64,
     "layer_types": ["full_attention", "sliding_attention"]},
])
def test_a_qwen_window_counts_only_where_transformers_applies_it(model_dirs, tmp_path, arch,
                                                                 fields):
    """Qwen2/3 apply sliding_window only with use_sliding_window, and only on the layers
    layer_types names (by default those from max_window_layers on): the window kvsession
    refuses is the one transformers' layers use (the oracle), no more, no less."""
    transformers = pytest.importorskip("transformers")
    d = copy(model_dirs(arch), tmp_path)
    edit_config(d, **fields)
    hf = transformers.AutoConfig.from_pretrained(d)
    applied = hf.sliding_window if "sliding_attention" in hf.layer_types else None
    assert load_model_spec(d).sliding_window == applied
    if applied is not None:
        with pytest.raises(ModelLoadError, match=f"sliding_window={applied}"):
            LLM(d, kv_cache_memory="4MiB", max_model_len=128)
    with LLM(d, kv_cache_memory="4MiB", max_model_len=64) as llm:
        assert llm.runtime.max_model_len == 64


def test_max_model_len_none_fits_the_budget_and_the_window(model_dirs, tmp_path, caplog):
    """max_model_len=None: the checkpoint's length clamped to what the KV budget holds (and
    to a sliding window kvsession does not implement), logged with why; an explicit value
    that does not fit names the largest that does."""
    import logging

    d = copy(model_dirs("mistral"), tmp_path)
    edit_config(d, max_position_embeddings=8192, sliding_window=None)
    # (the fit is whatever the budget holds, in whole blocks of 16 tokens)
    with caplog.at_level(logging.INFO, logger="kvsession"):
        with LLM(d, kv_cache_memory="1MiB") as llm:
            fitted = llm.runtime.max_model_len
    assert 2 <= fitted < 8192 and fitted % 16 == 0
    assert f"max_model_len={fitted}: what kv_cache_memory holds" in caplog.text
    with pytest.raises(ConfigError, match=f"largest max_model_len that fits is {fitted}"):
        LLM(d, kv_cache_memory="1MiB", max_model_len=fitted + 1)
    with LLM(d, kv_cache_memory="1MiB", max_model_len=fitted) as llm:
        assert llm.runtime.max_model_len == fitted
    with LLM(d, kv_cache_memory="64MiB") as llm:  # room for all of it: the checkpoint's
        assert llm.runtime.max_model_len == 8192
    edit_config(d, sliding_window=1024)  # a window that would apply: kept below it
    with LLM(d, kv_cache_memory="64MiB") as llm:
        assert llm.runtime.max_model_len == 1024
    with pytest.raises(ConfigError, match="too little for any sequence"):
        LLM(d, kv_cache_memory=1)
