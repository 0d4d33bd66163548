// Weight-only int8 linear layers for the CPU serving path (worker/engine/quant/schemes.py, issue 24).
// Built after cpu_kernels.cpp in the same translation unit (tokenbus_kernels/cpu.py), beside its fp32 panel kernel, whose
// checks (check_panel_x), tile loop (panel_linear_tiles) and store (store_tile) it shares.
//
// y [m, n] = x [m, k] · (W_int8 · diag(scale))ᵀ (+ bias). The weight is the int8 twin of the fp32 panels,
// [ceil(n / 16), k, 16] int8 (worker/engine/backends/cpu_linear.py packs it), with one fp32 scale per output
// column (symmetric, per output channel; padded to a multiple of 16). A decode step's linears are a read of
// every weight, so a quarter of the bytes is most of the speed-up; the 16 int8 of a panel row are widened to
// fp32 in registers (one sign-extend and one convert, shared by every row of the tile), accumulated exactly
// as the fp32 kernel does, and scaled once at the end: Σ x·(q·s) = s·Σ x·q, equal up to fp32 rounding.
//
// AVX-512: one zmm per row of the tile, 16 rows. AVX2: two ymm per row, 6 rows (as cpu_kernels.cpp's
// kMaxTileRows). Elsewhere: the same loop in plain C++ for the compiler to vectorise.

#include <immintrin.h>

namespace {

// the weights asked for this far ahead: the same 4 KiB of panel as the fp32 kernel's kPrefetchFloats
constexpr int64_t kPrefetchInt8 = 4096;

template <int ROWS>
void panel_rows_int8(const float* x, int64_t x_stride, const int8_t* panel, const float* scale, int64_t k,
                     float* y, int64_t y_stride, int64_t col0, int64_t n, const float* bias) {
  alignas(64) float out[ROWS][kPanelCols];
#if defined(__AVX512F__)
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    const int8_t* w = panel + i * kPanelCols;
    if ((i & 3) == 0) __builtin_prefetch(w + kPrefetchInt8);  // 4 panel rows per cache line
    const __m512 wf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * x_stride + i]), wf, acc[r]);
  }
  const __m512 s = _mm512_loadu_ps(scale + col0);
  for (int r = 0; r < ROWS; ++r) _mm512_store_ps(out[r], _mm512_mul_ps(acc[r], s));
#elif defined(__AVX2__)
  __m256 lo[ROWS], hi[ROWS];
  for (int r = 0; r < ROWS; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    const int8_t* w = panel + i * kPanelCols;
    if ((i & 3) == 0) __builtin_prefetch(w + kPrefetchInt8);
    const __m128i w8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
    const __m256 wlo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(w8));
    const __m256 whi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(w8, 8)));
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r) {
      const __m256 xv = _mm256_set1_ps(x[r * x_stride + i]);
      lo[r] = _mm256_fmadd_ps(xv, wlo, lo[r]);
      hi[r] = _mm256_fmadd_ps(xv, whi, hi[r]);
    }
  }
  const __m256 slo = _mm256_loadu_ps(scale + col0), shi = _mm256_loadu_ps(scale + col0 + 8);
  for (int r = 0; r < ROWS; ++r) {
    _mm256_store_ps(out[r], _mm256_mul_ps(lo[r], slo));
    _mm256_store_ps(out[r] + 8, _mm256_mul_ps(hi[r], shi));
  }
#else
  float acc[ROWS][kPanelCols] = {};
  for (int64_t i = 0; i < k; ++i) {
    const int8_t* w = panel + i * kPanelCols;
    float wf[kPanelCols];
    for (int e = 0; e < kPanelCols; ++e) wf[e] = static_cast<float>(w[e]);
    for (int r = 0; r < ROWS; ++r) {
      const float xv = x[r * x_stride + i];
#pragma omp simd
      for (int e = 0; e < kPanelCols; ++e) acc[r][e] += xv * wf[e];
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int e = 0; e < kPanelCols; ++e) out[r][e] = acc[r][e] * scale[col0 + e];
#endif
  store_tile<ROWS>(out, y, y_stride, col0, n, bias);
}

}  // namespace

torch::Tensor panel_linear_int8_cpu(torch::Tensor x, torch::Tensor panels, torch::Tensor scales,
                                    int64_t out_features, c10::optional<torch::Tensor> bias) {
  check_panel_x(x);
  TORCH_CHECK(panels.scalar_type() == torch::kInt8 && panels.is_contiguous() && panels.dim() == 3 &&
                  panels.size(2) == kPanelCols && panels.size(1) == x.size(1),
              "panels must be the contiguous int8 [ceil(out / 16), in_features, 16] packing of the weight");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.is_contiguous() &&
                  scales.numel() == panels.size(0) * kPanelCols && out_features <= scales.numel(),
              "scales must be float32, one per output channel, padded to ceil(out / 16) * 16");
  const int64_t k = x.size(1), xs = x.stride(0);
  const int8_t* wp = panels.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  return panel_linear_tiles(x, panels.size(0), out_features, bias,
                            [&](int64_t p, auto height, const float* xr, float* yr, const float* bp) {
    panel_rows_int8<decltype(height)::value>(xr, xs, wp + p * k * kPanelCols, sp, k, yr, out_features,
                                             p * kPanelCols, out_features, bp);
  });
}

// The fused decode layers' linear: fp32 panels when scales is empty, W8A8 panels (4-d, cpu_w8a8.cpp) with their
// scales and column sums, weight-only int8 panels with their scales otherwise.
torch::Tensor panel_linear_any_cpu(const torch::Tensor& x, const torch::Tensor& panels, const torch::Tensor& scales,
                                   int64_t out_features, c10::optional<torch::Tensor> bias) {
  if (scales.numel() == 0) return panel_linear_cpu(x, panels, out_features, bias);
  if (panels.dim() == 4) return panel_linear_w8a8_cpu(x, panels, scales, out_features, bias);
  return panel_linear_int8_cpu(x, panels, scales, out_features, bias);
}
