"""Dependencies point one way (docs/architecture.md): API -> engine -> (scheduler, runner)
-> model -> attention -> kernels; cache/ and tiers/ never reach up into the engine, the
model or the API; the connector package (protocol and NIXL helpers) is library code below
the API (the prefill worker, `kvsession.worker`, is an application); the HTTP server,
`kvsession.serve`, is an application over the public API only: it imports nothing but
`kvsession`'s public names, itself and `kvsession.routing` (the bounded-load affinity
router, pure code under every layer that imports nothing of kvsession but its errors, so
the connector and the server share it), `kvsession.host_memory` (mappings and huge-page
tensors for the model and the tiers, imports nothing of kvsession) and `kvsession.flags`
(LLM arguments as command-line flags, for the server and the worker; imports nothing) and
`kvsession.notebook` (what changes inside IPython: stale LLMs, progress bars; imports
nothing).
Read from the source (imports inside functions and relative imports included), so a lazy
or relative import cannot slip an upward edge past the rule."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the API and application layer: the facade, sessions, the runtime that wires the engine
# (kvsession.worker, the prefill worker with its service, and kvsession.numerics build a
# Runtime)
API = {"kvsession.llm", "kvsession.session", "kvsession.session_store", "kvsession.cli",
       "kvsession.demo", "kvsession.testing", "kvsession.worker", "kvsession.worker_faults",
       "kvsession.worker_service",
       "kvsession.runtime", "kvsession.system_pins", "kvsession.sizing",
       "kvsession.remote_offload", "kvsession.sequence_factory", "kvsession.pinning",
       "kvsession.observability", "kvsession.integrity", "kvsession.turns",
       "kvsession.session_files", "kvsession.side_files",
       "kvsession.numerics", "kvsession.requests", "kvsession.handles", "kvsession",
       "kvsession.serve", "kvsession.openai_compat", "kvsession.choices"}
# module prefix -> the kvsession modules (by prefix) it must not import
FORBIDDEN = {
    "kvsession.kernels": {"kvsession.cache", "kvsession.engine", "kvsession.model",
                          "kvsession.attention", "kvsession.tiers", "kvsession.connector",
                          *API},
    "kvsession.cache": {"kvsession.engine", "kvsession.model", "kvsession.attention",
                        "kvsession.tiers", "kvsession.connector", *API},
    "kvsession.attention": {"kvsession.engine", "kvsession.model", "kvsession.tiers", *API},
    "kvsession.model": {"kvsession.engine", "kvsession.tiers", "kvsession.connector", *API},
    "kvsession.engine": {"kvsession.tiers", "kvsession.connector", *API},
    "kvsession.tiers": {"kvsession.engine", "kvsession.model", "kvsession.connector", *API},
    "kvsession.connector": {"kvsession.engine", "kvsession.model", *API},
}
# modules that import nothing of kvsession but kvsession.errors
NEUTRAL = {"kvsession.routing", "kvsession.host_memory", "kvsession.flags",
           "kvsession.notebook"}


def modules():
    """(dotted name, path) of every module; a package's __init__.py is the package."""
    for pkg, root in (("kvsession", ROOT / "kvsession"), ("kvsession.kernels", ROOT / "kernels")):
        for f in sorted(root.rglob("*.py")):
            parts = f.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            yield ".".join([pkg, *parts]), f


MODULES = {m for m, _ in modules()}
# the server sits on top: every kvsession module but the package itself (its public names)
# and the server's own modules is off limits to it
FORBIDDEN["kvsession.serve"] = {m for m in MODULES if m != "kvsession" and m not in NEUTRAL
                                and not m.startswith("kvsession.serve")}
for _m in NEUTRAL:
    FORBIDDEN[_m] = {m for m in MODULES if m != "kvsession.errors" and m != _m} | {"kvsession"}


def package_of(module: str, path: Path) -> str:
    """The package relative imports in `module` resolve against: the module itself for a
    package's __init__.py, else its parent."""
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def resolve(package: str, level: int, target: str | None) -> str:
    """The absolute module of `from <level dots><target> import ...` inside `package`."""
    if level == 0:
        return target or ""
    return importlib.util.resolve_name("." * level + (target or ""), package)


def imports(module: str, path: Path) -> set[str]:
    """Every kvsession module `module` (at `path`) imports, absolute or relative."""
    package = package_of(module, path)
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            source = resolve(package, node.level, node.module)
            if source != "kvsession" and not source.startswith("kvsession."):
                continue
            # each name is a submodule of `source`, or a name defined by it (for the
            # top-level package: a public name, i.e. the API)
            out |= {f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source
                    for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("kvsession")}
    return out


def under(name: str, prefix: str) -> bool:
    """name is prefix or inside it; the package itself ("kvsession") only matches itself."""
    return name == prefix or (prefix != "kvsession" and name.startswith(prefix + "."))


@pytest.mark.parametrize("module, path", list(modules()), ids=lambda x: str(x).split("/")[-1])
def test_no_upward_imports(module, path):
    upward = violations(module, path)
    assert not upward, f"{module} imports {upward}"


def violations(module: str, path: Path) -> list[str]:
    rules = [bad for prefix, bad in FORBIDDEN.items() if under(module, prefix)]
    found = imports(module, path)
    return sorted({i for i in found for bad in rules for b in bad if under(i, b)})


def test_the_rules_cover_every_layer():
    for prefix in FORBIDDEN:
        assert any(under(n, prefix) for n in MODULES), prefix


def test_the_worker_is_an_application_not_connector_code():
    assert "kvsession.worker" in API and "kvsession.worker" in MODULES
    assert not any(under(m, "kvsession.connector") and m.endswith("worker") for m in MODULES)
    # every module of the connector package falls under its rule, not only base and nixl
    connector = [m for m in MODULES if under(m, "kvsession.connector")]
    assert "kvsession.connector" in connector and len(connector) >= 3
    for m in connector:
        assert any(under(m, prefix) for prefix in FORBIDDEN), m


@pytest.mark.parametrize("package, level, target, want", [
    ("kvsession.connector", 1, None, "kvsession.connector"),  # from . import x
    ("kvsession.connector", 1, "base", "kvsession.connector.base"),  # from .base import y
    ("kvsession.connector", 2, None, "kvsession"),  # from .. import LLM
    ("kvsession.connector", 2, "llm", "kvsession.llm"),  # from ..llm import LLM
    ("kvsession.cache", 2, "engine.loop", "kvsession.engine.loop"),
    ("kvsession.kernels", 1, "reference", "kvsession.kernels.reference"),
    ("kvsession", 0, "kvsession.llm", "kvsession.llm"),
])
def test_relative_imports_resolve_against_the_package(package, level, target, want):
    assert resolve(package, level, target) == want


def test_relative_imports_count(tmp_path):
    pkg = tmp_path / "connector"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from . import base\nfrom .. import worker\n")
    (pkg / "fake.py").write_text(
        "from . import base, nixl\nfrom .base import encode\n"
        "def f():\n    from ..llm import LLM\n    from .. import LLM as L2, engine\n")
    # __init__.py: relative to the package itself
    assert imports("kvsession.connector", pkg / "__init__.py") == {
        "kvsession.connector.base", "kvsession.worker"}
    assert violations("kvsession.connector", pkg / "__init__.py") == ["kvsession.worker"]
    # a module: relative to its parent package; lazy imports included
    assert imports("kvsession.connector.fake", pkg / "fake.py") == {
        "kvsession.connector.base", "kvsession.connector.nixl", "kvsession.llm", "kvsession",
        "kvsession.engine"}
    assert violations("kvsession.connector.fake", pkg / "fake.py") == [
        "kvsession", "kvsession.engine", "kvsession.llm"]
    with pytest.raises(ImportError):
        resolve("kvsession", 2, "x")


def test_the_server_uses_only_the_public_api(tmp_path):
    assert any(under(m, "kvsession.serve") for m in MODULES)
    f = tmp_path / "app.py"
    f.write_text("from kvsession import LLM\nfrom kvsession.serve import protocol\n"
                 "def g():\n    from kvsession.session import Session\n")
    assert violations("kvsession.serve.app", f) == ["kvsession.session"]


# ---- structure: no cycles, no private names across modules ----------------------------------

def runtime_imports(module: str, path: Path) -> set[str]:
    """`imports`, less those inside `if TYPE_CHECKING:` (never run), as modules: a name a
    module defines counts as an edge to that module."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(node.test)
                   for n in ast.walk(node) if n is not node.test}
    package = package_of(module, path)
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            source = resolve(package, node.level, node.module)
            if source == "kvsession" or source.startswith("kvsession."):
                out |= {f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source
                        for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("kvsession")}
    return {m for m in out if m in MODULES and m != module}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    cycles.append(sorted(comp))
    return cycles


def test_no_import_cycles():
    """Imports form no cycle (lazy ones inside functions included: a cycle they hide is
    still two modules that cannot be understood, or split, apart); the package's
    __init__ re-exports the API and is left out as a target."""
    graph = {m: runtime_imports(m, p) - {"kvsession"} for m, p in modules()}
    assert import_cycles(graph) == []


def test_the_cycle_finder_finds_cycles():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def private_imports(module: str, path: Path) -> list[str]:
    """`from kvsession... import _name` in `module`: a private name of another module."""
    package = package_of(module, path)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            source = resolve(package, node.level, node.module)
            if source != "kvsession" and not source.startswith("kvsession."):
                continue
            found += [f"{source}.{a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
    return found


@pytest.mark.parametrize("module, path", list(modules()), ids=lambda x: str(x).split("/")[-1])
def test_no_private_name_is_imported_across_modules(module, path):
    assert private_imports(module, path) == []


def test_private_imports_are_seen(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from kvsession.structured import _xgrammar, checked\n"
                 "def f():\n    from .snapshot import _FOOTER\n")
    assert private_imports("kvsession.tiers.m", f) == ["kvsession.structured._xgrammar",
                                                       "kvsession.tiers.snapshot._FOOTER"]
