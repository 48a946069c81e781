// Gumbel-max draws for rows sampled with a temperature alone (no top-k, no top-p): the
// argmax over the vocabulary of (logit - top) / T + g, where g is the noise engine/sampling.py
// hashes from (the row's key, the token id). The same hash and the same fp32 operations, so
// the same token as that torch path; built without -ffast-math (cpu_ext.py) to keep them.
//
// Why a kernel: in torch a row's draw takes a conversion, a scaling and a comparison pass
// over its logits, then a sort and a hash of every token that can win (thousands of tokens at
// T = 0.7, most of the vocabulary at T >= 1). Here one pass reads the logits, and a token is
// hashed only if it could still beat the best score so far (its scaled logit plus the
// largest noise, g_max): the top token first, then few others.
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

inline float bf16_to_float(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

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

template <typename T, float (*load)(T)>
void draw_rows(const T* logits, int64_t rows, int64_t vocab, int64_t stride, const float* top,
               const int64_t* top_ids, const float* temperature, const int64_t* keys,
               float g_max, float u_max, int64_t* out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 4)
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = logits + r * stride;
    const float t = temperature[r], peak = top[r];
    const uint32_t key = static_cast<uint32_t>(keys[r]);
    // The top token first: its scaled logit is 0, so the best score starts at its noise.
    int64_t best_id = top_ids[r];
    float best = (load(row[best_id]) - peak) / t + gumbel(key, best_id, u_max);
    for (int64_t v = 0; v < vocab; ++v) {
      const float s = (load(row[v]) - peak) / t;
      if (s + g_max < best) continue;  // (g_max carries the rounding slack)
      const float score = s + gumbel(key, static_cast<uint32_t>(v), u_max);
      if (score > best) {
        best = score;
        best_id = v;
      }
    }
    out[r] = best_id;
  }
}

inline float load_f32(float x) { return x; }

}  // namespace

extern "C" {

// out[r] = the drawn token of logits row r ([rows, vocab] with row stride `stride`).
void llmdb_gumbel_argmax_bf16(const uint16_t* logits, int64_t rows, int64_t vocab,
                              int64_t stride, const float* top, const int64_t* top_ids,
                              const float* temperature, const int64_t* keys, float g_max,
                              float u_max, int64_t* out, int threads) {
  draw_rows<uint16_t, bf16_to_float>(logits, rows, vocab, stride, top, top_ids, temperature,
                                     keys, g_max, u_max, out, threads);
}

void llmdb_gumbel_argmax_f32(const float* logits, int64_t rows, int64_t vocab, int64_t stride,
                             const float* top, const int64_t* top_ids, const float* temperature,
                             const int64_t* keys, float g_max, float u_max, int64_t* out,
                             int threads) {
  draw_rows<float, load_f32>(logits, rows, vocab, stride, top, top_ids, temperature, keys,
                             g_max, u_max, out, threads);
}

}  // extern "C"
