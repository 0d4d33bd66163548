// W8A8 int8 linear layers for the CPU serving path (worker/engine/quant/schemes.py, issue 24): int8 weights per
// output channel as the weight-only kernel (cpu_quant.cpp) has them, and the activations quantized per row
// (token) and group of 64 input features at each call, so the products are int8 × int8 summed in int32 by
// VNNI's vpdpbusd. Built after cpu_kernels.cpp in the same translation unit (tokenbus_kernels/cpu.py): it shares the fp32
// panel linear's check of x (check_panel_x), its tile loop (for_each_panel_tile) and store (store_tile).
//
// Why: at 16-64 rows a decode step's linears are compute-bound, not weight-read-bound: the weight-only kernel
// reads a quarter of the bytes but still runs one fp32 FMA per weight and row (16 columns a zmm). vpdpbusd
// does 4 multiply-adds per 32-bit lane, 64 a zmm: a quarter of the instructions for the same products.
// Why groups of 64 rather than one scale per row: one outlier feature then coarsens only its own group's codes.
// On SmolLM2-135M per-row scales cost +4.6 % perplexity, groups of 64 +0.6 % (docs/quantization.md); the
// price is one int32 → fp32 scale-and-add per group and row, against 16 vpdpbusd.
//
// y[r, c] = sw[c] · Σ_g sx[r, g] · Σ_{i in g} qx[r, i] · qw[c, i] (+ bias[c]), groups g of 64 inputs, where
//   qx[r, g] = round(x[r, g] · 127 / max|x[r, g]|), sx[r, g] = max|x[r, g]| / 127 (all zero: codes 0, scale 0);
//   qw, sw: quantization.quantize_int8, symmetric per output channel.
// vpdpbusd multiplies unsigned by signed bytes, so the activations are stored as qx + 128 (0 ... 255) and
// 128 · Σ_{i in g} qw[c, i] (the group's column sums, packed beside the scales) is subtracted from each group's
// int32 sums: exact.
//
// Layouts (worker/engine/backends/cpu_linear.py pack_panels_w8a8):
//   panels  int8 [ceil(n / 16), ceil(k / 4), 16, 4]: per panel, each lane group of 4 input features holds the
//           16 columns' 4 weights side by side: 64 bytes, one zmm, one 32-bit lane per column (zeros past k, n)
//   scales  fp32 [1 + ceil(k / 64), ceil(n / 16) · 16]: row 0 the weight scales sw, row 1 + g the column sums
//           Σ_{i in g} qw[c, i] of activation group g (|sum| ≤ 127 · 64: exact)
//
// AVX-512 VNNI: one zmm of int32 per tile row, 16 rows; AVX-VNNI (AVX2 encoding): two ymm per row, 6 rows;
// elsewhere the same sums in plain C++ (tests only: worker/engine/quant/schemes.py serves the weight-only
// kernel on a CPU without VNNI, see w8a8_native_cpu).

#include <immintrin.h>

namespace {

constexpr int64_t kGroup = 4;  // input features per 32-bit lane
constexpr int64_t kGroupBytes = kGroup * kPanelCols;  // one panel lane group: 64 bytes, a cache line
constexpr int64_t kActGroup = 64;  // input features per activation scale (quantization.W8A8_GROUP)
constexpr int64_t kLanesPerActGroup = kActGroup / kGroup;
constexpr int32_t kZeroPoint = 128;
// rows of a prefill-sized batch per pass over the weights: their codes (≤ 384 KiB at k = 1536) stay in L2
constexpr int64_t kChunkRows = 256;
// the weights asked for this far ahead: 4 KiB of panel, as the other panel kernels
constexpr int64_t kPrefetchW8a8 = 4096;

#if (defined(__AVX512VNNI__) && defined(__AVX512F__)) || defined(__AVXVNNI__)
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif

inline int32_t load_lane(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);  // 4 activation bytes, broadcast to every lane (an embedded broadcast)
  return v;
}

// qx + 128 of rows of x [rows, k] into q, lane-group-major: [ceil(k / 4), rows, 4] (past k: code 0), so that a
// tile finds its rows' 4 bytes of a lane group side by side, at constant offsets from one pointer; and the
// scales, group-major [ceil(k / 64), rows], so that a tile's scales of one group are side by side too
void quantize_rows_u8(const float* x, int64_t x_stride, int64_t rows, int64_t k, int64_t groups,
                      int64_t act_groups, uint8_t* q, float* scale) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> buffer(groups * kGroup, kZeroPoint);  // a row's codes; past k: code 0
    uint8_t* codes = buffer.data();
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * x_stride;
      for (int64_t a = 0; a < act_groups; ++a) {
        const int64_t i0 = a * kActGroup, i1 = std::min(k, i0 + kActGroup);
        float amax = 0.f;
#pragma omp simd reduction(max : amax)
        for (int64_t i = i0; i < i1; ++i) amax = std::max(amax, std::fabs(xr[i]));
        // the fp32 ops of quantization.quantize_activations_int8: the same codes
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
#pragma omp simd
        for (int64_t i = i0; i < i1; ++i)
          codes[i] = static_cast<uint8_t>(
              static_cast<int32_t>(std::max(-127.f, std::min(127.f, std::nearbyint(xr[i] * inv)))) + kZeroPoint);
        scale[a * rows + r] = amax / 127.f;
      }
      for (int64_t g = 0; g < groups; ++g)
        std::memcpy(q + (g * rows + r) * kGroup, codes + g * kGroup, kGroup);
    }
  });
}

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
// acc += u8(x) · s8(w) in place. Through the intrinsic g++ 12 copied every accumulator to a fresh register
// each step (a vmovdqa64 per vpdpbusd: twice the instructions); the asm's tied operand keeps them put.
inline __m512i dpbusd(__m512i acc, __m512i x, __m512i w) {
  asm("vpdpbusd %[w], %[x], %[acc]" : [acc] "+v"(acc) : [x] "v"(x), [w] "v"(w));
  return acc;
}
#endif

// One tile: ROWS rows of x (codes from xq, scales from xscale, both at the tile's first row) against one panel.
// Per activation group the int32 sums start from zero and are then scaled into fp32 sums, which live in `out`
// (L1) rather than registers: 16 int32 and 16 fp32 accumulators would fill all 32 zmm. (Two passes of 8 rows
// with both in registers, the second reading the panel again from cache, ran ~10 % slower.)
template <int ROWS>
void panel_rows_w8a8(const uint8_t* xq, int64_t group_stride, const float* xscale, int64_t act_group_stride,
                     const int8_t* panel, const float* wscale, const float* colsums, int64_t colsum_stride,
                     int64_t groups, int64_t act_groups, float* y, int64_t y_stride, int64_t col0, int64_t n,
                     const float* bias) {
  alignas(64) float out[ROWS][kPanelCols] = {};
  for (int64_t a = 0; a < act_groups; ++a) {
    const int64_t g0 = a * kLanesPerActGroup, g1 = std::min(groups, g0 + kLanesPerActGroup);
    const float* sx = xscale + a * act_group_stride;
    const float* colsum = colsums + a * colsum_stride + col0;
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
    __m512i acc[ROWS];
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_si512();
    for (int64_t g = g0; g < g1; ++g) {
      const int8_t* w = panel + g * kGroupBytes;
      __builtin_prefetch(w + kPrefetchW8a8);
      const __m512i wv = _mm512_loadu_si512(w);
      const uint8_t* xg = xq + g * group_stride;
#pragma GCC unroll 16
      for (int r = 0; r < ROWS; ++r) acc[r] = dpbusd(acc[r], _mm512_set1_epi32(load_lane(xg + r * kGroup)), wv);
    }
    const __m512i zero_point = _mm512_slli_epi32(_mm512_cvtps_epi32(_mm512_loadu_ps(colsum)), 7);
    for (int r = 0; r < ROWS; ++r) {
      const __m512 sum = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r], zero_point));
      _mm512_store_ps(out[r], _mm512_fmadd_ps(sum, _mm512_set1_ps(sx[r]), _mm512_load_ps(out[r])));
    }
#elif defined(__AVXVNNI__)
    __m256i lo[ROWS], hi[ROWS];  // columns 0-7 and 8-15
    for (int r = 0; r < ROWS; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
    for (int64_t g = g0; g < g1; ++g) {
      const int8_t* w = panel + g * kGroupBytes;
      __builtin_prefetch(w + kPrefetchW8a8);
      const __m256i wlo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
      const __m256i whi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32));
#pragma GCC unroll 16
      for (int r = 0; r < ROWS; ++r) {
        const __m256i xv = _mm256_set1_epi32(load_lane(xq + g * group_stride + r * kGroup));
        lo[r] = _mm256_dpbusd_avx_epi32(lo[r], xv, wlo);
        hi[r] = _mm256_dpbusd_avx_epi32(hi[r], xv, whi);
      }
    }
    const __m256i zlo = _mm256_slli_epi32(_mm256_cvtps_epi32(_mm256_loadu_ps(colsum)), 7);
    const __m256i zhi = _mm256_slli_epi32(_mm256_cvtps_epi32(_mm256_loadu_ps(colsum + 8)), 7);
    for (int r = 0; r < ROWS; ++r) {
      const __m256 s = _mm256_set1_ps(sx[r]);
      _mm256_store_ps(out[r], _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(lo[r], zlo)), s,
                                              _mm256_load_ps(out[r])));
      _mm256_store_ps(out[r] + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(hi[r], zhi)), s,
                                                  _mm256_load_ps(out[r] + 8)));
    }
#else
    int32_t acc[ROWS][kPanelCols] = {};
    for (int64_t g = g0; g < g1; ++g) {
      const int8_t* w = panel + g * kGroupBytes;
      for (int r = 0; r < ROWS; ++r) {
        const uint8_t* xr = xq + g * group_stride + r * kGroup;
        for (int e = 0; e < kPanelCols; ++e)
          for (int j = 0; j < kGroup; ++j) acc[r][e] += static_cast<int32_t>(xr[j]) * w[e * kGroup + j];
      }
    }
    for (int r = 0; r < ROWS; ++r)
      for (int e = 0; e < kPanelCols; ++e)
        out[r][e] += static_cast<float>(acc[r][e] - kZeroPoint * static_cast<int32_t>(colsum[e])) * sx[r];
#endif
  }
  for (int r = 0; r < ROWS; ++r)
    for (int e = 0; e < kPanelCols; ++e) out[r][e] *= wscale[col0 + e];
  store_tile<ROWS>(out, y, y_stride, col0, n, bias);
}

}  // namespace

// Whether this build runs W8A8 on VNNI (AVX-512 VNNI or AVX-VNNI); without it the plain C++ sums are slower
// than the weight-only kernel, which the engine then serves instead.
bool w8a8_native_cpu() { return kVnni; }

torch::Tensor panel_linear_w8a8_cpu(torch::Tensor x, torch::Tensor panels, torch::Tensor scales,
                                    int64_t out_features, c10::optional<torch::Tensor> bias) {
  check_panel_x(x);
  const int64_t rows = x.size(0), k = x.size(1);
  const int64_t groups = (k + kGroup - 1) / kGroup, act_groups = (k + kActGroup - 1) / kActGroup;
  TORCH_CHECK(panels.scalar_type() == torch::kInt8 && panels.is_contiguous() && panels.dim() == 4 &&
                  panels.size(1) == groups && panels.size(2) == kPanelCols && panels.size(3) == kGroup,
              "panels must be the contiguous int8 [ceil(out / 16), ceil(in_features / 4), 16, 4] W8A8 packing");
  const int64_t num_panels = panels.size(0), cols = num_panels * kPanelCols;
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == 1 + act_groups && scales.size(1) == cols && out_features <= cols,
              "scales must be float32 [1 + ceil(in_features / 64), ceil(out / 16) * 16]: the weight scales, then "
              "the column sums of each group of 64 inputs (pack_panels_w8a8)");
  auto y = torch::empty({rows, out_features}, x.options());
  auto xq = torch::empty({groups, rows, kGroup}, x.options().dtype(torch::kUInt8));
  auto xscale = torch::empty({act_groups, rows}, x.options());
  uint8_t* qp = xq.data_ptr<uint8_t>();
  float* xsp = xscale.data_ptr<float>();
  quantize_rows_u8(x.data_ptr<float>(), x.stride(0), rows, k, groups, act_groups, qp, xsp);
  const int8_t* wp = panels.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  // Prefill-sized batches in chunks of rows, each chunk's codes (k bytes a row) read from L2 by every panel
  for (int64_t c0 = 0; c0 < rows; c0 += kChunkRows) {
    const int64_t chunk = std::min(kChunkRows, rows - c0);
    for_each_panel_tile(chunk, num_panels, [&](int64_t p, int64_t r0, auto height) {
      const int64_t r = c0 + r0;
      panel_rows_w8a8<decltype(height)::value>(qp + r * kGroup, rows * kGroup, xsp + r, rows,
                                               wp + p * groups * kGroupBytes, sp, sp + cols, cols, groups, act_groups,
                                               yp + r * out_features, out_features, p * kPanelCols, out_features, bp);
    });
  }
  return y;
}
