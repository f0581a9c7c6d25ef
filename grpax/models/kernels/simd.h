// SIMD helpers shared by the CPU kernels (GCC/Clang vector extensions: 8 floats per vector, which
// -march=native maps onto AVX2/AVX-512 or the machine's own vector unit).
#pragma once
#include <cstdint>
#include <cstring>

namespace grpax {

constexpr int kW = 8;  // floats per vector
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

inline v8 splat(float x) { return v8{x, x, x, x, x, x, x, x}; }

inline v8 load(const float* p) {
  v8 r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}

inline void store(float* p, v8 x) { std::memcpy(p, &x, sizeof(x)); }

typedef uint16_t v8h __attribute__((vector_size(16)));

// 8 consecutive values as float32: float32 as they are, bfloat16 widened (the high halves of the floats).
inline v8 load8(const float* p) { return load(p); }
inline v8 load8(const uint16_t* p) {
  v8h h;
  std::memcpy(&h, p, sizeof(h));
  v8i bits = __builtin_convertvector(h, v8i) << 16;
  v8 r;
  std::memcpy(&r, &bits, sizeof(r));
  return r;
}

inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {  // bfloat16 -> float32: the high half of the float's bits
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// exp(x) for x <= 0 (scores minus their max): 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], degree-6
// polynomial (Cephes expf coefficients), relative error ~1e-7; x below -87 gives 0.
inline v8 exp_nonpositive(v8 x) {
  const v8 lo = splat(-87.0f);
  x = x < lo ? lo : x;
  v8 n = x * splat(1.44269504088896341f);
  // round to nearest: add and subtract 1.5 * 2^23
  const v8 magic = splat(12582912.0f);
  n = (n + magic) - magic;
  v8 r = x - n * splat(0.693359375f) + n * splat(2.12194440e-4f);
  v8 p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * r * r + r + splat(1.0f);
  v8i e = __builtin_convertvector(n, v8i);
  e = (e + 127) << 23;
  v8 scale;
  std::memcpy(&scale, &e, sizeof(scale));
  v8 out = p * scale;
  return x <= lo ? splat(0.0f) : out;
}

}  // namespace grpax
