"""The model runner: turns a scheduled batch into tensors + AttentionMetadata, runs the
model, and returns logits for the sequences that sample this step."""

from __future__ import annotations

import torch

from kvsession.attention import AttentionMetadata
from kvsession.cache.kv_pool import KVPool
from kvsession.config import AttentionBackend
from kvsession.engine.graphs import DecodeGraphs
from kvsession.engine.scheduler import ScheduledSeq
from kvsession.kernels.reference import Workspace
from kvsession.model.llama import LlamaModel


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVPool, device: torch.device,
                 backend: AttentionBackend):
        self.model, self.kv, self.device, self.backend = model, kv, device, backend
        self.workspace = Workspace()
        self.graphs: DecodeGraphs | None = None  # set on CUDA with the Triton kernels

    def prepare(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor,
                                                          AttentionMetadata, list[int]]:
        """(input_ids, positions, metadata, rows whose hidden state is sampled).

        Built from Python lists with one tensor per field: a decode step's model work is a
        few milliseconds on CPU, and a handful of small tensor ops per sequence (what a
        per-sequence arange/index/cat costs) would be a visible part of it."""
        bs = self.kv.block_size
        ids, pos, slots, starts, seq_lens, sample_rows, tables = [], [], [], [0], [], [], []
        for item in batch:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            table = seq.block_ids
            ids += seq.token_ids[start:end]
            pos += range(start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            tables.append(table)
            starts.append(starts[-1] + item.num_new_tokens)
            seq_lens.append(end)
            if item.samples:
                sample_rows.append(starts[-1] - 1)
        width = max(len(t) for t in tables)
        dev, long = self.device, torch.long
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=long, device=dev),
            block_tables=torch.tensor([t + [-1] * (width - len(t)) for t in tables],
                                      dtype=long, device=dev),
            query_start_loc=starts,
            seq_lens=seq_lens,
            seq_lens_tensor=torch.tensor(seq_lens, dtype=long, device=dev),
            decode_only=all(item.num_new_tokens == 1 for item in batch),
            softmax_scale=self.model.softmax_scale,
            backend=self.backend,
            workspace=self.workspace,
            query_start_loc_tensor=torch.tensor(starts, dtype=long, device=dev),
            max_query_len=max(item.num_new_tokens for item in batch),
            on_layer_done=self._layer_hook(batch),
            all_slots_valid=True,  # every token of the batch is stored
        )
        return (torch.tensor(ids, dtype=long, device=dev), torch.tensor(pos, dtype=long,
                device=dev), meta, sample_rows)

    @staticmethod
    def _layer_hook(batch: list[ScheduledSeq]):
        hooks = [i.seq.on_layer_done for i in batch if i.seq.on_layer_done and i.samples]
        if not hooks:
            return None

        def done(layer: int) -> None:
            for hook in hooks:
                hook(layer)
        return done

    def run(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        """Run one step; float32 logits [num sampling sequences, vocab], in batch order."""
        if self.graphs is not None and all(i.num_new_tokens == 1 and i.samples for i in batch) \
                and self.graphs.bucket(len(batch)) is not None:
            bs = self.kv.block_size
            pos = [i.seq.num_computed_tokens for i in batch]
            return self.graphs.run(
                [i.seq.token_ids[p] for i, p in zip(batch, pos, strict=True)], pos,
                [i.seq.blocks[p // bs].block_id * bs + p % bs
                 for i, p in zip(batch, pos, strict=True)],
                [i.seq.block_ids for i in batch])
        input_ids, positions, meta, rows = self.prepare(batch)
        hidden = self.model.forward(input_ids, positions, self.kv, meta)
        if len(rows) < hidden.shape[0]:  # a decode step samples every row: no copy
            hidden = hidden[rows]
        return self.model.logits(hidden)
