// Categorical sampling on CPU from next-token logits, with each token's log-probability, in two passes over
// the vocabulary (grpax.sampler.sampling.sample_from_uniform without top-k / top-p, and token_logprobs).
//
// Per row b: x = logits[b] / temperature; a block of `block` tokens is drawn by its mass (inverse CDF at
// u[b, 0] over the blocks' sums of exp(x - max x)), then a token inside it (inverse CDF at u[b, 1]), so
// P(token) = exp(x_token - max) / sum; logprob = x_token - max - log(sum). XLA:CPU runs the same as ~6 passes
// over [B, V] (max, exp, block sums, logsumexp's max, exp and sum): 1.6 ms of every decode step at batch 16
// (V = 49152), 6.7 ms at batch 64. Rows are shared out over XLA's intra-op thread pool.
//
// Built at first use by grpax.models.cpu_kernels (g++ -O3 -march=native) and called through the XLA FFI.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace grpax;

// Inverse CDF over weights w[0..n-1] (>= 0) at u in [0, 1): the number of prefix sums <= u * total, clamped
// to the last index with weight (float rounding at u ~ 1 may step past it). Sums in order, as jnp.cumsum.
int64_t pick(const float* w, int64_t n, float u) {
  float total = 0.0f;
  int64_t last = 0;
  for (int64_t i = 0; i < n; ++i) {
    total += w[i];
    if (w[i] > 0.0f) last = i;
  }
  const float target = u * total;
  float cdf = 0.0f;
  int64_t index = 0;
  for (int64_t i = 0; i < n; ++i) {
    cdf += w[i];
    index += cdf <= target;
  }
  return std::min(index, last);
}

ffi::Error sample(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::F32> u, float temperature,
                  int64_t block, ffi::Result<ffi::Buffer<ffi::S32>> tokens,
                  ffi::Result<ffi::Buffer<ffi::F32>> logprobs) {
  auto ld = logits.dimensions();
  if (ld.size() != 2 || u.dimensions().size() != 2 || u.dimensions()[0] != ld[0] || u.dimensions()[1] != 2 ||
      block < 1 || block % kLanes)
    return ffi::Error::InvalidArgument("sample: logits must be [B, V], u [B, 2], block a multiple of the lanes");
  const int64_t B = ld[0], V = ld[1];
  const int64_t num_blocks = (V + block - 1) / block;
  const float inv_t = 1.0f / temperature;
  const float* lp = logits.typed_data();
  const float* up = u.typed_data();
  int32_t* tp = tokens->typed_data();
  float* op = logprobs->typed_data();
  parallel_for(pool, B, [&](int64_t b) {
    const float* x = lp + b * V;
    // x / temperature as x * (1 / temperature) (within an ulp of the division; exact at temperature 1);
    // exp(x / t - max) by the polynomial of simd.h (~1e-7 relative).
    auto scaled = [&](int64_t i) { return x[i] * inv_t; };
    float mx = -INFINITY;
    {
      vec vmax = splatv(-INFINITY);
      int64_t i = 0;
      for (; i + kLanes <= V; i += kLanes) {
        const vec s = loadv(x + i) * inv_t;
        vmax = s > vmax ? s : vmax;
      }
      for (int l = 0; l < kLanes; ++l) mx = std::max(mx, vmax[l]);
      for (; i < V; ++i) mx = std::max(mx, scaled(i));
    }
    thread_local std::vector<float> mass, inner;
    mass.assign(num_blocks, 0.0f);
    inner.resize(block);
    auto exps = [&](int64_t j, float* out) {  // exp(x / t - max) of block j into out[0..block) (zero past V)
      const int64_t start = j * block, n = std::min(block, V - start);
      int64_t i = 0;
      for (; i + kLanes <= n; i += kLanes) storev(out + i, exp_nonpositive(loadv(x + start + i) * inv_t - mx));
      for (; i < n; ++i) out[i] = exp_nonpositive(vec{} + (scaled(start + i) - mx))[0];
      for (; i < block; ++i) out[i] = 0.0f;
    };
    for (int64_t j = 0; j < num_blocks; ++j) {
      exps(j, inner.data());
      vec acc = vec{};
      for (int64_t i = 0; i < block; i += kLanes) acc += loadv(inner.data() + i);
      float s = 0.0f;
      for (int l = 0; l < kLanes; ++l) s += acc[l];
      mass[j] = s;
    }
    float total = 0.0f;
    for (int64_t j = 0; j < num_blocks; ++j) total += mass[j];
    const int64_t j = pick(mass.data(), num_blocks, up[2 * b]);
    exps(j, inner.data());
    const int64_t token = j * block + pick(inner.data(), block, up[2 * b + 1]);
    tp[b] = static_cast<int32_t>(token);
    op[b] = scaled(token) - mx - std::log(total);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GrpaxSample, sample,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("temperature")
                                  .Attr<int64_t>("block")
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
