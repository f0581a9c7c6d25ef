// Decode attention on CPU: one query per row over a KV cache in the decode layout, read in place.
// GrpaxDecodeAttentionUpdate first writes the step's new key and value of each row at slot positions[b] (the
// cache is updated in place: its buffers are the call's outputs aliased to its inputs), then attends.
//
// out[b, k, g, :] = softmax_s(q[b, k, g, :] . keys[b, k, :, s]) @ values[b, k, s, :] over slots
// s = 0 .. positions[b] (inclusive), the same as grpax.models.llama.cached_attention with T == 1.
// Keys are [B, K, H, S] (slot minor) and values [B, K, S, H]; the queries come pre-scaled by 1/sqrt(H).
// Only the filled slots are read, once each, and the (b, k) blocks are shared out over XLA's intra-op
// thread pool: the cost is the bytes of the filled cache, not XLA's reductions over every slot.
//
// Built at first use by grpax.backends.cpu.build (g++ -O3 -march=native) and called through the XLA FFI.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace grpax;

constexpr int kMaxGroup = 8;  // query heads per kv head handled in registers

constexpr int kV = 4;  // vectors per register block: 4 x kLanes slots of scores, or of a value row

// Prefetches the bytes [p, p + bytes) (whole cache lines).
inline void prefetch_bytes(const void* p, int64_t bytes) {
  for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(static_cast<const char*>(p) + c);
}

// kV vectors from `count` <= kV * kLanes values at p (zero past them).
template <typename T>
inline void load_block(const T* p, int64_t count, vec* out) {
  if (count == kV * kLanes) {
    for (int j = 0; j < kV; ++j) out[j] = loadv(p + j * kLanes);
  } else {
    float tmp[kV * kLanes] = {0};
    for (int64_t i = 0; i < count; ++i) tmp[i] = to_float(p[i]);
    for (int j = 0; j < kV; ++j) out[j] = loadv(tmp + j * kLanes);
  }
}

// One (b, k) block: G queries [G, H] over n filled slots of keys [H, S] and values [S, H].
template <typename T>
void attend_block(const float* q, const T* keys, const T* values, float* out, int64_t G, int64_t H,
                  int64_t S, int64_t n, std::vector<float>& scores, const T* next_keys, int64_t next_n) {
  constexpr int64_t kSlots = kV * kLanes;  // slots per block of scores
  const int64_t n_pad = (n + kSlots - 1) / kSlots * kSlots;
  scores.assign(G * n_pad, 0.0f);
  // Scores: blocks of kSlots slots (kV vectors) x G queries accumulated in registers; each key row is read
  // once for all G queries, whole cache lines at a time.
  for (int64_t s0 = 0; s0 < n_pad; s0 += kSlots) {
    const int64_t width = std::min<int64_t>(kSlots, n - s0);
    vec acc[kMaxGroup][kV];
    for (int64_t g = 0; g < G; ++g)
      for (int64_t j = 0; j < kV; ++j) acc[g][j] = vec{};
    for (int64_t h = 0; h < H; ++h) {
      const T* row = keys + h * S + s0;
      // The H key rows are H strided streams, more than the hardware prefetcher follows: fetch each row's
      // next block while this one is summed.
      if (s0 + kSlots < n) prefetch_bytes(row + kSlots, std::min<int64_t>(kSlots, n - s0 - kSlots) * sizeof(T));
      vec kv[kV];
      load_block(row, width, kv);
      for (int64_t g = 0; g < G; ++g) {
        const vec qg = splatv(q[g * H + h]);
        for (int64_t j = 0; j < kV; ++j) acc[g][j] += qg * kv[j];
      }
    }
    for (int64_t g = 0; g < G; ++g)
      for (int64_t j = 0; j < kV; ++j) storev(&scores[g * n_pad + s0 + j * kLanes], acc[g][j]);
  }
  // Softmax over the n filled slots of each query.
  float inv_sum[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) {
    float* sc = &scores[g * n_pad];
    float m = sc[0];
    for (int64_t s = 1; s < n; ++s) m = std::max(m, sc[s]);
    vec total = vec{};
    for (int64_t s0 = 0; s0 < n; s0 += kLanes) {  // the last vector's lanes past n are zeroed
      vec e = exp_nonpositive(loadv(sc + s0) - m);
      if (s0 + kLanes > n) {
        for (int64_t i = n - s0; i < kLanes; ++i) e[i] = 0.0f;
      }
      storev(sc + s0, e);
      total += e;
    }
    float sum = 0.0f;
    for (int i = 0; i < kLanes; ++i) sum += total[i];
    inv_sum[g] = 1.0f / sum;
  }
  // Weighted sum of values, H in chunks of kV vectors (G x kV accumulators stay in registers).
  for (int64_t h0 = 0; h0 < H; h0 += kSlots) {
    const int64_t hw = std::min<int64_t>(kSlots, H - h0);
    vec acc[kMaxGroup][kV];
    for (int64_t g = 0; g < G; ++g)
      for (int64_t j = 0; j < kV; ++j) acc[g][j] = vec{};
    for (int64_t s = 0; s < n; ++s) {
      const T* row = values + s * H + h0;
      if (s + 8 < n) prefetch_bytes(row + 8 * H, hw * sizeof(T));
      // The next block's first key block (its H rows start H strided streams) while this one is summed.
      if (next_keys != nullptr && h0 == 0 && s < H)
        prefetch_bytes(next_keys + s * S, std::min<int64_t>(kSlots, next_n) * sizeof(T));
      vec vv[kV];
      load_block(row, hw, vv);
      for (int64_t g = 0; g < G; ++g) {
        const vec p = splatv(scores[g * n_pad + s]);
        for (int64_t j = 0; j < kV; ++j) acc[g][j] += p * vv[j];
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float tmp[kSlots];
      for (int64_t j = 0; j < kV; ++j) storev(tmp + j * kLanes, acc[g][j] * inv_sum[g]);
      std::memcpy(out + g * H + h0, tmp, hw * sizeof(float));
    }
  }
}

// Attends (and with new_keys/new_values first writes them at slot positions[b] of keys/values, in place:
// the cache buffers are the call's outputs, aliased to its inputs).
template <typename T>
ffi::Error decode_attention_impl(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& q, ffi::AnyBuffer* new_keys,
                                 ffi::AnyBuffer* new_values, ffi::AnyBuffer& keys, ffi::AnyBuffer& values,
                                 ffi::Buffer<ffi::S32>& positions, float* op, T* keys_out, T* values_out) {
  auto qd = q.dimensions();  // [B, K, G, H]
  auto kd = keys.dimensions();  // [B, K, H, S]
  if (qd.size() != 4 || kd.size() != 4) return ffi::Error::InvalidArgument("decode_attention: rank 4 expected");
  const int64_t B = qd[0], K = qd[1], G = qd[2], H = qd[3], S = kd[3];
  if (kd[0] != B || kd[1] != K || kd[2] != H || G > kMaxGroup)
    return ffi::Error::InvalidArgument("decode_attention: keys must be [B, K, H, S] with G <= 8");
  const float* qp = q.typed_data();
  const int32_t* pos = positions.typed_data();
  const T* kp = reinterpret_cast<const T*>(keys.untyped_data());
  const T* vp = reinterpret_cast<const T*>(values.untyped_data());
  const T* nk = nullptr;
  const T* nv = nullptr;
  if (new_keys != nullptr) {
    const size_t count = static_cast<size_t>(B * K * H);
    if (new_keys->element_count() != count || new_values->element_count() != count ||
        new_keys->element_type() != keys.element_type() || new_values->element_type() != keys.element_type())
      return ffi::Error::InvalidArgument("decode_attention: new keys/values must be [B, K, H] in the cache dtype");
    nk = reinterpret_cast<const T*>(new_keys->untyped_data());
    nv = reinterpret_cast<const T*>(new_values->untyped_data());
    // The outputs alias the inputs (input_output_aliases); should XLA ever give fresh buffers, fill them.
    if (keys_out != kp) std::memcpy(keys_out, kp, B * K * H * S * sizeof(T));
    if (values_out != vp) std::memcpy(values_out, vp, B * K * S * H * sizeof(T));
    kp = keys_out;
    vp = values_out;
  }

  // Items are runs of consecutive (b, k) blocks, so a thread knows the block it attends next.
  const int64_t blocks = B * K;
  const int64_t run = std::max<int64_t>(1, blocks / (4 * std::max<int64_t>(1, pool.num_threads())));
  auto filled = [&](int64_t i) { return std::clamp<int64_t>(static_cast<int64_t>(pos[i / K]) + 1, 1, S); };
  parallel_for(pool, (blocks + run - 1) / run, [&](int64_t item) {
    thread_local std::vector<float> scores;
    const int64_t end = std::min(blocks, (item + 1) * run);
    for (int64_t i = item * run; i < end; ++i) {
      const int64_t b = i / K;
      if (nk != nullptr && pos[b] >= 0 && pos[b] < S) {  // a slot past the cache is dropped, as XLA's scatter
        T* key_rows = keys_out + i * H * S;
        for (int64_t h = 0; h < H; ++h) key_rows[h * S + pos[b]] = nk[i * H + h];
        std::memcpy(values_out + (i * S + pos[b]) * H, nv + i * H, H * sizeof(T));
      }
      const bool more = i + 1 < end;
      attend_block<T>(qp + i * G * H, kp + i * H * S, vp + i * S * H, op + i * G * H, G, H, S, filled(i), scores,
                      more ? kp + (i + 1) * H * S : nullptr, more ? filled(i + 1) : 0);
    }
  });
  return ffi::Error::Success();
}

// Calls run(T{}) with T the cache's element type: float (float32) or uint16_t (bfloat16 bits).
template <typename Run>
ffi::Error by_cache_type(const ffi::AnyBuffer& keys, const ffi::AnyBuffer& values, Run run) {
  if (keys.element_type() != values.element_type())
    return ffi::Error::InvalidArgument("decode_attention: keys and values must share a dtype");
  switch (keys.element_type()) {
    case ffi::DataType::F32:
      return run(float{});
    case ffi::DataType::BF16:
      return run(uint16_t{});
    default:
      return ffi::Error::InvalidArgument("decode_attention: cache dtype must be float32 or bfloat16");
  }
}

ffi::Error decode_attention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer keys,
                            ffi::AnyBuffer values, ffi::Buffer<ffi::S32> positions,
                            ffi::ResultBuffer<ffi::F32> out) {
  return by_cache_type(keys, values, [&](auto zero) {
    using T = decltype(zero);
    return decode_attention_impl<T>(pool, q, nullptr, nullptr, keys, values, positions, out->typed_data(),
                                    nullptr, nullptr);
  });
}

ffi::Error decode_attention_update(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer new_keys,
                                   ffi::AnyBuffer new_values, ffi::AnyBuffer keys, ffi::AnyBuffer values,
                                   ffi::Buffer<ffi::S32> positions, ffi::ResultBuffer<ffi::F32> out,
                                   ffi::Result<ffi::AnyBuffer> keys_out, ffi::Result<ffi::AnyBuffer> values_out) {
  return by_cache_type(keys, values, [&](auto zero) {
    using T = decltype(zero);
    return decode_attention_impl<T>(pool, q, &new_keys, &new_values, keys, values, positions, out->typed_data(),
                                    static_cast<T*>(keys_out->untyped_data()),
                                    static_cast<T*>(values_out->untyped_data()));
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GrpaxDecodeAttention, decode_attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(GrpaxDecodeAttentionUpdate, decode_attention_update,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
