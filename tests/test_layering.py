"""Dependencies point one way (docs/architecture.md): API -> engine -> (scheduler, runner)
-> model -> attention -> kernels; cache/ and tiers/ never reach up into the engine, the
model or the API. Read from the source (imports inside functions included), so a lazy
import cannot slip an upward edge past the rule."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
API = {"kvsession.llm", "kvsession.session", "kvsession.session_store", "kvsession.cli",
       "kvsession.demo", "kvsession.testing", "kvsession.worker", "kvsession"}
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
    "kvsession.connector.base": {"kvsession.engine", "kvsession.model", *API},
    "kvsession.connector.nixl": {"kvsession.engine", "kvsession.model", *API},
}


def modules():
    for pkg, root in (("kvsession", ROOT / "kvsession"), ("kvsession.kernels", ROOT / "kernels")):
        for f in sorted(root.rglob("*.py")):
            yield ".".join([pkg, *f.relative_to(root).with_suffix("").parts]), f


def imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "kvsession":  # a submodule, or a public name (the API)
                out |= {f"kvsession.{a.name}" if is_module(a.name) else "kvsession"
                        for a in node.names}
            elif node.module.startswith("kvsession."):
                out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("kvsession")}
    return out


def is_module(name: str) -> bool:
    return (ROOT / "kvsession" / f"{name}.py").exists() or (ROOT / "kvsession" / name).is_dir()


def under(name: str, prefix: str) -> bool:
    """name is prefix or inside it; the package itself ("kvsession") only matches itself."""
    return name == prefix or (prefix != "kvsession" and name.startswith(prefix + "."))


@pytest.mark.parametrize("module, path", list(modules()), ids=lambda x: str(x).split("/")[-1])
def test_no_upward_imports(module, path):
    rules = [bad for prefix, bad in FORBIDDEN.items() if under(module, prefix)]
    found = imports(path)
    upward = sorted({i for i in found for bad in rules for b in bad if under(i, b)})
    assert not upward, f"{module} imports {upward}"


def test_the_rules_cover_every_layer():
    names = {m for m, _ in modules()}
    for prefix in FORBIDDEN:
        assert any(under(n, prefix) for n in names), prefix
