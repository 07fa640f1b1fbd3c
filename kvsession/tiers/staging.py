"""Reusable CPU buffers for the write-behind's gathers (tiers/writeback.py).

After a turn the engine thread copies the session's new full blocks out of the KV pool into
CPU memory, and the writer thread writes that copy. Fresh memory costs the kernel's
zeroing of every page on first touch: on the 2-core CI machine a gather into fresh memory
ran at ~2 GB/s, into memory touched before at ~11 GB/s, so with O_DIRECT appends the
gathers, not the disk, bound the write-behind (bench/durability.py). The gather is also
the one part of write-behind on the engine thread. So the buffers are kept and reused.

Contract: `take` (engine thread) hands out a `[n, *tail]` view of a buffer nobody else
holds; `give_back` (writer thread, once those blocks are written) returns it. At most
`max_bytes` are kept between uses (the write-behind's queue bound: what its queue may hold
anyway); buffers past that are freed. Buffers are sized in powers of two rows so that
turns of other lengths reuse them.

Fresh buffers are page-aligned private mappings (`host_memory.fresh_memory`): the
write-behind writes block data from them in place with O_DIRECT (direct_io.Aligned), which
needs aligned memory, and a large torch.empty is only 64-byte aligned. Not advised into
transparent huge pages: in this VM a cold 512 MiB copy into 2 MiB pages took 0.08-0.9 s
from one fresh process to the next, into 4 KiB pages a steady 0.15-0.2 s.
"""

from __future__ import annotations

import threading

import torch

from kvsession.host_memory import fresh_memory


class StagingBuffers:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._free: list[torch.Tensor] = []  # flat uint8 buffers, smallest first
        self._kept_bytes = 0
        self._guard = threading.Lock()
        self.reused = self.allocated = 0  # counters (tests, benchmark)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """(a `shape` tensor of `dtype`, the buffer behind it, to give back)."""
        nbytes = dtype.itemsize
        for n in shape:
            nbytes *= n
        buf = None
        with self._guard:
            for k, b in enumerate(self._free):  # the smallest that fits
                if b.numel() >= nbytes:
                    buf = self._free.pop(k)
                    self._kept_bytes -= buf.numel()
                    self.reused += 1
                    break
        if buf is None:
            rows = max(shape[0], 1) if shape else 1
            per_row = -(-nbytes // rows)
            # the tensor keeps the mapping alive (and unmaps it when freed)
            buf = torch.frombuffer(fresh_memory(max(per_row << (rows - 1).bit_length(), 1)),
                                   dtype=torch.uint8)
            self.allocated += 1
        return buf[:nbytes].view(dtype).view(shape), buf

    def give_back(self, buf: torch.Tensor) -> None:
        """`buf` (from `take`) is read no more: kept for a later gather, or freed."""
        with self._guard:
            if self._kept_bytes + buf.numel() > self.max_bytes:
                return
            self._free.append(buf)
            self._free.sort(key=torch.Tensor.numel)
            self._kept_bytes += buf.numel()

    @property
    def kept_bytes(self) -> int:
        with self._guard:
            return self._kept_bytes
