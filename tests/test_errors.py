"""Bad checkpoints raise ModelLoadError, bad arguments ConfigError, before memory is taken."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from kvsession import LLM, ConfigError, KVSessionError, ModelLoadError, SamplingParams


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


@pytest.mark.parametrize("kwargs, match", [
    ({"dtype": "float64"}, "dtype"),
    ({"kv_cache_dtype": "int4"}, "kv_cache_dtype"),
    ({"block_size": 24}, "block_size"),
    ({"kv_cache_memory": "lots"}, "kv_cache_memory"),
    ({"kv_cache_memory": "64KiB"}, "max_model_len"),
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
