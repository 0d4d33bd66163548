// The CPU serving path's kernels (fp32), built on first use by tokenbus_kernels/cpu.py with torch's cpp_extension:
// the decoder layer's elementwise ops (worker/engine/backends/cpu.py), the greedy sampler's argmax
// (worker/engine/backends/cpu.py) and the small-batch panel linear (worker/engine/backends/cpu_linear.py).
// write_kv and the paged decode attention are in cpu_attention.cpp, cpu_attention_block.cpp and
// cpu_decode_attention.cpp, next in the same translation unit.
// tests/kernels/test_cpu_kernels.py compares each with its PyTorch version.
//
// Compiled with -ffast-math (tokenbus_kernels/cpu.py) for vectorised exp and reductions: no kernel relies on NaN.

// Not <torch/extension.h>: it pulls in the whole C++ frontend (nn, optim, serialization), 28 of a build's 46 s
// of g++ on a Xeon; tensors, at::parallel_for and the pybind11 bindings need only these (the build: 32 s).
#include <torch/types.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <climits>
#include <utility>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

void check_layout(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, name, " must be float32 (other dtypes use the reference)");
  TORCH_CHECK(t.stride(-1) == 1, name, " must have a contiguous last (head_dim) dimension");
}

}  // namespace

// ---- the elementwise parts of a decoder layer, one pass each (CPU, fp32) ----
// Eager PyTorch runs each of these as 4-8 small ops per layer; a decode step's tensors are tiny, so the
// per-op overhead, not the arithmetic, was their cost.

// residual += x; x = weight * residual * rsqrt(mean(residual^2) + eps), both in place. x, residual [n, hidden]
void add_rms_norm_cpu(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_layout(x, "x");
  check_layout(residual, "residual");
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous(),
              "x, residual and weight must be contiguous");
  const int64_t n = x.size(0), hidden = x.size(1);
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* xr = xp + i * hidden;
      float* rr = rp + i * hidden;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t d = 0; d < hidden; ++d) {
        rr[d] += xr[d];
        sum += rr[d] * rr[d];
      }
      const float inv = 1.f / std::sqrt(sum / hidden + static_cast<float>(eps));
#pragma omp simd
      for (int64_t d = 0; d < hidden; ++d) xr[d] = wp[d] * (rr[d] * inv);
    }
  });
}

// out = weight * x * rsqrt(mean(x^2) + eps). x [n, hidden] (rows may be strided), out contiguous
torch::Tensor rms_norm_cpu(torch::Tensor x, torch::Tensor weight, double eps) {
  check_layout(x, "x");
  const int64_t n = x.size(0), hidden = x.size(1), xs = x.stride(0);
  auto out = torch::empty({n, hidden}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* xr = xp + i * xs;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t d = 0; d < hidden; ++d) sum += xr[d] * xr[d];
      const float inv = 1.f / std::sqrt(sum / hidden + static_cast<float>(eps));
#pragma omp simd
      for (int64_t d = 0; d < hidden; ++d) op[i * hidden + d] = wp[d] * (xr[d] * inv);
    }
  });
  return out;
}

// gate_up [n, 2 * inter] -> silu(gate) * up [n, inter]
torch::Tensor silu_and_mul_cpu(torch::Tensor gate_up) {
  check_layout(gate_up, "gate_up");
  const int64_t n = gate_up.size(0), inter = gate_up.size(1) / 2, gs = gate_up.stride(0);
  auto out = torch::empty({n, inter}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* g = gp + i * gs;
      const float* u = g + inter;
      float* o = op + i * inter;
#pragma omp simd
      for (int64_t d = 0; d < inter; ++d) o[d] = g[d] / (1.f + std::exp(-g[d])) * u[d];
    }
  });
  return out;
}

// In place: x = x * cos + rotate_half(x) * sin for q [n, hq, d] and k [n, hk, d] (strided views of the fused
// qkv output), cos/sin [n, d] (this step's positions).
void rotary_cpu(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  check_layout(q, "q");
  check_layout(k, "k");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous(), "cos and sin must be contiguous");
  const int64_t n = q.size(0), head_dim = q.size(2), half = head_dim / 2;
  const int64_t heads[2] = {q.size(1), k.size(1)};
  float* ptrs[2] = {q.data_ptr<float>(), k.data_ptr<float>()};
  const int64_t s0[2] = {q.stride(0), k.stride(0)}, s1[2] = {q.stride(1), k.stride(1)};
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, n, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * head_dim;
      const float* s = sp + t * head_dim;
      for (int which = 0; which < 2; ++which) {
        for (int64_t h = 0; h < heads[which]; ++h) {
          float* x = ptrs[which] + t * s0[which] + h * s1[which];
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = x[i], x2 = x[i + half];
            x[i] = x1 * c[i] - x2 * s[i];
            x[i + half] = x2 * c[i + half] + x1 * s[i + half];
          }
        }
      }
    }
  });
}

// ---- greedy sampling ----
// logits [rows, vocab] -> int64 [rows]: the first index of each row's maximum, as torch.argmax picks it.
// torch's argmax runs one thread without vectorising here (3-6 ms for 64 rows of SmolLM2's 49152 logits).
// This is one pass per row, rows in parallel: 16 lanes each keep their best value and its first index,
// then the lanes are merged (higher value, or the same value at a lower index). Logits are assumed free of
// NaN (-ffast-math); -inf (a banned token) is fine.

namespace {

int64_t argmax_row(const float* row, int64_t vocab) {
  constexpr int kLanes = 16;
  float best[kLanes];
  int32_t where[kLanes];
  for (int e = 0; e < kLanes; ++e) {
    best[e] = row[0];
    where[e] = 0;
  }
  int64_t i = 0;
  for (; i + kLanes <= vocab; i += kLanes) {
#pragma omp simd
    for (int e = 0; e < kLanes; ++e) {
      const float v = row[i + e];
      const bool higher = v > best[e];  // strictly: a lane keeps its first maximum
      best[e] = higher ? v : best[e];
      where[e] = higher ? static_cast<int32_t>(i + e) : where[e];
    }
  }
  float top = best[0];
  int64_t at = where[0];
  for (int e = 1; e < kLanes; ++e)
    if (best[e] > top || (best[e] == top && where[e] < at)) {
      top = best[e];
      at = where[e];
    }
  for (; i < vocab; ++i)  // the tail lies after every lane's index
    if (row[i] > top) {
      top = row[i];
      at = i;
    }
  return at;
}

}  // namespace

torch::Tensor argmax_rows_cpu(torch::Tensor logits) {
  check_layout(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "logits must be [rows, vocab] with vocab > 0");
  TORCH_CHECK(logits.size(1) <= INT32_MAX, "vocab must fit in int32");
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  auto out = torch::empty({rows}, logits.options().dtype(torch::kInt64));
  const float* lp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(lp + r * stride, vocab);
  });
  return out;
}

// ---- small-batch linear layers ----
// y [m, n] = x [m, k] · Wᵀ (+ bias) for the few rows of a decode step. The weight is kept as 16-column
// panels, [ceil(n / 16), k, 16] (worker/engine/backends/cpu_linear.py packs it), so each panel streams from memory
// once, front to back, while a tile of rows of x accumulates against it in registers: at a few rows a decode
// step's linear layers are a read of every weight, and this reads at close to the memory bandwidth.

namespace {

constexpr int kPanelCols = 16;
// The accumulators [rows][16] must stay in registers: a row of 16 columns is one zmm register with AVX-512
// (32 of them) or two ymm with AVX2 (16). Taller tiles spill to the stack: on an AVX2-only EPYC 16-row
// tiles made 16 rows cost 131 ms for all of a step's linears, against 58 ms with tiles of 6.
#if defined(__AVX512F__)
constexpr int kMaxTileRows = 16;
#else
constexpr int kMaxTileRows = 6;
#endif
// How far ahead in the panel the weights are requested. Without it the loop stalls on each new line: the
// hardware prefetcher alone kept ~12 GB/s in flight at 8 rows, this streams close to the memory bandwidth.
constexpr int64_t kPrefetchFloats = 64 * kPanelCols;

// A tile's [ROWS][16] sums into y's columns col0.. (the last panel may hold fewer than 16), plus the bias.
template <int ROWS>
inline void store_tile(const float (&acc)[ROWS][kPanelCols], float* y, int64_t y_stride, int64_t col0, int64_t n,
                       const float* bias) {
  const int64_t cols = std::min<int64_t>(kPanelCols, n - col0);
  for (int r = 0; r < ROWS; ++r)
    for (int64_t e = 0; e < cols; ++e) y[r * y_stride + col0 + e] = acc[r][e] + (bias ? bias[col0 + e] : 0.f);
}

// f(std::integral_constant<int, rows>): the tile's height as a compile-time constant, 1 ... kMaxTileRows, so
// each height gets its own fully unrolled accumulators
template <int R = 1, typename F>
inline void with_tile_rows(int64_t rows, F&& f) {
  if constexpr (R < kMaxTileRows) {
    if (rows != R) return with_tile_rows<R + 1>(rows, std::forward<F>(f));
  }
  f(std::integral_constant<int, R>{});
}

// A panel GEMV's loop, for every weight type: panels split over the threads, each read once per tile of up to
// kMaxTileRows rows of x (more rows than one tile read it again, from cache). tile(p, r0, height) computes
// panel p against rows r0 .. r0 + height (height an std::integral_constant).
template <typename Tile>
void for_each_panel_tile(int64_t rows, int64_t num_panels, Tile&& tile) {
  at::parallel_for(0, num_panels, 4, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t r0 = 0; r0 < rows; r0 += kMaxTileRows)
        with_tile_rows(std::min<int64_t>(kMaxTileRows, rows - r0), [&](auto height) { tile(p, r0, height); });
  });
}

template <int ROWS>
void panel_rows(const float* x, int64_t x_stride, const float* panel, int64_t k, float* y, int64_t y_stride,
                int64_t col0, int64_t n, const float* bias) {
  float acc[ROWS][kPanelCols];
  for (int r = 0; r < ROWS; ++r)
    for (int e = 0; e < kPanelCols; ++e) acc[r][e] = 0.f;
  for (int64_t i = 0; i < k; ++i) {
    const float* w = panel + i * kPanelCols;
    __builtin_prefetch(w + kPrefetchFloats);
    for (int r = 0; r < ROWS; ++r) {
      const float xv = x[r * x_stride + i];
#pragma omp simd
      for (int e = 0; e < kPanelCols; ++e) acc[r][e] += xv * w[e];
    }
  }
  store_tile<ROWS>(acc, y, y_stride, col0, n, bias);
}

void check_panel_x(const torch::Tensor& x) {
  check_layout(x, "x");
  TORCH_CHECK(x.dim() == 2, "x must be [rows, in_features]");
}

// What the fp32 panel linear and the int8 one (cpu_quant.cpp) share around their tile kernels: y [rows,
// out_features] and the loop over (panel, row tile). tile(p, height, x_rows, y_rows, bias) computes panel p's
// kPanelCols columns of the tile's `height` rows (x's row stride is x.stride(0), y's out_features).
template <typename Tile>
torch::Tensor panel_linear_tiles(const torch::Tensor& x, int64_t num_panels, int64_t out_features,
                                 const c10::optional<torch::Tensor>& bias, Tile&& tile) {
  const int64_t rows = x.size(0), xs = x.stride(0);
  auto y = torch::empty({rows, out_features}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  for_each_panel_tile(rows, num_panels, [&](int64_t p, int64_t r0, auto height) {
    tile(p, height, xp + r0 * xs, yp + r0 * out_features, bp);
  });
  return y;
}

}  // namespace

torch::Tensor panel_linear_cpu(torch::Tensor x, torch::Tensor panels, int64_t out_features,
                               c10::optional<torch::Tensor> bias) {
  check_panel_x(x);
  TORCH_CHECK(panels.is_contiguous() && panels.size(2) == kPanelCols && panels.size(1) == x.size(1),
              "panels must be the contiguous [ceil(out / 16), in_features, 16] packing of the weight");
  const int64_t k = x.size(1), xs = x.stride(0);
  const float* wp = panels.data_ptr<float>();
  return panel_linear_tiles(x, panels.size(0), out_features, bias,
                            [&](int64_t p, auto height, const float* xr, float* yr, const float* bp) {
    panel_rows<decltype(height)::value>(xr, xs, wp + p * k * kPanelCols, k, yr, out_features, p * kPanelCols,
                                        out_features, bp);
  });
}
