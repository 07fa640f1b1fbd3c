"""Real shapes: random-weight checkpoints with the exact configs of Qwen3-0.6B and
Llama-3.2-1B (bfloat16 safetensors, their real vocabulary sizes: 151,936 and 128,256; the
tiny tokenizer, since prompts are token ids), measured per weight format:

    load time, resident memory after load, decode tokens/s at batch 1 and 8, prefill of
    512 tokens

for kvsession bf16 (`dtype="auto"`: the checkpoint's), float32, int8 (`quantization=
"int8"`) and bf16 with the opt-in second layout (`cpu_weight_layout="dual"`), against
transformers on the same weights (bf16) and against the bandwidth bound measured in the
same run (a `sum` over 1 GiB between the measurements: bound = the bytes a decode step
reads / the best rate seen).

Each engine and format runs in a fresh child process (load time and resident memory are a
process's, and one format's allocator state must not slow the next); the parent samples the
bandwidth between children. Decode rate: two greedy runs of the same prompt, 8 and 8 + N
new tokens (eos ignored), N * batch / the time difference (prefill and start-up cancel
out); median of `--rounds`. Prefill: one 512-token prompt, one token out, prefix caching
off. Resident: RssAnon + RssFile growth over the process's state before loading (after the
libraries' first use), so it includes kvsession's KV budget (`--kv-cache-memory`, 1 GiB
by default, as #47's table).

Load time: kvsession keeps the one-token step it compiles on disk (model/region_store.py),
so a process loads what the first one compiled. The run gives kvsession a compiled store
of its own (a fresh $KVSESSION_CACHE sharing the built C++ kernels) and loads each
kvsession format twice: `first_load_s`, a child that only loads, compiling into the empty
store (inductor's own cache as the machine has it), then the measured child, which loads
from it (`load_s`, compared with llama.cpp's).

llama.cpp (`--llama-cpp-python PYTHON --llama-cpp-src DIR`: a Python with llama-cpp-python
installed, which builds from its sdist, and the sdist's `vendor/llama.cpp` for the
converter): the same checkpoint converted by llama.cpp's own convert_hf_to_gguf.py to bf16
and to q8_0 (run by this Python, which has torch and transformers; the converter's check
of the tokenizer's pre-tokenizer, which does not know the tiny test tokenizer, is told
"default": prompts are token ids), then measured by bench/llama_cpp_child.py with the
same method, in the same run.

Writes bench/results/real_shapes.json, and with --plot a figure; docs/benchmarks.md has
the table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import pyplot, save_figure, write_result
from decode_rates import answer_decode_rounds, rates

from kvsession.kernels.cpp_build import cache_dir
from kvsession.testing import make_tiny_model

SHAPES = {
    "qwen3-0.6b": ("qwen3", dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True)),
    "llama-3.2-1b": ("llama", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
        max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
}
# engine -> LLM keyword arguments (None: transformers)
ENGINES = {
    "kvsession bf16": {},
    "kvsession float32": {"dtype": "float32"},
    "kvsession int8": {"quantization": "int8"},
    "kvsession bf16 dual": {"cpu_weight_layout": "dual"},
    "transformers bf16": None,
}
LLAMA_CPP = {"llama.cpp bf16": "bf16", "llama.cpp q8_0": "q8_0"}  # engine -> GGUF outtype
CONVERT = """
import runpy, sys
import conversion.base as base
# the tiny test tokenizer is no tokenizer llama.cpp knows: its pre-tokenizer is "default",
# and it is a BPE tokenizer.json (no SentencePiece model to look for)
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
def no_sentencepiece(self):
    raise FileNotFoundError("tokenizer.model")
base.TextModel._set_vocab_sentencepiece = no_sentencepiece
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[1:]]
runpy.run_path("convert_hf_to_gguf.py", run_name="__main__")
"""


def checkpoint(name: str) -> Path:
    """The random bf16 checkpoint of shape `name` (built once, ~1-2 GB)."""
    arch, cfg = SHAPES[name]
    path = Path.home() / ".cache" / "kvsession" / f"bench-{name}"
    if not (path / "config.json").is_file():
        print(f"building {path} ...", flush=True)
        make_tiny_model(path, arch=arch, dtype="bfloat16", **cfg)
    return path


def resident_bytes() -> int:
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return sum(int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "RssFile"))


# ---- the child: one engine, one format ------------------------------------------------


def child(model: Path, engine: str, decode_tokens: int, rounds: int, kv: str,
          load_only: bool = False, answer_rounds: bool = False) -> dict:
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(0)

    def prompt(n: int) -> list[int]:
        return torch.randint(1000, vocab, (n,), generator=gen).tolist()

    if ENGINES[engine] is None:
        return hf_child(model, prompt, decode_tokens, rounds)
    from kvsession import LLM, SamplingParams
    from kvsession.testing import make_tiny_model as tiny

    warm = tiny(model.parent / "bench-real-shapes-warm")  # the libraries' first use
    LLM(warm, kv_cache_memory="4MiB", max_model_len=64).close()
    # and the compiler's (importing inductor, a first compile: ~0.23 GB whatever the model),
    # which builds the one-token step; that step's own code and graphs count as the model's
    torch.compile(lambda x: x + 1)(torch.zeros(1))
    gc.collect()
    before = resident_bytes()
    t = time.perf_counter()
    llm = LLM(model, device="cpu", kv_cache_memory=kv, max_model_len=2048,
              enable_prefix_caching=False, **ENGINES[engine])
    load_s = time.perf_counter() - t
    gc.collect()
    grew = resident_bytes() - before

    def run(prompts, n):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        return time.perf_counter() - t

    out = {"load_s": load_s, "resident_bytes": grew,
           "weight_bytes": llm.runtime.weight_bytes}
    if answer_rounds:  # bench/vs_llama_cpp.py's decode rounds
        answer_decode_rounds(run, prompt, decode_tokens, out)
    elif not load_only:
        out |= rates(run, prompt, decode_tokens, rounds)
    llm.close()
    return out


def hf_child(model: Path, prompt, decode_tokens: int, rounds: int) -> dict:
    from transformers import AutoModelForCausalLM

    torch.zeros(1) @ torch.zeros(1, 1)  # torch's own first use
    gc.collect()
    before = resident_bytes()
    t = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()
    load_s = time.perf_counter() - t
    gc.collect()
    grew = resident_bytes() - before

    @torch.inference_mode()
    def run(prompts, n):
        ids = torch.tensor(prompts)
        t = time.perf_counter()
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                    min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t

    out = {"load_s": load_s, "resident_bytes": grew,
           "weight_bytes": sum(p.numel() * p.element_size() for p in hf.parameters())}
    out |= rates(run, prompt, decode_tokens, rounds)
    return out


# ---- the parent ------------------------------------------------------------------------


class Bandwidth:
    """DRAM read rate: the best `sum` over 1 GiB (far beyond the caches), sampled between
    the children, so that the bound sees the machine of the run."""

    def __init__(self):
        self.buf = torch.ones(1 << 28)
        self.samples: list[float] = []

    def sample(self, n: int = 5) -> None:
        for _ in range(n):
            t = time.perf_counter()
            self.buf.sum()
            self.samples.append(self.buf.numel() * 4 / (time.perf_counter() - t))

    def sample_now(self, n: int = 3) -> float:
        """The best rate (bytes/s) of `n` samples taken now (kept in the run's samples)."""
        self.sample(n)
        return max(self.samples[-n:])

    @property
    def best(self) -> float:
        return max(self.samples)


def gguf(model: Path, outtype: str, src: Path) -> Path:
    """`model` converted by llama.cpp's converter (in `src`) to `outtype` (built once)."""
    out = model / f"model-{outtype}.gguf"
    if not out.is_file():
        print(f"converting {model} to {outtype} ...", flush=True)
        subprocess.run([sys.executable, "-c", CONVERT, str(model), "--outtype", outtype,
                        "--outfile", str(out)], cwd=src, check=True, capture_output=True,
                       timeout=3600, env={**os.environ, "PYTHONPATH": str(src)})
    return out


def llama_cpp_run(python: str, path: Path, args) -> subprocess.CompletedProcess:
    return subprocess.run([python, str(Path(__file__).with_name("llama_cpp_child.py")),
                           str(path), "--threads", str(torch.get_num_threads()),
                           "--decode-tokens", str(args.decode_tokens), "--rounds",
                           str(args.rounds)], capture_output=True, text=True, timeout=3600)


def decode_bytes_per_token(engine: str, engines: dict) -> int:
    """What a batch-1 decode step reads: every weight once but the embedding's unused rows
    (a tied embedding is the head, read whole; the KV of a short context is negligible).
    The dual layout reads one of its two copies: the single layout's bytes."""
    if "dual" in engine and "kvsession bf16" in engines:
        return engines["kvsession bf16"]["weight_bytes"]
    return engines[engine]["weight_bytes"] // (2 if "dual" in engine else 1)


def arguments(rounds: int, llama_cpp_required: bool) -> argparse.ArgumentParser:
    """The arguments this script and bench/vs_llama_cpp.py share."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--llama-cpp-python", required=llama_cpp_required,
                    help="a Python with llama-cpp-python (llama.cpp bf16 and q8_0)")
    ap.add_argument("--llama-cpp-src", type=Path, required=llama_cpp_required,
                    help="llama.cpp's source (its convert_hf_to_gguf.py and conversion/)")
    ap.add_argument("--plot", action="store_true")
    return ap


def main() -> None:
    ap = arguments(rounds=3, llama_cpp_required=False)
    ap.description = __doc__.split("\n")[0]
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "ENGINE"), help=argparse.SUPPRESS)
    ap.add_argument("--load-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--answer-rounds", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(Path(args.child[0]), args.child[1], args.decode_tokens,
                               args.rounds, args.kv_cache_memory, args.load_only,
                               args.answer_rounds)))
        return
    store = tempfile.TemporaryDirectory(prefix="real_shapes-")  # kvsession's cache, this run
    (Path(store.name) / "kernels").symlink_to(cache_dir(), target_is_directory=True)
    env = {**os.environ, "KVSESSION_CACHE": store.name}
    bw = Bandwidth()
    results: dict = {}
    for shape in args.shapes:
        model = checkpoint(shape)
        size = sum(p.stat().st_size for p in model.glob("*.safetensors"))
        results[shape] = {"checkpoint_bytes": size, "engines": {}}
        peers = list(LLAMA_CPP) if args.llama_cpp_python else []
        for engine in args.engines + peers:
            bw.sample()
            first = None
            if engine in LLAMA_CPP:
                proc = llama_cpp_run(args.llama_cpp_python,
                                     gguf(model, LLAMA_CPP[engine], args.llama_cpp_src), args)
            else:
                command = [sys.executable, __file__, "--child", str(model), engine,
                           "--decode-tokens", str(args.decode_tokens), "--rounds",
                           str(args.rounds), "--kv-cache-memory", args.kv_cache_memory]
                if engine.startswith("kvsession"):  # compiles into the run's empty store
                    first = subprocess.run(command + ["--load-only"], capture_output=True,
                                           text=True, timeout=3600, env=env)
                proc = subprocess.run(command, capture_output=True, text=True, timeout=3600,
                                      env=env)
                if first is not None and first.returncode != 0:
                    proc = first
            if proc.returncode != 0:
                print(f"{shape} {engine}: failed\n{proc.stderr[-3000:]}")
                continue
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            if first is not None:
                res["first_load_s"] = json.loads(first.stdout.strip().splitlines()[-1])[
                    "load_s"]
            if engine in LLAMA_CPP:  # what a decode step reads: the GGUF's tensors
                res["weight_bytes"] = gguf(model, LLAMA_CPP[engine],
                                           args.llama_cpp_src).stat().st_size
            results[shape]["engines"][engine] = res
            print(f"{shape:13s} {engine:20s} load {res['load_s']:5.1f} s (first "
                  f"{res.get('first_load_s', res['load_s']):5.1f})  resident "
                  f"{res['resident_bytes'] / 1e9:5.2f} GB  decode b1 "
                  f"{res['decode_b1_tok_s']:5.1f} b8 {res['decode_b8_tok_s']:6.1f} tok/s  "
                  f"prefill 512 {res['prefill_512_s']:5.2f} s", flush=True)
        bw.sample()
        engines = results[shape]["engines"]
        for engine, res in engines.items():
            bound = bw.best / decode_bytes_per_token(engine, engines)
            res["decode_b1_bound_tok_s"] = bound
            res["decode_b1_vs_bound"] = bound / res["decode_b1_tok_s"]  # >= 1; 1 = the bound
        hf = results[shape]["engines"].get("transformers bf16")
        for engine, res in results[shape]["engines"].items():
            if hf is not None and engine != "transformers bf16":
                res["vs_transformers"] = {
                    k: res[k] / hf[k] for k in ("decode_b1_tok_s", "decode_b8_tok_s")} | {
                    "prefill_512": hf["prefill_512_s"] / res["prefill_512_s"]}
        # each kvsession format against llama.cpp's nearest: int8 against q8_0, the rest bf16
        for engine, res in results[shape]["engines"].items():
            peer = results[shape]["engines"].get(
                "llama.cpp q8_0" if "int8" in engine else "llama.cpp bf16")
            if peer is not None and engine.startswith("kvsession"):
                res["vs_llama_cpp"] = {
                    k: res[k] / peer[k] for k in ("decode_b1_tok_s", "decode_b8_tok_s")} | {
                    "prefill_512": peer["prefill_512_s"] / res["prefill_512_s"],
                    "load": res["load_s"] / peer["load_s"]}
    print(f"DRAM read bandwidth (best of {len(bw.samples)} samples in the run): "
          f"{bw.best / 1e9:.1f} GB/s (median {statistics.median(bw.samples) / 1e9:.1f})")
    for shape, r in results.items():
        for engine, res in r["engines"].items():
            extra = "" if "vs_transformers" not in res else \
                "; vs transformers: decode b1 {decode_b1_tok_s:.2f}x b8 {decode_b8_tok_s:.2f}x " \
                "prefill {prefill_512:.2f}x".format(**res["vs_transformers"])
            if "vs_llama_cpp" in res:
                extra += "; vs llama.cpp: decode b1 {decode_b1_tok_s:.2f}x b8 " \
                    "{decode_b8_tok_s:.2f}x prefill {prefill_512:.2f}x, load time " \
                    "{load:.2f}x theirs".format(**res["vs_llama_cpp"])
            print(f"{shape:13s} {engine:20s} decode b1 at {res['decode_b1_vs_bound']:.2f}x its "
                  f"bound ({res['decode_b1_bound_tok_s']:.1f} tok/s); resident "
                  f"{res['resident_bytes'] / r['checkpoint_bytes']:.2f}x the checkpoint{extra}")
    write_result("real_shapes", {"bandwidth_best_gb_s": bw.best / 1e9,
                                 "bandwidth_median_gb_s": statistics.median(bw.samples) / 1e9,
                                 "decode_tokens": args.decode_tokens, "rounds": args.rounds,
                                 "kv_cache_memory": args.kv_cache_memory, "shapes": results})
    if args.plot:
        plot(results)


def plot(results: dict) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (shape, r) in zip(axes[0], results.items(), strict=True):
        names = list(r["engines"])
        b1 = [r["engines"][n]["decode_b1_tok_s"] for n in names]
        b8 = [r["engines"][n]["decode_b8_tok_s"] for n in names]
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], b1, 0.4, label="decode batch 1")
        ax.bar([x + 0.2 for x in xs], b8, 0.4, label="decode batch 8")
        ax.scatter(list(xs), [r["engines"][n]["decode_b1_bound_tok_s"] for n in names],
                   marker="_", s=400, color="k", label="batch-1 bandwidth bound")
        ax.set_xticks(list(xs), [n.replace(" ", "\n", 1) for n in names], fontsize=8)
        ax.set_ylabel("tokens/s")
        ax.set_title(shape)
        ax.legend(fontsize=8)
    save_figure(fig, "real_shapes")


if __name__ == "__main__":
    main()
