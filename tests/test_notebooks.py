"""Notebooks in a real Jupyter kernel (nbclient + ipykernel): the example notebooks run
top to bottom, and re-running the cell that builds an LLM does not keep the old one's
memory (kvsession/notebook.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "examples").glob("*.ipynb"))


def run(nb, cwd: Path):
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(cwd)}})
    client.execute()
    return nb


def run_cells(cells: list[str], cwd: Path) -> list[str]:
    """`cells` run as a notebook in a kernel: each cell's outputs as text."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    run(nb, cwd)
    return [outputs_of(c) for c in nb.cells]


def outputs_of(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        parts.append(out.get("text", ""))
        parts += [str(v) for v in out.get("data", {}).values()]
    return "\n".join(parts)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_example_notebook_runs_in_a_kernel(path, tmp_path):
    nb = run(nbformat.read(path, as_version=4), tmp_path)
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o["output_type"] == "error"]
    assert not errors
    text = "\n".join(outputs_of(c) for c in nb.cells if c.cell_type == "code")
    assert "<b>kvsession LLM</b>" in text  # the LLM's table, displayed
    assert "image/png" in str([o.get("data", {}).keys() for c in nb.cells
                               for o in c.get("outputs", [])])  # a plot


def test_rerunning_the_cell_that_builds_an_llm_frees_the_old_one(tmp_path):
    """Re-running `llm = LLM(...); llm`: while it runs, the first LLM is still the
    variable's (a warning naming close()); once it has run, the variable holds the new one
    and only the output history (Out[2], _2, ...) the first, which is closed and dropped
    from it, so it is freed. One kept in another variable stays open."""
    cells = [
        "import gc, weakref\nfrom kvsession import LLM\n"
        "from kvsession.testing import make_tiny_model\n"
        f"d = make_tiny_model({str(tmp_path / 'm')!r})\n"
        "kw = dict(kv_cache_memory='4MiB', max_model_len=128)",
        "llm = LLM(d, **kw)\nllm",  # displayed: Out[2] holds it
        "first = weakref.ref(llm)",
        "llm = LLM(d, **kw)\nllm",  # the cell run again
        "gc.collect()\nprint('first freed:', first() is None)",
        "keep = llm\nthird = LLM(d, **kw)",  # the second is a variable's: only a warning
        "print('second open:', not keep.closed)\nkeep.close(); third.close()",
    ]
    text = run_cells(cells, tmp_path)
    # while the cell runs again the old LLM is its variable's: a warning; when it has run
    # the variable holds the new one, and the old one is closed and dropped
    assert "call llm.close() on it" in text[3]
    assert "closed the LLM over" in text[3] and "Out[2]" in text[3]
    assert "first freed: True" in text[4]
    assert "call llm.close() on it" in text[5]
    assert "second open: True" in text[6]


def test_progress_bars_in_a_kernel(tmp_path):
    """In a kernel, a weight load, a single generation (its tokens), a snapshot's save and
    restore show tqdm bars (here with no delay: the tiny model is too quick for the
    one-second one); in this process (no kernel) nothing is shown."""
    from kvsession import notebook

    assert notebook.progress(1, "x") is None  # not a kernel
    cells = [
        "import kvsession.notebook as N\nN.PROGRESS_DELAY_S = 0\n"
        "from kvsession import LLM, SamplingParams\n"
        "from kvsession.testing import make_tiny_model\n"
        f"d = make_tiny_model({str(tmp_path / 'm')!r})\n"
        "llm = LLM(d, kv_cache_memory='4MiB', max_model_len=256)",
        "out = llm.generate(['a'], SamplingParams(max_tokens=40, ignore_eos=True))",
        f"s = llm.session()\ns.send('hi')\ns.save({str(tmp_path / 's.kvs')!r})",
        f"llm.restore({str(tmp_path / 's.kvs')!r}, session_id='copy')\nllm.close()",
    ]
    text = run_cells(cells, tmp_path)
    assert "loading weights" in text[0]
    assert "generate" in text[1] and "40/40" in text[1]
    assert "saving session" in text[2]
    assert "restoring s.kvs" in text[3]
