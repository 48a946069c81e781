// Fused element-wise ops for bf16 and fp32 activations: one pass over memory instead of the
// five to eight torch ops (each with its own temporary) they replace. Same rounding points as
// the torch reference in kernels/elementwise.py: fp32 math, bf16 where torch rounds. Each row
// is computed alone, in the same order whatever the number of rows (batch invariance).
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "bf16.h"

namespace {

// x rounded to T where torch rounds an intermediate to the activations' dtype.
template <typename T>
inline float round_to(float x) {
  if constexpr (std::is_same_v<T, uint16_t>) return bf16_to_float(float_to_bf16(x));
  return x;
}

// out = w * T(x * rsqrt(mean(x^2) + eps)), row by row.
template <typename T>
void rms_norm(const T* x, const T* w, T* out, int64_t rows, int64_t dim, float eps,
              int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * dim;
    T* o = out + r * dim;
    float sum = 0.f;
    for (int64_t d = 0; d < dim; ++d) {
      const float v = load(xr[d]);
      sum += v * v;
    }
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(dim) + eps);
    for (int64_t d = 0; d < dim; ++d) store(load(w[d]) * round_to<T>(load(xr[d]) * inv), &o[d]);
  }
}

// gate_up [rows, 2 * ffn] -> out [rows, ffn] = T(silu(gate)) * up.
template <typename T>
void silu_mul(const T* gate_up, T* out, int64_t rows, int64_t ffn, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gate_up + r * 2 * ffn;
    const T* u = g + ffn;
    T* o = out + r * ffn;
    for (int64_t d = 0; d < ffn; ++d) {
      const float gv = load(g[d]);
      store(round_to<T>(gv / (1.f + std::exp(-gv))) * load(u[d]), &o[d]);
    }
  }
}

}  // namespace

extern "C" {

void llmdb_rms_norm_bf16(const uint16_t* x, const uint16_t* w, uint16_t* out, int64_t rows,
                         int64_t dim, float eps, int threads) {
  rms_norm(x, w, out, rows, dim, eps, threads);
}

void llmdb_rms_norm_f32(const float* x, const float* w, float* out, int64_t rows, int64_t dim,
                        float eps, int threads) {
  rms_norm(x, w, out, rows, dim, eps, threads);
}

void llmdb_silu_mul_bf16(const uint16_t* gate_up, uint16_t* out, int64_t rows, int64_t ffn,
                         int threads) {
  silu_mul(gate_up, out, rows, ffn, threads);
}

void llmdb_silu_mul_f32(const float* gate_up, float* out, int64_t rows, int64_t ffn,
                        int threads) {
  silu_mul(gate_up, out, rows, ffn, threads);
}
}
