"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step (every sequence adds one token and samples) has fixed shapes once the batch
is padded to a bucket: padded rows store nothing (slot -1) and attend to nothing (seq_len 0,
the kernels return zeros), and block tables are padded (-1) to the longest table a
sequence of max_model_len can have. Each bucket is captured once, after an eager warm-up
that also compiles the kernels, and replayed with the step's inputs copied into its static
buffers: one launch instead of hundreds, which is what batch-1 decode needs on a GPU.

Capture needs the Triton backend (the torch reference reads seq_lens on the host). On CPU
the same padded step runs eagerly (`capture=False`): that is the twin the tests exercise.
"""

from __future__ import annotations

import torch

from kvsession.attention import AttentionMetadata
from kvsession.cache.kv_pool import KVPool
from kvsession.config import AttentionBackend
from kvsession.model.llama import LlamaModel

BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)


class DecodeGraphs:
    def __init__(self, model: LlamaModel, kv: KVPool, device: torch.device,
                 backend: AttentionBackend, max_blocks_per_seq: int, max_batch: int,
                 capture: bool):
        self.model, self.kv_pool, self.device, self.backend = model, kv, device, backend
        self.max_blocks, self.capture = max_blocks_per_seq, capture
        self.buckets = sorted({b for b in BUCKETS if b < max_batch} | {max_batch})
        self._buffers: dict[int, dict[str, torch.Tensor]] = {}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool = None

    def bucket(self, num_seqs: int) -> int | None:
        return next((b for b in self.buckets if b >= num_seqs), None)

    def _static(self, b: int) -> dict[str, torch.Tensor]:
        if b not in self._buffers:
            dev, long = self.device, torch.long
            self._buffers[b] = {
                "ids": torch.zeros(b, dtype=long, device=dev),
                "positions": torch.zeros(b, dtype=long, device=dev),
                "slots": torch.full((b,), -1, dtype=long, device=dev),
                "tables": torch.full((b, self.max_blocks), -1, dtype=long, device=dev),
                "seq_lens": torch.zeros(b, dtype=long, device=dev),
                "logits": torch.zeros(b, self.model.spec.vocab_size, dtype=torch.float32,
                                      device=dev),
            }
        return self._buffers[b]

    def _step(self, st: dict[str, torch.Tensor]) -> None:
        meta = AttentionMetadata(
            slot_mapping=st["slots"], block_tables=st["tables"], query_start_loc=[],
            seq_lens=[], seq_lens_tensor=st["seq_lens"], decode_only=True,
            softmax_scale=self.model.softmax_scale, backend=self.backend)
        hidden = self.model.forward(st["ids"], st["positions"], self.kv_pool, meta)
        st["logits"].copy_(self.model.logits(hidden))

    def run(self, ids: list[int], positions: list[int], slots: list[int],
            tables: list[list[int]]) -> torch.Tensor:
        """One decode step for len(ids) sequences (<= the largest bucket): logits
        [len(ids), vocab]. Valid until the next call."""
        n = len(ids)
        b = self.bucket(n)
        st = self._static(b)
        host_tables = torch.full((b, self.max_blocks), -1, dtype=torch.long)
        for i, t in enumerate(tables):
            host_tables[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        pad = b - n
        st["ids"].copy_(torch.tensor(ids + [0] * pad), non_blocking=True)
        st["positions"].copy_(torch.tensor(positions + [0] * pad), non_blocking=True)
        st["slots"].copy_(torch.tensor(slots + [-1] * pad), non_blocking=True)
        st["seq_lens"].copy_(torch.tensor([p + 1 for p in positions] + [0] * pad),
                             non_blocking=True)
        st["tables"].copy_(host_tables, non_blocking=True)
        if not self.capture:
            self._step(st)
        else:
            if b not in self._graphs:
                self._step(st)  # warm-up: compiles the kernels outside the capture
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    self._step(st)
                self._pool = graph.pool()
                self._graphs[b] = graph
            self._graphs[b].replay()
        return st["logits"][:n]
