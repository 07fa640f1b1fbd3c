"""What a new user meets: the demo, the CLI, notebook display, the public API docs (the
example notebooks run in a kernel: tests/test_notebooks.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import kvsession
from kvsession import LLM, SamplingParams
from kvsession.demo import run_demo

ROOT = Path(__file__).resolve().parents[1]


def test_demo_runs_and_its_summary_matches_stats(llama_dir, tmp_path):
    lines: list[str] = []
    summary = run_demo(llama_dir, tmp_path / "sd", num_sessions=4, num_turns=2,
                       out=lines.append)
    phase1, phase2 = summary["stats"]
    for tier in ("host", "disk"):
        assert summary["spills"][tier] == phase1.spills[tier] + phase2.spills[tier]
        assert summary["restores"][tier] == phase1.restores[tier] + phase2.restores[tier]
    assert summary["recomputes"] == phase1.recomputes + phase2.recomputes
    assert summary["resumed_after_restart"] == 4 and summary["resumed_cached_tokens"] > 0
    assert summary["tokens_computed"] < summary["tokens_stateless"]
    assert phase1.num_requests == 4 * 2  # the turns (the system prompt's pin is not one)
    text = "\n".join(lines)
    assert f"resumed after restart: 4 sessions, {summary['resumed_cached_tokens']}" in text
    assert f"prompt tokens computed {summary['tokens_computed']} vs " \
           f"{summary['tokens_stateless']}" in text
    # like with like: the stateless engine ran the same turns, at once each turn
    assert summary["turns_s"] > 0 and summary["stateless_turns_s"] > 0
    assert f"every turn, end to end: {summary['turns_s']:.2f} s vs " \
           f"{summary['stateless_turns_s']:.2f} s stateless" in text
    assert summary["ttft_stateless_p50_s"] > 0 and "TTFT p50 of later turns" in text
    assert list((tmp_path / "sd").glob("*.kvs")) == []  # the demo cleans up after itself


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "kvsession", *args], capture_output=True,
                          text=True, timeout=120, cwd=cwd)


@pytest.mark.parametrize("sub", ["demo", "generate", "inspect", "make-tiny-model"])
def test_cli_help(sub):
    out = cli(sub, "--help")
    assert out.returncode == 0 and "usage:" in out.stdout


def test_cli_errors_are_one_line(tmp_path):
    bad = cli("generate", "--model", str(tmp_path / "missing"), "--prompt", "hi")
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and "ConfigError" in bad.stderr
    junk = tmp_path / "junk.kvs"
    junk.write_bytes(b"KVSNAP\x00\x01" + b"\x00" * 40)
    bad = cli("inspect", str(junk))
    assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1
    assert "SnapshotError" in bad.stderr
    for arg in ("--sessions", "--turns"):  # a usage error, before anything is built
        bad = cli("demo", arg, "0")
        assert bad.returncode == 2 and "Traceback" not in bad.stderr
        assert f"argument {arg}: must be >= 1, got 0" in bad.stderr


def test_cli_make_model_and_generate(tmp_path):
    assert cli("make-tiny-model", str(tmp_path / "m"), "--arch", "qwen3").returncode == 0
    out = cli("generate", "--model", str(tmp_path / "m"), "--prompt", "the agent",
              "--max-tokens", "4", "--kv-cache-memory", "4MiB", "--max-model-len", "128")
    assert out.returncode == 0, out.stderr


def test_notebook_friendly_reprs(llama_dir):
    with LLM(llama_dir, kv_cache_memory="4MiB", max_model_len=256) as llm:
        s = llm.session(sampling=SamplingParams(max_tokens=4, temperature=0.0))
        s.send("hello")
        assert "LlamaForCausalLM" in repr(llm) and "1 sessions" in repr(llm)
        html = llm._repr_html_()
        assert "<table>" in html and "device" in html and "prefix hit rate" in html
        assert s.session_id in s._repr_html_() and "1 turns" in s._repr_html_()
        assert "state=idle" in repr(s)
        reply = s.send("<b>a tag</b> & more")
        html = reply._repr_html_()  # the reply's own text, escaped
        assert "<b>Reply</b>" in html and _html_text(reply.text) in html
        assert f"{reply.cached_tokens} from the cache" in html and "TTFT" in html
        out = llm.generate(["x < y"], SamplingParams(max_tokens=3, n=2, temperature=1.0),
                           use_tqdm=False)[0]
        html = out._repr_html_()
        assert "text 1" in html and _html_text(out.outputs[1].text) in html
        assert f"{len(out.prompt_token_ids)} tokens" in html
        st = llm.stats()
        html = st._repr_html_()
        assert "device" in html and f"{st.prefill_tokens}" in html and "hit rate" in html
        pin = llm.pin(system="You are a pinned system prompt " * 4)
        assert "active" in pin._repr_html_() and f"{pin.num_blocks} blocks" in \
            pin._repr_html_()
        pin.unpin()
        assert "released" in pin._repr_html_()
        s.close()
    assert "closed" in repr(llm) and "closed" in llm._repr_html_()


def _html_text(text: str) -> str:
    import html

    return html.escape(text)


def test_api_doc_lists_exactly_the_public_names():
    doc = (ROOT / "docs" / "api.md").read_text()
    documented = set(re.findall(r"^### `(\w+)`", doc, flags=re.M))
    assert documented == set(kvsession.__all__)
