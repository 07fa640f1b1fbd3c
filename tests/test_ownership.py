"""One owner per concept, checked by reading the sources: block tables (`.blocks`,
`.host_blocks` of sequences, sessions, pins, quarantines) are written only by
kvsession/cache/manager.py; reference counts (`.ref_cnt`) only by cache/block_pool.py."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TABLES = {"blocks", "host_blocks"}
OWNERS = {"blocks": "kvsession/cache/manager.py", "host_blocks": "kvsession/cache/manager.py",
          "ref_cnt": "kvsession/cache/block_pool.py"}
MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "__setitem__"}
# a pool's own list of its blocks (a growing pool, the host tier's, appends to it as it
# creates them) shares the name of holders' tables but is not one
OWN_LIST = {("kvsession/cache/block_pool.py", "blocks")}


def sources():
    for folder in ("kvsession", "kernels", "bench", "examples"):
        for f in sorted((ROOT / folder).rglob("*.py")):
            if not f.is_symlink() and not any(p.is_symlink() for p in f.parents):
                yield f


def writes(tree: ast.AST) -> list[tuple[str, int, bool]]:
    """(attribute, line, is a `self.x = ...` inside an __init__) for every write of an
    owned attribute: assignment, augmented assignment, del, subscript store, and calls of
    mutating list methods on it."""
    found = []

    def visit(node: ast.AST, in_init: bool) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            in_init = node.name == "__init__"
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        flat = []
        for t in targets:
            flat += t.elts if isinstance(t, ast.Tuple | ast.List) else [t]
        for t in flat:
            if isinstance(t, ast.Subscript):
                t = t.value
            if isinstance(t, ast.Attribute) and t.attr in OWNERS:
                own = isinstance(t.value, ast.Name) and t.value.id == "self"
                found.append((t.attr, t.lineno, own and in_init))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in MUTATORS and isinstance(node.func.value, ast.Attribute) \
                and node.func.value.attr in TABLES:
            found.append((node.func.value.attr, node.lineno, False))
        for child in ast.iter_child_nodes(node):
            visit(child, in_init)

    visit(tree, False)
    return found


@pytest.mark.parametrize("path", list(sources()), ids=lambda p: str(p.relative_to(ROOT)))
def test_only_the_owner_writes(path):
    rel = str(path.relative_to(ROOT))
    bad = [(attr, line) for attr, line, own_init in writes(ast.parse(path.read_text()))
           if OWNERS[attr] != rel and not own_init and (rel, attr) not in OWN_LIST]
    assert not bad, f"{rel} writes {bad}; only {sorted(set(OWNERS.values()))} may"


def test_the_checker_sees_each_kind_of_write():
    code = """
class X:
    def __init__(self):
        self.blocks = ()
    def f(self, seq, s):
        seq.blocks = ()
        seq.blocks += (1,)
        s.host_blocks, s.tier = [], 0
        seq.blocks.append(3)
        seq.blocks[0] = 1
        b.ref_cnt -= 1
"""
    found = writes(ast.parse(code))
    assert [(a, own) for a, _, own in found] == [
        ("blocks", True), ("blocks", False), ("blocks", False), ("host_blocks", False),
        ("blocks", False), ("blocks", False), ("ref_cnt", False)]
