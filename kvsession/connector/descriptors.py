"""The NIXL data plane's pieces that callers and workers share: agents (UCX backend, no
progress or listen thread), tensor descriptors, and the (address, length, device) lists of
one layer's transfer, built from block ids in runs of consecutive slots."""

from __future__ import annotations

import logging
import os
import uuid

import torch

from kvsession.connector.base import TensorDesc


def make_agent(prefix: str):
    from nixl._api import nixl_agent, nixl_agent_config

    if "NIXL_LOG_LEVEL" not in os.environ:  # NIXL logs every agent at INFO to stdout
        logging.getLogger("nixl").setLevel(logging.WARNING)
    config = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                               backends=["UCX"])
    return nixl_agent(f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}", config)


def describe_tensors(tensors: dict[str, torch.Tensor]) -> list[TensorDesc]:
    return [TensorDesc(name, t.data_ptr(), t.shape[0], t.shape[1],
                       t[0, 0].numel() * t.element_size(),
                       "VRAM" if t.is_cuda else "DRAM", t.device.index or 0)
            for name, t in tensors.items()]


def slot_runs(src_ids: list[int], dst_ids: list[int], first_slot: int, num_slots: int,
              block_size: int) -> list[tuple[int, int, int]]:
    """(src slot, dst slot, count) runs, in slots of one layer (slot = block id *
    block_size + position in the block), for `num_slots` consecutive token positions
    starting at position `first_slot` of the first block: only the tokens wanted move, not
    whole blocks (a follow-up turn's first block is shared with the previous turn's tail).
    Runs contiguous on both sides are merged into one descriptor."""
    runs: list[list[int]] = []
    end = first_slot + num_slots
    for i, (s_blk, d_blk) in enumerate(zip(src_ids, dst_ids, strict=True)):
        lo, hi = max(first_slot - i * block_size, 0), min(end - i * block_size, block_size)
        if hi <= lo:
            break
        s0, d0 = s_blk * block_size + lo, d_blk * block_size + lo
        if runs and runs[-1][0] + runs[-1][2] == s0 and runs[-1][1] + runs[-1][2] == d0:
            runs[-1][2] += hi - lo
        else:
            runs.append([s0, d0, hi - lo])
    return [(s, d, n) for s, d, n in runs]


def layer_descs(local: list[TensorDesc], remote: list[TensorDesc], layer: int,
                runs: list[tuple[int, int, int]], block_size: int) -> tuple[list, list]:
    """(local, remote) (addr, length, device) lists for one layer of every tensor; `runs`
    in slots (`slot_runs`)."""
    src, dst = [], []
    for lt, rt in zip(local, remote, strict=True):
        slot = lt.block_bytes // block_size  # a block is [block_size, ...]: slots contiguous
        for s0, d0, n in runs:
            src.append((lt.addr + (layer * lt.num_blocks * block_size + s0) * slot,
                        n * slot, lt.device_id))
            dst.append((rt.addr + (layer * rt.num_blocks * block_size + d0) * slot,
                        n * slot, rt.device_id))
    return src, dst
