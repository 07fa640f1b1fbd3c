"""A tool-calling agent loop on the built-in tiny model: tools passed as OpenAI schemas,
rendered by the checkpoint's chat template (a Hermes/Qwen-style one here), calls forced with
tool_choice="required" (so they are valid even with random weights), run as real Python
functions on a scratch project directory, and their results appended as tool messages.

Run: python examples/tool_agent.py [MODEL_DIR]   (MODEL_DIR: a checkpoint whose template
renders tools; default: a tiny random model with a Hermes template, built in a temp dir)
Exits non-zero if a step produced no call or a call the tool could not run.
"""

import json
import sys
import tempfile
from pathlib import Path

from kvsession import LLM, SamplingParams
from kvsession.testing import make_tiny_model

FILES = {"src/calc.py": "def add(a, b):\n    return a - b\n",
         "tests/test_calc.py": "from calc import add\nassert add(2, 3) == 5\n",
         "README.md": "A calculator.\n"}


def make_project(root: Path) -> None:
    for name, text in FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def tools_for(root: Path) -> tuple[list[dict], dict]:
    """OpenAI tool schemas and the Python functions that run them. The enums name what
    exists, so every call the grammar allows can run."""

    def list_files(directory: str) -> dict:
        return {"files": sorted(p.name for p in (root / directory).iterdir())}

    def read_file(path: str, max_chars: int = 200) -> dict:
        return {"path": path, "content": (root / path).read_text()[:max_chars]}

    def add(a: int, b: int) -> dict:
        return {"sum": a + b}

    schemas = [
        {"type": "function", "function": {
            "name": "list_files", "description": "List a directory of the project",
            "parameters": {"type": "object", "properties": {
                "directory": {"enum": sorted({str(Path(f).parent) for f in FILES})}},
                "required": ["directory"]}}},
        {"type": "function", "function": {
            "name": "read_file", "description": "Read a file of the project",
            "parameters": {"type": "object", "properties": {
                "path": {"enum": sorted(FILES)},
                "max_chars": {"type": "integer", "minimum": 1, "maximum": 400}},
                "required": ["path"]}}},
        {"type": "function", "function": {
            "name": "add", "description": "Add two integers",
            "parameters": {"type": "object", "properties": {
                "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
                "required": ["a", "b"]}}},
    ]
    return schemas, {"list_files": list_files, "read_file": read_file, "add": add}


def main() -> None:
    scratch = Path(tempfile.mkdtemp(prefix="tool-agent-"))
    model = sys.argv[1] if len(sys.argv) > 1 else \
        make_tiny_model(scratch / "model", chat_template="hermes")
    project = scratch / "project"
    make_project(project)
    tools, functions = tools_for(project)
    messages = [{"role": "system", "content": "You are a coding agent. Use the tools."},
                {"role": "user", "content": "The calculator test fails. Find out why."}]
    params = SamplingParams(max_tokens=128, temperature=1.0)
    with LLM(model, kv_cache_memory="64MiB", max_model_len=2048) as llm:
        for step in range(3):
            (out,) = llm.chat(messages, params.with_overrides(seed=step), tools=tools,
                              tool_choice="required", use_tqdm=False)
            if not out.tool_calls:
                raise SystemExit(f"step {step}: no valid tool call in {out.text!r:.200}")
            messages.append({"role": "assistant", "content": out.text or None,
                             "tool_calls": [c.to_dict() for c in out.tool_calls]})
            for call in out.tool_calls:
                try:
                    result = functions[call.name](**call.arguments)
                except (KeyError, TypeError, OSError) as e:  # not a call the tool accepts
                    raise SystemExit(f"step {step}: invalid call {call}: {e}") from None
                print(f"step {step}: {call.name}({json.dumps(call.arguments)}) -> "
                      f"{json.dumps(result)[:100]}")
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": json.dumps(result)})
        # the answer: tools still rendered (same prompt prefix), no call this time
        (final,) = llm.chat(messages, SamplingParams(max_tokens=24, temperature=0.0),
                            tools=tools, tool_choice="none", use_tqdm=False)
        print(f"answer ({len(final.token_ids)} tokens, {final.num_cached_tokens} prompt "
              f"tokens from cache): {final.text!r:.80}")


if __name__ == "__main__":
    main()
