// Prefill attention on CPU for packed prompts: several prompts back to back in one sequence, each token
// attending causally to the earlier tokens of its own prompt (grpax.backends.cpu.backend, the packed prefill).
//
// out[t, n, :] = softmax_j(scale q[t, n, :] . k[j, n / G, :]) @ v[j, n / G, :] over the tokens j of t's row
// with j <= t (rows[j] == rows[t]; the tokens of a row are contiguous). Tokens whose row is outside
// 0 .. num_rows - 1 (the packing's padding) get zeros and cost nothing. With `prefix` = A > 0 the first A
// tokens are a prefix shared by every row (a system prompt): they attend causally among themselves, and every
// later token also attends to all of them (its row continues the prefix). The head size H is a multiple of
// 64 (the caller zero-pads q, k and v; scale stays 1 / sqrt(true H)).
//
// XLA:CPU runs the jnp version as windows of keys gathered per query chunk, masks and generic reductions
// (about 1 s for the 30 layers of SmolLM2-135M over 1.5 k prompt tokens on 2 cores). Here each work item is
// one (row, kv head): its keys are laid out transposed once ([H, L]), then blocks of query rows (the G heads
// of consecutive tokens) get their scores from register tiles over the keys they may see, a softmax, and the
// product with the values (read in place) from register tiles too; nothing past a token's own position is
// computed beyond the tile's last token. Float32 throughout; with `probs_bf16` the normalised probabilities
// are rounded to bfloat16 before the product with the values, as the jnp version does in bfloat16.
//
// Built at first use by grpax.backends.cpu.build (g++ -O3 -march=native) and called through the XLA FFI.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace grpax;

// Score tiles: kScoreRows query rows x 2 vectors of keys (24 of AVX-512's 32 registers; 12 of AVX2's 16 with
// 6 rows). Value tiles: kValueRows query rows x kValueVectors vectors of a value row.
constexpr int kScoreRows = kLanes == 16 ? 12 : 6;
constexpr int kScoreVectors = 2;
constexpr int kKeyBlock = kScoreVectors * kLanes;
constexpr int kValueRows = kLanes == 16 ? 6 : 3;
constexpr int kValueVectors = 4;

// out[r, 0:NV kLanes] = sum_{s < n} a[r * a_row + s * a_step] * b[s * b_row ..] for RT rows: RT x NV
// accumulators, one load of b's row s for all RT rows. The scores are (qt, rows r at stride 1, h at stride R) x
// (kt, row h), the outputs (probs, rows at stride ld, keys at stride 1) x (values, row s).
template <int RT, int NV>
inline void rows_tile(const float* a, int64_t a_row, int64_t a_step, const float* b, int64_t b_row, int64_t n,
                      float* out, int64_t out_row) {
  vec acc[RT][NV];
  for (int r = 0; r < RT; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = vec{};
  for (int64_t s = 0; s < n; ++s) {
    vec bv[NV];
    for (int j = 0; j < NV; ++j) bv[j] = loadv(b + s * b_row + j * kLanes);
    for (int r = 0; r < RT; ++r) {
      const vec ar = splatv(a[r * a_row + s * a_step]);
      for (int j = 0; j < NV; ++j) acc[r][j] += ar * bv[j];
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int j = 0; j < NV; ++j) storev(out + r * out_row + j * kLanes, acc[r][j]);
}

struct Segment {
  int64_t start, length;
};

ffi::Error packed_attention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                            ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> rows, int64_t num_rows, int64_t prefix,
                            float scale, bool probs_bf16, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 3 || kd.size() != 3 || vd.size() != 3)
    return ffi::Error::InvalidArgument("packed_attention: q must be [T, N, H], k and v [T, K, H]");
  const int64_t T = qd[0], N = qd[1], H = qd[2], K = kd[1];
  if (kd[0] != T || vd[0] != T || vd[1] != K || kd[2] != H || vd[2] != H || K < 1 || N % K ||
      rows.element_count() != static_cast<size_t>(T))
    return ffi::Error::InvalidArgument("packed_attention: shapes of q [T, N, H], k, v [T, K, H], rows [T] differ");
  if (prefix < 0 || prefix > T)
    return ffi::Error::InvalidArgument("packed_attention: the shared prefix must be 0..T tokens");
  if (H % 64 != 0)  // whole value tiles (4 vectors: 64 floats with AVX-512, 32 with AVX2)
    return ffi::Error::InvalidArgument("packed_attention: the head size must be a multiple of 64 (zero padded)");
  const int64_t G = N / K;
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  const int32_t* rp = rows.typed_data();
  float* op = out->typed_data();

  // The shared prefix (tokens 0 .. prefix - 1, whatever their ids), then runs of equal row ids; padding runs
  // (ids outside 0 .. num_rows - 1) are zeroed and skipped.
  std::vector<Segment> segments;
  if (prefix > 0) segments.push_back({0, prefix});
  for (int64_t t = prefix; t < T;) {
    int64_t e = t + 1;
    while (e < T && rp[e] == rp[t]) ++e;
    if (rp[t] >= 0 && rp[t] < num_rows) {
      segments.push_back({t, e - t});
    } else {
      std::memset(op + t * N * H, 0, (e - t) * N * H * sizeof(float));
    }
    t = e;
  }
  // Items (segment, kv head), the longest segments first (work grows as length^2) so the last items are short.
  std::vector<int64_t> order(segments.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return segments[a].length > segments[b].length; });

  parallel_for(pool, static_cast<int64_t>(segments.size()) * K, [&](int64_t item) {
    const Segment seg = segments[order[item / K]];
    const int64_t kh = item % K, L = seg.length, R = L * G;  // query rows r = i G + g (token i, head g)
    // Keys j = 0 .. A + L - 1: the A shared-prefix tokens (for a row after the prefix), then the row's own.
    const int64_t A = seg.start >= prefix ? prefix : 0, AL = A + L;
    const int64_t Lp = (AL + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
    const int64_t Rp = (R + kScoreRows - 1) / kScoreRows * kScoreRows;
    thread_local std::vector<float> kt, qt, probs, vbuf;
    kt.assign(H * Lp, 0.0f);  // kt[h, j] = key j's element h
    qt.assign(H * Rp, 0.0f);  // qt[h, i G + g] = scale q[start + i, kh G + g, h]
    probs.resize(kScoreRows * Lp);
    auto key_token = [&](int64_t j) { return j < A ? j : seg.start + j - A; };  // packed index of key j
    for (int64_t j = 0; j < AL; ++j) {
      const float* key = kp + (key_token(j) * K + kh) * H;
      for (int64_t h = 0; h < H; ++h) kt[h * Lp + j] = key[h];
    }
    for (int64_t i = 0; i < L; ++i)
      for (int64_t g = 0; g < G; ++g) {
        const float* query = qp + ((seg.start + i) * N + kh * G + g) * H;
        for (int64_t h = 0; h < H; ++h) qt[h * Rp + i * G + g] = query[h] * scale;
      }
    // Value row j at values + j vstride: in place, or gathered when the prefix's rows come first.
    const float* values = vp + seg.start * K * H + kh * H;
    int64_t vstride = K * H;
    if (A > 0) {
      vbuf.resize(AL * H);
      for (int64_t j = 0; j < AL; ++j)
        std::memcpy(vbuf.data() + j * H, vp + (key_token(j) * K + kh) * H, H * sizeof(float));
      values = vbuf.data();
      vstride = H;
    }
    for (int64_t r0 = 0; r0 < R; r0 += kScoreRows) {
      const int64_t rows_here = std::min<int64_t>(kScoreRows, R - r0);
      const int64_t last_token = (r0 + rows_here - 1) / G;
      const int64_t seen = A + last_token + 1;  // keys any row of this block may attend to
      const int64_t seen_pad = (seen + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
      // Scores of the block (full tiles: the padding rows of qt are zero).
      for (int64_t c = 0; c < seen_pad; c += kKeyBlock)
        rows_tile<kScoreRows, kScoreVectors>(qt.data() + r0, 1, Rp, kt.data() + c, Lp, H, probs.data() + c, Lp);
      // Softmax of each row over its keys 0 .. i; zero past them (up to the block's `seen`).
      for (int64_t r = 0; r < rows_here; ++r) {
        float* p = probs.data() + r * Lp;
        const int64_t n = A + (r0 + r) / G + 1;
        int64_t j = 0;
        vec vmax = splatv(p[0]);
        for (; j + kLanes <= n; j += kLanes) {
          const vec x = loadv(p + j);
          vmax = x > vmax ? x : vmax;
        }
        float mx = p[0];
        for (int l = 0; l < kLanes; ++l) mx = std::max(mx, vmax[l]);
        for (; j < n; ++j) mx = std::max(mx, p[j]);
        vec vsum = vec{};
        for (j = 0; j + kLanes <= n; j += kLanes) {
          const vec e = exp_nonpositive(loadv(p + j) - mx);
          storev(p + j, e);
          vsum += e;
        }
        float sum = 0.0f;
        for (int l = 0; l < kLanes; ++l) sum += vsum[l];
        for (; j < n; ++j) {
          const float e = exp_nonpositive(vec{} + (p[j] - mx))[0];
          p[j] = e;
          sum += e;
        }
        const float inv = 1.0f / sum;
        for (j = 0; j + kLanes <= n; j += kLanes) {
          const vec x = loadv(p + j) * inv;
          storev(p + j, probs_bf16 ? round_bf16(x) : x);
        }
        for (; j < n; ++j) p[j] = probs_bf16 ? round_bf16(p[j] * inv) : p[j] * inv;
        for (; j < seen; ++j) p[j] = 0.0f;
      }
      // Outputs: probs [rows_here, seen] @ values [seen, H], kValueVectors vectors of H at a time.
      for (int64_t r1 = 0; r1 < rows_here; r1 += kValueRows) {
        const int64_t n_rows = std::min<int64_t>(kValueRows, rows_here - r1);
        for (int64_t h0 = 0; h0 < H; h0 += kValueVectors * kLanes) {
          float tmp[kValueRows * kValueVectors * kLanes];
          with_rows<kValueRows>(n_rows, [&]<int RT>() {
            rows_tile<RT, kValueVectors>(probs.data() + r1 * Lp, Lp, 1, values + h0, vstride, seen, tmp,
                                         kValueVectors * kLanes);
          });
          for (int64_t r = 0; r < n_rows; ++r) {
            const int64_t row = r0 + r1 + r, i = row / G, g = row % G;
            std::memcpy(op + ((seg.start + i) * N + kh * G + g) * H + h0, tmp + r * kValueVectors * kLanes,
                        kValueVectors * kLanes * sizeof(float));
          }
        }
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GrpaxPackedAttention, packed_attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("num_rows")
                                  .Attr<int64_t>("prefix")
                                  .Attr<float>("scale")
                                  .Attr<bool>("probs_bf16")
                                  .Ret<ffi::Buffer<ffi::F32>>());
