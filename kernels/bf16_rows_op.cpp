// The bfloat16 rows kernel (bf16_rows.cpp, included whole) as the CPU implementation of the
// op kvsession::bf16_rows_matmul, whose schema bf16_rows.py defines: compiled one-token
// code (model/onerow.py) calls it for every product of a bfloat16 model, a few hundred
// times a step, where a Python implementation's ~30 us a call would cost more than the
// compiled regions save. Built by bf16_rows.py (cpp_build.TorchOp) with torch's headers;
// where it cannot be, the Python implementation serves (the same kernel through ctypes).

#include "bf16_rows.cpp"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace {

at::Tensor rows_matmul(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.is_contiguous() &&
                  w.size(1) % 32 == 0,
              "bf16_rows_matmul: w is contiguous bfloat16 [out, in], in a multiple of 32");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.size(1) && x.size(0) >= 1 &&
                  x.size(0) <= MAX_ROWS,
              "bf16_rows_matmul: x is [rows, in] with 1 to 16 rows");
  const at::Tensor xb = x.to(at::kBFloat16).contiguous();
  at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options().dtype(at::kFloat));
  kvs_bf16_matmul(static_cast<const uint16_t*>(w.data_ptr()),
                  static_cast<const uint16_t*>(xb.data_ptr()), x.size(0), w.size(1), w.size(0),
                  y.data_ptr<float>(), at::get_num_threads());
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(kvsession, CPU, m) { m.impl("bf16_rows_matmul", rows_matmul); }
