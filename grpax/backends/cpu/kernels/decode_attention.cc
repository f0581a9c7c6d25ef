// Decode attention on CPU: one query per sequence over a paged KV cache, read in place.
// GrpaxPagedAttentionUpdate first writes the step's new key and value of each sequence at its position (the page
// pools are updated in place: their buffers are the call's outputs aliased to its inputs), then attends.
//
// out[b, k, g, :] = softmax_s(q[b, k, g, :] . key_s) @ value_s over positions s = 0 .. positions[b] (inclusive) of
// sequence b, the same as grpax.models.attention.paged_attention. Position s of b lives in page
// page_table[b, s / page_size] at offset s % page_size; a page holds keys [K, H, page_size] (slot minor) and values
// [K, page_size, H]. The queries come pre-scaled by 1/sqrt(H). Only the filled slots are read, once each, and the
// (b, k) blocks are shared out over XLA's intra-op thread pool: the cost is the bytes of the filled pages. A
// sequence with position < 0 (an idle slot) writes and reads nothing; its output is zeros.
//
// The scores, the softmax and the weighted sum run in the order of a dense cache of the same slots (one score per
// slot summed over H in order, the softmax over a contiguous row of scores, the values summed slot by slot), so
// the result does not depend on the page size or on where the pages lie.
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

// One (b, k) block: G queries [G, H] over n filled slots in pages of ps slots, keys[p] -> [H, ps] and values[p] ->
// [ps, H] the block's part of page p of the sequence.
template <typename T>
void attend_block(const float* q, const T* const* keys, const T* const* values, int64_t ps, float* out, int64_t G,
                  int64_t H, int64_t n, std::vector<float>& scores, const T* next_keys, int64_t next_n) {
  constexpr int64_t kSlots = kV * kLanes;  // slots per block of scores
  // Rows of kSlots-rounded scores plus one block: a page's last block may end mid-block (its zeros are
  // overwritten by the next page's scores).
  const int64_t stride = (n + kSlots - 1) / kSlots * kSlots + kSlots;
  scores.assign(G * stride, 0.0f);
  // Scores: per page, blocks of kSlots slots (kV vectors) x G queries accumulated in registers; each key row is
  // read once for all G queries, whole cache lines at a time.
  for (int64_t p0 = 0; p0 < n; p0 += ps) {
    const T* page = keys[p0 / ps];
    const int64_t fill = std::min(ps, n - p0);
    for (int64_t o = 0; o < fill; o += kSlots) {
      const int64_t width = std::min<int64_t>(kSlots, fill - o);
      vec acc[kMaxGroup][kV];
      for (int64_t g = 0; g < G; ++g)
        for (int64_t j = 0; j < kV; ++j) acc[g][j] = vec{};
      for (int64_t h = 0; h < H; ++h) {
        const T* row = page + h * ps + o;
        // The H key rows are H strided streams, more than the hardware prefetcher follows: fetch each row's
        // next block while this one is summed.
        if (o + kSlots < fill) prefetch_bytes(row + kSlots, std::min<int64_t>(kSlots, fill - o - kSlots) * sizeof(T));
        vec kv[kV];
        load_block(row, width, kv);
        for (int64_t g = 0; g < G; ++g) {
          const vec qg = splatv(q[g * H + h]);
          for (int64_t j = 0; j < kV; ++j) acc[g][j] += qg * kv[j];
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t j = 0; j < kV; ++j) storev(&scores[g * stride + p0 + o + j * kLanes], acc[g][j]);
    }
  }
  // Softmax over the n filled slots of each query.
  float inv_sum[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) {
    float* sc = &scores[g * stride];
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
      const T* row = values[s / ps] + (s % ps) * H + h0;
      if (s + 8 < n) prefetch_bytes(values[(s + 8) / ps] + ((s + 8) % ps) * H + h0, hw * sizeof(T));
      // The next block's first key block (its H rows start H strided streams) while this one is summed.
      if (next_keys != nullptr && h0 == 0 && s < H)
        prefetch_bytes(next_keys + s * ps, std::min<int64_t>({kSlots, next_n, ps}) * sizeof(T));
      vec vv[kV];
      load_block(row, hw, vv);
      for (int64_t g = 0; g < G; ++g) {
        const vec p = splatv(scores[g * stride + s]);
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

// Writes new_keys/new_values at each sequence's position in its pages (in place: the pools are the call's outputs,
// aliased to its inputs), then attends.
template <typename T>
ffi::Error paged_attention_impl(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& q, ffi::AnyBuffer& new_keys,
                                ffi::AnyBuffer& new_values, ffi::AnyBuffer& keys, ffi::AnyBuffer& values,
                                ffi::Buffer<ffi::S32>& page_table, ffi::Buffer<ffi::S32>& positions, float* op,
                                T* keys_out, T* values_out) {
  auto qd = q.dimensions();  // [B, K, G, H]
  auto kd = keys.dimensions();  // [P, K, H, ps]
  auto td = page_table.dimensions();  // [B, W]
  if (qd.size() != 4 || kd.size() != 4 || td.size() != 2)
    return ffi::Error::InvalidArgument("paged_attention: q, pages rank 4 and page_table rank 2 expected");
  const int64_t B = qd[0], K = qd[1], G = qd[2], H = qd[3], P = kd[0], ps = kd[3], W = td[1];
  if (kd[1] != K || kd[2] != H || td[0] != B || G > kMaxGroup)
    return ffi::Error::InvalidArgument("paged_attention: pages must be [P, K, H, ps], page_table [B, W], G <= 8");
  const size_t count = static_cast<size_t>(B * K * H);
  if (new_keys.element_count() != count || new_values.element_count() != count ||
      new_keys.element_type() != keys.element_type() || new_values.element_type() != keys.element_type())
    return ffi::Error::InvalidArgument("paged_attention: new keys/values must be [B, K, H] in the pages' dtype");
  const float* qp = q.typed_data();
  const int32_t* pos = positions.typed_data();
  const int32_t* table = page_table.typed_data();
  const T* nk = reinterpret_cast<const T*>(new_keys.untyped_data());
  const T* nv = reinterpret_cast<const T*>(new_values.untyped_data());
  const T* kp = reinterpret_cast<const T*>(keys.untyped_data());
  const T* vp = reinterpret_cast<const T*>(values.untyped_data());
  // The outputs alias the inputs (input_output_aliases); should XLA ever give fresh buffers, fill them.
  if (keys_out != kp) std::memcpy(keys_out, kp, P * K * H * ps * sizeof(T));
  if (values_out != vp) std::memcpy(values_out, vp, P * K * ps * H * sizeof(T));
  for (int64_t b = 0; b < B; ++b) {
    if (pos[b] >= W * ps) return ffi::Error::InvalidArgument("paged_attention: a position past its page table");
    for (int64_t w = 0; w <= std::max<int64_t>(pos[b], 0) / ps; ++w)
      if (pos[b] >= 0 && (table[b * W + w] < 0 || table[b * W + w] >= P))
        return ffi::Error::InvalidArgument("paged_attention: a page index outside the pool");
  }
  // Items are runs of consecutive (b, k) blocks, so a thread knows the block it attends next.
  const int64_t blocks = B * K;
  const int64_t run = std::max<int64_t>(1, blocks / (4 * std::max<int64_t>(1, pool.num_threads())));
  auto key_page = [&](int64_t b, int64_t k, int64_t w) { return keys_out + (table[b * W + w] * K + k) * H * ps; };
  parallel_for(pool, (blocks + run - 1) / run, [&](int64_t item) {
    thread_local std::vector<float> scores;
    thread_local std::vector<const T*> key_pages, value_pages;
    const int64_t end = std::min(blocks, (item + 1) * run);
    for (int64_t i = item * run; i < end; ++i) {
      const int64_t b = i / K, k = i % K;
      if (pos[b] < 0) {  // an idle slot
        std::memset(op + i * G * H, 0, G * H * sizeof(float));
        continue;
      }
      const int64_t n = pos[b] + 1, num = (n + ps - 1) / ps;
      T* page = keys_out + (table[b * W + pos[b] / ps] * K + k) * H * ps;
      for (int64_t h = 0; h < H; ++h) page[h * ps + pos[b] % ps] = nk[i * H + h];
      std::memcpy(values_out + ((table[b * W + pos[b] / ps] * K + k) * ps + pos[b] % ps) * H, nv + i * H,
                  H * sizeof(T));
      key_pages.resize(num);
      value_pages.resize(num);
      for (int64_t w = 0; w < num; ++w) {
        key_pages[w] = key_page(b, k, w);
        value_pages[w] = values_out + (table[b * W + w] * K + k) * ps * H;
      }
      const bool more = i + 1 < end && pos[(i + 1) / K] >= 0;
      attend_block<T>(qp + i * G * H, key_pages.data(), value_pages.data(), ps, op + i * G * H, G, H, n, scores,
                      more ? key_page((i + 1) / K, (i + 1) % K, 0) : nullptr, more ? pos[(i + 1) / K] + 1 : 0);
    }
  });
  return ffi::Error::Success();
}

// Calls run(T{}) with T the cache's element type: float (float32) or uint16_t (bfloat16 bits).
template <typename Run>
ffi::Error by_cache_type(const ffi::AnyBuffer& keys, const ffi::AnyBuffer& values, Run run) {
  if (keys.element_type() != values.element_type())
    return ffi::Error::InvalidArgument("paged_attention: keys and values must share a dtype");
  switch (keys.element_type()) {
    case ffi::DataType::F32:
      return run(float{});
    case ffi::DataType::BF16:
      return run(uint16_t{});
    default:
      return ffi::Error::InvalidArgument("paged_attention: cache dtype must be float32 or bfloat16");
  }
}

ffi::Error paged_attention_update(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer new_keys,
                                  ffi::AnyBuffer new_values, ffi::AnyBuffer keys, ffi::AnyBuffer values,
                                  ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> positions,
                                  ffi::ResultBuffer<ffi::F32> out, ffi::Result<ffi::AnyBuffer> keys_out,
                                  ffi::Result<ffi::AnyBuffer> values_out) {
  return by_cache_type(keys, values, [&](auto zero) {
    using T = decltype(zero);
    return paged_attention_impl<T>(pool, q, new_keys, new_values, keys, values, page_table, positions,
                                   out->typed_data(), static_cast<T*>(keys_out->untyped_data()),
                                   static_cast<T*>(values_out->untyped_data()));
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GrpaxPagedAttentionUpdate, paged_attention_update,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
