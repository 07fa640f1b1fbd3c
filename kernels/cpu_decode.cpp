// Decode attention over a paged float32 or bfloat16 KV cache on CPU: one query token per sequence,
// every block read in place through the block table (no gather), the batch's shared
// leading blocks read once for all of its queries. Built at first use by cpu_decode.py
// (the system's C++ compiler, -O3 -march=native, OpenMP: the same runtime torch loaded).
// Its torch twin is reference.paged_attention; tests/test_cpu_decode.py holds them equal.
//
// Layout: k_cache / v_cache [num_blocks, block_size, kv_heads, head_dim] (token-major: one
// token's K of every head is one contiguous row), q and out [num_seqs, kv_heads, group,
// head_dim] (the query heads sharing a KV head are its `group` query rows).
//
// Work is split into tasks of at most 256 tokens (a run of one sequence's blocks, or of
// the shared blocks for every sequence), so that a long context spreads over all threads.
// A task computes every score of its blocks (K streamed once), one softmax per query row
// over its tokens (max m, sum l), then the weighted values (V streamed once): one stream
// at a time, no per-block rescaling (3-7% faster than an online softmax block by block).
// A second pass merges each sequence's tasks by log-sum-exp.
// Why it is written this way:
// - scores are computed token-major (each K row is read once, for every query row of its
//   head); with AVX-512 a full block's 16 scores per query row are summed as one shuffle
//   tree (~3 ops a dot product instead of ~7 for a horizontal sum each);
// - values are accumulated per query row over a block's tokens in registers (head_dim is
//   a template constant for 64 and 128), so acc is loaded and stored once per block;
// - blocks sit anywhere in memory and the hardware's streamer stops at page boundaries:
//   the full-block path prefetches the next K block and this block's V token row by token
//   row while it scores (see block_scores16), other paths one line a page of the next;
// - portable loops (omp simd) serve other head sizes, partial blocks and CPUs without
//   AVX-512. On the AMD EPYC bench machine, 2,048 tokens of the bench model's layer took
//   ~128 us of compute on one thread with the data in cache.
// - a bfloat16 cache (a bfloat16 model's) is read as such and widened to float32 in
//   registers (bfloat16 is float32's upper half: one shift); everything else is float32.
// Slots past a sequence's last token are never read, so whatever they hold (freed data,
// NaN) cannot reach the output.

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// K blocks of a thread's next task read ahead during its current task's values pass
constexpr int64_t AHEAD_BLOCKS = 2;

struct Task {
  int64_t s0, s1;      // sequences [s0, s1): one, or the whole batch for shared blocks
  int64_t b0, b1;      // table columns [b0, b1)
  int64_t scratch;     // offset of its (acc, m, l) rows in the scratch buffer
};

// The cache's element: float, or uint16_t for bfloat16.
inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {
  const uint32_t u = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
// elements of T in one 64-byte cache line
template <typename T>
constexpr int64_t LINE = 64 / int64_t(sizeof(T));

template <typename T>
struct Args {
  const T* k;
  const T* v;
  int64_t bs, kvh, dim, group;
  const int64_t* table;
  int64_t stride;
  const int64_t* lens;
  const float* q;
  float scale;
};

#if defined(__AVX512F__)
// 16 consecutive elements as float32
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// Lane i of the result: the sum of the 16 lanes of v[i]. Summing each dot product's 16
// partial sums on its own costs ~7 dependent shuffles and adds; summing 16 of them at once
// as a tree of shuffles costs ~3 per dot.
inline __m512 transpose_sum16(const __m512* v) {
  __m512 t[8], u[4], w[2];
  for (int k = 0; k < 8; k++)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    t[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                         _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; k++)  // per 128-bit lane L: [v0_L, v1_L, v2_L, v3_L] (lane sums)
    u[k] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * k], t[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * k], t[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int k = 0; k < 2; k++)  // 128-bit lanes [u0.L0+L1, u0.L2+L3, u1.L0+L1, u1.L2+L3]
    w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// The scores of a full block of 16 tokens for every query row r of task t:
// sc[r * stride + i]. Tokens in order, so the block is read front to back (by head, the
// reads jumped a row each: the hardware's prefetchers followed them ~10% worse); a
// sequence's query rows CHUNK at a time, their 16 partial sums each kept in `part` (L1).
// While scoring, each token's row of the next K block (next_k, or none) and of this block's
// V (vb, for the values pass) is prefetched into L2: the two streams overlap the compute
// instead of stalling it (~15% faster cold on the AMD bench machine than one line a page).
// Into L2, not L1: the current K block, the next one and `part` together overflow a 32 KiB
// L1, and prefetching K into L1 ran 12-20% slower cold (batch 1 and 8, 2,048 tokens).
template <int DC, typename T>
void block_scores16(const Args<T>& a, const Task& t, const T* kb, float* sc,
                    int64_t stride, const T* next_k, const T* vb) {
  constexpr int64_t CHUNK = 16;  // 16 KiB of partial sums
  const int64_t row = a.kvh * DC, rows = a.kvh * a.group;
  const __m512 scale = _mm512_set1_ps(a.scale);
  __m512 part[CHUNK * 16];
  for (int64_t s = t.s0; s < t.s1; s++) {
    const float* qs = a.q + s * rows * DC;
    float* out = sc + (s - t.s0) * rows * stride;
    for (int64_t r0 = 0; r0 < rows; r0 += CHUNK) {
      const int64_t r1 = std::min(rows, r0 + CHUNK);
      for (int i = 0; i < 16; i++) {
        const T* kt = kb + i * row;
        if (r0 == 0 && s == t.s0) {
          for (int64_t x = 0; x < row; x += LINE<T>) {
            if (next_k) __builtin_prefetch(next_k + i * row + x, 0, 2);  // prefetcht1
            __builtin_prefetch(vb + i * row + x, 0, 1);                  // prefetcht2
          }
        }
        for (int64_t r = r0; r < r1; r++) {
          const T* kr = kt + (r / a.group) * DC;
          const float* qr = qs + r * DC;
          __m512 d = _mm512_mul_ps(load16(kr), _mm512_loadu_ps(qr));
          for (int c = 1; c < DC / 16; c++)
            d = _mm512_fmadd_ps(load16(kr + 16 * c), _mm512_loadu_ps(qr + 16 * c), d);
          part[(r - r0) * 16 + i] = d;
        }
      }
      for (int64_t r = r0; r < r1; r++)
        _mm512_storeu_ps(out + r * stride,
                         _mm512_mul_ps(transpose_sum16(part + (r - r0) * 16), scale));
    }
  }
}

// o[:DC] += sum_i p[i] * v[i * row : i * row + DC] for i < n.
template <int DC, typename T>
inline void values16(float* o, const float* p, int64_t n, const T* v, int64_t row) {
  __m512 r[DC / 16];
  for (int k = 0; k < DC / 16; k++) r[k] = _mm512_loadu_ps(o + 16 * k);
  for (int64_t i = 0; i < n; i++) {
    const __m512 w = _mm512_set1_ps(p[i]);
    for (int k = 0; k < DC / 16; k++)
      r[k] = _mm512_fmadd_ps(load16(v + i * row + 16 * k), w, r[k]);
  }
  for (int k = 0; k < DC / 16; k++) _mm512_storeu_ps(o + 16 * k, r[k]);
}
#endif

// one line per page of a block: the hardware's streamer does the rest within each page
template <typename T>
inline void prefetch_block(const T* base, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 4096)
    __builtin_prefetch(reinterpret_cast<const char*>(base) + off);
}

// Task t in two passes over its blocks: every score (K streamed once), one softmax per
// query row over the task's tokens, then the weighted values (V streamed once). Two
// sequential streams, one at a time, and no per-block rescaling.
// sc: room for (t.s1 - t.s0) * kv_heads * group * (t.b1 - t.b0) * block_size floats.
template <int DC, typename T>
void run_task(const Args<T>& a, const Task& t, float* scratch, float* sc, const Task* next) {
  const int64_t D = DC ? DC : a.dim;
  const int64_t row = a.kvh * D, block = a.bs * row;
  const int64_t per_seq = a.kvh * a.group;               // query rows of one sequence
  const int64_t rows = (t.s1 - t.s0) * per_seq;
  const int64_t stride = (t.b1 - t.b0) * a.bs;           // sc row: the task's tokens
  float* acc = scratch + t.scratch;                      // [rows, D]
  float* m = acc + rows * D;                             // [rows]
  float* l = m + rows;                                   // [rows]
  std::memset(acc, 0, sizeof(float) * rows * D);
  const int64_t* ids = a.table + t.s0 * a.stride;        // shared blocks: any row will do
  const int64_t len = t.s1 - t.s0 == 1 ? a.lens[t.s0] : INT64_MAX;
  const int64_t ntok = std::min<int64_t>(stride, len - t.b0 * a.bs);
  for (int64_t b = t.b0; b < t.b1; b++) {
    const int64_t n = std::min<int64_t>(a.bs, len - b * a.bs), first = (b - t.b0) * a.bs;
    const T* kb = a.k + ids[b] * block;
#if defined(__AVX512F__)
    if (DC && a.bs == 16 && n == 16) {
      block_scores16<DC ? DC : 16>(a, t, kb, sc + first, stride,
                                   b + 1 < t.b1 ? a.k + ids[b + 1] * block : nullptr,
                                   a.v + ids[b] * block);
      continue;
    }
#endif
    if (b + 1 < t.b1) prefetch_block(a.k + ids[b + 1] * block, block * int64_t(sizeof(T)));
    for (int64_t i = 0; i < n; i++) {
      for (int64_t h = 0; h < a.kvh; h++) {
        const T* kr = kb + i * row + h * D;
        for (int64_t s = t.s0; s < t.s1; s++) {
          for (int64_t j = 0; j < a.group; j++) {
            const float* qr = a.q + ((s * a.kvh + h) * a.group + j) * D;
            float d = 0.f;
#pragma omp simd reduction(+ : d)
            for (int64_t x = 0; x < D; x++) d += to_float(kr[x]) * qr[x];
            sc[(((s - t.s0) * a.kvh + h) * a.group + j) * stride + first + i] = d * a.scale;
          }
        }
      }
    }
  }
  prefetch_block(a.v + ids[t.b0] * block, block * int64_t(sizeof(T)));
  for (int64_t r = 0; r < rows; r++) {
    float* p = sc + r * stride;
    float mx = p[0];
    for (int64_t i = 1; i < ntok; i++) mx = p[i] > mx ? p[i] : mx;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < ntok; i++) {
      p[i] = std::exp(p[i] - mx);
      sum += p[i];
    }
    m[r] = mx;
    l[r] = sum;
  }
  // The values pass reads V from L2 (prefetched while scoring) and leaves the memory idle:
  // meanwhile the first K blocks of `next` (the task this thread likely runs next, or none)
  // are read into L2, a share of their lines per block of this pass (attention alone 5-14%
  // faster at batch 1 and 2,048 tokens on the AMD bench machine).
  const int64_t ahead_lines =
      next ? std::min(AHEAD_BLOCKS, next->b1 - next->b0) * block / LINE<T> : 0;
  const int64_t lines_per_block = (ahead_lines + (t.b1 - t.b0) - 1) / (t.b1 - t.b0);
  for (int64_t b = t.b0; b < t.b1; b++) {
    const int64_t n = std::min<int64_t>(a.bs, len - b * a.bs), first = (b - t.b0) * a.bs;
    const T* vb = a.v + ids[b] * block;
    if (b + 1 < t.b1) prefetch_block(a.v + ids[b + 1] * block, block * int64_t(sizeof(T)));
    const int64_t line_end = std::min(ahead_lines, (b - t.b0 + 1) * lines_per_block);
    for (int64_t line = (b - t.b0) * lines_per_block; line < line_end; line++) {
      const int64_t j = line * LINE<T> / block;  // the next task's j-th block
      const T* kb = a.k + a.table[next->s0 * a.stride + next->b0 + j] * block;
      __builtin_prefetch(kb + (line * LINE<T> - j * block), 0, 2);
    }
    for (int64_t r = 0; r < rows; r++) {
      const float* p = sc + r * stride + first;
      const int64_t h = (r / a.group) % a.kvh;
      float* o = acc + r * D;
#if defined(__AVX512F__)
      if (DC) {  // the block's weighted values added to acc in registers
        values16<DC ? DC : 16>(o, p, n, vb + h * D, row);
        continue;
      }
#endif
      for (int64_t i = 0; i < n; i++) {
        const T* vr = vb + i * row + h * D;
        const float w = p[i];
#pragma omp simd
        for (int64_t x = 0; x < D; x++) o[x] += w * to_float(vr[x]);
      }
    }
  }
}

// out rows of sequence s: its tasks' partial results merged by log-sum-exp; zeros when it
// has no token (padding).
template <typename T>
void merge(const Args<T>& a, const std::vector<Task>& tasks, const std::vector<int64_t>& mine,
           int64_t s, const float* scratch, float* out) {
  const int64_t D = a.dim, per_seq = a.kvh * a.group;
  for (int64_t r = 0; r < per_seq; r++) {
    float* o = out + (s * per_seq + r) * D;
    float mx = -FLT_MAX;
    for (int64_t ti : mine) {
      const Task& t = tasks[ti];
      const int64_t rows = (t.s1 - t.s0) * per_seq, rr = (s - t.s0) * per_seq + r;
      mx = std::max(mx, scratch[t.scratch + rows * D + rr]);
    }
    std::memset(o, 0, sizeof(float) * D);
    if (mine.empty()) continue;  // every task has at least one token
    float total = 0.f;
    for (int64_t ti : mine) {
      const Task& t = tasks[ti];
      const int64_t rows = (t.s1 - t.s0) * per_seq, rr = (s - t.s0) * per_seq + r;
      const float* acc = scratch + t.scratch;
      const float w = std::exp(acc[rows * D + rr] - mx);
      total += w * acc[rows * D + rows + rr];
      for (int64_t x = 0; x < D; x++) o[x] += w * acc[rr * D + x];
    }
    const float inv = 1.f / total;
    for (int64_t x = 0; x < D; x++) o[x] *= inv;
  }
}

template <typename T>
void run(const Args<T>& a, int64_t num_seqs, int64_t shared_blocks, int64_t chunk_blocks,
         float* out, int num_threads);

template <typename T>
int decode_attention(T* k_cache, T* v_cache, int64_t block_size, int64_t kv_heads,
                     int64_t head_dim, const int64_t* block_tables, int64_t table_stride,
                     const int64_t* seq_lens, int64_t num_seqs, int64_t group, const float* q,
                     float scale, int64_t shared_blocks, int64_t chunk_blocks, float* out,
                     int num_threads, const T* new_k, const T* new_v, const int64_t* slots) {
  if (new_k) {
    const int64_t row = kv_heads * head_dim;
    for (int64_t s = 0; s < num_seqs; s++) {
      if (slots[s] < 0) continue;
      std::memcpy(k_cache + slots[s] * row, new_k + s * row, sizeof(T) * row);
      std::memcpy(v_cache + slots[s] * row, new_v + s * row, sizeof(T) * row);
    }
  }
  try {
    run(Args<T>{k_cache, v_cache, block_size, kv_heads, head_dim, group, block_tables,
                table_stride, seq_lens, q, scale},
        num_seqs, shared_blocks, chunk_blocks, out, num_threads);
  } catch (const std::bad_alloc&) {  // an exception must not cross the C boundary
    return 1;
  }
  return 0;
}

}  // namespace

// Returns 0, or 1 when its scratch could not be allocated (nothing written).
// shared_blocks: leading table columns every sequence has (same block ids, full blocks);
// chunk_blocks: blocks per task (the split across threads).
// new_k, new_v [num_seqs, kv_heads, head_dim] (or null: nothing stored): each sequence's
// new token, stored at slot slots[s] (skipped if < 0) before attending. Here rather than
// as two index_copy_ calls, which cost ~20-40 us a layer in a decode step (cold caches
// after the weights streamed through) for two 1 KiB rows.
extern "C" int kvs_decode_attention(float* k_cache, float* v_cache,
                                    int64_t block_size, int64_t kv_heads, int64_t head_dim,
                                    const int64_t* block_tables, int64_t table_stride,
                                    const int64_t* seq_lens, int64_t num_seqs, int64_t group,
                                    const float* q, float scale, int64_t shared_blocks,
                                    int64_t chunk_blocks, float* out, int num_threads,
                                    const float* new_k, const float* new_v,
                                    const int64_t* slots) {
  return decode_attention(k_cache, v_cache, block_size, kv_heads, head_dim, block_tables,
                          table_stride, seq_lens, num_seqs, group, q, scale, shared_blocks,
                          chunk_blocks, out, num_threads, new_k, new_v, slots);
}

// The same over bfloat16 caches (raw uint16_t; new_k / new_v bfloat16 rows too); q and out
// stay float32.
extern "C" int kvs_decode_attention_bf16(uint16_t* k_cache, uint16_t* v_cache,
                                         int64_t block_size, int64_t kv_heads,
                                         int64_t head_dim, const int64_t* block_tables,
                                         int64_t table_stride, const int64_t* seq_lens,
                                         int64_t num_seqs, int64_t group, const float* q,
                                         float scale, int64_t shared_blocks,
                                         int64_t chunk_blocks, float* out, int num_threads,
                                         const uint16_t* new_k, const uint16_t* new_v,
                                         const int64_t* slots) {
  return decode_attention(k_cache, v_cache, block_size, kv_heads, head_dim, block_tables,
                          table_stride, seq_lens, num_seqs, group, q, scale, shared_blocks,
                          chunk_blocks, out, num_threads, new_k, new_v, slots);
}

namespace {

template <typename T>
void run(const Args<T>& a, int64_t num_seqs, int64_t shared_blocks, int64_t chunk_blocks,
         float* out, int num_threads) {
  const int64_t block_size = a.bs, kv_heads = a.kvh, head_dim = a.dim, group = a.group;
  const int64_t* seq_lens = a.lens;
  const int64_t per_seq = kv_heads * group, floats_per_row = head_dim + 2;
  std::vector<Task> tasks;
  std::vector<std::vector<int64_t>> mine(num_seqs);
  int64_t scratch = 0;
  for (int64_t b = 0; b < shared_blocks; b += chunk_blocks) {
    tasks.push_back({0, num_seqs, b, std::min(b + chunk_blocks, shared_blocks), scratch});
    scratch += num_seqs * per_seq * floats_per_row;
    for (int64_t s = 0; s < num_seqs; s++) mine[s].push_back(int64_t(tasks.size()) - 1);
  }
  for (int64_t s = 0; s < num_seqs; s++) {
    const int64_t end = (seq_lens[s] + block_size - 1) / block_size;
    for (int64_t b = shared_blocks; b < end; b += chunk_blocks) {
      tasks.push_back({s, s + 1, b, std::min(b + chunk_blocks, end), scratch});
      scratch += per_seq * floats_per_row;
      mine[s].push_back(int64_t(tasks.size()) - 1);
    }
  }
  const int64_t num_tasks = tasks.size();
  const int threads = int(std::max<int64_t>(1, std::min<int64_t>(num_threads, num_tasks)));
  // every allocation happens here: an exception inside the parallel region would abort
  const int64_t score_floats = (shared_blocks ? num_seqs : 1) * per_seq * chunk_blocks *
                               block_size;
  std::vector<float> buf(scratch), scores(threads * score_floats);
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t i = 0; i < num_tasks; i++) {
    float* sc = scores.data() + omp_get_thread_num() * score_floats;
    // dynamic scheduling hands out tasks in order: with threads of even speed, this one's
    // next task is i + threads
    const Task* next = i + threads < num_tasks ? &tasks[i + threads] : nullptr;
    if (head_dim == 64) run_task<64, T>(a, tasks[i], buf.data(), sc, next);
    else if (head_dim == 128) run_task<128, T>(a, tasks[i], buf.data(), sc, next);
    else run_task<0, T>(a, tasks[i], buf.data(), sc, next);
  }
  const int merge_threads = int(std::max<int64_t>(1, std::min<int64_t>(num_threads, num_seqs)));
#pragma omp parallel for num_threads(merge_threads)
  for (int64_t s = 0; s < num_seqs; s++) merge(a, tasks, mine[s], s, buf.data(), out);
}

}  // namespace
