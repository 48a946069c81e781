// RoPE and the K/V cache write of one layer in one pass over its packed QKV projection: Q
// heads rotated into a tensor of their own, K heads rotated and V heads copied into their
// cache slots. In torch the same takes a conversion to fp32, four multiplies or
// multiply-adds, a conversion back, a copy of Q and two index_copy_ calls (about 1.1 s of a
// 31 s run of bench/throughput.py here). The rounding is torch's (kernels/rope.py, rotate):
// fp32 math, x1 cos - x2 sin and x2 cos + x1 sin each as a product rounded then one fused
// multiply-add (torch's addcmul_), the result rounded once to the cache's dtype. Built
// without -ffast-math and in ISO C++, so no other multiply-add is contracted (cpu_ext.py).
#include <cmath>
#include <cstdint>
#include <cstring>

#include "bf16.h"

namespace {

// One head of `dim` values: its first 2 * half rotate (rotate-half layout), the rest pass.
template <typename T>
inline void rotate_head(const T* src, const float* cos, const float* sin, int64_t half,
                        int64_t dim, T* dst) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = load(src[i]), x2 = load(src[i + half]);
    store(std::fma(-x2, sin[i], x1 * cos[i]), &dst[i]);
    store(std::fma(x1, sin[i], x2 * cos[i]), &dst[i + half]);
  }
  if (2 * half < dim) std::memcpy(dst + 2 * half, src + 2 * half, (dim - 2 * half) * sizeof(T));
}

// qkv [rows, (hq + 2 hk) * dim] (Q heads, K heads, V heads); cos and sin [positions, half]
// (half = 0: no rotation); rows r < written with slots[r] >= 0 write their K/V to that slot
// of the caches [slots, hk, dim]; q_out [rows, hq, dim].
template <typename T>
void rope_write_kv(const T* qkv, const int64_t* positions, const float* cos, const float* sin,
                   const int64_t* slots, T* k_cache, T* v_cache, T* q_out, int64_t rows,
                   int64_t written, int64_t hq, int64_t hk, int64_t dim, int64_t half,
                   int threads) {
  const int64_t stride = (hq + 2 * hk) * dim;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = qkv + r * stride;
    const float* c = cos + positions[r] * half;
    const float* s = sin + positions[r] * half;
    for (int64_t h = 0; h < hq; ++h)
      rotate_head(src + h * dim, c, s, half, dim, q_out + (r * hq + h) * dim);
    const int64_t slot = r < written ? slots[r] : -1;
    if (slot < 0) continue;
    for (int64_t h = 0; h < hk; ++h)
      rotate_head(src + (hq + h) * dim, c, s, half, dim, k_cache + (slot * hk + h) * dim);
    std::memcpy(v_cache + slot * hk * dim, src + (hq + hk) * dim, hk * dim * sizeof(T));
  }
}

}  // namespace

extern "C" {

void llmdb_rope_write_kv_bf16(const uint16_t* qkv, const int64_t* positions, const float* cos,
                              const float* sin, const int64_t* slots, uint16_t* k_cache,
                              uint16_t* v_cache, uint16_t* q_out, int64_t rows, int64_t written,
                              int64_t hq, int64_t hk, int64_t dim, int64_t half, int threads) {
  rope_write_kv(qkv, positions, cos, sin, slots, k_cache, v_cache, q_out, rows, written, hq, hk,
                dim, half, threads);
}

void llmdb_rope_write_kv_f32(const float* qkv, const int64_t* positions, const float* cos,
                             const float* sin, const int64_t* slots, float* k_cache,
                             float* v_cache, float* q_out, int64_t rows, int64_t written,
                             int64_t hq, int64_t hk, int64_t dim, int64_t half, int threads) {
  rope_write_kv(qkv, positions, cos, sin, slots, k_cache, v_cache, q_out, rows, written, hq, hk,
                dim, half, threads);
}

}  // extern "C"
