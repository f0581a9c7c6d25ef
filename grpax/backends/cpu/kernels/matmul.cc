// Matmul on CPU for the sampler: y[M, N] = x[M, K] @ W with W packed in column panels.
//
// A decode step multiplies a few rows (M = batch) by every weight matrix, so its cost is streaming the
// weights from memory, not arithmetic. W comes packed as [P, K, 16] (P = ceil(N / 16) panels of 16 columns,
// zero padded; grpax.backends.cpu.ops.pack): each panel is one contiguous run of memory, read once
// per call and shared out over XLA's intra-op thread pool. Register tiles of up to 12 rows x 2 panels with
// AVX-512 (24 of its 32 vector registers), else 6 rows x 1 panel (12 of AVX2's 16, the BLIS-style tile), run
// over K while the panels' next rows are prefetched; x is read from its transpose, so the broadcasts of one k
// are one run of memory. Float32 or bfloat16 weights (widened to float32 in registers: bf16 halves the bytes
// read), x and y float32 or bfloat16; the accumulation is float32.
//
// Options for the decode layer: the pre-norm (RMSNorm) applied to x as it is transposed; x given already
// transposed; y written transposed (the SwiGLU output feeds the down projection that way).
//
// With `swiglu` the panels of two matrices come interleaved (gate panel p at 2p, up panel p at 2p + 1) and
// y = silu(x @ W_gate) * (x @ W_up): the MLP's gate, up and activation in one pass (Llama's SwiGLU).
//
// Built at first use by grpax.backends.cpu.build (g++ -O3 -march=native) and called through the XLA FFI.
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
  if constexpr (sizeof(T) == 4) {
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
  } else {  // bfloat16 row pairs: a 32-bit lane holds column j's (k, k + 1), widened by a shift and a mask
    for (int64_t k = 0; k < K; k += 2) {
      vec even[NV], odd[NV];
      for (int j = 0; j < NV; ++j) {
        const int64_t offset =
            (j / kVectorsPerPanel) * K * kPanel + k * kPanel + (j % kVectorsPerPanel) * 2 * kLanes;
        widen_pairs(panel + offset, even[j], odd[j]);
        if (fetch != nullptr && j % kVectorsPerPanel == 0) __builtin_prefetch(fetch + offset);
      }
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        const vec x0 = splatv(xt[k * M + r]), x1 = splatv(xt[(k + 1) * M + r]);
        for (int j = 0; j < NV; ++j) {
          acc[r][j] += x0 * even[j];
          acc[r][j] += x1 * odd[j];
        }
      }
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

// The product's destination: float32, or bfloat16 (rounded to nearest even, as XLA converts; NaN kept).
struct Out {
  float* f32 = nullptr;
  uint16_t* bf16 = nullptr;
  void put(int64_t i, float v) const {
    if (f32 != nullptr) {
      f32[i] = v;
    } else {
      bf16[i] = to_bf16(v);
    }
  }
};

// Finishes rows m0 .. m0 + rows - 1 of one block's product into y (N columns; y^T [N, M] with
// `transpose_out`) at output column `col`: row i of the product at a + i * stride, `width` columns; with
// `gated` the gate half there and the up half at + up, combined by SwiGLU first (16 columns).
inline void emit(float* a, int64_t stride, int64_t up, int64_t rows, int64_t m0, bool gated, bool transpose_out,
                 int64_t col, int64_t width, int64_t M, int64_t N, const Out& y) {
  if (gated)
    for (int64_t i = 0; i < rows; ++i) {
      float* g = a + i * stride;
      for (int64_t j = 0; j < kPanel; j += kLanes) storev(g + j, swiglu(loadv(g + j), loadv(g + up + j)));
    }
  if (transpose_out) {
    for (int64_t j = 0; j < width; ++j)
      for (int64_t i = 0; i < rows; ++i) y.put((col + j) * M + m0 + i, a[i * stride + j]);
  } else if (y.f32 != nullptr) {
    for (int64_t i = 0; i < rows; ++i)
      std::memcpy(y.f32 + (m0 + i) * N + col, a + i * stride, width * sizeof(float));
  } else {
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < width; ++j) y.put((m0 + i) * N + col + j, a[i * stride + j]);
  }
}

// Per-thread scratch is kept from call to call, but released after a call that needed more than this (a
// prefill's thousands of rows), so that no thread holds its largest buffer for life.
constexpr size_t kKeepBytes = size_t{4} << 20;
template <typename V>
void trim(V& buffer) {
  if (buffer.capacity() * sizeof(typename V::value_type) > kKeepBytes) V().swap(buffer);
}

template <typename T>
ffi::Error matmul_impl(ffi::ThreadPool& pool, ffi::AnyBuffer& x, ffi::AnyBuffer& w, int64_t N, bool gated,
                       bool x_transposed, bool transpose_out, const Norm& norm, ffi::Result<ffi::AnyBuffer>& y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != kPanel)
    return ffi::Error::InvalidArgument("matmul: x must be [M, K] ([K, M] transposed) and the weights [P, K, 16]");
  const int64_t M = x_transposed ? xd[1] : xd[0], Kx = x_transposed ? xd[0] : xd[1], P = wd[0];
  const int64_t K = sizeof(T) == 2 ? Kx + Kx % 2 : Kx;  // the packed rows: bfloat16 in pairs, a zero row past odd K
  const int64_t panels = gated ? P / 2 : P;  // output panels
  if (wd[1] != K || (gated && P % 2) || N > panels * kPanel || N <= (panels - 1) * kPanel)
    return ffi::Error::InvalidArgument("matmul: packed weights do not match x [M, K] and n");
  auto yd = y->dimensions();
  if (yd.size() != 2 || yd[0] != (transpose_out ? N : M) || yd[1] != (transpose_out ? M : N))
    return ffi::Error::InvalidArgument("matmul: the output must be [M, n] ([n, M] transposed)");
  const bool x_bf16 = x.element_type() == ffi::DataType::BF16;
  const float* xf = x_bf16 ? nullptr : static_cast<const float*>(x.untyped_data());
  const uint16_t* xh = x_bf16 ? static_cast<const uint16_t*>(x.untyped_data()) : nullptr;
  auto xp = [&](int64_t i) { return x_bf16 ? to_float(xh[i]) : xf[i]; };  // element i of x as stored
  thread_local std::vector<float> scale;  // per row: 1 / sqrt(mean_k x[m, k]^2 + eps) with the norm
  scale.assign(M, 1.0f);
  if (norm.on) {
    for (int64_t m = 0; m < M; ++m) {
      float ss = 0.0f;
      for (int64_t k = 0; k < Kx; ++k) ss += xp(m * Kx + k) * xp(m * Kx + k);
      scale[m] = 1.0f / std::sqrt(ss / static_cast<float>(Kx) + norm.eps);
    }
  }
  const float* row_scale = scale.data();  // (a lambda would see another thread's thread_local `scale`)
  auto normed = [&](int64_t m, int64_t k) {  // x[m, k], or w[k] * x[m, k] * scale[m] with the norm
    const float value = xp(m * Kx + k) * row_scale[m];
    return !norm.on ? value : norm.bf16 ? round_bf16(norm.weight[k] * round_bf16(value)) : norm.weight[k] * value;
  };
  const T* wp = reinterpret_cast<const T*>(w.untyped_data());
  const Out yp = y->element_type() == ffi::DataType::BF16 ? Out{nullptr, static_cast<uint16_t*>(y->untyped_data())}
                                                          : Out{static_cast<float*>(y->untyped_data()), nullptr};
  // Tiles broadcast x[r, k] from its transpose, so that the rows of one k are one run: xt[k * M + r]. Blocks
  // of 64 k keep the 64 output lines in L1 while the rows advance (3x the naive loop order).
  const float* xt = xf;
  thread_local std::vector<float> xt_buf;
  if (x_transposed && (K != Kx || x_bf16)) {  // widened, or one zero row past the last
    xt_buf.assign(M * K, 0.0f);
    for (int64_t i = 0; i < M * Kx; ++i) xt_buf[i] = xp(i);
    xt = xt_buf.data();
  } else if (!x_transposed) {
    xt_buf.resize(M * K);
    float* t = xt_buf.data();
    std::fill(t + M * Kx, t + M * K, 0.0f);
    for (int64_t k0 = 0; k0 < Kx; k0 += 64) {
      const int64_t k1 = std::min<int64_t>(Kx, k0 + 64);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t k = k0; k < k1; ++k) t[k * M + m] = normed(m, k);
    }
    xt = t;
  }
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
      // Row m of the product at a + m * stride: [M, 32] (gate and up of one tile side by side, or two panels),
      // [M, 16], or with 8 lanes a gated pair as [M, 16] gates then [M, 16] ups.
      const bool one_tile = in_panels == kBlockPanels;
      const int64_t stride = gated ? (one_tile ? 2 * kPanel : kPanel) : in_panels * kPanel;
      emit(a, stride, one_tile ? kPanel : M * kPanel, M, 0, gated, transpose_out, p0 * kPanel, width, M, N, yp);
    }
    trim(buf);
  });
  trim(xt_buf);
  trim(scale);
  return ffi::Error::Success();
}

ffi::Error matmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::F32> norm_weight,
                  int64_t n, bool swiglu, bool x_transposed, bool transpose_out, bool normalize, float eps,
                  ffi::Result<ffi::AnyBuffer> y) {
  const bool x_bf16 = x.element_type() == ffi::DataType::BF16;
  const auto is_float = [](ffi::DataType t) { return t == ffi::DataType::F32 || t == ffi::DataType::BF16; };
  if (!is_float(x.element_type()) || !is_float(y->element_type()))
    return ffi::Error::InvalidArgument("matmul: x and the output must be float32 or bfloat16");
  Norm norm;
  if (normalize) {
    const int64_t K = x.dimensions().size() == 2 ? x.dimensions()[1] : -1;
    if (x_transposed || static_cast<int64_t>(norm_weight.element_count()) != K)
      return ffi::Error::InvalidArgument("matmul: the norm takes x [M, K] (not transposed) and a weight [K]");
    norm = Norm{true, norm_weight.typed_data(), eps, x_bf16};
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

// Where weight (k, j) of a panel goes: row k (float32), or for bfloat16 the pair of rows (k - k % 2, k - k % 2
// + 1) interleaved per column, [K / 2, 16, 2] (the layout of AVX-512 BF16's pair dot products).
template <typename T>
inline int64_t slot(int64_t k, int64_t j) {
  if constexpr (sizeof(T) == 4) {
    return k * kPanel + j;
  } else {
    return (k & ~int64_t{1}) * kPanel + 2 * j + (k & 1);
  }
}

// One panel from `width` columns of an input: column j is column j of `src` [K, N] (row stride N), or with
// `transposed` row j of `src` [width, K]. The panel is zero beforehand where nothing is copied.
template <typename T>
void copy_panel(const T* src, T* panel, int64_t K, int64_t N, int64_t width, bool transposed) {
  if constexpr (sizeof(T) == 4) {
    if (!transposed) {
      for (int64_t k = 0; k < K; ++k) std::memcpy(panel + k * kPanel, src + k * N, width * sizeof(T));
    } else {
      for (int64_t j = 0; j < width; ++j)
        for (int64_t k = 0; k < K; ++k) panel[k * kPanel + j] = src[j * K + k];
    }
  } else if (!transposed) {  // rows k and k + 1 interleaved
    for (int64_t k = 0; k < K; k += 2) {
      const T* first = src + k * N;
      T* out = panel + k * kPanel;
      if (k + 1 < K) {
        const T* second = first + N;
        for (int64_t j = 0; j < width; ++j) {
          out[2 * j] = first[j];
          out[2 * j + 1] = second[j];
        }
      } else {
        for (int64_t j = 0; j < width; ++j) out[2 * j] = first[j];
      }
    }
  } else {  // row j of src holds column j: its pairs (k, k + 1) are already adjacent
    for (int64_t j = 0; j < width; ++j) {
      const T* column = src + j * K;
      for (int64_t k = 0; k + 1 < K; k += 2) std::memcpy(panel + slot<T>(k, j), column + k, 2 * sizeof(T));
      if (K % 2) panel[slot<T>(K - 1, j)] = column[K - 1];
    }
  }
}

// Packs weights for `matmul`: per layer l, the inputs' columns (in order, or with `swiglu` two inputs'
// panels alternating) cut into panels of 16: out[l][p, k, j] = column 16p + j of the layer's matrix (zero
// past its last column). Inputs are [L, K, N_i] (with `transposed` [L, N_i, K], e.g. tied embeddings
// [V, D]), one dtype (2 or 4 bytes, copied as is); one output [P, Kp, 16] per layer: Kp = K for float32;
// for bfloat16 the rows come in pairs (`slot`), Kp = K rounded up to even (a zero row). Work items are
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
  const int64_t P = first_panel[num_inputs], Kp = elem == 2 ? K + K % 2 : K;
  std::vector<char*> out(L);
  for (int64_t l = 0; l < L; ++l) {
    auto ret = rets.get<ffi::AnyBuffer>(l);
    if (!ret) return ffi::Error::InvalidArgument("pack: an output is not a buffer");
    auto d = (*ret)->dimensions();
    if (d.size() != 3 || d[0] != P || d[1] != Kp || d[2] != kPanel || (*ret)->element_type() != dtype)
      return ffi::Error::InvalidArgument("pack: outputs must be [P, K, 16] (K even for bfloat16) in the inputs' dtype");
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
    const char* src = data[i] + (l * N * K + (transposed ? q * kPanel * K : q * kPanel)) * elem;
    char* dst = out[l] + (swiglu ? (2 * q + i) : p) * Kp * kPanel * elem;
    if (width < kPanel || Kp != K) std::memset(dst, 0, Kp * kPanel * elem);
    if (elem == 4) {
      copy_panel(reinterpret_cast<const float*>(src), reinterpret_cast<float*>(dst), K, N, width, transposed);
    } else {
      copy_panel(reinterpret_cast<const uint16_t*>(src), reinterpret_cast<uint16_t*>(dst), K, N, width, transposed);
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
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("n")
                                  .Attr<bool>("swiglu")
                                  .Attr<bool>("x_transposed")
                                  .Attr<bool>("transpose_out")
                                  .Attr<bool>("normalize")
                                  .Attr<float>("eps")
                                  .Ret<ffi::AnyBuffer>());
