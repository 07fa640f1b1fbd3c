"""Mutation check: the suite fails when the engine is wrong.

Each mutation breaks one invariant in a copy of the package (a missing decref, a skipped
copy-on-write, fp8 scales not moved with their block, a hash hit trusted without checking
its tokens, a preempted sequence that keeps its blocks, a skipped integrity accounting, a
refused draft counted as computed) and
runs the tests that guard it; every mutant must make them fail. Run by CI after the suite:

    python tests/mutations.py            # all mutations
    python tests/mutations.py NAME ...   # some of them

Exit code 0 iff every mutant was caught. Not collected by pytest (no test_ prefix).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the repository root
    old: str  # must occur exactly once
    new: str
    tests: tuple[str, ...]  # pytest node ids or files that must fail


MUTATIONS = [
    Mutation("missing decref", "kvsession/cache/block_pool.py",
             "            b.ref_cnt -= 1\n",
             "            b.ref_cnt -= 0 if b.block_id % 7 else 1\n",
             ("tests/test_engine.py::test_stress_random_requests_keep_pool_consistent",)),
    Mutation("skipped copy-on-write", "kvsession/cache/manager.py",
             "            if tail.ref_cnt == 1 and tail.block_hash is None:",
             "            if tail.block_hash is None:",
             ("tests/test_sessions.py::test_fork_shares_blocks_and_diverges",
              "tests/test_kv_manager.py")),
    Mutation("fp8 scales left behind on a host spill", "kvsession/tiers/host.py",
             "        for name, s in src.items():\n            d = dst[name]\n",
             "        for name, s in src.items():\n            if 'scale' in name:\n"
             "                continue\n            d = dst[name]\n",
             ("tests/test_tiers.py::test_every_path_continues_exactly",)),
    Mutation("hash hit trusted without its tokens", "kvsession/cache/block_pool.py",
             "        if b is None or b.token_ids != tuple(token_ids):",
             "        if b is None:",
             ("tests/test_prefix_cache.py::test_collisions_are_rejected_by_token_verification",)),
    Mutation("preempted sequence keeps its blocks", "kvsession/engine/scheduler.py",
             "        self.prefix.clear_pending(seq.seq_id, seq.block_hashes)\n"
             "        self.manager.release(seq)\n        seq.num_computed_tokens = 0",
             "        self.prefix.clear_pending(seq.seq_id, seq.block_hashes)\n"
             "        seq.num_computed_tokens = 0",
             ("tests/test_engine.py::test_stress_random_requests_keep_pool_consistent",
              "tests/test_scheduler_unit.py")),
    Mutation("a reference taken behind the manager's back", "kvsession/cache/manager.py",
             "        self.pool.touch(blocks)\n"
             "        self._set(holder, holder.blocks + tuple(blocks))",
             "        self.pool.touch(blocks)\n        self.pool.touch(blocks[:1])\n"
             "        self._set(holder, holder.blocks + tuple(blocks))",
             ("tests/test_sessions.py::test_fork_shares_blocks_and_diverges",)),
    Mutation("a refused draft counted as computed", "kvsession/engine/scheduler.py",
             "        if num_kept:\n            self.update([ScheduledSeq(seq, num_kept)])",
             "        if True:\n            self.update([ScheduledSeq(seq, num_kept + 1)])",
             ("tests/test_speculative.py::test_replayed_drafts_keep_greedy_and_seeded_outputs",
              )),
]


def mutant_tree(tmp: Path, m: Mutation | None) -> Path:
    """A copy of the package and tests with one mutation applied (None: unchanged)."""
    root = tmp / "repo"
    for part in ("kvsession", "kernels", "tests"):
        shutil.copytree(ROOT / part, root / part,
                        ignore=shutil.ignore_patterns("__pycache__", "kernels"))
    (root / "kvsession" / "kernels").symlink_to(root / "kernels", target_is_directory=True)
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    if m is None:
        return root
    target = root / m.path
    text = target.read_text()
    if text.count(m.old) != 1:
        raise SystemExit(f"mutation {m.name!r}: expected one match in {m.path}, found "
                         f"{text.count(m.old)} (update tests/mutations.py)")
    target.write_text(text.replace(m.old, m.new))
    return root


def pytest(root: Path, tests: tuple[str, ...]) -> tuple[int, float, str]:
    """(exit code, seconds, the end of the output) of the tests in a tree."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    t0 = time.perf_counter()
    # in one process (-n 0): a few tests, and a worker's crash would not be a test failure
    out = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-n", "0", "-p",
                          "no:cacheprovider", *tests], cwd=root, env=env, capture_output=True,
                         text=True, timeout=600)
    lines = (out.stdout + out.stderr).strip().splitlines()
    failed = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
    return out.returncode, time.perf_counter() - t0, "\n".join(failed[:1] or lines[-4:])


def run(m: Mutation) -> tuple[bool, float, str]:
    """(caught: a test failed, not an error of the harness; seconds; the output's end)."""
    with tempfile.TemporaryDirectory() as tmp:
        code, seconds, tail = pytest(mutant_tree(Path(tmp), m), m.tests)
        return code == 1, seconds, tail


def main(names: list[str]) -> int:
    chosen = [m for m in MUTATIONS if not names or m.name in names]
    guards = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
    with tempfile.TemporaryDirectory() as tmp:  # the unmutated tree passes the same tests
        code, seconds, tail = pytest(mutant_tree(Path(tmp), None), guards)
    print(f"baseline: {len(guards)} guard tests {'pass' if code == 0 else 'FAIL'} "
          f"({seconds:.0f} s)", flush=True)
    if code != 0:
        print(tail)
        return 2
    missed = []
    for m in chosen:
        caught, seconds, tail = run(m)
        print(f"{'caught' if caught else 'MISSED'}  {m.name}  ({seconds:.0f} s): "
              f"{tail}", flush=True)
        if not caught:
            missed.append(m.name)
            print(tail)
    print(f"{len(chosen) - len(missed)} passed, {len(missed)} failed")
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
