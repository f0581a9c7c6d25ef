// Small-batch matmul on CPU for the decode step: y[M, N] = x[M, K] @ W with W packed in column panels.
//
// A decode step multiplies a few rows (M = batch) by every weight matrix, so its cost is streaming the
// weights from memory, not arithmetic. W comes packed as [P, K, 16] (P = ceil(N / 16) panels of 16 columns,
// zero padded; grpax.models.cpu_kernels.pack): each panel is one contiguous run of memory, read once
// per call and shared out over XLA's intra-op thread pool. A panel is multiplied in blocks of up to 6 rows
// held in 12 vector registers (6 rows x 16 columns, the register tile of BLIS-style AVX2 kernels) while the
// panel's next rows are prefetched. Float32 or bfloat16 weights (widened to float32 in registers: bf16 halves
// the bytes read); x, y and the accumulation are float32.
//
// With `swiglu` the panels of two matrices come interleaved (gate panel p at 2p, up panel p at 2p + 1) and
// y = silu(x @ W_gate) * (x @ W_up): the MLP's gate, up and activation in one pass (Llama's SwiGLU).
//
// Built at first use by grpax.models.cpu_kernels (g++ -O3 -march=native) and called through the XLA FFI.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace grpax;

constexpr int kPanel = 16;  // columns per panel: two vectors
constexpr int kRows = 6;    // rows per register tile
constexpr int kAhead = 32;  // panel rows prefetched ahead (2 KB of float32 weights)

// out[r, 0:16] = x[r, :] @ panel for MR rows of x (row stride K); the panel is [K, 16]. One cache line a row
// (64 bytes: a float32 panel row, two bfloat16 rows) of `fetch` is prefetched per panel row.
template <typename T, int MR>
inline void tile(const float* x, const T* panel, int64_t K, float* out, const T* fetch) {
  v8 lo[MR], hi[MR];
  for (int r = 0; r < MR; ++r) lo[r] = hi[r] = splat(0.0f);
  for (int64_t k = 0; k < K; ++k) {
    const T* w = panel + k * kPanel;
    if (fetch != nullptr) __builtin_prefetch(fetch + k * kPanel);
    const v8 w0 = load8(w), w1 = load8(w + 8);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const v8 xr = splat(x[r * K + k]);
      lo[r] += xr * w0;
      hi[r] += xr * w1;
    }
  }
  for (int r = 0; r < MR; ++r) {
    store(out + r * kPanel, lo[r]);
    store(out + r * kPanel + 8, hi[r]);
  }
}

// out[M, 16] = x[M, K] @ panel. The first tile reads the panel from memory (prefetching its own rows ahead);
// the second prefetches `next` (the panel this thread multiplies next, or null) while it computes from
// cache, so that memory keeps streaming during the compute-only tiles.
template <typename T>
void panel_product(const float* x, int64_t M, const T* panel, const T* next, int64_t K, float* out) {
  int64_t m = 0, t = 0;
  auto fetch = [&](int64_t tile_index) -> const T* {
    if (tile_index == 0) return panel + kAhead * kPanel;
    return tile_index == 1 ? next : nullptr;
  };
  for (; m + kRows <= M; m += kRows, ++t) tile<T, kRows>(x + m * K, panel, K, out + m * kPanel, fetch(t));
  switch (M - m) {
    case 5: tile<T, 5>(x + m * K, panel, K, out + m * kPanel, fetch(t)); break;
    case 4: tile<T, 4>(x + m * K, panel, K, out + m * kPanel, fetch(t)); break;
    case 3: tile<T, 3>(x + m * K, panel, K, out + m * kPanel, fetch(t)); break;
    case 2: tile<T, 2>(x + m * K, panel, K, out + m * kPanel, fetch(t)); break;
    case 1: tile<T, 1>(x + m * K, panel, K, out + m * kPanel, fetch(t)); break;
    default: break;
  }
}

// silu(g) * u = g * sigmoid(g) * u, sigmoid from e = exp(-|g|) <= 1: 1 / (1 + e) for g >= 0, else e / (1 + e).
inline v8 swiglu(v8 g, v8 u) {
  const v8 zero = splat(0.0f);
  const v8 e = exp_nonpositive(g < zero ? g : -g);
  const v8 s = (g < zero ? e : splat(1.0f)) / (splat(1.0f) + e);
  return g * s * u;
}

template <typename T>
ffi::Error matmul_impl(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::AnyBuffer& w, int64_t N,
                       bool gated, ffi::Result<ffi::Buffer<ffi::F32>>& y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != kPanel)
    return ffi::Error::InvalidArgument("matmul: x must be [M, K] and the packed weights [P, K, 16]");
  const int64_t M = xd[0], K = xd[1], P = wd[0];
  const int64_t panels = gated ? P / 2 : P;  // output panels
  if (wd[1] != K || (gated && P % 2) || N > panels * kPanel || N <= (panels - 1) * kPanel)
    return ffi::Error::InvalidArgument("matmul: packed weights do not match x [M, K] and n");
  auto yd = y->dimensions();
  if (yd.size() != 2 || yd[0] != M || yd[1] != N)
    return ffi::Error::InvalidArgument("matmul: the output must be [M, n]");
  const float* xp = x.typed_data();
  const T* wp = reinterpret_cast<const T*>(w.untyped_data());
  float* yp = y->typed_data();
  // Items are runs of consecutive output panels, so a thread knows the panel it multiplies next.
  const int64_t run = std::max<int64_t>(1, panels / (8 * std::max<int64_t>(1, pool.num_threads())));
  const int64_t step = gated ? 2 : 1;  // input panels per output panel
  parallel_for(pool, (panels + run - 1) / run, [&](int64_t item) {
    thread_local std::vector<float> buf;
    buf.resize(2 * M * kPanel);
    float* a = buf.data();
    float* b = a + M * kPanel;
    const int64_t end = std::min(panels, (item + 1) * run);
    for (int64_t p = item * run; p < end; ++p) {
      const T* first = wp + step * p * K * kPanel;
      const T* after_last = p + 1 < end ? wp + step * (p + 1) * K * kPanel : nullptr;
      if (gated) {
        panel_product<T>(xp, M, first, first + K * kPanel, K, a);
        panel_product<T>(xp, M, first + K * kPanel, after_last, K, b);
        for (int64_t i = 0; i < M * kPanel; i += kW) store(a + i, swiglu(load(a + i), load(b + i)));
      } else {
        panel_product<T>(xp, M, first, after_last, K, a);
      }
      const int64_t n0 = p * kPanel, width = std::min<int64_t>(kPanel, N - n0);
      for (int64_t m = 0; m < M; ++m) std::memcpy(yp + m * N + n0, a + m * kPanel, width * sizeof(float));
    }
  });
  return ffi::Error::Success();
}

ffi::Error matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, int64_t n, bool swiglu,
                  ffi::Result<ffi::Buffer<ffi::F32>> y) {
  switch (w.element_type()) {
    case ffi::DataType::F32:
      return matmul_impl<float>(pool, x, w, n, swiglu, y);
    case ffi::DataType::BF16:
      return matmul_impl<uint16_t>(pool, x, w, n, swiglu, y);
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
                                  .Attr<int64_t>("n")
                                  .Attr<bool>("swiglu")
                                  .Ret<ffi::Buffer<ffi::F32>>());
