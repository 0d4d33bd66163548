// The CPU serving path's kernels (fp32), built on first use by kernels/cpu.py with torch's cpp_extension:
// write_kv and paged decode attention (same functions, layouts and results as kernels/reference.py), the
// decoder layer's elementwise ops (worker/models/layer_ops.py) and the small-batch panel linear
// (worker/models/cpu_linear.py). tests/test_cpu_kernels.py compares each with its PyTorch version.
//
// Layout (as everywhere in kernels/):
//   k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim], contiguous
//   block_tables      int32 [num_seqs, max_blocks_per_seq] (last dim contiguous)
//   seq_lens          int32 [num_seqs]
//   slot_mapping      int64 [num_tokens], -1 = skip
//   q, k, v           [num_tokens, heads, head_dim], any token/head strides, head_dim contiguous
//
// Why a C++ kernel on the CPU: the PyTorch reference gathers each sequence's blocks into a padded copy and
// runs ~20 small ops per layer; this reads each cached row once, in place, which is what decode attention
// costs at its floor (memory bandwidth). Compiled with -ffast-math for vectorised exp and reductions, so no
// infinities are used: running maxima start at -1e30 and only the first seq_lens[i] tokens are ever read.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
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

void write_kv_cpu(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                  torch::Tensor slot_mapping) {
  check_layout(k, "k");
  check_layout(v, "v");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "k_cache and v_cache must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous(),
              "slot_mapping must be a contiguous int64 tensor");
  const int64_t num_tokens = k.size(0), num_kv_heads = k.size(1), head_dim = k.size(2);
  const int64_t row = num_kv_heads * head_dim;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  const size_t bytes = head_dim * sizeof(float);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      std::memcpy(kc + slot * row + h * head_dim, kp + t * ks0 + h * ks1, bytes);
      std::memcpy(vc + slot * row + h * head_dim, vp + t * vs0 + h * vs1, bytes);
    }
  }
}

// One work item is one sequence with all its heads, so each cached row [num_kv_heads, head_dim] is read
// once, front to back. Per block of block_size tokens: scores for every query head, then an online-softmax
// update (running max m, running sum l, rescaled accumulator acc), then the P·V accumulation.
torch::Tensor paged_decode_attention_cpu(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                         torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  check_layout(q, "q");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "k_cache and v_cache must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.stride(1) == 1,
              "block_tables must be int32 with a contiguous last dimension");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt32 && seq_lens.is_contiguous(),
              "seq_lens must be a contiguous int32 tensor");
  const int64_t num_seqs = q.size(0), num_q_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(num_q_heads % num_kv_heads == 0, "num_q_heads must be a multiple of num_kv_heads");
  const int64_t group = num_q_heads / num_kv_heads;
  const int64_t row = num_kv_heads * head_dim;
  auto out = torch::empty({num_seqs, num_q_heads, head_dim}, q.options());
  const float* qp = q.data_ptr<float>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t table_stride = block_tables.stride(0);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(num_q_heads * head_dim), acc(num_q_heads * head_dim);
    std::vector<float> m(num_q_heads), l(num_q_heads), scores(num_q_heads * block_size);
    for (int64_t s = begin; s < end; ++s) {
      const int64_t len = lens[s];
      for (int64_t h = 0; h < num_q_heads; ++h) {
        const float* src = qp + s * qs0 + h * qs1;
        for (int64_t d = 0; d < head_dim; ++d) qs[h * head_dim + d] = src[d] * fscale;
        m[h] = -1e30f;
        l[h] = 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t start = 0; start < len; start += block_size) {
        const int64_t block = tables[s * table_stride + start / block_size];
        const int64_t n = std::min(block_size, len - start);
        const float* kb = kp + block * block_size * row;
        const float* vb = vp + block * block_size * row;
        for (int64_t j = 0; j < n; ++j) {
          for (int64_t h = 0; h < num_q_heads; ++h) {
            const float* kr = kb + j * row + (h / group) * head_dim;
            const float* qh = qs.data() + h * head_dim;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * kr[d];
            scores[h * block_size + j] = dot;
          }
        }
        for (int64_t h = 0; h < num_q_heads; ++h) {
          float* sh = scores.data() + h * block_size;
          float block_max = m[h];
          for (int64_t j = 0; j < n; ++j) block_max = std::max(block_max, sh[j]);
          const float correction = std::exp(m[h] - block_max);
#pragma omp simd
          for (int64_t j = 0; j < n; ++j) sh[j] = std::exp(sh[j] - block_max);
          float block_sum = 0.f;
          for (int64_t j = 0; j < n; ++j) block_sum += sh[j];
          l[h] = l[h] * correction + block_sum;
          m[h] = block_max;
          float* ah = acc.data() + h * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) ah[d] *= correction;
        }
        for (int64_t j = 0; j < n; ++j) {
          for (int64_t h = 0; h < num_q_heads; ++h) {
            const float p = scores[h * block_size + j];
            const float* vr = vb + j * row + (h / group) * head_dim;
            float* ah = acc.data() + h * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) ah[d] += p * vr[d];
          }
        }
      }
      for (int64_t h = 0; h < num_q_heads; ++h) {
        float* dst = op + (s * num_q_heads + h) * head_dim;
        const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;  // seq_lens 0: zeros
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = acc[h * head_dim + d] * inv;
      }
    }
  });
  return out;
}

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

// ---- small-batch linear layers ----
// y [m, n] = x [m, k] · Wᵀ (+ bias) for the few rows of a decode step. The weight is kept as 16-column
// panels, [ceil(n / 16), k, 16] (worker/models/cpu_linear.py packs it), so each panel streams from memory
// once, front to back, while up to 16 rows of x accumulate against it in registers: at a few rows a decode
// step's linear layers are a read of every weight, and this reads at close to the memory bandwidth.

namespace {

template <int ROWS>
void panel_rows(const float* x, int64_t x_stride, const float* panel, int64_t k, float* y, int64_t y_stride,
                int64_t col0, int64_t n, const float* bias) {
  float acc[ROWS][16];
  for (int r = 0; r < ROWS; ++r)
    for (int e = 0; e < 16; ++e) acc[r][e] = 0.f;
  for (int64_t i = 0; i < k; ++i) {
    const float* w = panel + i * 16;
    for (int r = 0; r < ROWS; ++r) {
      const float xv = x[r * x_stride + i];
#pragma omp simd
      for (int e = 0; e < 16; ++e) acc[r][e] += xv * w[e];
    }
  }
  const int64_t cols = std::min<int64_t>(16, n - col0);
  for (int r = 0; r < ROWS; ++r)
    for (int64_t e = 0; e < cols; ++e) y[r * y_stride + col0 + e] = acc[r][e] + (bias ? bias[col0 + e] : 0.f);
}

}  // namespace

torch::Tensor panel_linear_cpu(torch::Tensor x, torch::Tensor panels, int64_t out_features,
                               c10::optional<torch::Tensor> bias) {
  check_layout(x, "x");
  TORCH_CHECK(x.dim() == 2, "x must be [rows, in_features]");
  TORCH_CHECK(panels.is_contiguous() && panels.size(2) == 16 && panels.size(1) == x.size(1),
              "panels must be the contiguous [ceil(out / 16), in_features, 16] packing of the weight");
  const int64_t rows = x.size(0), k = x.size(1), num_panels = panels.size(0);
  auto y = torch::empty({rows, out_features}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const int64_t xs = x.stride(0);
  at::parallel_for(0, num_panels, 4, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const float* panel = wp + p * k * 16;
      for (int64_t r0 = 0; r0 < rows;) {
        const int64_t left = rows - r0;
        const float* xr = xp + r0 * xs;
        float* yr = yp + r0 * out_features;
        if (left >= 16) {
          panel_rows<16>(xr, xs, panel, k, yr, out_features, p * 16, out_features, bp);
          r0 += 16;
        } else if (left >= 8) {
          panel_rows<8>(xr, xs, panel, k, yr, out_features, p * 16, out_features, bp);
          r0 += 8;
        } else if (left >= 4) {
          panel_rows<4>(xr, xs, panel, k, yr, out_features, p * 16, out_features, bp);
          r0 += 4;
        } else if (left >= 2) {
          panel_rows<2>(xr, xs, panel, k, yr, out_features, p * 16, out_features, bp);
          r0 += 2;
        } else {
          panel_rows<1>(xr, xs, panel, k, yr, out_features, p * 16, out_features, bp);
          r0 += 1;
        }
      }
    }
  });
  return y;
}
