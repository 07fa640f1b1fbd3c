"""Serve a model over the OpenAI API and talk to it with the official `openai` client.

Starts `python -m kvsession serve` on a tiny random model (port 0: the server prints the
port it got), holds a conversation the way every OpenAI client does (re-sending the whole
history each turn: the server continues the conversation's session, so the history's KV is
reused — see `cached_tokens`), streams a reply, then stops the server with SIGTERM.

Needs the extras: pip install 'kvsession[server]' openai
Exits non-zero if anything fails.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from openai import OpenAI

from kvsession.testing import make_tiny_model


def start_server(model: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "kvsession", "serve", "--model", str(model),
                             "--port", "0", "--device", "cpu", "--kv-cache-memory", "64MiB",
                             "--max-model-len", "1024"], stdout=subprocess.PIPE, text=True)
    found: list[str] = []

    def read():  # the first line names the address; later lines are only echoed
        for line in proc.stdout:
            if m := re.search(r"listening on (http://\S+)", line):
                found.append(m.group(1))
            print(f"[server] {line.rstrip()}")
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    for _ in range(1200):  # up to 120 s for the model to load
        if found or proc.poll() is not None:
            break
        reader.join(timeout=0.1)
    if not found:
        proc.kill()
        raise SystemExit("the server did not start")
    return proc, found[0]


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "tiny-llama")
        proc, url = start_server(model)
        try:
            client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
            name = client.models.list().data[0].id
            messages = [{"role": "system", "content": "You are a helpful coding assistant."},
                        {"role": "user", "content": "List the files in the project."}]
            history = 0
            for turn in range(3):
                r = client.chat.completions.create(model=name, messages=messages,
                                                   max_tokens=16, temperature=0)
                cached = r.usage.prompt_tokens_details.cached_tokens
                print(f"turn {turn + 1}: {r.usage.prompt_tokens} prompt tokens, {cached} "
                      f"from the cache (previous history: {history})")
                if turn and cached < 0.9 * history:
                    raise SystemExit("the re-sent history was not reused")
                history = r.usage.prompt_tokens + r.usage.completion_tokens
                messages += [{"role": "assistant", "content": r.choices[0].message.content},
                             {"role": "user", "content": "Now run the tests."}]
            print("streamed: ", end="")
            for chunk in client.chat.completions.create(model=name, messages=messages,
                                                        max_tokens=16, temperature=0,
                                                        stream=True):
                if chunk.choices and chunk.choices[0].delta.content:
                    print(chunk.choices[0].delta.content, end="", flush=True)
            print()
        finally:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=60)
        print(f"server exited with status {code}")
        return code


if __name__ == "__main__":
    raise SystemExit(main())
