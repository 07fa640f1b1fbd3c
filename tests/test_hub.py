"""Hub ids: `LLM("org/name")` loads a checkpoint from the Hugging Face cache, laid out
here by the test (refs/main -> snapshots/<commit>/files), with HF_HUB_OFFLINE=1: nothing
is downloaded. Each case runs in a child process, since huggingface_hub reads HF_HOME and
HF_HUB_OFFLINE when it is imported."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from kvsession import LLM, ConfigError
from kvsession.flags import add_llm_flags
from kvsession.model.hub import is_hub_id

pytest.importorskip("huggingface_hub")
COMMIT, OTHER = "a" * 40, "b" * 40


@pytest.fixture(scope="module")
def hf_home(model_dirs, tmp_path_factory):
    """A Hugging Face cache holding acme/tiny (main and a tagged older revision)."""
    home = tmp_path_factory.mktemp("hf")
    repo = home / "hub" / "models--acme--tiny"
    for commit in (COMMIT, OTHER):
        snap = repo / "snapshots" / commit
        shutil.copytree(model_dirs("qwen3"), snap)
    # the tagged revision names another served-model length: which one loaded is visible
    cfg = json.loads((repo / "snapshots" / OTHER / "config.json").read_text())
    cfg["max_position_embeddings"] = 96
    (repo / "snapshots" / OTHER / "config.json").write_text(json.dumps(cfg))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    (repo / "refs" / "v0").write_text(OTHER)
    return home


def run(hf_home, code: str, **env) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", **env}
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_hub_id_loads_from_the_cache(hf_home):
    r = run(hf_home, """
        from kvsession import LLM, SamplingParams
        with LLM("acme/tiny", kv_cache_memory="4MiB") as llm:
            print(llm.config.model.name, llm.runtime.max_model_len)
            print(len(llm.generate("hi", SamplingParams(max_tokens=4), use_tqdm=False)[0]
                      .token_ids))
        with LLM("acme/tiny", revision="v0", kv_cache_memory="4MiB") as llm:
            print(llm.config.model.name, llm.runtime.max_model_len)
        """)
    assert r.returncode == 0, r.stderr
    first, generated, tagged = r.stdout.split("\n")[:3]
    assert first.split()[0] == COMMIT and generated == "4"
    assert tagged.split() == [OTHER, "96"]


def test_missing_repos_and_revisions_are_typed_errors_at_once(hf_home, tmp_path):
    r = run(hf_home, """
        import time
        from kvsession import LLM, ModelLoadError
        for kw in ({"model": "acme/missing"}, {"model": "acme/tiny", "revision": "v9"}):
            t0 = time.monotonic()
            try:
                LLM(kv_cache_memory="4MiB", **kw)
            except ModelLoadError as e:
                print(round(time.monotonic() - t0) < 10, e)
        """)
    assert r.returncode == 0, r.stderr
    missing, revision = r.stdout.strip().split("\n")
    assert missing.startswith("True model='acme/missing'") and "not in the Hugging Face " \
        "cache" in missing
    assert revision.startswith("True model='acme/tiny'") and "'v9'" in revision


def test_download_dir_is_the_cache_it_reads(hf_home, tmp_path):
    r = run(tmp_path, f"""
        from kvsession import LLM
        with LLM("acme/tiny", download_dir={str(hf_home / "hub")!r},
                 kv_cache_memory="4MiB") as llm:
            print(llm.config.model.name)
        """)
    assert r.returncode == 0 and r.stdout.strip() == COMMIT, r.stderr


def test_hub_arguments_are_checked(llama_dir):
    assert is_hub_id("Qwen/Qwen3-0.6B") and not is_hub_id(str(llama_dir))
    assert not is_hub_id("no-slash") and not is_hub_id("a/b/c")
    with pytest.raises(ConfigError, match="revision and download_dir apply to a hub id"):
        LLM(llama_dir, revision="main")
    with pytest.raises(ConfigError, match="revision"):
        LLM("acme/tiny", revision=3)
    parser = argparse.ArgumentParser()
    add_llm_flags(parser, LLM)
    args = parser.parse_args(["--model", "acme/tiny", "--revision", "v0",
                              "--download-dir", "/tmp/x"])
    assert (args.model, args.revision, args.download_dir) == ("acme/tiny", "v0", "/tmp/x")
