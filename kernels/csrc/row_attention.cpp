// Paged attention for the CPU, one query row at a time: each row (a decode, or one position
// of a prefill chunk) has its own block table and number of visible keys; under a sliding
// window the row starts at the window's first block (so a decode over a long context reads
// about `window` keys, not the context). K/V are read in
// place from the block-paged cache (no gather copy), fp32 softmax and accumulation, GQA
// without expanding K/V. Parallel over (row, kv head). Compiled at first use with the machine's own
// -march, loaded with ctypes (see kernels/cpu_ext.py): no torch headers, a one-second build.
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "bf16.h"

#if defined(__AVX512BF16__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512BF16__) || (defined(__AVX2__) && defined(__FMA__))
// Four keys' scores written, and the running maximum taken over them.
inline void store_scores(__m128 dots, float* dst, float& mx) {
  _mm_storeu_ps(dst, dots);
  __m128 m = _mm_max_ps(dots, _mm_movehl_ps(dots, dots));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  const float best = _mm_cvtss_f32(m);
  mx = best > mx ? best : mx;
}
#endif

#if defined(__AVX512BF16__)
// [sum(a), sum(b), sum(c), sum(d)] of four 16-lane vectors: pairs interleaved and added
// within each 128-bit lane, then the four lanes added.
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                    _mm512_extractf32x8_ps(abcd, 1));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// [sum(a), sum(b), sum(c), sum(d)] of four 8-lane vectors: three horizontal adds and one add
// of the halves, for four dot products at once.
inline __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// The fp32 kernel's shapes written with AVX2 intrinsics (attend_one): what the compiler made
// of the plain loops ran prefill attention at ~38 GFLOP/s here, a horizontal sum per key and
// the query group's accumulators spilled to memory on every key.
template <typename T, int DIM, int GROUP>
constexpr bool kAvx2F32 = std::is_same_v<T, float> && DIM > 0 && DIM % 8 == 0 &&
                          GROUP > 0 && GROUP <= 12;

// Vectors of 8 per query head in one pass of P x V: the group's accumulators (group x w)
// stay within AVX2's 16 registers beside the broadcast weight and a V vector.
constexpr int pv_width(int group) { return 12 / group; }

// out[:, d0 : d0 + 8W] of the group's heads = sum over keys t of p[g][t] V[t, d0 : d0 + 8W],
// times inv[g]: the accumulators stay in registers over every key, and each output element
// sums its keys in order.
template <int GROUP, int W>
void pv_slice(const float* v_cache, const int64_t* table, int64_t ctx, int64_t block_size,
              int64_t kv_heads, int64_t h, int64_t dim, int64_t d0, const float* scores,
              const float* inv, float* out) {
  const int64_t stride = kv_heads * dim;
  __m256 sum[GROUP][W];
  for (int g = 0; g < GROUP; ++g)
    for (int w = 0; w < W; ++w) sum[g][w] = _mm256_setzero_ps();
  for (int64_t start = 0, blk = 0; start < ctx; start += block_size, ++blk) {
    const int64_t n = ctx - start < block_size ? ctx - start : block_size;
    const float* vb = v_cache + (table[blk] * block_size * kv_heads + h) * dim + d0;
    for (int64_t o = 0; o < n; ++o) {
      __m256 v[W];
      for (int w = 0; w < W; ++w) v[w] = _mm256_loadu_ps(vb + o * stride + 8 * w);
      for (int g = 0; g < GROUP; ++g) {
        const __m256 p = _mm256_broadcast_ss(scores + g * ctx + start + o);
        for (int w = 0; w < W; ++w) sum[g][w] = _mm256_fmadd_ps(p, v[w], sum[g][w]);
      }
    }
  }
  for (int g = 0; g < GROUP; ++g) {
    float* o = out + (h * GROUP + g) * dim + d0;
    const __m256 scale_g = _mm256_set1_ps(inv[g]);
    for (int w = 0; w < W; ++w) _mm256_storeu_ps(o + 8 * w, _mm256_mul_ps(sum[g][w], scale_g));
  }
}
#endif

constexpr int kMaxGroup = 16;
constexpr int kMaxDim = 256;

// One (row, kv head): the `group` query heads that share it, over the first ctx keys of the
// blocks in `table`, of which the first `skip` are not visible (under a sliding window the
// caller starts the table at the window's first block; skip < block_size). DIM and GROUP
// are compile-time for the common shapes (so the inner loops unroll into vector code) and 0
// for the generic version.
template <typename T, int DIM, int GROUP>
void attend_one(const T* q, const T* k_cache, const T* v_cache, const int64_t* table,
                int64_t skip, int64_t ctx, int64_t h, int64_t kv_heads, int64_t dim_rt,
                int64_t group_rt, int64_t block_size, float scale, float softcap, T* out,
                float* scores) {
  const int64_t dim = DIM ? DIM : dim_rt;
  const int64_t group = GROUP ? GROUP : group_rt;
  float qf[kMaxGroup][kMaxDim];
  float acc[kMaxGroup][kMaxDim];
  float row[kMaxDim];
  float mx[kMaxGroup];
  for (int64_t g = 0; g < group; ++g) {
    const T* qs = q + (h * group + g) * dim;
    for (int64_t d = 0; d < dim; ++d) qf[g][d] = load(qs[d]) * scale;
    for (int64_t d = 0; d < dim; ++d) acc[g][d] = 0.f;
    mx[g] = -INFINITY;
  }
  const int64_t stride = kv_heads * dim;
#if defined(__AVX512BF16__)
  // bf16 with a 64-wide head: the CPU's bf16 dot-product instruction multiplies pairs
  // exactly and accumulates in fp32, two instructions per key instead of a widening pass.
  if constexpr (std::is_same_v<T, uint16_t> && DIM == 64) {
    __m512bh qv[kMaxGroup][2];
    for (int64_t g = 0; g < group; ++g) {
      const T* qs = q + (h * group + g) * dim;
      qv[g][0] = (__m512bh)_mm512_loadu_si512(qs);
      qv[g][1] = (__m512bh)_mm512_loadu_si512(qs + 32);
    }
    const __m128 scale4 = _mm_set1_ps(scale);
    for (int64_t start = 0, blk = 0; start < ctx; start += block_size, ++blk) {
      const int64_t n = ctx - start < block_size ? ctx - start : block_size;
      const T* kb = k_cache + (table[blk] * block_size * kv_heads + h) * dim;
      int64_t o = 0;
      // Four keys at a time: their four dot products are summed across lanes together
      // (sum4), a third of the instructions of four separate horizontal sums.
      for (; o + 4 <= n; o += 4) {
        __m512bh k[4][2];
        for (int i = 0; i < 4; ++i) {
          const T* kr = kb + (o + i) * stride;
          k[i][0] = (__m512bh)_mm512_loadu_si512(kr);
          k[i][1] = (__m512bh)_mm512_loadu_si512(kr + 32);
        }
        for (int64_t g = 0; g < group; ++g) {
          __m512 acc[4];
          for (int i = 0; i < 4; ++i) {
            acc[i] = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], k[i][0]);
            acc[i] = _mm512_dpbf16_ps(acc[i], qv[g][1], k[i][1]);
          }
          store_scores(_mm_mul_ps(sum4(acc[0], acc[1], acc[2], acc[3]), scale4),
                       scores + g * ctx + start + o, mx[g]);
        }
      }
      for (; o < n; ++o) {
        const T* kr = kb + o * stride;
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kr);
        const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kr + 32);
        for (int64_t g = 0; g < group; ++g) {
          __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], k0);
          acc = _mm512_dpbf16_ps(acc, qv[g][1], k1);
          const float dot = _mm512_reduce_add_ps(acc) * scale;
          scores[g * ctx + start + o] = dot;
          mx[g] = dot > mx[g] ? dot : mx[g];
        }
      }
    }
  } else
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (kAvx2F32<T, DIM, GROUP>) {
    // Four keys at a time, each dot product in 8 lanes, the four summed across lanes at once.
    constexpr int C = DIM / 8;
    for (int64_t start = 0, blk = 0; start < ctx; start += block_size, ++blk) {
      const int64_t n = ctx - start < block_size ? ctx - start : block_size;
      const float* kb = reinterpret_cast<const float*>(k_cache) +
                        (table[blk] * block_size * kv_heads + h) * DIM;
      int64_t o = 0;
      for (; o + 4 <= n; o += 4) {
        const float* k0 = kb + o * stride;
        for (int g = 0; g < GROUP; ++g) {
          __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
          for (int c = 0; c < C; ++c) {
            const __m256 qc = _mm256_loadu_ps(qf[g] + 8 * c);
            a0 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k0 + 8 * c), a0);
            a1 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k0 + stride + 8 * c), a1);
            a2 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k0 + 2 * stride + 8 * c), a2);
            a3 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k0 + 3 * stride + 8 * c), a3);
          }
          store_scores(sum4(a0, a1, a2, a3), scores + g * ctx + start + o, mx[g]);
        }
      }
      for (; o < n; ++o) {
        const float* kr = kb + o * stride;
        for (int g = 0; g < GROUP; ++g) {
          __m256 a = _mm256_setzero_ps();
          for (int c = 0; c < C; ++c)
            a = _mm256_fmadd_ps(_mm256_loadu_ps(qf[g] + 8 * c), _mm256_loadu_ps(kr + 8 * c), a);
          const __m256 z = _mm256_setzero_ps();
          const float dot = _mm_cvtss_f32(sum4(a, z, z, z));
          scores[g * ctx + start + o] = dot;
          mx[g] = dot > mx[g] ? dot : mx[g];
        }
      }
    }
  } else
#endif
  {
    for (int64_t start = 0, blk = 0; start < ctx; start += block_size, ++blk) {
      const int64_t n = ctx - start < block_size ? ctx - start : block_size;
      const T* kb = k_cache + (table[blk] * block_size * kv_heads + h) * dim;
      for (int64_t o = 0; o < n; ++o) {
        const T* kr = kb + o * stride;
        for (int64_t d = 0; d < dim; ++d) row[d] = load(kr[d]);
        for (int64_t g = 0; g < group; ++g) {
          float dot = 0.f;
          for (int64_t d = 0; d < dim; ++d) dot += qf[g][d] * row[d];
          scores[g * ctx + start + o] = dot;
          mx[g] = dot > mx[g] ? dot : mx[g];
        }
      }
    }
  }
  // The loops above score the skipped keys too (they share the window's first block) and
  // the one below weighs them by 0. These extra passes run only for rows that need them, so
  // that the others keep the loops above as they are.
  if (skip > 0 || softcap > 0.f) {
    for (int64_t g = 0; g < group; ++g) {
      float* sg = scores + g * ctx;
      mx[g] = -INFINITY;
      for (int64_t t = skip; t < ctx; ++t) {
        // Gemma 2's soft-capping: s -> softcap * tanh(s / softcap).
        if (softcap > 0.f) sg[t] = softcap * std::tanh(sg[t] / softcap);
        mx[g] = sg[t] > mx[g] ? sg[t] : mx[g];
      }
      for (int64_t t = 0; t < skip; ++t) sg[t] = 0.f;
    }
  }
  float inv[kMaxGroup];
  for (int64_t g = 0; g < group; ++g) {
    float total = 0.f;
    float* sg = scores + g * ctx;
    for (int64_t t = skip; t < ctx; ++t) {
      sg[t] = std::exp(sg[t] - mx[g]);
      total += sg[t];
    }
    inv[g] = 1.f / total;
  }
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (kAvx2F32<T, DIM, GROUP>) {
    // P x V a slice of W chunks of 8 at a time (the last slice the chunks left over).
    constexpr int C = DIM / 8, W = pv_width(GROUP);
    for (int c0 = 0; c0 + W <= C; c0 += W)
      pv_slice<GROUP, W>(reinterpret_cast<const float*>(v_cache), table, ctx, block_size,
                         kv_heads, h, DIM, 8 * c0, scores, inv, reinterpret_cast<float*>(out));
    if constexpr (C % W != 0)
      pv_slice<GROUP, C % W>(reinterpret_cast<const float*>(v_cache), table, ctx, block_size,
                             kv_heads, h, DIM, 8 * (C - C % W), scores, inv,
                             reinterpret_cast<float*>(out));
    return;
  }
#endif
  for (int64_t start = 0, blk = 0; start < ctx; start += block_size, ++blk) {
    const int64_t n = ctx - start < block_size ? ctx - start : block_size;
    const T* vb = v_cache + (table[blk] * block_size * kv_heads + h) * dim;
    for (int64_t o = 0; o < n; ++o) {
      const T* vr = vb + o * stride;
      for (int64_t d = 0; d < dim; ++d) row[d] = load(vr[d]);
      for (int64_t g = 0; g < group; ++g) {
        const float p = scores[g * ctx + start + o];
        for (int64_t d = 0; d < dim; ++d) acc[g][d] += p * row[d];
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    T* o = out + (h * group + g) * dim;
    for (int64_t d = 0; d < dim; ++d) store(acc[g][d] * inv[g], &o[d]);
  }
}

template <typename T>
using AttendFn = void (*)(const T*, const T*, const T*, const int64_t*, int64_t, int64_t,
                          int64_t, int64_t, int64_t, int64_t, int64_t, float, float, T*, float*);

// The kernel compiled for fixed shapes (query heads per K/V head, head dim): for fp32, the
// AVX2 path's, every shape of the models this engine loads (SmolLM2 3/64, Llama-3.2-1B
// 4/64, Qwen2.5-0.5B 7/64, Phi-3 1/96, Llama-2-7B 1/128, Llama-3-8B and Mistral 4/128,
// Qwen2.5-1.5B 6/128 and -7B 7/128, Gemma 2 2/256 and 8/256); for bf16 the common ones
// (each shape adds compile time to the first build). Others take the generic loops.
template <typename T, int DIM, int... GROUPS>
AttendFn<T> pick_group(int64_t group) {
  AttendFn<T> fn = nullptr;
  ((group == GROUPS ? (fn = attend_one<T, DIM, GROUPS>, 0) : 0), ...);
  return fn;
}

template <typename T>
AttendFn<T> pick(int64_t dim, int64_t group) {
  AttendFn<T> fn = nullptr;
  if constexpr (std::is_same_v<T, float>) {
    if (dim == 64) fn = pick_group<T, 64, 1, 2, 3, 4, 5, 6, 7, 8>(group);
    if (dim == 96) fn = pick_group<T, 96, 1>(group);
    if (dim == 128) fn = pick_group<T, 128, 1, 2, 4, 6, 7, 8>(group);
    if (dim == 256) fn = pick_group<T, 256, 2, 8>(group);
  } else {
    if (dim == 64) fn = pick_group<T, 64, 1, 2, 3, 4, 8>(group);
    if (dim == 128) fn = pick_group<T, 128, 1, 4, 8>(group);
  }
  return fn ? fn : attend_one<T, 0, 0>;
}

template <typename T>
void row_attention(const T* q, const T* k_cache, const T* v_cache,
                   const int64_t* block_tables, const int64_t* context_lens,
                   int64_t num_rows, int64_t heads, int64_t kv_heads, int64_t dim,
                   int64_t block_size, int64_t max_blocks, float scale, int64_t window,
                   float softcap, int threads, T* out) {
  const int64_t group = heads / kv_heads;
  const AttendFn<T> attend = pick<T>(dim, group);
  // An explicit thread count: torch's setting, not OpenMP's per-thread default, which a
  // background thread would otherwise get.
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scores;
#pragma omp for collapse(2) schedule(dynamic, 4)
    for (int64_t s = 0; s < num_rows; ++s) {
      for (int64_t h = 0; h < kv_heads; ++h) {
        int64_t ctx = context_lens[s];
        const int64_t* table = block_tables + s * max_blocks;
        int64_t skip = 0;
        if (window > 0 && ctx > window) {  // keys ctx - window .. ctx - 1 only
          const int64_t first_block = (ctx - window) / block_size;
          table += first_block;
          ctx -= first_block * block_size;
          skip = ctx - window;
        }
        if (scores.size() < static_cast<size_t>(group * ctx)) scores.resize(group * ctx);
        attend(q + s * heads * dim, k_cache, v_cache, table, skip, ctx, h, kv_heads, dim,
               group, block_size, scale, softcap, out + s * heads * dim, scores.data());
      }
    }
  }
}

}  // namespace

extern "C" {
int llmdb_max_group() { return kMaxGroup; }
int llmdb_max_dim() { return kMaxDim; }

void llmdb_row_attention_f32(const float* q, const float* k, const float* v,
                             const int64_t* bt, const int64_t* lens, int64_t n, int64_t h,
                             int64_t kvh, int64_t d, int64_t bs, int64_t mb, float scale,
                             int64_t window, float softcap, int threads, float* out) {
  row_attention(q, k, v, bt, lens, n, h, kvh, d, bs, mb, scale, window, softcap, threads, out);
}

void llmdb_row_attention_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                              const int64_t* bt, const int64_t* lens, int64_t n, int64_t h,
                              int64_t kvh, int64_t d, int64_t bs, int64_t mb, float scale,
                              int64_t window, float softcap, int threads, uint16_t* out) {
  row_attention(q, k, v, bt, lens, n, h, kvh, d, bs, mb, scale, window, softcap, threads, out);
}
}
