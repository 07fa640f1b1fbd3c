"""The child side of common.RoundsProcess, in the standard library only: a benchmark's
child process in another Python (llama.cpp's, bench/llama_cpp_child.py) answers rounds as
kvsession's children do."""

from __future__ import annotations

import json
import resource
import sys


def answer_rounds(run_round, facts: dict | None = None) -> None:
    """Says it is ready (with `facts` about the child, if any), then answers each
    {"round": t} read on stdin with run_round(t)'s seconds and the user CPU it took;
    returns at {"round": null} (the caller then reports and closes)."""
    print(json.dumps({"ready": True} | (facts or {})), flush=True)
    for line in sys.stdin:
        t = json.loads(line)["round"]
        if t is None:
            return
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        elapsed = run_round(t)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        print(json.dumps({"elapsed_s": elapsed, "user_cpu_s": r1.ru_utime - r0.ru_utime}),
              flush=True)
