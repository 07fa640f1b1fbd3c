// y = x @ W^T for int8 weights with a float scale per group of GROUP inputs (llama.cpp's
// Q8_0 layout: W[o, g*GROUP + k] ~ scale[o, g] * q[o, g*GROUP + k]), for the few rows of a
// decode step. Built by kernels/q8_matmul.py with -O3 -march=native -ffast-math -fopenmp.
//
// Why its own kernel: ATen's int8 weight-only product (_weight_int8pack_mm) takes one scale
// per output channel, and a scale per 32 inputs is what keeps int8 as accurate as llama.cpp's
// Q8_0 (bench/int8_accuracy.py); the int4 products that take group scales round them to
// bfloat16. A decode step is bound by reading the weights, and int8 reads half of bf16's.
//
// Layout: q [out, in] int8 row-major, scale [out, in / GROUP] float32, x [rows, in] float32,
// y [rows, out] float32; in % GROUP == 0. The output channels are split over the threads in
// blocks of OUT_BLOCK; a block's rows of q are read once for all rows of x (MAX_ROWS at
// most: the caller splits larger batches); each group's int8 values are converted and scaled
// once and multiplied into every row's GROUP float32 lanes (vectorised: the compiler turns
// the k loops into conversions and FMAs), summed across lanes once per output.

#include <omp.h>

#include <cstdint>

namespace {

constexpr int64_t MAX_ROWS = 16;
constexpr int64_t ROW_TILE = 8;  // rows whose GROUP-lane accumulators stay in registers
constexpr int64_t OUT_BLOCK = 16;

// ROWS rows of x against output channels [o_begin, o_end): ROWS and GROUP are compile-time
// constants, so the row and lane loops unroll and each row's accumulator lanes stay in
// vector registers (8 rows x 32 lanes: 16 of AVX-512's 32 registers).
template <int64_t GROUP, int64_t ROWS>
void q8_tile(const int8_t* q, const float* scale, const float* x, int64_t in, int64_t out,
             int64_t o_begin, int64_t o_end, float* y) {
  const int64_t groups = in / GROUP;
  for (int64_t o = o_begin; o < o_end; ++o) {
    const int8_t* qo = q + o * in;
    const float* so = scale + o * groups;
    float acc[ROWS][GROUP];
    for (int64_t r = 0; r < ROWS; ++r)
      for (int64_t k = 0; k < GROUP; ++k) acc[r][k] = 0.0f;
    for (int64_t g = 0; g < groups; ++g) {
      const int8_t* qg = qo + g * GROUP;
      const float s = so[g];
      float w[GROUP];
      for (int64_t k = 0; k < GROUP; ++k) w[k] = s * static_cast<float>(qg[k]);
      for (int64_t r = 0; r < ROWS; ++r) {
        const float* xg = x + r * in + g * GROUP;
        for (int64_t k = 0; k < GROUP; ++k) acc[r][k] += w[k] * xg[k];
      }
    }
    for (int64_t r = 0; r < ROWS; ++r) {
      float sum = 0.0f;
      for (int64_t k = 0; k < GROUP; ++k) sum += acc[r][k];
      y[r * out + o] = sum;
    }
  }
}

template <int64_t GROUP>
void q8_rows(const int8_t* q, const float* scale, const float* x, int64_t rows, int64_t in,
             int64_t out, float* y, int threads) {
  const int64_t blocks = (out + OUT_BLOCK - 1) / OUT_BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t o_begin = b * OUT_BLOCK;
    const int64_t o_end = o_begin + OUT_BLOCK < out ? o_begin + OUT_BLOCK : out;
    // the block's weights are read once per tile of rows: once for a decode batch of <= 8
    for (int64_t r0 = 0; r0 < rows; r0 += ROW_TILE) {
      const float* xr = x + r0 * in;
      float* yr = y + r0 * out;
      switch (rows - r0 < ROW_TILE ? rows - r0 : ROW_TILE) {
        case 1: q8_tile<GROUP, 1>(q, scale, xr, in, out, o_begin, o_end, yr); break;
        case 2: q8_tile<GROUP, 2>(q, scale, xr, in, out, o_begin, o_end, yr); break;
        case 3: q8_tile<GROUP, 3>(q, scale, xr, in, out, o_begin, o_end, yr); break;
        case 4: q8_tile<GROUP, 4>(q, scale, xr, in, out, o_begin, o_end, yr); break;
        case 5: q8_tile<GROUP, 5>(q, scale, xr, in, out, o_begin, o_end, yr); break;
        case 6: q8_tile<GROUP, 6>(q, scale, xr, in, out, o_begin, o_end, yr); break;
        case 7: q8_tile<GROUP, 7>(q, scale, xr, in, out, o_begin, o_end, yr); break;
        default: q8_tile<GROUP, 8>(q, scale, xr, in, out, o_begin, o_end, yr); break;
      }
    }
  }
}

}  // namespace

// Returns 0, or 1 when the arguments are outside what the kernel takes (the caller checks
// them first; this is the last guard against reading out of bounds).
extern "C" int kvs_q8_matmul(const int8_t* q, const float* scale, const float* x, int64_t rows,
                             int64_t in, int64_t out, int64_t group, float* y, int threads) {
  if (rows < 1 || rows > MAX_ROWS || in < 1 || out < 1 || threads < 1) return 1;
  if (group == 32 && in % 32 == 0) {
    q8_rows<32>(q, scale, x, rows, in, out, y, threads);
  } else if (group == 64 && in % 64 == 0) {
    q8_rows<64>(q, scale, x, rows, in, out, y, threads);
  } else {
    return 1;
  }
  return 0;
}
