// Fused element-wise ops for bf16 and fp32 activations: one pass over memory instead of the
// five to eight torch ops (each with its own temporary) they replace. Same rounding points as
// the torch reference in kernels/elementwise.py: fp32 math, bf16 where torch rounds. Each row
// is computed alone, in the same order whatever the number of rows (batch invariance).
#include <cmath>
#include <cstdint>

#include "bf16.h"

extern "C" {

// out = w * bf16(x * rsqrt(mean(x^2) + eps)), row by row.
void llmdb_rms_norm_bf16(const uint16_t* x, const uint16_t* w, uint16_t* out, int64_t rows,
                         int64_t dim, float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* xr = x + r * dim;
    uint16_t* o = out + r * dim;
    float sum = 0.f;
    for (int64_t d = 0; d < dim; ++d) {
      const float v = bf16_to_float(xr[d]);
      sum += v * v;
    }
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(dim) + eps);
    for (int64_t d = 0; d < dim; ++d) {
      const float normed = bf16_to_float(float_to_bf16(bf16_to_float(xr[d]) * inv));
      o[d] = float_to_bf16(bf16_to_float(w[d]) * normed);
    }
  }
}

// gate_up [rows, 2 * ffn] -> out [rows, ffn] = bf16(silu(gate)) * up.
void llmdb_silu_mul_bf16(const uint16_t* gate_up, uint16_t* out, int64_t rows, int64_t ffn,
                         int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* g = gate_up + r * 2 * ffn;
    const uint16_t* u = g + ffn;
    uint16_t* o = out + r * ffn;
    for (int64_t d = 0; d < ffn; ++d) {
      const float gv = bf16_to_float(g[d]);
      const float s = bf16_to_float(float_to_bf16(gv / (1.f + std::exp(-gv))));
      o[d] = float_to_bf16(s * bf16_to_float(u[d]));
    }
  }
}

// fp32: out = w * (x * rsqrt(mean(x^2) + eps)), row by row.
void llmdb_rms_norm_f32(const float* x, const float* w, float* out, int64_t rows, int64_t dim,
                        float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float* o = out + r * dim;
    float sum = 0.f;
    for (int64_t d = 0; d < dim; ++d) sum += xr[d] * xr[d];
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(dim) + eps);
    for (int64_t d = 0; d < dim; ++d) o[d] = w[d] * (xr[d] * inv);
  }
}

// fp32: gate_up [rows, 2 * ffn] -> out [rows, ffn] = silu(gate) * up.
void llmdb_silu_mul_f32(const float* gate_up, float* out, int64_t rows, int64_t ffn,
                        int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate_up + r * 2 * ffn;
    const float* u = g + ffn;
    float* o = out + r * ffn;
    for (int64_t d = 0; d < ffn; ++d) o[d] = g[d] / (1.f + std::exp(-g[d])) * u[d];
  }
}
}
