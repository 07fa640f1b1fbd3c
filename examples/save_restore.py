"""Save a session, restart the process, and continue exactly where it was.

Run: python examples/save_restore.py
The first process talks and saves; a second process (a real restart) restores the
snapshot and continues; the continuation is compared with an uninterrupted session
(exit code 1 if they differ, or if the restored session recomputed its history).
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from kvsession import LLM, SamplingParams
from kvsession.testing import make_tiny_model

PARAMS = SamplingParams(max_tokens=12, temperature=0.0)


def first_process(model: str, path: str) -> None:
    with LLM(model, kv_cache_memory="32MiB", max_model_len=512) as llm:
        s = llm.session(system="You are a careful assistant.", sampling=PARAMS,
                        session_id="agent-7")
        s.send("Remember the number 42.")
        s.save(path)
        print(f"saved {s} to {path}")


def second_process(model: str, path: str) -> None:
    with LLM(model, kv_cache_memory="32MiB", max_model_len=512) as llm:
        s = llm.restore(path)
        r = s.send("What number did I ask you to remember?")
        print(f"restored {s.session_id}: reused {r.cached_tokens} tokens, computed "
              f"{r.prefill_tokens}; reply ids {r.token_ids}")
        print(json.dumps({"ids": r.token_ids, "cached": r.cached_tokens}))


def main() -> None:
    if len(sys.argv) == 4:
        (first_process if sys.argv[1] == "first" else second_process)(sys.argv[2], sys.argv[3])
        return
    tmp = Path(tempfile.mkdtemp())
    model, path = str(make_tiny_model(tmp / "model")), str(tmp / "agent-7.kvs")
    for role in ("first", "second"):  # two separate processes: a real restart
        out = subprocess.run([sys.executable, __file__, role, model, path], check=True,
                             capture_output=True, text=True).stdout
        print(out, end="")
    restored = json.loads(out.strip().splitlines()[-1])
    subprocess.run([sys.executable, "-m", "kvsession", "inspect", path], check=True)
    with LLM(model, kv_cache_memory="32MiB", max_model_len=512) as llm:
        s = llm.session(system="You are a careful assistant.", sampling=PARAMS)
        s.send("Remember the number 42.")
        r = s.send("What number did I ask you to remember?")
        print(f"uninterrupted reply ids {r.token_ids}")
    if restored["ids"] != r.token_ids or restored["cached"] == 0:
        raise SystemExit("the restored session did not continue exactly where it was")


if __name__ == "__main__":
    main()
