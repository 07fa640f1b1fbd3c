"""Hub ids (`LLM("Qwen/Qwen3-0.6B")`): a checkpoint named `org/name` is fetched into the
Hugging Face cache through `huggingface_hub` (the `hub` extra) and loaded from there, as a
directory would be. huggingface_hub honours HF_HOME, HF_HUB_OFFLINE (only the cache is
read) and HF_TOKEN. Only what loading reads is fetched: configs, safetensors weights,
tokenizer files and chat templates (never .bin / .pt weights, which are pickles). A
missing repository, revision or file is a typed error at once; nothing waits without a
bound (huggingface_hub's own request timeouts)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from kvsession.errors import ConfigError, ModelLoadError

# "org/name": what the hub calls a repository id (a local path that exists wins)
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
# what loading a checkpoint reads (kvsession/model/config.py, loader.py, tokenizer.py)
FILES = ["config.json", "generation_config.json", "*.safetensors",
         "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
         "special_tokens_map.json", "chat_template.jinja", "tokenizer.model"]
# seconds huggingface_hub waits for the hub's answer about a file (its own default: 10)
ETAG_TIMEOUT_S = 10.0


def is_hub_id(model) -> bool:
    """`model` names a hub repository rather than a local directory."""
    return isinstance(model, str) and HUB_ID.fullmatch(model) is not None \
        and not os.path.exists(model)


def fetch(repo_id: str, revision: str | None, download_dir: Path | None) -> Path:
    """The local snapshot of `repo_id` (fetched if needed: only FILES)."""
    try:
        import huggingface_hub
        from huggingface_hub import errors
    except ImportError as e:
        raise ConfigError(f"model={repo_id!r} is a hub id: loading one needs the hub extra "
                          f"(pip install 'kvsession[hub]'), or pass a local checkpoint "
                          f"directory ({e})") from None
    try:
        path = huggingface_hub.snapshot_download(
            repo_id, revision=revision, cache_dir=download_dir, allow_patterns=FILES,
            etag_timeout=ETAG_TIMEOUT_S)
    except errors.RepositoryNotFoundError:
        raise ModelLoadError(f"model={repo_id!r}: no such repository on the hub (or it is "
                             f"private: set HF_TOKEN)") from None
    except errors.RevisionNotFoundError:
        raise ModelLoadError(f"model={repo_id!r}: no revision {revision!r}") from None
    except errors.LocalEntryNotFoundError:
        raise ModelLoadError(f"model={repo_id!r} (revision {revision or 'main'!r}) is not in "
                             f"the Hugging Face cache and cannot be fetched now "
                             f"(HF_HUB_OFFLINE, or no network)") from None
    except (errors.HfHubHTTPError, OSError, ValueError) as e:
        raise ModelLoadError(f"model={repo_id!r}: cannot fetch it: {e}") from None
    return Path(path)
