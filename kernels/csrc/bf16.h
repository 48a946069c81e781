// bf16 <-> fp32 for the C++ kernels: bf16 is the top half of an fp32's bits.
#pragma once
#include <cstdint>
#include <cstring>

inline float bf16_to_float(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits += 0x7FFF + ((bits >> 16) & 1);  // round to nearest even, as torch does
  return static_cast<uint16_t>(bits >> 16);
}

// An element of either dtype as fp32, and an fp32 result stored as the dtype (the kernels'
// templates over float and bf16 read and write through these).
inline float load(float x) { return x; }
inline float load(uint16_t x) { return bf16_to_float(x); }
inline void store(float x, float* out) { *out = x; }
inline void store(float x, uint16_t* out) { *out = float_to_bf16(x); }
