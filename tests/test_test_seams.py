"""The tests reach an LLM's engine only through tests/internals.py (issue #46): no other
file under tests/ names the private runtime, and the interface stays small and says why
each of its members exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
INTERFACE = TESTS / "internals.py"
MAX_MEMBERS = 40
# an attribute access to the LLM's private parts (the runtime, the session store, the
# request builder; an alias of one too, in code or in a child process's script) or a
# getattr of one; the names spelled apart so that this file does not match
PRIVATE = "_" + "rt"
PRIVATES = "|".join([PRIVATE, "_" + "store", "_" + "requests"])
REACH_IN = re.compile(rf"\.\s*(?:{PRIVATES})\b|getattr\([^)]*['\"](?:{PRIVATES})['\"]")


def reach_ins(source: str) -> list[int]:
    """Line numbers of `source` that reach the private runtime."""
    return [n for n, line in enumerate(source.splitlines(), 1) if REACH_IN.search(line)]


def test_only_the_interface_touches_the_private_runtime():
    found = {p.name: reach_ins(p.read_text())
             for p in sorted(TESTS.rglob("*.py")) if p != INTERFACE}
    assert {name: lines for name, lines in found.items() if lines} == {}, \
        "reach the engine through tests/internals.py (Internals), not the private runtime"
    assert reach_ins(INTERFACE.read_text())  # the one place that does


def test_the_scan_finds_a_reach_in():
    assert reach_ins(f"x = 1\nrt = llm.{PRIVATE}\n") == [2]
    assert reach_ins(f"llm.{PRIVATE}.engine.num_steps") == [1]
    assert reach_ins(f"getattr(llm, '{PRIVATE}')") == [1]
    assert reach_ins("llm." + "_" + "store.live") == [1]
    assert reach_ins("self.rt_x, llm.runtime, s._rtt, s._stores") == []


def test_the_interface_is_small_and_says_why():
    tree = ast.parse(INTERFACE.read_text())
    assert ast.get_docstring(tree), "the module docstring states the contract"
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Internals"]
    members = [n for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
               and not n.name.startswith("_")]
    assert 0 < len(members) <= MAX_MEMBERS, [m.name for m in members]
    assert len({m.name for m in members}) == len(members)  # no property setter pairs
    undocumented = [m.name for m in members if not ast.get_docstring(m)]
    assert undocumented == [], "each member says which behaviour it makes testable"
