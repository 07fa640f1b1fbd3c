"""Remote prefill: start a prefill worker process, offload prompts to it, compare with
local generation, and stop the worker cleanly.

Run: python examples/remote_prefill.py
(The same worker from a shell: python -m kvsession.worker --model DIR --listen tcp://...)
Exits non-zero if remote prefill changed the tokens, or the worker did not stop cleanly.
"""

import subprocess
import sys
import tempfile

from kvsession import LLM, SamplingParams
from kvsession.testing import make_tiny_model


def main() -> None:
    model = str(make_tiny_model(tempfile.mkdtemp()))
    # port 0: the worker binds a free port and prints the endpoint it listens on
    worker = subprocess.Popen([sys.executable, "-m", "kvsession.worker", "--model", model,
                               "--listen", "tcp://127.0.0.1:0", "--kv-cache-memory", "32MiB",
                               "--max-model-len", "1024"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = "x"
    while line and "listening on " not in line:  # wait until the worker is up
        line = worker.stdout.readline()
    if "listening on " not in line:
        raise SystemExit("the worker did not start")
    address = line.split("listening on ", 1)[1].strip()
    prompts = [f"Task {i}: " + "read the file and run the tests. " * 20 for i in range(4)]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    try:
        with LLM(model, kv_cache_memory="32MiB", max_model_len=1024) as llm:
            local = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        with LLM(model, kv_cache_memory="32MiB", max_model_len=1024,
                 prefill_worker=address, remote_prefill="always") as llm:
            remote = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            st = llm.stats().remote
            print(f"remote prefills: {st.prefills}, KV bytes moved: {st.bytes}, "
                  f"bandwidth {st.bandwidth_gbps:.2f} Gbit/s, fallbacks: {st.fallbacks}")
        print("same tokens as local prefill:", remote == local)
        if remote != local or st.prefills == 0:
            raise SystemExit("remote prefill did not give the local tokens")
    finally:
        worker.terminate()
        code = worker.wait(timeout=30)
        print("worker exit code:", code)
    if code != 0:
        raise SystemExit(f"the worker exited with {code}")


if __name__ == "__main__":
    main()
