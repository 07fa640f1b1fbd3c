"""The host (DRAM) tier: a block pool in CPU memory with the device pool's geometry,
indexed by content.

Its blocks are owned the way the device pool's are: `index` is a `BlockPool` (ref counts,
the chained-hash index verified token by token, a free queue that keeps content and evicts
leaves first by the cost rule). A host block is referenced by the sessions that spilled it
(the KVCacheManager writes their host tables); a block with no reference keeps its content,
found by hash by any request, until the host tier needs the room. Content reaches it two
ways: a session's spill (shared blocks stored once), and cached device blocks copied here as
the device pool evicts them (`TierPolicy.evicting`), so a prefix pushed off the device by
other work is loaded back instead of recomputed.

Blocks move as whole blocks, all layers at once, one gather/scatter per tensor (K, V and
fp8 scales): `store(ids)` copies device blocks `ids` into host blocks in a single call per
tensor, so a spill is a few large copies, never per-token work. On CUDA the host tensors are
pinned so the copies can run at PCIe speed.

With the Triton kernels (`KVPool.use_kernels`, the engine's setting on CUDA), a move is
staged: the block-copy kernel packs the device blocks into one contiguous buffer per tensor,
which crosses PCIe as a single DMA to or from a pinned buffer that the CPU scatters into (or
gathers from) the host blocks, however fragmented the ids are on either side. Without the
kernels, each run of consecutive ids is one slice copy.
"""

from __future__ import annotations

import threading

import torch

from kvsession.cache.block_pool import BlockPool
from kvsession.cache.eviction import EvictionPolicy, Order
from kvsession.cache.kv_pool import KVPool, block_runs
from kvsession.kernels.reference import Workspace, raw_view


class HostPool:
    def __init__(self, device_pool: KVPool, num_blocks: int):
        self.num_blocks = num_blocks
        pin = device_pool.k.device.type == "cuda"
        self.tensors = {
            name: torch.empty((t.shape[0], num_blocks, *t.shape[2:]), dtype=t.dtype,
                              pin_memory=pin)
            for name, t in device_pool.tensors().items()}
        # the recency order alone: no shadow pools to duel (the host sees evictions and
        # spills, not the prompts the duel replays)
        self.index = BlockPool(num_blocks, device_pool.block_size, True, EvictionPolicy.COST,
                               (Order.RECENCY,), grow=True)
        self.staged = device_pool.use_kernels
        # grown, reused staging buffers, per thread (the engine thread's, the copier's):
        # device side, and (pinned on CUDA) host side
        self._pin = pin
        self._staging = threading.local()
        # counters (llm.stats().tiers["host"]): tokens found here by lookups, bytes copied
        # (loads run on the engine thread and on the copier: tiers/copier.py)
        self._count = threading.Lock()
        self.hit_tokens = 0
        self.bytes_read = 0  # host -> device
        self.bytes_written = 0  # device -> host

    @property
    def num_free(self) -> int:
        """Blocks no session holds (some keep cached content until reused)."""
        return self.index.num_free

    def store(self, pool: KVPool, device_ids: list[int], host_ids: list[int]) -> int:
        """Copy device blocks into host blocks; returns bytes moved (done on return)."""
        if self.staged:
            moved = self._staged(pool, device_ids, host_ids, to_host=True)
        else:
            moved = self._copy(pool.tensors(), self.tensors, device_ids, host_ids)
        with self._count:
            self.bytes_written += moved
        return moved

    def load(self, pool: KVPool, host_ids: list[int], device_ids: list[int]) -> int:
        """Copy host blocks into device blocks; returns bytes moved."""
        if self.staged:
            moved = self._staged(pool, device_ids, host_ids, to_host=False)
        else:
            moved = self._copy(self.tensors, pool.tensors(), host_ids, device_ids)
        with self._count:
            self.bytes_read += moved
        return moved


    def _staged(self, pool: KVPool, device_ids: list[int], host_ids: list[int],
                to_host: bool) -> int:
        from kvsession.kernels.block_copy import gather_blocks, scatter_blocks

        n = len(device_ids)
        if not hasattr(self._staging, "device"):
            self._staging.device, self._staging.host = Workspace(), Workspace(self._pin)
        device_staging, host_staging = self._staging.device, self._staging.host
        ids = torch.tensor(device_ids, dtype=torch.long, device=pool.k.device)
        host_idx = torch.tensor(host_ids, dtype=torch.long)
        moved = 0
        for name, t in pool.tensors().items():
            shape = (t.shape[0], n, *t.shape[2:])  # [num_layers, n, *block]
            dev_buf = device_staging.get(name, shape, t)
            host_buf = host_staging.get(name, shape, self.tensors[name])
            host = raw_view(self.tensors[name])
            if to_host:
                gather_blocks(t, dev_buf, ids)
                host_buf.copy_(dev_buf)  # blocking: the CPU reads host_buf next
                host.index_copy_(1, host_idx, raw_view(host_buf))
            else:
                torch.index_select(host, 1, host_idx, out=raw_view(host_buf))
                dev_buf.copy_(host_buf)  # blocking: host_buf is reused by the next call
                scatter_blocks(dev_buf, t, ids)
            moved += t[:, :1].numel() * t.element_size() * n
        return moved

    @staticmethod
    def _copy(src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor], src_ids: list[int],
              dst_ids: list[int]) -> int:
        """dst[:, dst_ids] = src[:, src_ids] for every tensor, as one slice copy per run of
        consecutive ids on both sides (a single pass over the bytes; blocks allocated
        together are usually consecutive)."""
        runs = block_runs(src_ids, dst_ids)
        moved = 0
        for name, s in src.items():
            d = dst[name]
            for s0, d0, n in runs:
                raw_view(d)[:, d0:d0 + n].copy_(raw_view(s)[:, s0:s0 + n], non_blocking=True)
            moved += s[:, :1].numel() * s.element_size() * len(src_ids)
        return moved

