// The int8 product kernel (q8_matmul.cpp, included whole) as the CPU implementation of the
// op kvsession::q8_matmul, whose schema q8_matmul.py defines: compiled one-token code
// (model/onerow.py) calls it for every product of an int8 model, a few hundred times a
// step, where a Python implementation's ~30 us a call would cost more than the compiled
// regions save. Built by q8_matmul.py (cpp_build.TorchOp) with torch's headers; where it
// cannot be, the Python implementation serves (the same kernel through ctypes).

#include "q8_matmul.cpp"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace {

at::Tensor q8_product(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous() &&
                  scale.scalar_type() == at::kFloat && scale.dim() == 2 &&
                  scale.is_contiguous() && scale.size(0) == q.size(0) && scale.size(1) >= 1 &&
                  q.size(1) % scale.size(1) == 0,
              "q8_matmul: q is contiguous int8 [out, in], scale float32 [out, groups]");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == q.size(1) && x.size(0) >= 1 &&
                  x.size(0) <= MAX_ROWS,
              "q8_matmul: x is [rows, in] with 1 to 16 rows");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({x.size(0), q.size(0)}, xf.options());
  TORCH_CHECK(!kvs_q8_matmul(q.data_ptr<int8_t>(), scale.data_ptr<float>(),
                             xf.data_ptr<float>(), x.size(0), q.size(1), q.size(0),
                             q.size(1) / scale.size(1), y.data_ptr<float>(),
                             at::get_num_threads()),
              "q8_matmul: the kernel takes groups of 32 or 64 inputs");
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(kvsession, CPU, m) { m.impl("q8_matmul", q8_product); }
