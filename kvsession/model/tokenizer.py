"""Tokenizer and chat template: `tokenizers` for text <-> ids, sandboxed jinja2 for chats.

Both checkpoint layouts load: the chat template from `chat_template.jinja` (current) or from
`tokenizer_config.json["chat_template"]` (classic, a string or a list of named templates);
BPE merges as pairs or as space-joined strings (the `tokenizers` library reads both).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from kvsession.errors import ConfigError, ModelLoadError


def _raise_exception(message: str):
    raise TemplateError(message)


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older tokenizer_config files
        return value.get("content")
    return value


class Tokenizer:
    """Encodes, decodes and renders chats for one checkpoint. Immutable after construction,
    safe to share between threads."""

    def __init__(self, model_dir: Path, config_eos_ids: list[int] | None = None):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"missing file: {path}")
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as e:
            raise ModelLoadError(f"cannot read {path}: {e}") from None
        tcfg = {}
        if (model_dir / "tokenizer_config.json").is_file():
            try:
                tcfg = json.loads((model_dir / "tokenizer_config.json").read_text())
            except json.JSONDecodeError as e:
                raise ModelLoadError(f"tokenizer_config.json is not valid JSON: {e}") from None
        self.bos_token = _token_text(tcfg.get("bos_token"))
        self.eos_token = _token_text(tcfg.get("eos_token"))
        self.chat_template = self._find_template(model_dir, tcfg)
        self.eos_token_ids = self._find_eos_ids(model_dir, config_eos_ids)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._env.globals["raise_exception"] = _raise_exception
        self._template = (self._env.from_string(self.chat_template)
                          if self.chat_template else None)
        self.digest = hashlib.sha256(path.read_bytes()).hexdigest()
        self.template_digest = hashlib.sha256((self.chat_template or "").encode()).hexdigest()

    @staticmethod
    def _find_template(model_dir: Path, tcfg: dict) -> str | None:
        jinja = model_dir / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text()
        tpl = tcfg.get("chat_template")
        if isinstance(tpl, list):  # [{"name": "default", "template": "..."}, ...]
            named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
            return named.get("default") or next(iter(named.values()), None)
        return tpl

    def _find_eos_ids(self, model_dir: Path, config_eos_ids: list[int] | None) -> frozenset[int]:
        ids: list[int] = []
        gen = model_dir / "generation_config.json"
        if gen.is_file():
            try:
                eos = json.loads(gen.read_text()).get("eos_token_id")
            except json.JSONDecodeError as e:
                raise ModelLoadError(f"generation_config.json is not valid JSON: {e}") from None
            ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
        if not ids and config_eos_ids:
            ids += config_eos_ids
        if not ids and self.eos_token is not None:
            tid = self._tok.token_to_id(self.eos_token)
            ids += [tid] if tid is not None else []
        return frozenset(int(i) for i in ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The conversation as the model's chat template writes it (sandboxed jinja2)."""
        if self._template is None:
            raise ConfigError("this checkpoint has no chat template; use generate() instead")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ConfigError(
                    f"each chat message must be a dict with 'role' and 'content', got {m!r}")
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except TemplateError as e:
            raise ConfigError(f"the chat template rejected the conversation: {e}") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        # Templates write their own special tokens (bos included), as HF apply_chat_template.
        return self.encode(self.render_chat(messages, add_generation_prompt),
                           add_special_tokens=False)
