// SIMD helpers shared by the CPU kernels (GCC/Clang vector extensions: 16 floats per vector with AVX-512,
// else 8, which -march=native maps onto the machine's vector unit).
#pragma once
#include <cstdint>
#include <cstring>
#include <utility>

namespace grpax {

// The machine's widest float vector (16 lanes with AVX-512, else 8): the kernels' tiles scale with it.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vec __attribute__((vector_size(4 * kLanes)));
typedef int32_t veci __attribute__((vector_size(4 * kLanes)));
typedef uint16_t vech __attribute__((vector_size(2 * kLanes)));

template <int... I>
inline vec splat_lanes(float x, std::integer_sequence<int, I...>) {
  return vec{((void)I, x)...};
}
inline vec splatv(float x) { return splat_lanes(x, std::make_integer_sequence<int, kLanes>{}); }
inline vec loadv(const float* p) {
  vec r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}
inline vec loadv(const uint16_t* p) {  // kLanes bfloat16 widened to float32
  vech h;
  std::memcpy(&h, p, sizeof(h));
  veci bits = __builtin_convertvector(h, veci) << 16;
  vec r;
  std::memcpy(&r, &bits, sizeof(r));
  return r;
}
// kLanes pairs of bfloat16 (2 kLanes values, pairs in order) widened to float32: the first of each pair in
// `first`, the second in `second`.
inline void widen_pairs(const uint16_t* p, vec& first, vec& second) {
  veci bits;
  std::memcpy(&bits, p, sizeof(bits));
  const veci lo = bits << 16, hi = bits & static_cast<int32_t>(0xffff0000u);
  std::memcpy(&first, &lo, sizeof(first));
  std::memcpy(&second, &hi, sizeof(second));
}
inline void storev(float* p, vec x) { std::memcpy(p, &x, sizeof(x)); }

// float32 -> bfloat16 bits, rounded to nearest even as XLA converts (a NaN stays a quiet NaN of its sign).
inline uint16_t to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if (f != f) return static_cast<uint16_t>((bits >> 16) | 0x40);
  return static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

// bfloat16 rounding (to nearest even) of float32 values, kept as float32: one value, or each lane.
inline float round_bf16(float f) {
  uint32_t bits = static_cast<uint32_t>(to_bf16(f)) << 16;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline vec round_bf16(vec f) {
  veci bits;
  std::memcpy(&bits, &f, sizeof(bits));
  bits = (bits + 0x7fff + ((bits >> 16) & 1)) & static_cast<int32_t>(0xffff0000u);
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Calls f.template operator()<R>() for the R in 1..N equal to n: picks the register tile (a template on its row
// count) for the last rows of a block. Nothing is called for n outside 1..N.
template <int N, typename F>
inline void with_rows(int64_t n, F&& f) {
  [&]<int... I>(std::integer_sequence<int, I...>) {
    ((n == I + 1 ? f.template operator()<I + 1>() : void()), ...);
  }(std::make_integer_sequence<int, N>{});
}

inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {  // bfloat16 -> float32: the high half of the float's bits
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// exp(x) for x <= 0 (scores minus their max): 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], degree-6
// polynomial (Cephes expf coefficients), relative error ~1e-7; x below -87 gives 0. V: a float vector type (vec).
template <typename V>
inline V exp_nonpositive(V x) {
  typedef int32_t VI __attribute__((vector_size(sizeof(V))));
  const V lo = V{} - 87.0f;
  x = x < lo ? lo : x;
  V n = x * 1.44269504088896341f;
  // round to nearest: add and subtract 1.5 * 2^23
  n = (n + 12582912.0f) - 12582912.0f;
  V r = x - n * 0.693359375f + n * 2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  VI e = __builtin_convertvector(n, VI);
  e = (e + 127) << 23;
  V scale;
  std::memcpy(&scale, &e, sizeof(scale));
  V out = p * scale;
  return x <= lo ? V{} : out;
}

}  // namespace grpax
