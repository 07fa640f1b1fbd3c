"""Packaging rules: every package directory is listed; no top-level `kernels` module."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_directory_is_listed():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    dirs = {cfg["package-dir"]["kvsession.kernels"]: "kvsession.kernels"}
    found = set()
    for init in (ROOT / "kvsession").rglob("__init__.py"):
        found.add(".".join(init.parent.relative_to(ROOT).parts))
    for init in (ROOT / "kernels").rglob("__init__.py"):
        rel = init.parent.relative_to(ROOT / "kernels").parts
        found.add(".".join([dirs["kernels"], *rel]))
    assert found == listed


def test_kernels_is_not_a_top_level_module():
    code = ("import importlib.util, sys; import kvsession.kernels.reference; "
            "sys.exit(importlib.util.find_spec('kernels') is not None and "
            "'kvsession' in (importlib.util.find_spec('kernels').origin or ''))")
    # run outside the repo root so the working directory does not shadow anything
    assert subprocess.run([sys.executable, "-c", code], cwd="/").returncode == 0
    assert importlib.util.find_spec("kvsession.kernels") is not None


def test_the_wheel_ships_the_cpu_kernel_source(tmp_path):
    """kernels/*.cpp (cpu_decode, its op, the int8 and bf16-rows products) are compiled at
    first use: they must be in the wheel."""
    import zipfile

    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), str(ROOT)], check=True, capture_output=True,
                   timeout=300)
    (wheel,) = tmp_path.glob("kvsession-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {f"kvsession/kernels/{n}.cpp" for n in ("cpu_decode", "cpu_decode_op", "q8_matmul",
                                                  "bf16_rows")} <= set(names)
