// y = x @ W^T for bfloat16 weights kept as the checkpoint's [out, in] rows, for the few rows
// of a decode step (x rounded to bfloat16, as a bfloat16 model's activations are; sums in
// float32). Built by kernels/bf16_rows.py with -O3 -march=native -fopenmp.
//
// Why: a bfloat16 model keeps every projection as rows (one copy, which prefill's F.linear
// reads too and a tied embedding shares), and oneDNN's product streamed them slower than
// DRAM allows at one row: on the AMD EPYC bench VM oneDNN read Qwen3-0.6B's layer weights at
// ~21-25 GB/s packed (~15 unpacked) where this kernel reads ~31-38 and a plain read loop
// ~33-37. With AVX512-BF16 each 32 weights of a row are one `vdpbf16ps` per row of x. The
// output channels go to the threads in contiguous ranges (blocks of OUT_BLOCK).
// - One row of x (`one_row`): the weight rows one at a time, front to back, four partial
//   sums over k: one sequential stream per thread. Reading NO rows side by side (four
//   streams 2-6 KiB apart) streamed ~25% slower.
// - 2 to 8 rows (`tile`, ROW_TILE rows at a time): NO weight rows a pass, so that each x
//   load serves NO products and each weight load every row of x: with one weight row a
//   pass the 64-byte x load per vdpbf16ps was the limit (~2x oneDNN's time at 8 rows). The
//   product is then compute-heavy enough that the hardware prefetcher fell behind: each
//   weight row is prefetched two passes ahead (8 rows: 17.5 -> 22.9 GB/s, oneDNN's ~23).
// Without AVX512-BF16 a portable loop converts (bf16 is float32's upper half) and
// multiplies in float32; the model then keeps oneDNN's layout (kvs_bf16_native).
//
// Layout: w [out, in] bf16 row-major, xb [rows, in] bf16, y [rows, out] float32;
// in % 32 == 0, rows <= MAX_ROWS (the caller checks; the entry point refuses otherwise).

#include <immintrin.h>
#include <omp.h>

#include <cstdint>
#include <cstring>

namespace {
constexpr int64_t MAX_ROWS = 16;
constexpr int64_t OUT_BLOCK = 64;
constexpr int64_t ROW_TILE = 8;

#if defined(__AVX512BF16__)
inline __m512bh bf16x32(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

// One row of x: output channels [o_begin, o_end).
void one_row(const uint16_t* w, const uint16_t* x, int64_t in, int64_t o_begin, int64_t o_end,
             float* y) {
  for (int64_t o = o_begin; o < o_end; ++o) {
    const uint16_t* wo = w + o * in;
    // four partial sums: one chain of vdpbf16ps would wait on its latency
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t k = 0;
    for (; k + 128 <= in; k += 128) {
      a0 = _mm512_dpbf16_ps(a0, bf16x32(wo + k), bf16x32(x + k));
      a1 = _mm512_dpbf16_ps(a1, bf16x32(wo + k + 32), bf16x32(x + k + 32));
      a2 = _mm512_dpbf16_ps(a2, bf16x32(wo + k + 64), bf16x32(x + k + 64));
      a3 = _mm512_dpbf16_ps(a3, bf16x32(wo + k + 96), bf16x32(x + k + 96));
    }
    for (; k < in; k += 32) a0 = _mm512_dpbf16_ps(a0, bf16x32(wo + k), bf16x32(x + k));
    y[o] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  }
}

// ROWS rows of x, NO weight rows a pass (accumulators ROWS * NO <= 24 of the 32 registers),
// the rest one at a time.
template <int64_t ROWS, int64_t NO>
void tile(const uint16_t* w, const uint16_t* xb, int64_t in, int64_t out, int64_t o_begin,
          int64_t o_end, float* y) {
  int64_t o = o_begin;
  for (; o + NO <= o_end; o += NO) {
    __m512 acc[ROWS][NO];
#pragma GCC unroll 8
    for (int64_t r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
      for (int64_t j = 0; j < NO; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < in; k += 32) {
      __m512bh wv[NO];
#pragma GCC unroll 4
      for (int64_t j = 0; j < NO; ++j) {
        wv[j] = bf16x32(w + (o + j) * in + k);
        _mm_prefetch(reinterpret_cast<const char*>(w + (o + 2 * NO + j) * in + k),
                     _MM_HINT_T0);
      }
#pragma GCC unroll 8
      for (int64_t r = 0; r < ROWS; ++r) {
        const __m512bh xv = bf16x32(xb + r * in + k);
#pragma GCC unroll 4
        for (int64_t j = 0; j < NO; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv[j], xv);
      }
    }
#pragma GCC unroll 8
    for (int64_t r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
      for (int64_t j = 0; j < NO; ++j) y[r * out + o + j] = _mm512_reduce_add_ps(acc[r][j]);
  }
  if constexpr (NO > 1) {
    if (o < o_end) tile<ROWS, 1>(w, xb, in, out, o, o_end, y);
  }
}
#else
template <int64_t ROWS, int64_t NO>
void tile(const uint16_t* w, const uint16_t* xb, int64_t in, int64_t out, int64_t o_begin,
          int64_t o_end, float* y) {
  for (int64_t o = o_begin; o < o_end; ++o) {
    float acc[ROWS][16] = {};
    const uint16_t* wo = w + o * in;
    for (int64_t k = 0; k < in; k += 16) {
      float wf[16];
      for (int j = 0; j < 16; ++j) { uint32_t u = uint32_t(wo[k + j]) << 16; std::memcpy(&wf[j], &u, 4); }
      for (int64_t r = 0; r < ROWS; ++r)
        for (int j = 0; j < 16; ++j) { uint32_t u = uint32_t(xb[r * in + k + j]) << 16; float xf; std::memcpy(&xf, &u, 4); acc[r][j] += wf[j] * xf; }
    }
    for (int64_t r = 0; r < ROWS; ++r) { float s = 0; for (int j = 0; j < 16; ++j) s += acc[r][j]; y[r * out + o] = s; }
  }
}

void one_row(const uint16_t* w, const uint16_t* x, int64_t in, int64_t o_begin, int64_t o_end,
             float* y) {
  tile<1, 1>(w, x, in, 0, o_begin, o_end, y);
}
#endif
}  // namespace

// 1 where the kernel multiplies with AVX512-BF16 (vdpbf16ps), 0 where it runs the portable
// loop (the model then keeps oneDNN's packed layout: linear.py).
extern "C" int kvs_bf16_native() {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

// Returns 0, or 1 for arguments outside what the kernel takes.
extern "C" int kvs_bf16_matmul(const uint16_t* w, const uint16_t* xb, int64_t rows, int64_t in,
                               int64_t out, float* y, int threads) {
  if (in % 32 || rows < 1 || rows > MAX_ROWS || out < 1 || threads < 1) return 1;
  const int64_t blocks = (out + OUT_BLOCK - 1) / OUT_BLOCK;
  // static: each thread one contiguous range of blocks, so one stream through w
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t ob = b * OUT_BLOCK, oe = ob + OUT_BLOCK < out ? ob + OUT_BLOCK : out;
    if (rows == 1) {
      one_row(w, xb, in, ob, oe, y);
      continue;
    }
    for (int64_t r0 = 0; r0 < rows; r0 += ROW_TILE) {
      const int64_t n = rows - r0 < ROW_TILE ? rows - r0 : ROW_TILE;
      const uint16_t* x = xb + r0 * in;
      float* yr = y + r0 * out;
      switch (n) {
        case 1: one_row(w, x, in, ob, oe, yr); break;
        case 2: tile<2, 4>(w, x, in, out, ob, oe, yr); break;
        case 3: tile<3, 4>(w, x, in, out, ob, oe, yr); break;
        case 4: tile<4, 4>(w, x, in, out, ob, oe, yr); break;
        case 5: tile<5, 4>(w, x, in, out, ob, oe, yr); break;
        case 6: tile<6, 3>(w, x, in, out, ob, oe, yr); break;
        case 7: tile<7, 3>(w, x, in, out, ob, oe, yr); break;
        default: tile<8, 3>(w, x, in, out, ob, oe, yr); break;
      }
    }
  }
  return 0;
}
