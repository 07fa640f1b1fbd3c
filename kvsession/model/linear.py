"""Projections y = x @ W.T (+ b), with W stored the way the CPU kernels stream it.

A decode step multiplies a few rows by every weight of the model, so it is as fast as the
projections read their weights. Formats (`Linear(..., fmt=)`), measured on the bench
model's projections (bench/decode_vs_hf.py --kernels prints the table, against the DRAM
bandwidth of the same run):

- "float": `[in, out]` contiguous, x @ W^T by MKL. On an Intel machine the fastest at one
  row: it read the bench model's projections in 0.83x the time their bytes take at the
  DRAM read bandwidth (part of them stays in the large L3), where `F.linear` on the
  checkpoint's `[out, in]` took 0.94x and the padded `(W @ x.T).T` used before ~3x. But MKL
  repacks the weight on every call for 2-64 rows (2.0x the bound at 8 rows), and on an AMD
  EPYC it runs its generic code path (`mkl_blas_def_xsgemv`: ~22 GB/s through the output
  head where oneDNN streams ~39 GB/s; ~160-180 GFLOP/s at prefill sizes). One copy.
- "onednn": oneDNN's prepacked blocked layout (`torch.ops.mkldnn._reorder_linear_weight`,
  what inductor's freezing uses): 1.40x the bound at 8 rows; at one row 1.24x on the Intel
  machine; the compute-bound prefill products at ~300-430 GFLOP/s in float32 on the AMD
  machine (1.8-2.5x MKL's; bfloat16 alike, ~850). One copy, opaque (a tied embedding keeps
  its own).
- "both": "onednn" for every batch of two rows or more (decode batches and prefill), plus
  the checkpoint's `[out, in]` rows, contiguous: a one-token step streams them through
  inductor-compiled code where that is faster (model/onerow.py: ~1.6x oneDNN's one-row
  time on the AMD machine), else one row goes through whichever of `F.linear` on the rows
  and oneDNN `measure_one_row` found faster when the model was built. The model's default
  on CPU, at twice the weight memory.
- "rows": the checkpoint's `[out, in]` rows, `F.linear` for every batch but a bfloat16
  decode batch (up to 16 rows), which runs kernels/bf16_rows (oneDNN streams unpacked bf16
  rows at ~0.6x its packed rate, and the kernel at one row ~1.4x the packed rate: ~0.9 of
  a plain read loop's; where oneDNN has no bfloat16 GEMM, as on AVX2 CPUs, a bfloat16
  prefill converts the rows to float32 a chunk at a time: `bf16_rows.dense`). One copy
  that a tied embedding shares. Every projection of a bfloat16 model on a CPU with
  AVX512-BF16 or AVX2 and FMA (LlamaModel; prefill through F.linear on the rows ran ~4%
  slower than packed at 512 rows with AVX512), and elsewhere the head of a single-layout
  model that ties its embeddings (a packed head would need the embedding kept a second
  time, ~0.3 GB for a 152k vocabulary).
- "int8": int8 weights with a float scale per group of 32 inputs (llama.cpp's Q8_0 layout,
  kernels/q8_matmul.py; `LLM(quantization="int8")`): 0.56x bfloat16's bytes. A decode batch
  (up to 16 rows) runs the C++ kernel built at first use (with AVX512-VNNI, or AVX2 and
  FMA, rounding its activations to int8 per 32, as llama.cpp's Q8_0 products do); larger
  batches (prefill) and a machine without a compiler dequantize the weight for one dense
  product in the compute dtype. Accuracy against float32 and against a Q8_0 emulation:
  bench/int8_accuracy.py.
"""

from __future__ import annotations

import time

import torch

from kvsession.host_memory import huge_page_empty
from kvsession.kernels import bf16_rows, q8_matmul

FORMATS = ("float", "onednn", "both", "rows", "int8")
PACKED_MAX_ROWS = 64  # oneDNN's blocking hint (decode batches); larger batches run packed too
# below this many weight bytes measure_one_row keeps MKL: weights that fit the CPU caches run
# about as fast either way, and a choice made by noise could differ between two processes
# (float rounding, so a near-tie of greedy logits, would then differ with it)
MEASURE_MIN_BYTES = 32 << 20


class Linear:
    """One projection. `weight` [out, in] as in the checkpoint, or a list of such stacked
    along `out` (q/k/v fused); `bias` [out] or None. On other devices than the CPU every
    format is "float" (cuBLAS takes either layout). "both" and "rows" write their rows into
    `rows_buffer` when given (a RowsBuffer: the model's one allocation of them), else into
    memory of their own."""

    def __init__(self, weight: torch.Tensor | list[torch.Tensor],
                 bias: torch.Tensor | None = None, fmt: str = "float",
                 rows_buffer: RowsBuffer | None = None):
        if fmt not in FORMATS:
            raise ValueError(f"unknown weight format {fmt!r}; accepted: {list(FORMATS)}")
        parts = weight if isinstance(weight, list) else [weight]
        cpu = parts[0].device.type == "cpu"
        self.fmt = fmt if cpu else "float"
        self.bias = bias
        self.weight_t = self.rows = self.packed = self.int8 = None
        # "both": one row through the packed weight too (set by measure_one_row)
        self.one_row_packed = False
        if self.fmt == "float":
            # [in, out] contiguous, built in one copy
            self.weight_t = torch.cat([w.t() for w in parts], dim=1) if cpu or len(parts) > 1 \
                else parts[0].t()
        if self.fmt in ("both", "rows") and rows_buffer is not None:
            w = self.rows = rows_buffer.take(parts)  # fused in its place (RowsBuffer)
        elif self.fmt == "int8":  # quantized part by part (q8_matmul.quantize)
            w = parts[0]
        else:
            w = torch.cat(parts) if self.fmt != "float" and len(parts) > 1 else parts[0]
        if self.fmt in ("both", "rows"):
            self.rows = w.contiguous()
        # "rows" in bfloat16 (a tied head): decode rows through kernels/bf16_rows
        self.rows_kernel = bf16_rows.load() if self.fmt == "rows" and \
            bf16_rows.applies(self.rows) else None
        if self.fmt in ("onednn", "both"):
            # packed for every batch (the hint only tunes the blocking)
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(w, PACKED_MAX_ROWS)
            except RuntimeError:
                # oneDNN packs some dtypes only on some CPUs (bfloat16 needs AVX512BW/VL
                # or AVX-NE-CONVERT, float16 avx512_fp16): elsewhere one copy serves every
                # batch, the rows "both" already wrote (no second layout to pair them
                # with), else the plain layout
                if self.rows is not None:
                    self.fmt = "rows"
                    self.rows_kernel = bf16_rows.load() if bf16_rows.applies(self.rows) \
                        else None
                else:
                    self.fmt = "float"
                    self.weight_t = w.t().contiguous()
        if self.fmt == "int8":  # symmetric, per group of inputs: w ~ q * scale
            self.int8 = q8_matmul.quantize(parts, q8_matmul.group_for(w.shape[1]))
            self.dtype = w.dtype  # what rows looked up (`lookup`) come back in
            self.q8_kernel = q8_matmul.load()

    @property
    def weight(self) -> torch.Tensor:
        """[out, in] float view ("float", "both" and "rows"; strided for "float" on CPU)."""
        if self.rows is not None:
            return self.rows
        if self.weight_t is None:
            raise AttributeError(f"a {self.fmt!r} projection keeps no float weight")
        return self.weight_t.t()

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight, [len(ids), in] (a tied embedding reads the head's)."""
        if self.int8 is not None:
            q, scale = self.int8
            return q8_matmul.dequantize(q.index_select(0, ids), scale.index_select(0, ids),
                                        self.dtype)
        return self.weight.index_select(0, ids)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] -> [rows, out]."""
        if self.int8 is not None:
            y = q8_matmul.matmul(self.q8_kernel, x, *self.int8)
            return y if self.bias is None else y + self.bias
        if self.packed is not None and (self.rows is None or x.shape[0] > 1
                                        or self.one_row_packed):
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.rows_kernel is not None:
            return bf16_rows.matmul(self.rows_kernel, x, self.rows, self.bias)
        if self.rows is not None:
            return bf16_rows.dense(x, self.rows, self.bias)
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)


def measure_one_row(linears: list[Linear], rounds: int = 3) -> bool:
    """Which kernel a one-row product (a batch-1 decode step) should use in "both"
    projections, measured on this machine: every projection of `linears` with one row, MKL
    on the plain rows against oneDNN on the packed layout, interleaved `rounds` times (the
    best round of each counts, so a burst of other work does not decide). Sets
    `one_row_packed` on each and returns it; models under MEASURE_MIN_BYTES keep MKL. Why
    measure: the faster one depends on the CPU (MKL wins on Intel, oneDNN on AMD, by 1.5x
    either way), not on the model."""
    both = [lin for lin in linears if lin.rows is not None and lin.packed is not None]
    if weight_bytes(both) < MEASURE_MIN_BYTES:
        return False
    xs = [torch.zeros(1, lin.rows.shape[1], dtype=lin.rows.dtype) for lin in both]

    def one_pass(packed: bool) -> None:
        for lin in both:
            lin.one_row_packed = packed
        for lin, x in zip(both, xs, strict=True):
            lin(x)

    best = best_times([lambda: one_pass(False), lambda: one_pass(True)], rounds)
    choice = best[1] < best[0]
    for lin in both:
        lin.one_row_packed = choice
    return choice


ROWS_ALIGN_BYTES = 4096  # each weight a RowsBuffer takes starts on a page


class RowsBuffer:
    """One allocation that the one-row weights ("both" and "rows") are written into, each
    where the Linear built with it is built: the order a batch-1 decode step reads them
    when the model builds its Linears in that order (each layer's q/k/v, o, gate/up, down,
    then the output head), on the CPU in transparent huge pages
    (host_memory.huge_page_empty), each weight starting on a page.

    Why one buffer: a one-token step streamed the bench model's weights ~15% faster from
    one fresh buffer than where loading left them (the head ~5-9%; interleaved A/B in one
    process on the AMD bench machine), and that buffer in 2 MiB pages ~17% faster again
    (median step 8.85 -> 7.37 ms, the same compiled code over a copy of the same bytes):
    fewer TLB misses and page boundaries in the stream. Why written at build time: each
    weight is copied once, from the checkpoint's mapping straight into its place, its fused
    parts (q/k/v, gate/up) side by side; fusing first and moving after copied a real
    checkpoint's bytes twice (Qwen3-0.6B bf16: ~0.2 s of torch.cat and a fresh allocation's
    first touch, then the move).

    Sized up front (`numels`: each weight part it will take, in elements; the rounding of
    each to a page is room enough for every slot's), dtype fixed; pages never written take
    no memory."""

    def __init__(self, numels: list[int], dtype: torch.dtype):
        self.dtype = dtype
        self.align = max(ROWS_ALIGN_BYTES // dtype.itemsize, 1)
        self.buf = huge_page_empty((sum(self._rounded(n) for n in numels),), dtype)
        self.used = 0  # elements handed out, slots rounded to `align`

    def _rounded(self, n: int) -> int:
        return -(-n // self.align) * self.align

    def take(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """`parts` ([out_i, in] each, this buffer's dtype, on the CPU) stacked along out,
        copied into the next slot: a contiguous [sum of out_i, in] view of the buffer.

        Raises:
            ValueError: a part of another dtype or width, or no room left (the buffer was
                sized for other weights: a bug of its caller's)."""
        cols = parts[0].shape[1]
        if any(p.dtype != self.dtype or p.dim() != 2 or p.shape[1] != cols for p in parts):
            raise ValueError(f"a RowsBuffer of {self.dtype} takes 2-D parts of one width")
        rows = sum(p.shape[0] for p in parts)
        if self.used + rows * cols > self.buf.numel():
            raise ValueError(f"the RowsBuffer has no room for [{rows}, {cols}]")
        view = self.buf[self.used:self.used + rows * cols].view(rows, cols)
        torch.cat(parts, out=view)
        self.used += self._rounded(rows * cols)
        return view


def weight_bytes(linears: list[Linear]) -> int:
    """Bytes of the one-row weights of `linears`: their rows ("both" and "rows"), or their
    int8 weights and scales."""
    def nbytes(lin: Linear) -> int:
        kept = lin.int8 if lin.int8 is not None else (lin.rows,) if lin.rows is not None \
            else ()
        return sum(t.numel() * t.element_size() for t in kept)

    return sum(nbytes(lin) for lin in linears)


def round_times(fns: list, rounds: int) -> list[list[float]]:
    """The wall time of each of `fns` in each of `rounds` interleaved rounds, after one
    untimed call each (first touches, oneDNN's primitive cache, compiling)."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t)
    return times


def best_times(fns: list, rounds: int) -> list[float]:
    """The best wall time of each of `fns` over `rounds` interleaved rounds (`round_times`)."""
    return [min(t) for t in round_times(fns, rounds)]
