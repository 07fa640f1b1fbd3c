"""Session logs written by the real commit thread for the log tests (test_durability.py,
test_log_recovery.py): a fixed engine identity and a few turns' records."""

from __future__ import annotations

import os
from pathlib import Path

from kvsession.tiers import wal
from kvsession.tiers.commit import GroupCommit, Op, SessionLog

IDENTITY = wal.Identity(model_fingerprint="m" * 64, tokenizer_digest="t", template_digest="c",
                        kv_dtype="float32", block_size=16)


def write_log(root: Path, turns: int, sid: str = "s") -> tuple[Path, list[int]]:
    """A log of `turns` records through the real commit thread; returns its path and the
    file size after each record."""
    gc = GroupCommit(root)
    slog = SessionLog(root / f"{sid}.log", sid, IDENTITY)
    messages, tokens, ends = [{"role": "system", "content": "sys"}], [], []
    try:
        for t in range(turns):
            messages += [{"role": "user", "content": f"question {t}"},
                         {"role": "assistant", "content": f"answer {t} " * t}]
            tokens = tokens[: max(0, len(tokens) - 3)] + list(range(t, t + 20))
            op, data = slog.record(messages, tokens, {"max_tokens": 4, "stop": ("x",)},
                                   "sys", {"max_tokens": 4})
            gc.submit(slog, op, data).result(timeout=30)
            ends.append(os.path.getsize(slog.path))
        gc.submit(slog, Op.CLOSE).result(timeout=30)
    finally:
        gc.close()
    return slog.path, ends
