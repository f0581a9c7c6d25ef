// Small-batch matmul on CPU for the decode step: y[M, N] = x[M, K] @ W with W packed in column panels.
//
// A decode step multiplies a few rows (M = batch) by every weight matrix, so its cost is streaming the
// weights from memory, not arithmetic. W comes packed as [P, K, 16] (P = ceil(N / 16) panels of 16 columns,
// zero padded; grpax.models.cpu_kernels.pack): each panel is one contiguous run of memory, read once
// per call and shared out over XLA's intra-op thread pool. Register tiles of up to 12 rows x 2 panels with
// AVX-512 (24 of its 32 vector registers), else 6 rows x 1 panel (12 of AVX2's 16, the BLIS-style tile), run
// over K while the panels' next rows are prefetched; x is read from its transpose, so the broadcasts of one k
// are one run of memory. Float32 or bfloat16 weights (widened to float32 in registers: bf16 halves the bytes
// read); x, y and the accumulation are float32.
//
// Options for the decode layer: the pre-norm (RMSNorm) applied to x as it is transposed; x given already
// transposed; y written transposed (the SwiGLU output feeds the down projection that way).
//
// With `swiglu` the panels of two matrices come interleaved (gate panel p at 2p, up panel p at 2p + 1) and
// y = silu(x @ W_gate) * (x @ W_up): the MLP's gate, up and activation in one pass (Llama's SwiGLU).
//
// Built at first use by grpax.models.cpu_kernels (g++ -O3 -march=native) and called through the XLA FFI.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace grpax;

constexpr int kPanel = 16;  // columns per panel
constexpr int kAhead = 96;  // panel rows prefetched ahead (6 KB of float32 weights; 32 streamed ~4% slower at B16)
// Register tiles: rows x panels of float32 accumulators, two vectors a row. With AVX-512 (16 lanes) a tile is
// 12 rows x 2 panels (24 of the 32 vector registers), so each weight load feeds 12 FMAs and each broadcast
// 2; with 8 lanes it is 6 rows x 1 panel (12 of 16 registers, the BLIS-style AVX2 tile).
constexpr int kVectorsPerPanel = kPanel / kLanes;
constexpr int kBlockPanels = 2 / kVectorsPerPanel;  // panels in one tile
constexpr int kRows = kLanes == 16 ? 12 : 6;

// out[r, 0:16 NP] = x[r, :] @ [NP panels] for MR rows of x, given transposed: x[r, k] at xt[k * M + r];
// panel j is panel + j * K * 16.
// One cache line a row (64 bytes: a float32 panel row, two bfloat16 rows) of each panel of `fetch` is
// prefetched per panel row.
template <typename T, int MR, int NP>
inline void tile(const float* xt, int64_t M, const T* panel, int64_t K, float* out, const T* fetch,
                 int64_t ld = NP * kPanel) {
  constexpr int NV = NP * kVectorsPerPanel;
  vec acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = vec{};
  for (int64_t k = 0; k < K; ++k) {
    vec w[NV];
    for (int j = 0; j < NV; ++j) {
      const int64_t offset = (j / kVectorsPerPanel) * K * kPanel + k * kPanel + (j % kVectorsPerPanel) * kLanes;
      w[j] = loadv(panel + offset);
      if (fetch != nullptr && j % kVectorsPerPanel == 0) __builtin_prefetch(fetch + offset);
    }
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const vec xr = splatv(xt[k * M + r]);
      for (int j = 0; j < NV; ++j) acc[r][j] += xr * w[j];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NV; ++j) storev(out + r * ld + j * kLanes, acc[r][j]);
}

// out[M, 16 NP] = x[M, K] @ [NP panels] (x transposed, xt [K, M]). The first tile reads the panels from memory
// (prefetching their own rows ahead); the second prefetches `next` (the panels this thread multiplies next, or
// null) while it computes from cache, so that memory keeps streaming during the compute-only tiles.
template <typename T, int NP>
void panel_product(const float* xt, int64_t M, const T* panel, const T* next, int64_t K, float* out) {
  int64_t m = 0, t = 0;
  auto fetch = [&](int64_t tile_index) -> const T* {
    if (tile_index == 0) return panel + kAhead * kPanel;
    return tile_index == 1 ? next : nullptr;
  };
  constexpr int64_t stride = NP * kPanel;
  for (; m + kRows <= M; m += kRows, ++t) tile<T, kRows, NP>(xt + m, M, panel, K, out + m * stride, fetch(t));
  const int64_t rest = M - m;
  if (rest == 0) return;
  with_rows<kRows - 1>(rest, [&]<int R>() { tile<T, R, NP>(xt + m, M, panel, K, out + m * stride, fetch(t)); });
}

// With 16 lanes and M <= 16 rows: out[M, 16 NP] = x @ [NP panels], one M-row tile per panel (M accumulators),
// so each panel streams from memory once with no second tile re-reading it (batch 16, 30 layers + head: ~1-2
// ms of ~32 less for float32, 2-3 ms of ~30 for bfloat16). Returns false (nothing done) otherwise.
template <typename T>
bool few_rows_product(const float* xt, int64_t M, const T* panels, int64_t NP, int64_t K, float* out) {
  if constexpr (kLanes != 16) {
    return false;
  } else {
    if (M > 16) return false;
    for (int64_t j = 0; j < NP; ++j) {
      const T* panel = panels + j * K * kPanel;
      with_rows<16>(M, [&]<int R>() {
        tile<T, R, 1>(xt, M, panel, K, out + j * kPanel, panel + kAhead * kPanel, NP * kPanel);
      });
    }
    return true;
  }
}

// silu(g) * u = g * sigmoid(g) * u, sigmoid from e = exp(-|g|) <= 1: 1 / (1 + e) for g >= 0, else e / (1 + e).
inline vec swiglu(vec g, vec u) {
  const vec zero = vec{};
  const vec e = exp_nonpositive(g < zero ? g : -g);
  const vec s = (g < zero ? e : zero + 1.0f) / (1.0f + e);
  return g * s * u;
}

struct Norm {  // RMSNorm of x's rows before the product (Llama's pre-norm), as grpax.models.llama.rms_norm
  bool on = false;
  const float* weight = nullptr;  // [K]
  float eps = 0.0f;
  bool bf16 = false;  // the model's dtype is bfloat16: round the normed row and the product as XLA does
};

template <typename T>
ffi::Error matmul_impl(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::AnyBuffer& w, int64_t N,
                       bool gated, bool x_transposed, bool transpose_out, const Norm& norm,
                       ffi::Result<ffi::Buffer<ffi::F32>>& y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != kPanel)
    return ffi::Error::InvalidArgument("matmul: x must be [M, K] ([K, M] transposed) and the weights [P, K, 16]");
  const int64_t M = x_transposed ? xd[1] : xd[0], K = x_transposed ? xd[0] : xd[1], P = wd[0];
  const int64_t panels = gated ? P / 2 : P;  // output panels
  if (wd[1] != K || (gated && P % 2) || N > panels * kPanel || N <= (panels - 1) * kPanel)
    return ffi::Error::InvalidArgument("matmul: packed weights do not match x [M, K] and n");
  auto yd = y->dimensions();
  if (yd.size() != 2 || yd[0] != (transpose_out ? N : M) || yd[1] != (transpose_out ? M : N))
    return ffi::Error::InvalidArgument("matmul: the output must be [M, n] ([n, M] transposed)");
  // Tiles broadcast x[r, k] from its transpose, so that the rows of one k are one run: xt[k * M + r]. Blocks
  // of 64 k keep the 64 output lines in L1 while the rows advance (3x the naive loop order).
  const float* xt = x.typed_data();
  thread_local std::vector<float> xt_buf;
  if (!x_transposed) {
    xt_buf.resize(M * K);
    float* t = xt_buf.data();
    const float* xp = x.typed_data();
    thread_local std::vector<float> scale;  // per row: 1 / sqrt(mean_k x[m, k]^2 + eps) with the norm
    scale.assign(M, 1.0f);
    if (norm.on) {
      for (int64_t m = 0; m < M; ++m) {
        float ss = 0.0f;
        for (int64_t k = 0; k < K; ++k) ss += xp[m * K + k] * xp[m * K + k];
        scale[m] = 1.0f / std::sqrt(ss / static_cast<float>(K) + norm.eps);
      }
    }
    for (int64_t k0 = 0; k0 < K; k0 += 64) {  // t[k, m] = x[m, k], or w[k] * x[m, k] * scale[m] with the norm
      const int64_t k1 = std::min<int64_t>(K, k0 + 64);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t k = k0; k < k1; ++k) {
          const float normed = xp[m * K + k] * scale[m];
          t[k * M + m] = !norm.on   ? normed
                         : norm.bf16 ? round_bf16(norm.weight[k] * round_bf16(normed))
                                     : norm.weight[k] * normed;
        }
    }
    xt = t;
  }
  const T* wp = reinterpret_cast<const T*>(w.untyped_data());
  float* yp = y->typed_data();
  // A block is the output panels one tile covers: kBlockPanels of them, or one with `gated` (its gate and up
  // input panels). Items are runs of consecutive blocks, so a thread knows the panels it multiplies next. With
  // <= 16 rows (streaming-bound) each thread takes one contiguous run, which its prefetches follow without a
  // cold start per item (30 layers + head at B16, alternating: 28.5-34.1 against 30.3-34.8 ms with 8 runs a
  // thread); more rows keep 8 runs a thread to balance the compute.
  const int64_t per_block = gated ? 1 : kBlockPanels;  // output panels per block
  const int64_t blocks = (panels + per_block - 1) / per_block;
  const int64_t runs_per_thread = M <= 16 ? 1 : 8;
  const int64_t run = std::max<int64_t>(1, blocks / (runs_per_thread * std::max<int64_t>(1, pool.num_threads())));
  const int64_t in_per_out = gated ? 2 : 1;  // input panels per output panel
  parallel_for(pool, (blocks + run - 1) / run, [&](int64_t item) {
    thread_local std::vector<float> buf;
    buf.resize(2 * M * kPanel);
    float* a = buf.data();
    const int64_t end = std::min(blocks, (item + 1) * run);
    for (int64_t blk = item * run; blk < end; ++blk) {
      const int64_t p0 = blk * per_block;  // first output panel
      const int64_t count = std::min(per_block, panels - p0);
      const int64_t in_panels = count * in_per_out;
      const T* first = wp + in_per_out * p0 * K * kPanel;
      const T* after_last = blk + 1 < end ? first + in_panels * K * kPanel : nullptr;
      // a = x @ the block's input panels: [M, 16 in_panels].
      if (in_panels == kBlockPanels) {
        if (!few_rows_product<T>(xt, M, first, in_panels, K, a))
          panel_product<T, kBlockPanels>(xt, M, first, after_last, K, a);
      } else {  // one panel (the last block with AVX-512) or, with 8 lanes, a gated pair taken one by one
        for (int64_t j = 0; j < in_panels; ++j) {
          const T* next = j + 1 < in_panels ? first + (j + 1) * K * kPanel : after_last;
          panel_product<T, 1>(xt, M, first + j * K * kPanel, next, K, a + j * M * kPanel);
        }
      }
      const int64_t width = std::min<int64_t>(count * kPanel, N - p0 * kPanel);
      if (gated) {  // gate and up of each row: [M, 32] from one tile, or [M, 16] twice
        const bool one_tile = in_panels == kBlockPanels;
        for (int64_t m = 0; m < M; ++m) {
          float* g = one_tile ? a + m * 2 * kPanel : a + m * kPanel;
          const float* u = one_tile ? g + kPanel : a + (M + m) * kPanel;
          for (int64_t i = 0; i < kPanel; i += kLanes) storev(g + i, swiglu(loadv(g + i), loadv(u + i)));
        }
      }
      // Row m of the block's output is at a + m * stride ([M, 32] gate rows from one tile keep their stride).
      const int64_t stride = gated ? (in_panels == kBlockPanels ? 2 * kPanel : kPanel) : in_panels * kPanel;
      if (transpose_out) {
        for (int64_t j = 0; j < width; ++j)
          for (int64_t m = 0; m < M; ++m) yp[(p0 * kPanel + j) * M + m] = a[m * stride + j];
      } else {
        for (int64_t m = 0; m < M; ++m) std::memcpy(yp + m * N + p0 * kPanel, a + m * stride, width * sizeof(float));
      }
    }
  });
  return ffi::Error::Success();
}

ffi::Error matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::Buffer<ffi::F32> norm_weight,
                  int64_t n, bool swiglu, bool x_transposed, bool transpose_out, bool normalize, float eps,
                  bool norm_bf16, ffi::Result<ffi::Buffer<ffi::F32>> y) {
  Norm norm;
  if (normalize) {
    const int64_t K = x.dimensions().size() == 2 ? x.dimensions()[1] : -1;
    if (x_transposed || static_cast<int64_t>(norm_weight.element_count()) != K)
      return ffi::Error::InvalidArgument("matmul: the norm takes x [M, K] (not transposed) and a weight [K]");
    norm = Norm{true, norm_weight.typed_data(), eps, norm_bf16};
  }
  switch (w.element_type()) {
    case ffi::DataType::F32:
      return matmul_impl<float>(pool, x, w, n, swiglu, x_transposed, transpose_out, norm, y);
    case ffi::DataType::BF16:
      return matmul_impl<uint16_t>(pool, x, w, n, swiglu, x_transposed, transpose_out, norm, y);
    default:
      return ffi::Error::InvalidArgument("matmul: packed weights must be float32 or bfloat16");
  }
}

// panel[k, j] = rows[j, k] for j < width: a panel of a transposed input from `width` rows of length K.
template <typename T>
void copy_columns(const T* rows, T* panel, int64_t K, int64_t width) {
  for (int64_t j = 0; j < width; ++j)
    for (int64_t k = 0; k < K; ++k) panel[k * kPanel + j] = rows[j * K + k];
}

// Packs weights for `matmul`: per layer l, the inputs' columns (in order, or with `swiglu` two inputs'
// panels alternating) cut into panels of 16: out[l][p, k, j] = column 16p + j of the layer's matrix (zero
// past its last column). Inputs are [L, K, N_i] (with `transposed` [L, N_i, K], e.g. tied embeddings
// [V, D]), one dtype (2 or 4 bytes, copied as is); one output [P, K, 16] per layer. Work items are
// (layer, panel) pairs shared over the thread pool: reading each input once, writing each output once.
ffi::Error pack(ffi::ThreadPool pool, ffi::RemainingArgs args, ffi::RemainingRets rets, bool swiglu,
                bool transposed) {
  const int64_t num_inputs = args.size(), L = rets.size();
  if (num_inputs < 1 || L < 1 || (swiglu && num_inputs != 2))
    return ffi::Error::InvalidArgument("pack: one or more inputs (two with swiglu) and one output per layer");
  std::vector<const char*> data(num_inputs);
  std::vector<int64_t> cols(num_inputs), first_panel(num_inputs + 1, 0);
  int64_t K = -1, elem = 0;
  ffi::DataType dtype = ffi::DataType::INVALID;
  for (int64_t i = 0; i < num_inputs; ++i) {
    auto arg = args.get<ffi::AnyBuffer>(i);
    if (!arg) return ffi::Error::InvalidArgument("pack: an input is not a buffer");
    auto d = arg->dimensions();
    if (d.size() != 3 || d[0] != L) return ffi::Error::InvalidArgument("pack: inputs must be [L, K, N]");
    const int64_t k = transposed ? d[2] : d[1];
    cols[i] = transposed ? d[1] : d[2];
    if (i == 0) {
      K = k;
      dtype = arg->element_type();
      elem = static_cast<int64_t>(ffi::ByteWidth(dtype));
    }
    if (k != K || arg->element_type() != dtype || (elem != 2 && elem != 4) || (swiglu && cols[i] != cols[0]))
      return ffi::Error::InvalidArgument("pack: inputs must share K and a 2- or 4-byte dtype");
    data[i] = static_cast<const char*>(arg->untyped_data());
    first_panel[i + 1] = first_panel[i] + (cols[i] + kPanel - 1) / kPanel;
  }
  const int64_t P = first_panel[num_inputs];
  std::vector<char*> out(L);
  for (int64_t l = 0; l < L; ++l) {
    auto ret = rets.get<ffi::AnyBuffer>(l);
    if (!ret) return ffi::Error::InvalidArgument("pack: an output is not a buffer");
    auto d = (*ret)->dimensions();
    if (d.size() != 3 || d[0] != P || d[1] != K || d[2] != kPanel || (*ret)->element_type() != dtype)
      return ffi::Error::InvalidArgument("pack: outputs must be [P, K, 16] in the inputs' dtype");
    out[l] = static_cast<char*>((*ret)->untyped_data());
  }
  parallel_for(pool, L * P, [&](int64_t item) {
    const int64_t l = item / P, p = item % P;  // output panel p of layer l
    int64_t i, q;  // input and its panel
    if (swiglu) {
      i = p % 2;
      q = p / 2;
    } else {
      i = std::upper_bound(first_panel.begin(), first_panel.end(), p) - first_panel.begin() - 1;
      q = p - first_panel[i];
    }
    const int64_t N = cols[i], width = std::min<int64_t>(kPanel, N - q * kPanel);
    const char* src = data[i] + l * N * K * elem;
    char* dst = out[l] + (swiglu ? (2 * q + i) : p) * K * kPanel * elem;
    if (width < kPanel) std::memset(dst, 0, K * kPanel * elem);
    if (!transposed) {  // row k of the panel: `width` contiguous columns of row k
      for (int64_t k = 0; k < K; ++k)
        std::memcpy(dst + k * kPanel * elem, src + (k * N + q * kPanel) * elem, width * elem);
    } else if (elem == 4) {  // column j of the panel: row 16q + j of the [N, K] input
      copy_columns(reinterpret_cast<const float*>(src) + q * kPanel * K, reinterpret_cast<float*>(dst), K, width);
    } else {
      copy_columns(reinterpret_cast<const uint16_t*>(src) + q * kPanel * K, reinterpret_cast<uint16_t*>(dst), K,
                   width);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GrpaxPack, pack,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<bool>("swiglu")
                                  .Attr<bool>("transposed"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(GrpaxMatmul, matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("n")
                                  .Attr<bool>("swiglu")
                                  .Attr<bool>("x_transposed")
                                  .Attr<bool>("transpose_out")
                                  .Attr<bool>("normalize")
                                  .Attr<float>("eps")
                                  .Attr<bool>("norm_bf16")
                                  .Ret<ffi::Buffer<ffi::F32>>());
