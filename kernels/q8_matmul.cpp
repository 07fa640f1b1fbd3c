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
// most: the caller splits larger batches). Three paths:
// - groups of 32 with AVX512-VNNI (`vnni_rows`, the common case): x rounded to int8 per
//   group, integer dot products (see its comment);
// - groups of 32 with AVX2 and FMA, no VNNI (`avx2_rows`): x rounded the same way, integer
//   dot products through vpmaddubsw (see its comment);
// - otherwise (`q8_rows`): each group's int8 values are converted and scaled once and
//   multiplied into every row's GROUP float32 lanes (vectorised: the compiler turns the k
//   loops into conversions and FMAs), summed across lanes once per output.

#include <omp.h>
#if (defined(__AVX512VNNI__) && defined(__AVX512BW__)) || defined(__AVX2__)
#include <immintrin.h>

#include <vector>
#endif

#include <cstdint>
#include <type_traits>

namespace {

constexpr int64_t MAX_ROWS = 16;
constexpr int64_t ROW_TILE = 8;  // rows whose GROUP-lane accumulators stay in registers
constexpr int64_t OUT_BLOCK = 16;

// f(std::integral_constant<int64_t, R>) for R = min(n, ROW_TILE): a tile's row count as a
// compile-time constant (n >= 1).
template <typename F>
void with_rows(int64_t n, F&& f) {
  switch (n < ROW_TILE ? n : ROW_TILE) {
    case 1: f(std::integral_constant<int64_t, 1>{}); break;
    case 2: f(std::integral_constant<int64_t, 2>{}); break;
    case 3: f(std::integral_constant<int64_t, 3>{}); break;
    case 4: f(std::integral_constant<int64_t, 4>{}); break;
    case 5: f(std::integral_constant<int64_t, 5>{}); break;
    case 6: f(std::integral_constant<int64_t, 6>{}); break;
    case 7: f(std::integral_constant<int64_t, 7>{}); break;
    default: f(std::integral_constant<int64_t, 8>{}); break;
  }
}

// The output channels in blocks of OUT_BLOCK split over the threads (static: each thread
// one contiguous range), and a block's rows of x in tiles of up to ROW_TILE, so that the
// block's weights are read once per tile (once for a decode batch of <= 8):
// tile(o_begin, o_end, r0, n) with n a compile-time row count (with_rows).
template <typename F>
void over_tiles(int64_t rows, int64_t out, int threads, F&& tile) {
  const int64_t blocks = (out + OUT_BLOCK - 1) / OUT_BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t o_begin = b * OUT_BLOCK;
    const int64_t o_end = o_begin + OUT_BLOCK < out ? o_begin + OUT_BLOCK : out;
    for (int64_t r0 = 0; r0 < rows; r0 += ROW_TILE)
      with_rows(rows - r0, [&](auto n) { tile(o_begin, o_end, r0, n); });
  }
}

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
  over_tiles(rows, out, threads, [&](int64_t o_begin, int64_t o_end, int64_t r0, auto n) {
    q8_tile<GROUP, decltype(n)::value>(q, scale, x + r0 * in, in, out, o_begin, o_end,
                                       y + r0 * out);
  });
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// With AVX512-VNNI (llama.cpp's Q8_0 x Q8_0 dot): each row of x is rounded to int8 per
// group of 32 (d = max |x| / 127, as llama.cpp's quantize_row_q8_0), and each 64 bytes of a
// weight row (two groups) are one vpdpbusd per row of x, the int32 sums scaled to float per
// group. The float path above spends ~10 instructions a 32 weights converting and scaling
// them before its FMAs: compute-bound, ~22 GB/s at one row and ~6 at eight on the bench VM,
// where this reads ~26-31 GB/s and ~12-14 (Qwen3-0.6B's and Llama-3.2-1B's shapes). vpdpbusd multiplies unsigned by signed bytes: the
// weights go in plus 128 (a XOR of the sign bit), which adds 128 * (the group's sum of x)
// to each group's sum: taken off in float, from a per-row table (`cv`), so that no
// instruction per 64 weights is spent on it.
constexpr int64_t G = 32;

// A batch's rows of x rounded to int8, and per pair of groups (a, b) four floats:
// d_a, d_b, and each group's surplus 128 * d * (the group's sum of q) / 8 (spread over the
// group's 8 lanes of vpdpbusd's sums), widened to those lanes in registers (`lanes`). Four
// floats, not the two 16-lane vectors they widen to: with 8 rows of 8,192 inputs the
// vectors took 256 KiB, read from L2 for every 64 weight bytes (3.7 GB/s at 8 rows on
// Llama-3.2-1B's shapes, against ~8 on Qwen3-0.6B's).
struct QuantizedRows {
  const int8_t* q;    // [rows, in]
  const float* dcv;   // [rows, pairs_up, 4]: d_a, d_b, surplus_a, surplus_b
  int64_t pairs_up;   // groups / 2 rounded up
};

// lanes 0-7 v[i], lanes 8-15 v[j] of the four floats at `p`
inline __m512 lanes(__m512 four, int i, int j) {
  return _mm512_permutexvar_ps(
      _mm512_set_epi32(j, j, j, j, j, j, j, j, i, i, i, i, i, i, i, i), four);
}

// so[0] in lanes 0-7, so[1] in lanes 8-15 (`n` = 1: lanes 8-15 zero)
inline __m512 scale_pair(const float* so, int n) {
  const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(idx, _mm512_maskz_loadu_ps(n == 2 ? 0x3 : 0x1, so));
}

template <int64_t ROWS>
void vnni_tile(const int8_t* q, const float* scale, const QuantizedRows& x, int64_t in,
               int64_t out, int64_t o_begin, int64_t o_end, float* y) {
  const int64_t groups = in / G, pairs = groups / 2;
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t o = o_begin; o < o_end; ++o) {
    const int8_t* qo = q + o * in;
    const float* so = scale + o * groups;
    __m512 acc[ROWS];
#pragma GCC unroll 8
    for (int64_t r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t p = 0; p <= pairs; ++p) {
      __m512i w;
      if (p < pairs) {
        w = _mm512_loadu_si512(qo + p * 2 * G);
      } else if (groups % 2) {  // the last group alone: the lower half of a pair
        w = _mm512_zextsi256_si512(_mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(qo + p * 2 * G)));
      } else {
        break;
      }
      // (the weight row two ahead: with several rows of x the product is compute-heavy
      // enough that the hardware prefetcher fell behind)
      if constexpr (ROWS > 1)
        _mm_prefetch(reinterpret_cast<const char*>(qo + 2 * in + p * 2 * G), _MM_HINT_T0);
      const __m512i wu = _mm512_xor_si512(w, sign);
      const __m512 ws = scale_pair(so + 2 * p, p < pairs ? 2 : 1);
#pragma GCC unroll 8
      for (int64_t r = 0; r < ROWS; ++r) {
        const __m512 four = _mm512_castps128_ps512(
            _mm_loadu_ps(x.dcv + (r * x.pairs_up + p) * 4));
        const __m512i xv = p < pairs ? _mm512_loadu_si512(x.q + r * in + p * 2 * G)
                                     : _mm512_zextsi256_si512(_mm256_loadu_si256(
                                           reinterpret_cast<const __m256i*>(
                                               x.q + r * in + p * 2 * G)));
        const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wu, xv);
        const __m512 t = _mm512_fmsub_ps(_mm512_cvtepi32_ps(d), lanes(four, 0, 1),
                                         lanes(four, 2, 3));
        acc[r] = _mm512_fmadd_ps(t, ws, acc[r]);
      }
    }
#pragma GCC unroll 8
    for (int64_t r = 0; r < ROWS; ++r) y[r * out + o] = _mm512_reduce_add_ps(acc[r]);
  }
}

// Rows of x rounded to int8 per group into `q`, with their d and surplus per group in
// `dcv` (QuantizedRows' layout; a lone last group's pair partner zero).
void quantize_rows(const float* x, int64_t rows, int64_t in, int8_t* q, float* dcv) {
  const int64_t groups = in / G, pairs_up = (groups + 1) / 2;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < pairs_up * 4; ++i) dcv[r * pairs_up * 4 + i] = 0.0f;
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = x + r * in + g * G;
      const __m512 a = _mm512_loadu_ps(xg), b = _mm512_loadu_ps(xg + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      const float dg = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      const __m512 vinv = _mm512_set1_ps(inv);
      // rounded to nearest (halves to even; llama.cpp's roundf takes them away from zero:
      // a half lands exactly only for a value at an exact half step)
      const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, vinv));
      const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, vinv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + r * in + g * G), _mm512_cvtepi32_epi8(qa));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + r * in + g * G + 16),
                       _mm512_cvtepi32_epi8(qb));
      const float sum_q = float(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
      float* pair = dcv + (r * pairs_up + g / 2) * 4;
      pair[g % 2] = dg;
      pair[2 + g % 2] = 128.0f * dg * sum_q / 8.0f;
    }
  }
}

void vnni_rows(const int8_t* q, const float* scale, const float* x, int64_t rows, int64_t in,
               int64_t out, float* y, int threads) {
  const int64_t pairs_up = (in / G + 1) / 2;
  std::vector<int8_t> xq(rows * in);
  std::vector<float> dcv(rows * pairs_up * 4);
  quantize_rows(x, rows, in, xq.data(), dcv.data());
  over_tiles(rows, out, threads, [&](int64_t o_begin, int64_t o_end, int64_t r0, auto n) {
    const QuantizedRows xr{xq.data() + r0 * in, dcv.data() + r0 * pairs_up * 4, pairs_up};
    vnni_tile<decltype(n)::value>(q, scale, xr, in, out, o_begin, o_end, y + r0 * out);
  });
}
#elif defined(__AVX2__) && defined(__FMA__)
// With AVX2 (llama.cpp's Q8_0 x Q8_0 dot on AVX2): each row of x rounded to int8 per group
// of 32 as on the VNNI path, and each 32 weight bytes one vpmaddubsw per row of x, which
// multiplies unsigned by signed bytes: |q| against x with q's sign moved onto it (vpsignb,
// exact: |q| <= 127, and two products sum to at most 2 * 127 * 127 < 2^15, so the 16-bit
// sums never saturate), then vpmaddwd to 32-bit sums, converted and scaled by d_x * d_w.
// The float path spends ~10 instructions a 32 weights converting and scaling them, and
// with AVX2's 8 lanes it is compute-bound at every batch.
constexpr int64_t G = 32;

// x [rows, in] rounded per group into q [rows, in] with d [rows, groups] (llama.cpp's
// quantize_row_q8_0: d = max |x| / 127; rounded to nearest, halves to even as the VNNI path)
void quantize_rows(const float* x, int64_t rows, int64_t in, int8_t* q, float* d) {
  const int64_t groups = in / G;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = x + r * in + g * G;
      __m256 v[4];
      __m256 m = _mm256_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        v[j] = _mm256_loadu_ps(xg + 8 * j);
        m = _mm256_max_ps(m, _mm256_and_ps(v[j], abs_mask));
      }
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_movehdup_ps(h));
      const float amax = _mm_cvtss_f32(h);
      d[r * groups + g] = amax / 127.0f;
      const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      __m256i i32[4];
      for (int j = 0; j < 4; ++j) i32[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));
      // packs interleave 128-bit lanes: the permute puts the 32 bytes back in order
      const __m256i i16a = _mm256_packs_epi32(i32[0], i32[1]);
      const __m256i i16b = _mm256_packs_epi32(i32[2], i32[3]);
      const __m256i i8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(i16a, i16b),
                                                     _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + r * in + g * G), i8);
    }
  }
}

inline float reduce8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

template <int64_t ROWS>
void avx2_tile(const int8_t* q, const float* scale, const int8_t* xq, const float* xd,
               int64_t in, int64_t out, int64_t o_begin, int64_t o_end, float* y) {
  const int64_t groups = in / G;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t o = o_begin; o < o_end; ++o) {
    const int8_t* qo = q + o * in;
    const float* so = scale + o * groups;
    __m256 acc[ROWS];
#pragma GCC unroll 8
    for (int64_t r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qo + g * G));
      // the weight row two ahead, as the VNNI path; at one row too: without it the
      // product read the Qwen3-0.6B shape's weights at ~17-18 GB/s, with it ~20 (1.11-1.29x
      // in paired rounds, where a sum over as many bytes read ~21-25; AVX2 VM)
      _mm_prefetch(reinterpret_cast<const char*>(qo + 2 * in + g * G), _MM_HINT_T0);
      const __m256i wabs = _mm256_sign_epi8(w, w);
#pragma GCC unroll 8
      for (int64_t r = 0; r < ROWS; ++r) {
        const __m256i xv =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * in + g * G));
        const __m256i p16 = _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(xv, w));
        const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
        acc[r] = _mm256_fmadd_ps(p, _mm256_set1_ps(so[g] * xd[r * groups + g]), acc[r]);
      }
    }
#pragma GCC unroll 8
    for (int64_t r = 0; r < ROWS; ++r) y[r * out + o] = reduce8(acc[r]);
  }
}

void avx2_rows(const int8_t* q, const float* scale, const float* x, int64_t rows, int64_t in,
               int64_t out, float* y, int threads) {
  const int64_t groups = in / G;
  std::vector<int8_t> xq(rows * in);
  std::vector<float> xd(rows * groups);
  quantize_rows(x, rows, in, xq.data(), xd.data());
  over_tiles(rows, out, threads, [&](int64_t o_begin, int64_t o_end, int64_t r0, auto n) {
    avx2_tile<decltype(n)::value>(q, scale, xq.data() + r0 * in, xd.data() + r0 * groups, in,
                                  out, o_begin, o_end, y + r0 * out);
  });
}
#endif

}  // namespace

// 1 where groups of 32 take an integer path (VNNI or AVX2), which rounds x to int8 per group
// (q8_matmul.py's twin does the same then); 0 where every product is the float path's.
extern "C" int kvs_q8_rounds_activations() {
#if (defined(__AVX512VNNI__) && defined(__AVX512BW__)) || (defined(__AVX2__) && defined(__FMA__))
  return 1;
#else
  return 0;
#endif
}

// Returns 0, or 1 when the arguments are outside what the kernel takes (the caller checks
// them first; this is the last guard against reading out of bounds).
extern "C" int kvs_q8_matmul(const int8_t* q, const float* scale, const float* x, int64_t rows,
                             int64_t in, int64_t out, int64_t group, float* y, int threads) {
  if (rows < 1 || rows > MAX_ROWS || in < 1 || out < 1 || threads < 1) return 1;
  if (group == 32 && in % 32 == 0) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    vnni_rows(q, scale, x, rows, in, out, y, threads);
#elif defined(__AVX2__) && defined(__FMA__)
    avx2_rows(q, scale, x, rows, in, out, y, threads);
#else
    q8_rows<32>(q, scale, x, rows, in, out, y, threads);
#endif
  } else if (group == 64 && in % 64 == 0) {
    q8_rows<64>(q, scale, x, rows, in, out, y, threads);
  } else {
    return 1;
  }
  return 0;
}
