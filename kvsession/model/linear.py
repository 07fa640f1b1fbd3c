"""Projections y = x @ W.T (+ b), with W stored the way the CPU kernels stream it.

A decode step multiplies a few rows by every weight of the model, so it is as fast as the
projections read their weights. On CPU the checkpoint's `[out, in]` layout is the slow one
for decode-sized batches: MKL streams a weight stored `[in, out]` (row-major, x @ W^T with
W^T contiguous) at or above the DRAM read bandwidth for one row, where `F.linear` on
`[out, in]` reaches ~0.9x of it and the padded `(W @ x.T).T` form used before ~0.3x; at 8
rows the `[in, out]` layout is 1.2-1.3x faster than `F.linear` (bench/decode_vs_hf.py
--kernels prints these ratios, measured against the bandwidth in the same run). Prefill's
large batches are compute-bound and run as fast either way, so the transposed copy replaces
the checkpoint's: one copy of every weight.

oneDNN's prepacked weights (`torch.ops.mkldnn._reorder_linear_weight`) stream best for
2-64 rows but are slower at one row and opaque to everything else: `packed=True` keeps
such a copy beside the `[in, out]` one for batched decode, at twice the weight memory
(off by default; the bench measures both).
"""

from __future__ import annotations

import torch

PACKED_MAX_ROWS = 64  # above this a batch is prefill-like (compute-bound): plain GEMM


class Linear:
    """One projection. `weight` [out, in] as in the checkpoint (or several stacked along
    `out`, e.g. q/k/v fused); `bias` [out] or None."""

    def __init__(self, weight: torch.Tensor | list[torch.Tensor],
                 bias: torch.Tensor | None = None, packed: bool = False):
        parts = weight if isinstance(weight, list) else [weight]
        cpu = parts[0].device.type == "cpu"
        # [in, out] contiguous on CPU, built in one copy; cuBLAS takes either layout
        self.weight_t = torch.cat([w.t() for w in parts], dim=1) if cpu or len(parts) > 1 \
            else parts[0].t()
        self.bias = bias
        self.packed = None
        if packed and cpu and torch.backends.mkldnn.is_available():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, None)

    @property
    def weight(self) -> torch.Tensor:
        """[out, in] view (strided on CPU)."""
        return self.weight_t.t()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] -> [rows, out]."""
        if self.packed is not None and 1 < x.shape[0] <= PACKED_MAX_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)
