// y = x @ W^T for bfloat16 weights kept as the checkpoint's [out, in] rows, for the few rows
// of a decode step (x rounded to bfloat16, as a bfloat16 model's activations are; sums in
// float32). Built by kernels/bf16_rows.py with -O3 -march=native -fopenmp.
//
// Why: a model that ties its output head to its embedding keeps the head as rows (one copy
// the embedding reads), and oneDNN's product on unpacked bfloat16 rows streamed a Qwen3-0.6B
// head (151,936 x 1,024) at ~15 GB/s at one row where its packed layout reached ~26 and this
// kernel ~25 (bench VM, `sum` ~28-47 GB/s). With AVX512-BF16 each 32 weights of a row are one
// `vdpbf16ps` per row of x; the output channels go to the threads in blocks of OUT_BLOCK,
// NO channels a pass so each x load serves NO products. Without AVX512-BF16 a portable loop
// converts (bf16 is float32's upper half) and multiplies in float32.
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
constexpr int64_t ROW_TILE = 4;

template <int64_t ROWS>
void tile(const uint16_t* w, const uint16_t* xb, int64_t in, int64_t out, int64_t o_begin,
          int64_t o_end, float* y) {
#if defined(__AVX512BF16__)
  constexpr int64_t NO = ROWS <= 2 ? 4 : 2;  // outputs per pass: accumulators ROWS * NO
  int64_t o = o_begin;
  for (; o + NO <= o_end; o += NO) {
    __m512 acc[ROWS][NO];
    for (int64_t r = 0; r < ROWS; ++r)
      for (int64_t j = 0; j < NO; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < in; k += 32) {
      __m512bh wv[NO];
      for (int64_t j = 0; j < NO; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + (o + j) * in + k);
      for (int64_t r = 0; r < ROWS; ++r) {
        __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + r * in + k);
        for (int64_t j = 0; j < NO; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv[j], xv);
      }
    }
    for (int64_t r = 0; r < ROWS; ++r)
      for (int64_t j = 0; j < NO; ++j) y[r * out + o + j] = _mm512_reduce_add_ps(acc[r][j]);
  }
  for (; o < o_end; ++o) {
    __m512 acc[ROWS];
    for (int64_t r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < in; k += 32) {
      __m512bh wv = (__m512bh)_mm512_loadu_si512(w + o * in + k);
      for (int64_t r = 0; r < ROWS; ++r)
        acc[r] = _mm512_dpbf16_ps(acc[r], wv, (__m512bh)_mm512_loadu_si512(xb + r * in + k));
    }
    for (int64_t r = 0; r < ROWS; ++r) y[r * out + o] = _mm512_reduce_add_ps(acc[r]);
  }
#else
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
#endif
}
}  // namespace

// Returns 0, or 1 for arguments outside what the kernel takes.
extern "C" int kvs_bf16_matmul(const uint16_t* w, const uint16_t* xb, int64_t rows, int64_t in,
                               int64_t out, float* y, int threads) {
  if (in % 32 || rows < 1 || rows > MAX_ROWS || out < 1 || threads < 1) return 1;
  const int64_t blocks = (out + OUT_BLOCK - 1) / OUT_BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t ob = b * OUT_BLOCK, oe = ob + OUT_BLOCK < out ? ob + OUT_BLOCK : out;
    for (int64_t r0 = 0; r0 < rows; r0 += ROW_TILE) {
      switch (rows - r0 < ROW_TILE ? rows - r0 : ROW_TILE) {
        case 1: tile<1>(w, xb + r0 * in, in, out, ob, oe, y + r0 * out); break;
        case 2: tile<2>(w, xb + r0 * in, in, out, ob, oe, y + r0 * out); break;
        case 3: tile<3>(w, xb + r0 * in, in, out, ob, oe, y + r0 * out); break;
        default: tile<4>(w, xb + r0 * in, in, out, ob, oe, y + r0 * out); break;
      }
    }
  }
  return 0;
}
