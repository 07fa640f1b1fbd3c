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
// With AVX2 and FMA but no AVX512-BF16 (most laptops, AMD Zen 2/3), the weights are
// converted to float32 in registers, two instructions per 16 (see that path's comment):
// there ATen's bfloat16 products are far slower (F.linear streamed the rows at ~1.6-8 GB/s
// on the AVX2 bench VM, a bfloat16 torch.mm on the transposed layout at ~0.8), and oneDNN
// cannot pack bfloat16 at all. Without either, a portable loop converts (bf16 is float32's
// upper half) and multiplies in float32; the model then keeps oneDNN's layout
// (kvs_bf16_native).
//
// Layout: w [out, in] bf16 row-major, xb [rows, in] bf16, y [rows, out] float32;
// in % 32 == 0, rows <= MAX_ROWS (the caller checks; the entry point refuses otherwise).

#include <immintrin.h>
#include <omp.h>

#include <cstdint>
#include <cstring>
#include <vector>

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
#elif defined(__AVX2__) && defined(__FMA__)
// Without AVX512-BF16 (AVX2 and FMA: most laptops', AMD Zen 2/3's): the weights are turned
// into float32 in registers, two instructions per 16 (bfloat16 is float32's upper half:
// each 32-bit lane of a 16-weight load holds an even weight in its low half and an odd one
// in its high half, so a shift left by 16 gives the 8 even weights as float32 and a mask
// the 8 odd ones), and x is handed in float32 in the same order (`split_x`: per 16 inputs,
// the 8 even ones, then the 8 odd ones), so that each 16 weights are two FMAs per row of x
// with no shuffle. The products are exact in float32 (8-bit mantissas), as vdpbf16ps'
// are; only the order of the sums differs.
constexpr int64_t SPLIT = 16;  // inputs per split chunk (one 256-bit load of weights)

inline __m256 even_f32(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
inline __m256 odd_f32(__m256i v) {
  return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int32_t(0xFFFF0000u))));
}
inline __m256i bf16x16(const uint16_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
inline float reduce8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// x [rows, in] bfloat16 into xs [rows, in] float32, each 16 inputs as even then odd
void split_x(const uint16_t* xb, int64_t rows, int64_t in, float* xs) {
  for (int64_t i = 0; i < rows * in; i += SPLIT) {
    const __m256i v = bf16x16(xb + i);
    _mm256_storeu_ps(xs + i, even_f32(v));
    _mm256_storeu_ps(xs + i + 8, odd_f32(v));
  }
}

// One row of x (split): output channels [o_begin, o_end), a weight row at a time, front to
// back (one stream per thread, as the AVX512 path), eight partial sums over k: FMA's
// latency times its two ports.
void one_row(const uint16_t* w, const float* xs, int64_t in, int64_t o_begin, int64_t o_end,
             float* y) {
  for (int64_t o = o_begin; o < o_end; ++o) {
    const uint16_t* wo = w + o * in;
    __m256 a[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 4 * SPLIT <= in; k += 4 * SPLIT) {
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m256i v = bf16x16(wo + k + j * SPLIT);
        const float* xk = xs + k + j * SPLIT;
        a[2 * j] = _mm256_fmadd_ps(even_f32(v), _mm256_loadu_ps(xk), a[2 * j]);
        a[2 * j + 1] = _mm256_fmadd_ps(odd_f32(v), _mm256_loadu_ps(xk + 8), a[2 * j + 1]);
      }
    }
    for (; k < in; k += SPLIT) {
      const __m256i v = bf16x16(wo + k);
      a[0] = _mm256_fmadd_ps(even_f32(v), _mm256_loadu_ps(xs + k), a[0]);
      a[1] = _mm256_fmadd_ps(odd_f32(v), _mm256_loadu_ps(xs + k + 8), a[1]);
    }
    const __m256 lo = _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]));
    const __m256 hi = _mm256_add_ps(_mm256_add_ps(a[4], a[5]), _mm256_add_ps(a[6], a[7]));
    y[o] = reduce8(_mm256_add_ps(lo, hi));
  }
}

// ROWS rows of x (split), NO weight rows a pass (ROWS * NO accumulators and 2 * NO weight
// vectors within AVX2's 16 registers), each weight row prefetched two passes ahead (as the
// AVX512 path: with several rows of x the hardware prefetcher falls behind), the rest one
// weight row at a time; inputs [k0, k1) only, the sums added to y's where `add`.
template <int64_t ROWS, int64_t NO>
void tile_span(const uint16_t* w, const float* xs, int64_t in, int64_t out, int64_t o_begin,
               int64_t o_end, int64_t k0, int64_t k1, bool add, float* y) {
  int64_t o = o_begin;
  for (; o + NO <= o_end; o += NO) {
    __m256 acc[ROWS][NO];
#pragma GCC unroll 8
    for (int64_t r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
      for (int64_t j = 0; j < NO; ++j) acc[r][j] = _mm256_setzero_ps();
    for (int64_t k = k0; k < k1; k += SPLIT) {
      __m256 we[NO], wd[NO];
#pragma GCC unroll 4
      for (int64_t j = 0; j < NO; ++j) {
        const __m256i v = bf16x16(w + (o + j) * in + k);
        we[j] = even_f32(v);
        wd[j] = odd_f32(v);
        _mm_prefetch(reinterpret_cast<const char*>(w + (o + 2 * NO + j) * in + k),
                     _MM_HINT_T0);
      }
#pragma GCC unroll 8
      for (int64_t r = 0; r < ROWS; ++r) {
        const __m256 xe = _mm256_loadu_ps(xs + r * in + k);
        const __m256 xo = _mm256_loadu_ps(xs + r * in + k + 8);
#pragma GCC unroll 4
        for (int64_t j = 0; j < NO; ++j)
          acc[r][j] = _mm256_fmadd_ps(wd[j], xo, _mm256_fmadd_ps(we[j], xe, acc[r][j]));
      }
    }
#pragma GCC unroll 8
    for (int64_t r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
      for (int64_t j = 0; j < NO; ++j) {
        float* yo = y + r * out + o + j;
        *yo = add ? *yo + reduce8(acc[r][j]) : reduce8(acc[r][j]);
      }
  }
  if constexpr (NO > 1) {
    if (o < o_end) tile_span<ROWS, 1>(w, xs, in, out, o, o_end, k0, k1, add, y);
  }
}

// Inputs a span: x's float32 rows are twice bfloat16's, and 8 rows of 3,072 inputs (96 KiB)
// overflowed L1 for every weight row read (8 rows ran at ~3.6 GB/s, a sixth of one row's
// rate): a span of 8 rows is 16 KiB.
constexpr int64_t K_SPAN = 512;

template <int64_t ROWS, int64_t NO>
void tile(const uint16_t* w, const float* xs, int64_t in, int64_t out, int64_t o_begin,
          int64_t o_end, float* y) {
  for (int64_t k0 = 0; k0 < in; k0 += K_SPAN)
    tile_span<ROWS, NO>(w, xs, in, out, o_begin, o_end, k0, k0 + K_SPAN < in ? k0 + K_SPAN : in,
                        k0 > 0, y);
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

// How x reaches the products: as given (bfloat16), or, on the AVX2 path, in float32 split
// into even and odd inputs (`split_x`), made once per call into `buf`.
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512BF16__)
using XElem = float;
const XElem* prepared_x(const uint16_t* xb, int64_t rows, int64_t in, std::vector<float>& buf) {
  buf.resize(rows * in);
  split_x(xb, rows, in, buf.data());
  return buf.data();
}
// weight rows a pass for ROWS rows of x: ROWS * NO accumulators plus 2 * NO weight vectors
// within 14 of the 16 registers
template <int64_t ROWS>
constexpr int64_t PASS_ROWS = 14 / (ROWS + 2) < 1 ? 1 : 14 / (ROWS + 2);
#else
using XElem = uint16_t;
const XElem* prepared_x(const uint16_t* xb, int64_t, int64_t, std::vector<float>&) {
  return xb;
}
// ROWS * NO accumulators within 24 of AVX-512's 32 registers
template <int64_t ROWS>
constexpr int64_t PASS_ROWS = ROWS <= 5 ? 4 : 3;
#endif
}  // namespace

// 1 where the kernel multiplies in vector registers: with AVX512-BF16 (vdpbf16ps), or with
// AVX2 and FMA (converted to float32 in registers); 0 where it runs the portable loop, which
// is several times slower (the model then keeps oneDNN's packed layout: linear.py).
extern "C" int kvs_bf16_native() {
#if defined(__AVX512BF16__) || (defined(__AVX2__) && defined(__FMA__))
  return 1;
#else
  return 0;
#endif
}

// Returns 0, or 1 for arguments outside what the kernel takes.
extern "C" int kvs_bf16_matmul(const uint16_t* w, const uint16_t* xb, int64_t rows, int64_t in,
                               int64_t out, float* y, int threads) {
  if (in % 32 || rows < 1 || rows > MAX_ROWS || out < 1 || threads < 1) return 1;
  std::vector<float> buf;
  const XElem* xp = prepared_x(xb, rows, in, buf);
  const int64_t blocks = (out + OUT_BLOCK - 1) / OUT_BLOCK;
  // static: each thread one contiguous range of blocks, so one stream through w
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t ob = b * OUT_BLOCK, oe = ob + OUT_BLOCK < out ? ob + OUT_BLOCK : out;
    if (rows == 1) {
      one_row(w, xp, in, ob, oe, y);
      continue;
    }
    for (int64_t r0 = 0; r0 < rows; r0 += ROW_TILE) {
      const int64_t n = rows - r0 < ROW_TILE ? rows - r0 : ROW_TILE;
      const XElem* x = xp + r0 * in;
      float* yr = y + r0 * out;
      switch (n) {
        case 1: one_row(w, x, in, ob, oe, yr); break;
        case 2: tile<2, PASS_ROWS<2>>(w, x, in, out, ob, oe, yr); break;
        case 3: tile<3, PASS_ROWS<3>>(w, x, in, out, ob, oe, yr); break;
        case 4: tile<4, PASS_ROWS<4>>(w, x, in, out, ob, oe, yr); break;
        case 5: tile<5, PASS_ROWS<5>>(w, x, in, out, ob, oe, yr); break;
        case 6: tile<6, PASS_ROWS<6>>(w, x, in, out, ob, oe, yr); break;
        case 7: tile<7, PASS_ROWS<7>>(w, x, in, out, ob, oe, yr); break;
        default: tile<8, PASS_ROWS<8>>(w, x, in, out, ob, oe, yr); break;
      }
    }
  }
  return 0;
}
