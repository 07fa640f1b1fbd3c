"""An agent loop on the built-in tiny model: a session with a pinned system prompt, tool
calls answered with tool messages, and KV reused across turns.

Run: python examples/agent_loop.py [MODEL_DIR]
Exits non-zero if a turn reused less KV than the session held before it.
"""

import json
import sys
import tempfile

from kvsession import LLM, SamplingParams
from kvsession.testing import make_tiny_model

SYSTEM = ("You are a coding agent. Tools: list_files(path), read_file(path), run_tests(). "
          "Reply with one JSON tool call per turn.")
FILES = {"src/a.py": "def f(x): return x + 1", "tests/test_a.py": "assert f(1) == 3"}


def run_tool(turn: int) -> dict:
    """A stand-in tool executor (a real agent parses the model's JSON tool call)."""
    if turn == 0:
        return {"files": sorted(FILES)}
    if turn == 1:
        return {"path": "src/a.py", "content": FILES["src/a.py"]}
    return {"failed": ["tests/test_a.py::test_f"]}


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else make_tiny_model(tempfile.mkdtemp())
    with LLM(model, kv_cache_memory="64MiB", max_model_len=1024) as llm:
        agent = llm.session(system=SYSTEM, sampling=SamplingParams(max_tokens=24,
                                                                   temperature=0.0))
        reply = agent.send("The tests fail. Find out why.")
        held = 0
        for turn in range(3):
            if reply.cached_tokens < held:  # the previous turns' KV must be reused
                raise SystemExit(f"turn {turn}: reused {reply.cached_tokens} tokens, the "
                                 f"session held {held}")
            held = agent.num_cached_tokens - len(reply.token_ids)
            print(f"turn {turn}: computed {reply.prefill_tokens} prompt tokens, "
                  f"reused {reply.cached_tokens} ({reply.restored_from}), "
                  f"ttft {reply.metrics.ttft_s * 1e3:.1f} ms")
            agent.suspend(expected_idle_s=0.05)  # waiting on the tool
            agent.add("tool", json.dumps(run_tool(turn)))
            reply = agent.send("Continue.")
        print(f"session: {agent.stats.turns} turns, {agent.stats.cached_tokens} prompt tokens "
              f"served from cache, {agent.stats.computed_tokens} computed")
        print(agent)
        agent.close()


if __name__ == "__main__":
    main()
