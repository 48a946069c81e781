// Gumbel-max draws for rows sampled with a temperature and maybe top-k and top-p: the
// argmax of (logit - top) / T + g over the tokens top-k and top-p keep, where g is the noise
// engine/sampling.py hashes from (the row's key, the token id). The same hash, the same fp32
// scores and the same rule for equal logits as that torch path; built without -ffast-math
// (cpu_ext.py). Not to the bit: glibc's logf differs from torch's vectorized log in the last
// bit for 14.5% of the noise's 2^24 inputs, and top-p's mass is summed in double here, in
// float there. So two scores within an ULP of each other, or a token whose mass sits on
// top_p, may be decided otherwise (as between the CPU and a GPU); some 50,000 draws of
// SmolLM2 rows and random ones found no such case.
//
// Why a kernel: in torch a row's draw takes a conversion, a scaling and a comparison pass
// over its logits (and for top-p a pass of exponentials), then a sort and a hash of every
// token that can win (thousands of tokens at T = 0.7, most of the vocabulary at T >= 1).
// Here one pass reads the logits, and with a temperature alone a token is hashed only if it
// could still beat the best score so far (its scaled logit plus the largest noise, g_max):
// the top token first, then few others. With top-p, the tokens in reach of winning (a
// scaled logit of at least the top token's score less g_max) are sorted, and top-p keeps a
// prefix of them: no token out of reach can win, and all the tokens more likely than one
// in reach are in reach too. With top-k, a first pass finds the k-th largest score (torch
// took a conversion, a scaling, a count of the reach and a sort of the top k: four passes).
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <functional>
#include <utility>
#include <vector>

#include "bf16.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// engine/sampling.py's _mix_tensor: its int64 arithmetic masked to 32 bits is uint32's.
inline uint32_t mix(uint32_t x) {
  x ^= x >> 16;
  x *= 0x45D9F3Bu;
  x ^= x >> 16;
  x *= 0x45D9F3Bu;
  return x ^ (x >> 16);
}

// engine/sampling.py's gumbel_noise for one (key, token id).
inline float gumbel(uint32_t key, uint32_t token, float u_max) {
  const uint32_t h = mix(key ^ mix(token));
  float u = (static_cast<float>(h >> 8) + 0.5f) * 0x1p-24f;
  u = u < u_max ? u : u_max;
  return -std::log(-std::log(u));
}

#if defined(__AVX512F__)
template <typename T>
inline __m512 load16(const T* p) {
  if constexpr (sizeof(T) == 2) {  // bf16: the top half of an fp32
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  } else {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(p));
  }
}
#endif

template <typename T, float (*load)(T)>
int64_t draw_plain(const T* row, int64_t vocab, float peak, float t, uint32_t key,
                   int64_t top_id, float g_max, float u_max) {
  // The top token first: its scaled logit is 0, so the best score starts at its noise.
  int64_t best_id = top_id;
  float best = (load(row[top_id]) - peak) / t + gumbel(key, top_id, u_max);
  for (int64_t v = 0; v < vocab; ++v) {
    const float s = (load(row[v]) - peak) / t;
    if (s + g_max < best) continue;  // (g_max carries the rounding slack)
    const float score = s + gumbel(key, static_cast<uint32_t>(v), u_max);
    if (score > best) {
      best = score;
      best_id = v;
    }
  }
  return best_id;
}

// Top-p over `reach`, the (scaled logit, id) pairs of every token that may win, whose
// probabilities are exp(scaled logit) / mass: each run of equal scores whose more likely
// tokens hold less than top_p is kept (the first run always), and the argmax of score plus
// noise over the kept tokens wins.
inline int64_t draw_sorted(std::vector<std::pair<float, int64_t>>& reach, double mass,
                           float top_p, uint32_t key, int64_t top_id, float u_max) {
  std::sort(reach.begin(), reach.end(),
            [](const auto& a, const auto& b) { return a.first > b.first; });
  const double limit = static_cast<double>(top_p) * mass;
  double above = 0.0;
  float best = -INFINITY;
  int64_t best_id = top_id;
  for (size_t i = 0; i < reach.size();) {
    if (above >= limit && i > 0) break;
    size_t end = i;
    for (; end < reach.size() && reach[end].first == reach[i].first; ++end) {
      const float score = reach[end].first + gumbel(key, static_cast<uint32_t>(reach[end].second),
                                                    u_max);
      if (score > best) {
        best = score;
        best_id = reach[end].second;
      }
    }
    above += static_cast<double>(end - i) * std::exp(reach[i].first);
    i = end;
  }
  return best_id;
}

template <typename T, float (*load)(T)>
int64_t draw_nucleus(const T* row, int64_t vocab, float peak, float t, uint32_t key,
                     int64_t top_id, float top_p, float g_max, float u_max,
                     std::vector<std::pair<float, int64_t>>& reach) {
  const float least = gumbel(key, top_id, u_max) - g_max;
  double mass = 0.0;  // of the whole row: top-p's probabilities are of every token
  reach.clear();
  for (int64_t v = 0; v < vocab; ++v) {
    const float s = (load(row[v]) - peak) / t;
    mass += std::exp(s);  // (float exponentials, as torch takes them; a double sum)
    if (s >= least) reach.emplace_back(s, v);
  }
  return draw_sorted(reach, mass, top_p, key, top_id, u_max);
}

// The k-th largest of a row's n values (0 < k <= n, no NaN), equal values counted apart:
// a min-heap of the k largest seen, which most values fail to enter at one comparison (16 at
// a time where AVX-512 is at hand).
template <typename T, float (*load)(T)>
float kth_largest(const T* row, int64_t n, int64_t k, std::vector<float>& heap) {
  heap.clear();
  const auto offer = [&](float x) {
    if (static_cast<int64_t>(heap.size()) < k) {
      heap.push_back(x);
      std::push_heap(heap.begin(), heap.end(), std::greater<float>());
    } else if (x > heap.front()) {
      std::pop_heap(heap.begin(), heap.end(), std::greater<float>());
      heap.back() = x;
      std::push_heap(heap.begin(), heap.end(), std::greater<float>());
    }
  };
  int64_t v = 0;
#if defined(__AVX512F__)
  for (; v + 16 <= n; v += 16) {
    __mmask16 enter = 0xFFFF;
    if (static_cast<int64_t>(heap.size()) == k) {
      enter = _mm512_cmp_ps_mask(load16(row + v), _mm512_set1_ps(heap.front()), _CMP_GT_OQ);
    }
    for (; enter; enter &= enter - 1) offer(load(row[v + __builtin_ctz(enter)]));
  }
#endif
  for (; v < n; ++v) offer(load(row[v]));
  return heap.front();
}

// Top-k (k < vocab): every token whose scaled logit is at least the k-th largest (equal
// logits kept or dropped together), then top-p over those alone (their probabilities are
// of what top-k keeps), or with top_p = 1 the argmax of score plus noise over them.
template <typename T, float (*load)(T)>
int64_t draw_top_k(const T* row, int64_t vocab, float peak, float t, uint32_t key,
                   int64_t top_id, int64_t k, float top_p, float g_max, float u_max,
                   std::vector<float>& heap, std::vector<std::pair<float, int64_t>>& kept) {
  // (the k-th largest scaled logit is the k-th largest logit scaled: scaling is monotone)
  const float kth = (kth_largest<T, load>(row, vocab, k, heap) - peak) / t;
  if (top_p < 1.f) {
    kept.clear();
    double mass = 0.0;
    for (int64_t v = 0; v < vocab; ++v) {
      const float s = (load(row[v]) - peak) / t;
      if (s >= kth) {
        kept.emplace_back(s, v);
        mass += std::exp(s);
      }
    }
    return draw_sorted(kept, mass, top_p, key, top_id, u_max);
  }
  int64_t best_id = top_id;  // (scaled 0: always kept)
  float best = gumbel(key, static_cast<uint32_t>(top_id), u_max);
  for (int64_t v = 0; v < vocab; ++v) {
    const float s = (load(row[v]) - peak) / t;
    if (s < kth || s + g_max < best) continue;
    const float score = s + gumbel(key, static_cast<uint32_t>(v), u_max);
    if (score > best) {
      best = score;
      best_id = v;
    }
  }
  return best_id;
}

template <typename T, float (*load)(T)>
void draw_rows(const T* logits, int64_t rows, int64_t vocab, int64_t stride, const float* top,
               const int64_t* top_ids, const float* temperature, const float* top_p,
               const int64_t* top_k, const int64_t* keys, float g_max, float u_max,
               int64_t* out, int threads) {
#pragma omp parallel num_threads(threads)
  {
    std::vector<std::pair<float, int64_t>> reach;  // (each thread's, reused row to row)
    std::vector<float> heap;
#pragma omp for schedule(dynamic, 4)
    for (int64_t r = 0; r < rows; ++r) {
      const T* row = logits + r * stride;
      const uint32_t key = static_cast<uint32_t>(keys[r]);
      if (top[r] != top[r]) {
        out[r] = top_ids[r];  // a row with a NaN: its first NaN, as greedy gives
      } else if (top_k[r] > 0 && top_k[r] < vocab) {
        out[r] = draw_top_k<T, load>(row, vocab, top[r], temperature[r], key, top_ids[r],
                                     top_k[r], top_p[r], g_max, u_max, heap, reach);
      } else if (top_p[r] < 1.f) {
        out[r] = draw_nucleus<T, load>(row, vocab, top[r], temperature[r], key, top_ids[r],
                                       top_p[r], g_max, u_max, reach);
      } else {
        out[r] = draw_plain<T, load>(row, vocab, top[r], temperature[r], key, top_ids[r],
                                     g_max, u_max);
      }
    }
  }
}

inline float load_f32(float x) { return x; }


// The largest of n values and whether any is NaN (then the largest is meaningless).
template <typename T, float (*load)(T)>
float largest(const T* row, int64_t n, bool* nan) {
  float best = -INFINITY;
  bool any_nan = false;
  int64_t v = 0;
#if defined(__AVX512F__)
  // Vectorized by hand: without -ffast-math GCC keeps a maximum's loop scalar (a NaN would
  // make a reordered maximum differ), and the NaN test here makes the order irrelevant.
  __m512 top = _mm512_set1_ps(-INFINITY);
  __mmask16 unordered = 0;
  for (; v + 16 <= n; v += 16) {
    const __m512 x = load16(row + v);
    unordered |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    top = _mm512_max_ps(x, top);
  }
  best = _mm512_reduce_max_ps(top);
  any_nan = unordered != 0;
#endif
  for (; v < n; ++v) {
    const float x = load(row[v]);
    best = x > best ? x : best;
    any_nan |= x != x;
  }
  *nan = any_nan;
  return best;
}

// The first index whose value is `value` (with nan: the first NaN); 0 if none.
template <typename T, float (*load)(T)>
int64_t first_index(const T* row, int64_t n, float value, bool nan) {
  int64_t v = 0;
#if defined(__AVX512F__)
  const __m512 target = _mm512_set1_ps(value);
  for (; v + 16 <= n; v += 16) {
    const __m512 x = load16(row + v);
    const __mmask16 hit = nan ? _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q)
                              : _mm512_cmp_ps_mask(x, target, _CMP_EQ_OQ);
    if (hit) return v + __builtin_ctz(hit);
  }
#endif
  for (; v < n; ++v) {
    const float x = load(row[v]);
    if (nan ? x != x : x == value) return v;
  }
  return 0;
}

// Each row's largest value and the first index holding it; a row with a NaN gives its first
// NaN (torch's max(-1) on the CPU). Why: torch took 7.6 ms for 400 x 49,152 bf16 logits here,
// each greedy step; this is one vector pass, then a search of the same row, still in the
// cache, for the first hit.
template <typename T, float (*load)(T)>
void row_max(const T* logits, int64_t rows, int64_t vocab, int64_t stride, float* top,
             int64_t* top_ids, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = logits + r * stride;
    bool nan = false;
    const float best = largest<T, load>(row, vocab, &nan);
    const int64_t id = first_index<T, load>(row, vocab, best, nan);
    top[r] = load(row[id]);
    top_ids[r] = id;
  }
}

}  // namespace

extern "C" {

// out[r] = the drawn token of logits row r ([rows, vocab] with row stride `stride`).
void llmdb_gumbel_argmax_bf16(const uint16_t* logits, int64_t rows, int64_t vocab,
                              int64_t stride, const float* top, const int64_t* top_ids,
                              const float* temperature, const float* top_p,
                              const int64_t* top_k, const int64_t* keys, float g_max,
                              float u_max, int64_t* out, int threads) {
  draw_rows<uint16_t, bf16_to_float>(logits, rows, vocab, stride, top, top_ids, temperature,
                                     top_p, top_k, keys, g_max, u_max, out, threads);
}

void llmdb_gumbel_argmax_f32(const float* logits, int64_t rows, int64_t vocab, int64_t stride,
                             const float* top, const int64_t* top_ids, const float* temperature,
                             const float* top_p, const int64_t* top_k, const int64_t* keys,
                             float g_max, float u_max, int64_t* out, int threads) {
  draw_rows<float, load_f32>(logits, rows, vocab, stride, top, top_ids, temperature, top_p,
                             top_k, keys, g_max, u_max, out, threads);
}

// top[r], top_ids[r]: the largest value of logits row r and its first index (see row_max).
void llmdb_row_max_bf16(const uint16_t* logits, int64_t rows, int64_t vocab, int64_t stride,
                        float* top, int64_t* top_ids, int threads) {
  row_max<uint16_t, bf16_to_float>(logits, rows, vocab, stride, top, top_ids, threads);
}

void llmdb_row_max_f32(const float* logits, int64_t rows, int64_t vocab, int64_t stride,
                       float* top, int64_t* top_ids, int threads) {
  row_max<float, load_f32>(logits, rows, vocab, stride, top, top_ids, threads);
}

}  // extern "C"
