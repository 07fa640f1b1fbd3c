// The decode kernel (cpu_decode.cpp, included whole) as the CPU implementation of the op
// kvsession::cpu_decode_store_attention, whose schema cpu_decode.py defines. Why a C++
// implementation: compiled code (model/onerow.py's one-region decode step) calls the op
// once a layer, and through a Python implementation each call cost ~30 us of argument
// boxing, Python and ctypes (measured: ~34 us a call, against ~2.4 us for a C++ op with
// the same schema), ~5% of a batch-1 decode step of the bench model. Built by
// cpu_decode.py like the kernel, with torch's headers and libraries; where it cannot be,
// the Python implementation serves (the same kernel through ctypes).
//
// KVS_TASK_TOKENS (defined by the build from cpu_decode.TASK_TOKENS): tokens per task.

#include "cpu_decode.cpp"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace {

// Leading columns of the block tables that every sequence has, physically the same (a
// pinned system prompt, a forked history), full blocks only: read once for all of them
// (the shared_blocks argument of the kernel; reference.shared_prefix_blocks in Python).
int64_t shared_prefix_blocks(const int64_t* tables, int64_t stride, const int64_t* lens,
                             int64_t num_seqs, int64_t block_size) {
  if (num_seqs < 2) return 0;
  int64_t full = lens[0];
  for (int64_t s = 1; s < num_seqs; ++s) full = std::min(full, lens[s]);
  full /= block_size;
  for (int64_t c = 0; c < full; ++c)
    for (int64_t s = 1; s < num_seqs; ++s)
      if (tables[s * stride + c] != tables[c]) return c;
  return full;
}

at::Tensor store_attention(const at::Tensor& q, const at::Tensor& key, const at::Tensor& value,
                           at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           double softmax_scale) {
  const auto cache = k_cache.scalar_type();
  TORCH_CHECK((cache == at::kFloat || cache == at::kBFloat16) &&
                  v_cache.scalar_type() == cache && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.dim() == 4 &&
                  v_cache.sizes() == k_cache.sizes(),
              "cpu_decode_store_attention reads contiguous float32 or bfloat16 caches "
              "[num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(q.dim() == 3 && q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0,
              "cpu_decode_store_attention: q is [num_seqs, heads, head_dim] with heads a "
              "multiple of the cache's kv_heads");
  const int64_t num_seqs = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  // each conversion returns its input when it already has the dtype and is contiguous
  const at::Tensor qf = q.to(at::kFloat).contiguous();
  const at::Tensor kf = key.to(cache).contiguous(), vf = value.to(cache).contiguous();
  const at::Tensor sl = slots.to(at::kLong).contiguous();
  const at::Tensor tables = block_tables.to(at::kLong).contiguous();
  const at::Tensor lens = seq_lens.to(at::kLong).contiguous();
  TORCH_CHECK(kf.numel() == num_seqs * kv_heads * head_dim && vf.numel() == kf.numel() &&
                  sl.numel() == num_seqs && lens.numel() == num_seqs &&
                  tables.dim() == 2 && tables.size(0) == num_seqs,
              "cpu_decode_store_attention: one new K/V row, slot, length and table row a "
              "sequence");
  at::Tensor out = at::empty({num_seqs, heads, head_dim}, qf.options());
  if (num_seqs) {
    const int64_t chunk = std::max<int64_t>(1, KVS_TASK_TOKENS / block_size);
    const int64_t shared = shared_prefix_blocks(tables.data_ptr<int64_t>(), tables.stride(0),
                                                lens.data_ptr<int64_t>(), num_seqs,
                                                block_size);
    const int failed =
        cache == at::kFloat
            ? kvs_decode_attention(
                  k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), block_size, kv_heads,
                  head_dim, tables.data_ptr<int64_t>(), tables.stride(0),
                  lens.data_ptr<int64_t>(), num_seqs, heads / kv_heads, qf.data_ptr<float>(),
                  float(softmax_scale), shared, chunk, out.data_ptr<float>(),
                  at::get_num_threads(), kf.data_ptr<float>(), vf.data_ptr<float>(),
                  sl.data_ptr<int64_t>())
            : kvs_decode_attention_bf16(
                  static_cast<uint16_t*>(k_cache.data_ptr()),
                  static_cast<uint16_t*>(v_cache.data_ptr()), block_size, kv_heads, head_dim,
                  tables.data_ptr<int64_t>(), tables.stride(0), lens.data_ptr<int64_t>(),
                  num_seqs, heads / kv_heads, qf.data_ptr<float>(), float(softmax_scale),
                  shared, chunk, out.data_ptr<float>(), at::get_num_threads(),
                  static_cast<const uint16_t*>(kf.data_ptr()),
                  static_cast<const uint16_t*>(vf.data_ptr()), sl.data_ptr<int64_t>());
    TORCH_CHECK(!failed, "the CPU decode attention kernel could not allocate its scratch");
  }
  return q.scalar_type() == at::kFloat ? out : out.to(q.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(kvsession, CPU, m) { m.impl("cpu_decode_store_attention", store_attention); }
