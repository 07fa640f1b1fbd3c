"""Command line: `python -m kvsession {demo,generate,inspect,make-tiny-model,serve}`.

Errors print one line (no traceback) and exit with status 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kvsession.errors import ConfigError, KVSessionError


def default_model_dir() -> Path:
    root = Path(os.environ.get("KVSESSION_CACHE", Path.home() / ".cache" / "kvsession"))
    return root / "tiny-llama"


def ensure_tiny_model(path: Path) -> Path:
    from kvsession.testing import make_tiny_model

    # the weights are written last: without them an earlier build was interrupted
    if not ((path / "config.json").is_file() and (path / "model.safetensors").is_file()):
        print(f"building the built-in tiny model in {path} ...")
        make_tiny_model(path, arch="llama", hidden_size=128, intermediate_size=256,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=32)
    return path


def cmd_demo(args) -> int:
    import tempfile

    from kvsession.demo import run_demo

    model = Path(args.model) if args.model else ensure_tiny_model(default_model_dir())
    with tempfile.TemporaryDirectory(prefix="kvsession-demo-") as tmp:
        session_dir = Path(args.session_dir) if args.session_dir else Path(tmp)
        print(f"model: {model}")
        run_demo(model, session_dir, args.sessions, args.turns, out=print)
    return 0


def cmd_generate(args) -> int:
    from kvsession import LLM, SamplingParams

    with LLM(args.model, kv_cache_memory=args.kv_cache_memory,
             max_model_len=args.max_model_len) as llm:
        out = llm.generate(args.prompt, SamplingParams(max_tokens=args.max_tokens,
                                                       temperature=args.temperature),
                           use_tqdm=False)[0]
    print(out.text)
    return 0


def cmd_inspect(args) -> int:
    from kvsession.tiers.snapshot_read import describe, read_header

    print(describe(read_header(args.file), args.file))
    return 0


def cmd_make_tiny_model(args) -> int:
    from kvsession.testing import make_tiny_model

    try:
        path = make_tiny_model(args.dir, arch=args.arch, seed=args.seed, layout=args.layout)
    except OSError as e:  # an unwritable or invalid directory: one line, like every error
        raise ConfigError(f"cannot write a checkpoint to {args.dir!r}: {e}") from None
    print(f"wrote a tiny {args.arch} checkpoint to {path}")
    return 0


def cmd_serve(args) -> int:
    from kvsession.serve.main import run

    return run(args, args.parser)


def add_serve(sub) -> None:
    """`serve`: the OpenAI-compatible server (needs the `server` extra, imported only here)."""
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (extra: server)")
    try:
        from kvsession import LLM
        from kvsession.serve.main import add_serve_arguments
    except ImportError as e:  # the extra is not installed: say how to get it
        missing = str(e)
        s.set_defaults(fn=lambda args: _missing_server_extra(missing))
        s.add_argument("rest", nargs=argparse.REMAINDER)
        return
    add_serve_arguments(s, LLM)
    s.set_defaults(fn=cmd_serve, parser=s)


def _missing_server_extra(why: str) -> int:
    print(f"error: `serve` needs the server extra (pip install 'kvsession[server]'): {why}",
          file=sys.stderr)
    return 1


def _positive(text: str) -> int:
    """An int >= 1 (argparse prints the usage line and this message for anything else)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvsession",
                                description="kvsession: LLM sessions whose KV cache is state")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="agent demo on a built-in tiny model")
    d.add_argument("--model", help="a HF checkpoint directory (default: built-in tiny model)")
    d.add_argument("--sessions", type=_positive, default=6, help="concurrent agent sessions")
    d.add_argument("--turns", type=_positive, default=3, help="turns per session")
    d.add_argument("--session-dir", help="where sessions persist (default: a temp dir)")
    d.set_defaults(fn=cmd_demo)
    g = sub.add_parser("generate", help="generate a completion for one prompt")
    g.add_argument("--model", required=True, help="a HF checkpoint directory")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--kv-cache-memory", default=None, help="e.g. 1GiB")
    g.add_argument("--max-model-len", type=int, default=None)
    g.set_defaults(fn=cmd_generate)
    i = sub.add_parser("inspect", help="print a session snapshot's header")
    i.add_argument("file", help="a .kvs snapshot")
    i.set_defaults(fn=cmd_inspect)
    m = sub.add_parser("make-tiny-model", help="write a tiny random checkpoint")
    m.add_argument("dir")
    m.add_argument("--arch", default="llama", choices=["llama", "mistral", "qwen2", "qwen3"])
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--layout", default="current", choices=["current", "classic"])
    m.set_defaults(fn=cmd_make_tiny_model)
    add_serve(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except KVSessionError as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
