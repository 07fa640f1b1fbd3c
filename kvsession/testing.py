"""Deterministic tiny random-weight checkpoints for tests, the demo, examples and benchmarks.

`make_tiny_model(path, arch="llama")` writes a complete HF checkpoint directory: config.json,
safetensors (optionally sharded with an index), a byte-level BPE tokenizer.json trained with
the `tokenizers` library on text generated here (so it has real merges), tokenizer_config.json
with special tokens, a ChatML chat template and generation_config.json. Nothing is downloaded.
The same arguments always write the same bytes.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvsession.errors import ConfigError
from kvsession.model.config import load_model_spec
from kvsession.model.loader import expected_shapes

ARCHS = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
# a tiny checkpoint's reply bound (generation_config.json's max_new_tokens): vLLM's default
# max_tokens, so a chat or session turn of a random model is as short as a generate()
TINY_MAX_NEW_TOKENS = 16
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Test templates in the three tool-call families' formats, written for the tiny tokenizer
# (its only special tokens are ChatML's, so other families' markers are plain text and
# <|im_end|> ends every turn, as the model's EOS). Each renders `tools`, assistant
# `tool_calls` (arguments as a dict, the HF convention) and tool results like its family.
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n' }}</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}"
    "{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and loop.first %}"
    "{% elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{ '<|im_start|>assistant' }}"
    "{% if message['content'] %}{{ '\\n' + message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] %}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' "
    "+ (call['function']['arguments'] | tojson) + '}\\n</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Qwen3's shape of the Hermes template: a reasoning model's (its replies think in
# <think>...</think> first); chat_template_kwargs={"enable_thinking": False} writes an
# empty thinking block into the generation prompt, as Qwen3's does
QWEN3_TEMPLATE = HERMES_TEMPLATE.replace(
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}")
LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools or messages[0]['role'] == 'system' %}"
    "{{ '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{% if tools %}{{ 'Environment: ipython\\n' }}{% endif %}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% endif %}"
    "{% if tools %}{{ '\\nYou have access to the following functions. To call a function, "
    "respond with JSON for a function call. Respond in the format {\"name\": function name, "
    "\"parameters\": dictionary of argument name and its value}. Do not use variables.\\n' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}{% endif %}"
    "{{ '<|im_end|>' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and loop.first %}"
    "{% elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{% if message['tool_calls'] | length != 1 %}"
    "{{ raise_exception('This model only supports single tool-calls at once!') }}{% endif %}"
    "{% set call = message['tool_calls'][0]['function'] %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n{\"name\": \"' + call['name'] "
    "+ '\", \"parameters\": ' + (call['arguments'] | tojson) + '}<|im_end|>' }}"
    "{% elif message['role'] in ('tool', 'ipython') %}"
    "{{ '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message['content'] "
    "+ '<|im_end|>' }}"
    "{% else %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' "
    "+ message['content'] + '<|im_end|>' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}"
    "{% set system = messages[0]['content'] if messages[0]['role'] == 'system' else '' %}"
    "{% set ns = namespace(last_user=-1) %}"
    "{% for message in messages %}{% if message['role'] == 'user' %}"
    "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and loop.first %}"
    "{% elif message['role'] == 'user' %}"
    "{% if tools and loop.index0 == ns.last_user %}{{ '[AVAILABLE_TOOLS][' }}"
    "{% for tool in tools %}{{ (tool | tojson) + (', ' if not loop.last else '') }}"
    "{% endfor %}{{ '][/AVAILABLE_TOOLS]' }}{% endif %}"
    "{{ '[INST]' }}{% if system and loop.index0 == ns.last_user %}"
    "{{ system + '\\n\\n' }}{% endif %}{{ message['content'] + '[/INST]' }}"
    "{% elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{ '[TOOL_CALLS][' }}{% for call in message['tool_calls'] %}"
    "{{ '{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' "
    "+ (call['function']['arguments'] | tojson) + ', \"id\": \"' + call['id'] + '\"}' "
    "+ (', ' if not loop.last else '') }}{% endfor %}{{ ']<|im_end|>' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '[TOOL_RESULTS]{\"content\": ' + (message['content'] | tojson) "
    "+ ', \"call_id\": \"' + message['tool_call_id'] + '\"}[/TOOL_RESULTS]' }}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}"
    "{% endif %}{% endfor %}"
)
CHAT_TEMPLATES = {"chatml": CHATML_TEMPLATE, "hermes": HERMES_TEMPLATE, "qwen3": QWEN3_TEMPLATE,
                  "llama3": LLAMA3_TEMPLATE, "mistral": MISTRAL_TEMPLATE}
_WORDS = (
    "the agent reads a file and calls a tool then writes the answer to the user who asked for "
    "a list of files in the project with tests docs code and data while the model keeps its "
    "cache of keys and values for every token of the conversation so that the next turn only "
    "computes new tokens session system prompt you are a helpful coding assistant run python "
    "script error fix bug function class return value import module path directory open close "
    "read write json result status ok failed retry search query answer question context memory "
    "block page table hash prefix reuse spill restore disk host device kernel attention layer "
    "head token batch step schedule request response stream time cost model weight matrix"
).split()


def _corpus(seed: int, num_lines: int = 3000) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for i in range(num_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 18))]
        if i % 5 == 0:
            call = {"tool": words[0], "args": words[1:4], "n": rng.randint(0, 999)}
            lines.append(json.dumps(call))
        elif i % 7 == 0:
            lines.append(f"def {words[0]}_{words[1]}(x): return x + {rng.randint(0, 99)}")
        else:
            lines.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ":"]))
    return lines


def build_tokenizer(vocab_size: int = 512, seed: int = 0):
    """A byte-level BPE `tokenizers.Tokenizer` with ChatML special tokens and real merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(seed), trainer)
    return tok


def _config(arch: str, vocab_size: int, layout: str, overrides: dict,
            dtype: str = "float32") -> dict:
    architecture, model_type = ARCHS[arch]
    cfg = {
        "architectures": [architecture], "model_type": model_type, "vocab_size": vocab_size,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": arch in ("qwen2", "qwen3"), "attention_bias": False,
        "bos_token_id": 0, "eos_token_id": 2, "initializer_range": 0.02,
    }
    if arch == "mistral":
        cfg["sliding_window"] = None
    if arch in ("qwen2", "qwen3"):
        cfg["use_sliding_window"] = False
    rope_theta = overrides.pop("rope_theta", 10000.0)
    rope_scaling = overrides.pop("rope_scaling", None)
    cfg.update(overrides)
    if layout == "classic":
        cfg |= {"rope_theta": rope_theta, "torch_dtype": dtype}
        if rope_scaling:
            cfg["rope_scaling"] = rope_scaling
    else:
        params = {"rope_type": "default", **(rope_scaling or {}), "rope_theta": rope_theta}
        cfg |= {"rope_parameters": params, "dtype": dtype}
    return cfg


def _random_weights(model_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    spec = load_model_spec(model_dir)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in expected_shapes(spec).items():
        if name.endswith("norm.weight"):  # near 1, so the norms matter for parity tests
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith("bias"):
            t = 0.05 * torch.randn(shape, generator=gen)
        else:
            t = 0.08 * torch.randn(shape, generator=gen)
        tensors[name] = t.contiguous()
    return tensors


def make_tiny_model(path, arch: str = "llama", seed: int = 0, layout: str = "current",
                    num_shards: int = 1, tokenizer_vocab_size: int = 512,
                    chat_template: str = "chatml", generation_config: dict | None = None,
                    dtype: str = "float32", **config_overrides) -> Path:
    """Write a deterministic random checkpoint of `arch` to `path`; returns the path.

    layout: "current" (rope_parameters, dtype, chat_template.jinja, merges as pairs) or
    "classic" (rope_theta/rope_scaling, torch_dtype, chat_template in tokenizer_config.json,
    merges as space-joined strings). chat_template: "chatml" (no tools), or a template in
    one tool-call family's format: "hermes" (Qwen/Hermes <tool_call>), "llama3" (Llama 3
    JSON) or "mistral" ([TOOL_CALLS]). config_overrides replace config.json fields (e.g.
    hidden_size=512, num_hidden_layers=8, vocab_size=32000, rope_scaling={...}); a vocab_size
    above the tokenizer's size leaves the extra ids without text. generation_config: fields
    merged into generation_config.json (None removes one); by default it bounds a reply at
    TINY_MAX_NEW_TOKENS, as a checkpoint may (`max_new_tokens`): a random model seldom
    samples its end-of-turn token, and a chat or session turn runs until it does. dtype:
    the weights' ("float32", "bfloat16" or "float16"), named in config.json too.
    """
    if arch not in ARCHS:
        raise ConfigError(f"arch={arch!r} is not supported; accepted: {sorted(ARCHS)}")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"dtype={dtype!r}: accepted 'float32', 'bfloat16', 'float16'")
    if layout not in ("current", "classic"):
        raise ConfigError(f"layout={layout!r}; accepted: ['classic', 'current']")
    if chat_template not in CHAT_TEMPLATES:
        raise ConfigError(f"chat_template={chat_template!r}; accepted: "
                          f"{sorted(CHAT_TEMPLATES)}")
    template = CHAT_TEMPLATES[chat_template]
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(tokenizer_vocab_size, seed=0)
    tok_json = json.loads(tok.to_str())
    if layout == "classic":
        tok_json["model"]["merges"] = [" ".join(m) for m in tok_json["model"]["merges"]]
    (out / "tokenizer.json").write_text(json.dumps(tok_json, ensure_ascii=False))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    overrides = dict(config_overrides)
    overrides.setdefault("vocab_size", vocab)
    if overrides["vocab_size"] < vocab:
        raise ConfigError(f"vocab_size must be >= the tokenizer's {vocab}")
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    overrides.setdefault("bos_token_id", ids["<|endoftext|>"])
    overrides.setdefault("eos_token_id", ids["<|im_end|>"])
    (out / "config.json").write_text(json.dumps(_config(arch, vocab, layout, overrides, dtype),
                                                indent=2))
    tcfg = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
            "model_max_length": 2048, "tokenizer_class": "PreTrainedTokenizerFast"}
    if layout == "classic":
        tcfg["chat_template"] = template
        # a template file left by an earlier build would take precedence over this one
        (out / "chat_template.jinja").unlink(missing_ok=True)
    else:
        (out / "chat_template.jinja").write_text(template)
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2))
    gen = {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
           "bos_token_id": ids["<|endoftext|>"], "max_new_tokens": TINY_MAX_NEW_TOKENS}
    gen = {k: v for k, v in {**gen, **(generation_config or {})}.items() if v is not None}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    weights = _random_weights(out, seed)
    _write_weights(out, {n: t.to(getattr(torch, dtype)) for n, t in weights.items()},
                   num_shards)
    return out


def _write_weights(out: Path, tensors: dict[str, torch.Tensor], num_shards: int) -> None:
    for stale in list(out.glob("model*.safetensors")) + list(out.glob("*.index.json")):
        stale.unlink()
    meta = {"format": "pt"}
    if num_shards <= 1:
        save_file(tensors, str(out / "model.safetensors"), metadata=meta)
        return
    names = sorted(tensors)
    weight_map = {}
    for i in range(num_shards):
        fname = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::num_shards]}
        save_file(part, str(out / fname), metadata=meta)
        weight_map |= {n: fname for n in part}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


class ReplayLookup:
    """A draft source with a known acceptance, for speculation's tests and benchmarks
    (`Drafter.replace_lookup`): a prompt's drafts are the next `num_tokens` tokens of the
    output a run without drafts gave it (`outputs`: prompt token ids -> output token ids),
    each replaced by a random token with probability 1 - `accept` (seeded). Greedy, the
    model keeps every draft up to the first replaced one; a prompt it does not know gets no
    drafts."""

    def __init__(self, outputs: dict[tuple[int, ...], list[int]], num_tokens: int,
                 vocab_size: int, accept: float = 1.0, seed: int = 0):
        self.outputs, self.num_tokens = outputs, num_tokens
        self.vocab_size, self.accept = vocab_size, accept
        self.rng = random.Random(seed)

    def __call__(self, seq, max_tokens: int) -> list[int]:
        known = self.outputs.get(tuple(seq.token_ids[:seq.num_prompt_tokens]), [])
        done = seq.num_output_tokens
        return [t if self.rng.random() < self.accept else self.rng.randrange(self.vocab_size)
                for t in known[done: done + min(max_tokens, self.num_tokens)]]
