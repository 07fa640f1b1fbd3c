"""Compiled regions kept on disk (model/region_store.py): a one-token step compiled ahead of
time, stored, and loaded by a later process instead of traced again: transformers' tokens
either way; a stored file that does not load is compiled again; a call unlike the first runs
through dynamo."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from internals import CHILD_PRELUDE

from kvsession import SamplingParams
from kvsession.model import region_store
from kvsession.model.onerow import DENSE_OPTIONS, head
from kvsession.model.region_store import RegionStore, StoredRegion, region_key
from oracle import hf_greedy, random_prompts

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)

# builds the LLM, the whole-step regions through a store, and generates: what the store
# did and the tokens, as JSON (the parent and the children run the same code)
RUN = """
import json, sys
from internals import Internals
from kvsession import LLM, SamplingParams
from kvsession.model.onerow import OneRowKernels
from kvsession.model.region_store import RegionStore

def run(model_dir, store_dir, prompts):
    with LLM(model_dir, max_model_len=256, kv_cache_memory="4MiB",
             cpu_weight_layout="dual") as llm:
        ins = Internals(llm)
        model, kv = ins.model, ins.kv_pool
        kernels = model.one_row = OneRowKernels.for_model(model)  # tiny: never measured
        kernels.select_attention(kernel=True)
        store = RegionStore(store_dir)
        kernels.attach_store(store)
        assert kernels.warm_up(llm.runtime.spec, kv, model.softmax_scale,
                               model.token_tables())
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        tokens = [llm.generate(prompt_token_ids=[p], sampling_params=params,
                               use_tqdm=False)[0].token_ids for p in prompts]
        return {"loaded": store.loaded, "compiled": store.compiled, "failed": store.failed,
                "tokens": tokens, "stored_calls": kernels.decode.stored_calls,
                "head_calls": kernels.head.stored_calls}
"""


def child(model_dir, store_dir, prompts) -> dict:
    code = CHILD_PRELUDE + RUN + (
        f"print(json.dumps(run({str(model_dir)!r}, {str(store_dir)!r}, {prompts!r})))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_step_compiled_into_the_store_is_loaded_by_the_next_process(model_dirs, tmp_path):
    """The first process compiles the whole-step region and the output head ahead of time
    and stores them; a second loads both (compiling nothing); a third finds the files
    damaged, compiles them again and rewrites them. transformers' greedy tokens every
    time, every one-token step served by the stored function."""
    d = model_dirs("qwen2", tie_word_embeddings=True)  # the head aliases the embedding
    prompts = random_prompts(2, [1, 30], 500)
    ref = hf_greedy(d, prompts, GREEDY.max_tokens)
    store_dir = tmp_path / "compiled"
    scope: dict = {}
    exec(RUN, scope)  # the same code in this process: the first compiles
    first = scope["run"](d, store_dir, prompts)
    files = sorted(store_dir.glob("*.aot"))
    assert (first["loaded"], first["compiled"], first["failed"]) == (0, 2, 0)
    assert len(files) == 2 and first["tokens"] == ref
    # every decode step of both prompts went through the stored function
    assert first["stored_calls"] >= (GREEDY.max_tokens - 1) * len(prompts)

    second = child(d, store_dir, prompts)
    assert (second["loaded"], second["compiled"], second["failed"]) == (2, 0, 0)
    assert second["tokens"] == ref and second["stored_calls"] == first["stored_calls"]

    for f in files:
        f.write_bytes(f.read_bytes()[:100])  # a truncated file
    third = child(d, store_dir, prompts)
    assert (third["loaded"], third["compiled"], third["failed"]) == (0, 2, 2)
    assert third["tokens"] == ref and third["stored_calls"] == first["stored_calls"]
    assert all(f.stat().st_size > 100 for f in files)  # stored again, whole


def test_a_call_unlike_the_first_runs_through_dynamo(tmp_path):
    """The stored function serves calls shaped as its first; another shape runs through
    the plain dynamo region, as torch.compile would: the right result either way."""
    g = torch.Generator().manual_seed(0)
    region = StoredRegion(head, dynamic=False, options=DENSE_OPTIONS)
    store = RegionStore(tmp_path)
    region.attach(store)
    h, w, w2 = (torch.randn(s, generator=g) for s in ((1, 8), (16, 8), (12, 8)))
    with torch.inference_mode():
        torch.testing.assert_close(region(h, w, None), head(h, w, None))
        torch.testing.assert_close(region(h, w2, None), head(h, w2, None))
        torch.testing.assert_close(region(h, w, None), head(h, w, None))
    assert store.compiled == 1 and region.stored_calls == 2


def test_the_store_keeps_the_most_recently_used_files(tmp_path, monkeypatch):
    """Past MAX_STORED_FILES, storing another removes the least recently used (loading a
    file counts as a use)."""
    monkeypatch.setattr(region_store, "MAX_STORED_FILES", 2)
    store = RegionStore(tmp_path)
    h = torch.ones(1, 8)

    def run(rows: int) -> None:
        region = StoredRegion(head, dynamic=False, options=DENSE_OPTIONS)
        region.attach(store)
        with torch.inference_mode():
            region(h, torch.ones(rows, 8), None)

    run(4)
    run(5)
    first, second = sorted(tmp_path.glob("*.aot"), key=lambda f: f.stat().st_mtime)
    os.utime(first, (1, 1))
    os.utime(second, (2, 2))
    run(4)  # loads the first file: now the most recently used
    assert store.loaded == 1 and first.stat().st_mtime > 2
    run(6)  # a third: the second, least recently used, goes
    assert first.exists() and not second.exists()
    assert len(list(tmp_path.glob("*.aot"))) == 2 and store.compiled == 3


def test_the_key_follows_what_the_compiled_code_depends_on():
    """Another shape, stride, dtype, value or aliasing among the arguments is another file;
    a dimension marked unbacked is not part of it."""
    a, b = torch.zeros(4, 8), torch.zeros(4, 8)
    ids, longer = torch.zeros(2, dtype=torch.long), torch.zeros(5, dtype=torch.long)

    def key(*args):
        return region_key(head, args, DENSE_OPTIONS)

    base = key(a, [b], 1.0)
    assert key(a, [b], 1.0) == base
    assert key(a, [a], 1.0) != base  # the list's tensor is the first argument
    assert key(a.t().contiguous().t(), [b], 1.0) != base  # strides
    assert key(a.double(), [b], 1.0) != base and key(a, [b], 2.0) != base
    assert key(torch.zeros(4, 9), [b], 1.0) != base
    assert key(ids) != key(longer)
    torch._dynamo.decorators.mark_unbacked(ids, 0)
    torch._dynamo.decorators.mark_unbacked(longer, 0)
    assert key(ids) == key(longer)
