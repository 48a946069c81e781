// Paged decode attention for the CPU: one query per sequence, K/V read in place from the
// block-paged cache (no gather copy), fp32 softmax and accumulation, GQA without expanding
// K/V. Parallel over (sequence, kv head). Compiled at first use with the machine's own
// -march, loaded with ctypes (see kernels/cpu_ext.py): no torch headers, a one-second build.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline void from_float(float x, float* out) { *out = x; }
inline void from_float(float x, uint16_t* out) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits += 0x7FFF + ((bits >> 16) & 1);  // round to nearest even, as torch does
  *out = static_cast<uint16_t>(bits >> 16);
}

constexpr int kMaxGroup = 16;
constexpr int kMaxDim = 256;

template <typename T>
void decode_attention(const T* q, const T* k_cache, const T* v_cache,
                      const int64_t* block_tables, const int64_t* context_lens,
                      int64_t num_seqs, int64_t heads, int64_t kv_heads, int64_t dim,
                      int64_t block_size, int64_t max_blocks, float scale, T* out) {
  const int64_t group = heads / kv_heads;
#pragma omp parallel
  {
    std::vector<float> scores;
#pragma omp for collapse(2) schedule(dynamic, 4)
    for (int64_t s = 0; s < num_seqs; ++s) {
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t ctx = context_lens[s];
        const int64_t* table = block_tables + s * max_blocks;
        float qf[kMaxGroup][kMaxDim];
        float acc[kMaxGroup][kMaxDim];
        float row[kMaxDim];
        for (int64_t g = 0; g < group; ++g) {
          const T* qs = q + (s * heads + h * group + g) * dim;
          for (int64_t d = 0; d < dim; ++d) qf[g][d] = to_float(qs[d]) * scale;
          for (int64_t d = 0; d < dim; ++d) acc[g][d] = 0.f;
        }
        scores.resize(static_cast<size_t>(group * ctx));
        float mx[kMaxGroup];
        for (int64_t g = 0; g < group; ++g) mx[g] = -INFINITY;
        for (int64_t t = 0; t < ctx; ++t) {
          const int64_t slot = table[t / block_size] * block_size + t % block_size;
          const T* kr = k_cache + (slot * kv_heads + h) * dim;
          for (int64_t d = 0; d < dim; ++d) row[d] = to_float(kr[d]);
          for (int64_t g = 0; g < group; ++g) {
            float dot = 0.f;
            for (int64_t d = 0; d < dim; ++d) dot += qf[g][d] * row[d];
            scores[g * ctx + t] = dot;
            mx[g] = dot > mx[g] ? dot : mx[g];
          }
        }
        float sum[kMaxGroup];
        for (int64_t g = 0; g < group; ++g) {
          float total = 0.f;
          float* sg = scores.data() + g * ctx;
          for (int64_t t = 0; t < ctx; ++t) {
            sg[t] = std::exp(sg[t] - mx[g]);
            total += sg[t];
          }
          sum[g] = total;
        }
        for (int64_t t = 0; t < ctx; ++t) {
          const int64_t slot = table[t / block_size] * block_size + t % block_size;
          const T* vr = v_cache + (slot * kv_heads + h) * dim;
          for (int64_t d = 0; d < dim; ++d) row[d] = to_float(vr[d]);
          for (int64_t g = 0; g < group; ++g) {
            const float p = scores[g * ctx + t];
            for (int64_t d = 0; d < dim; ++d) acc[g][d] += p * row[d];
          }
        }
        for (int64_t g = 0; g < group; ++g) {
          T* o = out + (s * heads + h * group + g) * dim;
          const float inv = 1.f / sum[g];
          for (int64_t d = 0; d < dim; ++d) from_float(acc[g][d] * inv, &o[d]);
        }
      }
    }
  }
}

}  // namespace

extern "C" {
int llmdb_max_group() { return kMaxGroup; }
int llmdb_max_dim() { return kMaxDim; }

void llmdb_decode_attention_f32(const float* q, const float* k, const float* v,
                                const int64_t* bt, const int64_t* lens, int64_t n, int64_t h,
                                int64_t kvh, int64_t d, int64_t bs, int64_t mb, float scale,
                                float* out) {
  decode_attention(q, k, v, bt, lens, n, h, kvh, d, bs, mb, scale, out);
}

void llmdb_decode_attention_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                 const int64_t* bt, const int64_t* lens, int64_t n, int64_t h,
                                 int64_t kvh, int64_t d, int64_t bs, int64_t mb, float scale,
                                 uint16_t* out) {
  decode_attention(q, k, v, bt, lens, n, h, kvh, d, bs, mb, scale, out);
}
}
