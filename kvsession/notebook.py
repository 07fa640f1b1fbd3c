"""What an LLM does differently inside IPython (a Jupyter notebook or the IPython shell).

Re-running the cell that builds an `LLM` builds a second one while the first is alive:
the old object is still bound to the cell's variable while the new one loads, and once
the variable is rebound, IPython's output history (`Out[n]`, `_`, `__`, `___`, `_n`)
keeps any LLM a cell displayed, so its weights and KV pool are never freed. Before an LLM
is built, `release_stale` looks at every open LLM over the same model: one that only the
output history holds is closed (its sessions persisted, as `close()` does) and dropped
from the history, so the memory goes back; one that anything else holds (a variable, a
list) is left open, with a warning that names `llm.close()`, and looked at again when the
cell has run: a re-run cell has rebound its variable by then, and the old LLM is dropped.

Progress bars (`progress`, `activity`): shown only in a Jupyter kernel, and only once the
work has taken a second, where a long load, compile, snapshot or generation with nothing
on screen looks like a hang; quiet in scripts, servers and tests.
"""

from __future__ import annotations

import gc
import inspect
import logging
import re
import sys
import weakref
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger("kvsession")

# a bar shows once its work has taken this long: a tiny model's load stays silent
PROGRESS_DELAY_S = 1.0
# the names IPython binds to outputs: _, __, ___ (the last three) and _<n> (Out[n])
HISTORY_NAME = re.compile(r"_{1,3}|_\d+")


def shell():
    """The running IPython shell, or None (never imports IPython: a process that did not
    import it is not a notebook)."""
    ipython = sys.modules.get("IPython")
    get = getattr(ipython, "get_ipython", None)
    if get is None:
        return None
    try:
        return get()
    except Exception:  # noqa: BLE001 - an IPython that fails here is no shell to use
        return None


def in_kernel() -> bool:
    """Whether this process is a Jupyter kernel (a notebook's, or a console's)."""
    sh = shell()
    return sh is not None and type(sh).__name__ == "ZMQInteractiveShell"


def history_only(obj, ignore: Iterable[object] = ()) -> list[tuple[dict, object]] | None:
    """Where the output history holds `obj` when nothing else does: (dict, key) pairs,
    the dicts IPython keeps outputs in (the user namespace's `_3` / `_` / `__` / `___`, `Out`
    keyed by number, the display hook's `_` / `__` / `___` attributes); None when anything
    else holds it (a variable, a list). Frames (the calls looking at it now) and `ignore`
    (the caller's own containers) do not count."""
    skipped = {id(x) for x in ignore}
    held: list[tuple[dict, object]] = []
    for holder in gc.get_referrers(obj):
        if id(holder) in skipped or inspect.isframe(holder):
            continue
        if not isinstance(holder, dict):
            return None
        # (loops, not comprehensions: a comprehension reading `obj` would make it a
        # closure cell of this function, a referrer of its own)
        keys = []
        for key, value in holder.items():
            if value is obj:
                keys.append(key)
        if not keys or not all(_history_key(k) for k in keys):
            return None
        for key in keys:
            held.append((holder, key))
    return held


def _history_key(key) -> bool:
    return isinstance(key, int) or isinstance(key, str) and bool(HISTORY_NAME.fullmatch(key))


def release_stale(model: Path, live: Iterable, model_of) -> None:
    """Before an LLM over `model` is built in IPython: each open LLM of `live` over the
    same model (`model_of(llm)`) that only the output history holds is closed and dropped
    from the history (`_drop`). One that something else holds (typically the variable
    that the cell running now is about to rebind) is warned about, and looked at again
    when the cell has run: dropped then if only the history holds it (the cell rebound its
    variable). Nothing outside IPython."""
    sh = shell()
    if sh is None:
        return
    others = tuple(llm for llm in live if not llm.closed and model_of(llm) == model)
    for llm in others:
        held = history_only(llm, ignore=(others,))
        if held is not None:
            _drop(llm, held, model)
            continue
        log.warning("another LLM over %s is open in this process and holds its weights "
                    "and KV cache: call llm.close() on it (or build LLMs in `with LLM(...) "
                    "as llm:`); if this cell rebinds its variable, it is closed when the "
                    "cell has run", model)
        _AfterCell(sh, llm, model).register()


def _drop(llm, held: list[tuple[dict, object]], model: Path) -> None:
    """Close `llm` (its sessions persisted, as close() does) and remove it from the
    output history (`held`, history_only's), so that nothing holds its memory."""
    llm.close()
    for holder, key in held:
        if isinstance(key, int) or key not in ("_", "__", "___"):
            holder.pop(key, None)  # Out[n], _n
        else:
            holder[key] = ""  # the last outputs' names stay (IPython's own empty value)
    names = sorted({f"Out[{k}]" if isinstance(k, int) else k for _, k in held})
    log.warning("closed the LLM over %s that only IPython's output history held (%s): its "
                "memory goes back", model, ", ".join(names))


class _AfterCell:
    """A one-shot post_run_cell callback: when the cell has run, `llm` (held weakly) is
    dropped if only the output history holds it."""

    def __init__(self, sh, llm, model: Path):
        self.sh, self.llm, self.model = sh, weakref.ref(llm), model

    def register(self) -> None:
        self.sh.events.register("post_run_cell", self)

    def __call__(self, *result) -> None:
        self.sh.events.unregister("post_run_cell", self)
        llm = self.llm()
        if llm is None or llm.closed:
            return
        held = history_only(llm)
        if held is not None:
            _drop(llm, held, self.model)


def progress(total: float, desc: str, unit: str = "it"):
    """A tqdm.auto progress bar in a Jupyter kernel, shown once the work has taken a
    second; None elsewhere (callers skip their updates then)."""
    if not in_kernel():
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, leave=False, delay=PROGRESS_DELAY_S)


class activity:
    """`with activity("saving session a"):` a one-step progress bar in a Jupyter kernel,
    shown once the work has taken a second and completed when it ends; nothing
    elsewhere."""

    def __init__(self, desc: str):
        self.desc, self.bar = desc, None

    def __enter__(self) -> activity:
        self.bar = progress(1, self.desc)
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.close()
