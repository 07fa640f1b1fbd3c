"""Remote prefill over NIXL, mid-size model, worker and caller on this machine.

- connector transfer bandwidth (the worker's measured per-layer write times of a 4k-token
  prompt's KV, sent a second time so the worker's prefix cache makes its compute negligible)
  vs a raw NIXL WRITE of the same number of bytes between two processes (target >= 0.7x);
- TTFT of a 4k-token prompt, local vs remote;
- decode step-time jitter: p99 inter-token latency of 8 streaming sessions while long
  prefills arrive, with and without the worker (the case the design exists for).
JSON result. On a 2-core machine the worker and the caller share the cores, so the jitter
comparison understates what separate machines give.
"""

from __future__ import annotations

import multiprocessing as mp
import random
import socket
import subprocess
import sys
import threading
import time

from common import mid_model, text_of, write_result

from kvsession import LLM, SamplingParams
from kvsession.costmodel import RateEstimator
from kvsession.metrics import percentile


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raw_writer(conn, num_bytes: int) -> None:
    import torch

    from kvsession.connector.descriptors import make_agent

    agent = make_agent("raw-writer")
    src = torch.ones(num_bytes, dtype=torch.uint8)
    reg = agent.register_memory(src)
    meta, addr = conn.recv()
    peer = agent.add_remote_agent(meta)
    local = agent.get_xfer_descs([(src.data_ptr(), num_bytes, 0)], "DRAM")
    remote = agent.get_xfer_descs([(addr, num_bytes, 0)], "DRAM")
    times = []
    for i in range(5):
        t = time.perf_counter()
        h = agent.initialize_xfer("WRITE", local, remote, peer, f"raw:{i}".encode())
        state = agent.transfer(h)
        while state == "PROC":
            state = agent.check_xfer_state(h)
        times.append(time.perf_counter() - t)
        agent.release_xfer_handle(h)
    conn.send(min(times))
    conn.recv()
    agent.remove_remote_agent(peer)
    agent.deregister_memory(reg)


def raw_nixl_bytes_per_s(num_bytes: int) -> float:
    import torch

    from kvsession.connector.descriptors import make_agent

    agent = make_agent("raw-reader")
    dst = torch.zeros(num_bytes, dtype=torch.uint8)
    reg = agent.register_memory(dst)
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=raw_writer, args=(child, num_bytes))
    proc.start()
    parent.send((agent.get_agent_metadata(), dst.data_ptr()))
    while not parent.poll(0.001):
        agent.get_new_notifs()  # drive progress on this side, as the connector does
    best = parent.recv()
    parent.send("bye")
    proc.join()
    agent.deregister_memory(reg)
    return num_bytes / best


def itl_p99(llm, long_prompts: list[str]) -> float:
    """p99 gap between streamed tokens of 8 sessions while long prompts are prefilled."""
    gaps: list[float] = []
    lock = threading.Lock()

    def session(i):
        s = llm.session(sampling=SamplingParams(max_tokens=48, temperature=0.0,
                                                ignore_eos=True))
        last = None
        for _ in s.stream(f"agent {i}: summarise the file"):
            now = time.perf_counter()
            if last is not None:
                with lock:
                    gaps.append(now - last)
            last = now
        s.close()

    threads = [threading.Thread(target=session, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    time.sleep(0.2)  # let decoding start, then the long prefills arrive (the workload)
    llm.generate(long_prompts, SamplingParams(max_tokens=1), use_tqdm=False)
    for t in threads:
        t.join()
    return percentile(gaps, 99)


def main() -> None:
    path = mid_model()
    address = f"tcp://127.0.0.1:{free_port()}"
    worker = subprocess.Popen([sys.executable, "-m", "kvsession.worker", "--model", str(path),
                               "--listen", address, "--kv-cache-memory", "1GiB",
                               "--max-model-len", "8192"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = "x"
    while line and "listening" not in line:
        line = worker.stdout.readline()
    rng = random.Random(0)
    kw = dict(kv_cache_memory="1GiB", max_model_len=8192, enable_prefix_caching=False)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    try:
        with LLM(path, **kw) as llm:
            prompt = text_of(llm.tokenizer, rng, 4096)
            longs = [text_of(llm.tokenizer, rng, 2048) for _ in range(3)]
            ttft_local = llm.generate([prompt], one, use_tqdm=False)[0].metrics.ttft_s
            itl_local = itl_p99(llm, longs)
        with LLM(path, prefill_worker=address, remote_prefill="always", **kw) as llm:
            ttft_remote = llm.generate([prompt], one, use_tqdm=False)[0].metrics.ttft_s
            # the data plane alone: the same prompt again is a prefix hit on the worker, so
            # its writes do not share the cores with a forward pass
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline:  # let the first request's answer arrive
                llm._rt.call(lambda: llm._rt.engine.poll_remote(0.05)).result()
            llm._rt.connector.transfer_rate = RateEstimator(prior=0.0)  # forget the first one
            llm.generate([prompt], one, use_tqdm=False)
            st = llm.stats().remote
            deadline = time.monotonic() + 5
            while st.bandwidth_gbps == 0 and time.monotonic() < deadline:
                # the worker's PrefillDone (with its write time) may trail the data
                llm._rt.call(lambda: llm._rt.engine.poll_remote(0.05)).result()
                st = llm.stats().remote
            kv_bytes = st.bytes // 2
            connector_bw = st.bandwidth_gbps * 1e9 / 8
            itl_remote = itl_p99(llm, longs)
    finally:
        worker.terminate()
        worker.wait(timeout=60)
    raw_bw = raw_nixl_bytes_per_s(kv_bytes)
    res = {"kv_bytes": kv_bytes, "connector_bytes_per_s": connector_bw,
           "raw_nixl_bytes_per_s": raw_bw, "connector_vs_raw": connector_bw / raw_bw,
           "ttft_4k_local_s": ttft_local, "ttft_4k_remote_s": ttft_remote,
           "itl_p99_local_s": itl_local, "itl_p99_remote_s": itl_remote}
    print(f"connector {connector_bw / 1e9:.2f} GB/s vs raw NIXL {raw_bw / 1e9:.2f} GB/s "
          f"({res['connector_vs_raw']:.2f}x, target >= 0.7) for {kv_bytes / 2**20:.0f} MiB")
    print(f"TTFT 4k prompt: local {ttft_local * 1e3:.0f} ms, remote {ttft_remote * 1e3:.0f} ms")
    print(f"p99 inter-token latency under long prefills: local {itl_local * 1e3:.0f} ms, "
          f"with worker {itl_remote * 1e3:.0f} ms")
    write_result("remote_prefill", res)


if __name__ == "__main__":
    main()
