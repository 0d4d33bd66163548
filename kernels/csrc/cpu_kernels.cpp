// The CPU serving path's kernels (fp32), built on first use by kernels/cpu.py with torch's cpp_extension:
// write_kv and paged decode attention over a float32, bfloat16 or int8 KV cache (same functions, layouts and
// results as kernels/reference.py and kernels/kv_quant.py), the
// decoder layer's elementwise ops (worker/engine/backends/cpu.py), the greedy sampler's argmax
// (worker/engine/backends/cpu.py) and the small-batch panel linear (worker/engine/backends/cpu_linear.py).
// tests/kernels/test_cpu_kernels.py compares each with its PyTorch version.
//
// Layout (as everywhere in kernels/):
//   k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim], contiguous; int8: head_dim + 4
//                     (a row's codes, then its fp32 scale: kernels/kv_quant.py)
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

// ---- KV cache element kinds (kernels/kv_quant.py has the layouts) ----
// Each kind says how a row's codes become floats (load) and the row's scale (1 for plain floats, else the fp32
// stored after the head_dim codes). The attention loops are templates over the kind: the fp32 instance is the
// code it always was (x * 1.f is x), the others widen codes to fp32 in registers inside the same simd loops
// (int8: sign-extend + convert; bf16: a 16-bit shift) and fold the row's scale into the score (K) or the
// softmax weight (V), so a row is never dequantized into memory.

namespace {

struct KvF32 {
  using T = float;
  static constexpr int64_t kExtra = 0;  // elements after the head_dim codes of a row
  static inline float load(const T* p, int64_t d) { return p[d]; }
  static inline float scale(const T*, int64_t) { return 1.f; }
};

struct KvBf16 {
  using T = uint16_t;  // bfloat16 bits: the high half of an fp32
  static constexpr int64_t kExtra = 0;
  static inline float load(const T* p, int64_t d) {
    const uint32_t bits = static_cast<uint32_t>(p[d]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  }
  static inline float scale(const T*, int64_t) { return 1.f; }
};

struct KvInt8 {
  using T = int8_t;
  static constexpr int64_t kExtra = 4;  // the row's fp32 scale, as 4 bytes
  static inline float load(const T* p, int64_t d) { return static_cast<float>(p[d]); }
  static inline float scale(const T* row, int64_t head_dim) {
    float s;
    std::memcpy(&s, row + head_dim, sizeof s);
    return s;
  }
};

template <typename Kind>
const typename Kind::T* cache_data(const torch::Tensor& cache) {
  return reinterpret_cast<const typename Kind::T*>(cache.data_ptr());
}

// one token's row of one head into a cache row of the kind
template <typename Kind>
inline void store_row(const float* __restrict x, typename Kind::T* __restrict dst, int64_t head_dim);

template <>
inline void store_row<KvF32>(const float* __restrict x, float* __restrict dst, int64_t head_dim) {
  std::memcpy(dst, x, head_dim * sizeof(float));
}

template <>
inline void store_row<KvBf16>(const float* __restrict x, uint16_t* __restrict dst, int64_t head_dim) {
  for (int64_t d = 0; d < head_dim; ++d) dst[d] = c10::BFloat16(x[d]).x;  // round to nearest even, as torch
}

// symmetric: scale = max|x| / 127, codes = round(x * (127 / max|x|)) (kv_quant.quantize, the same fp32 ops)
template <>
inline void store_row<KvInt8>(const float* __restrict x, int8_t* __restrict dst, int64_t head_dim) {
  float amax = 0.f;
#pragma omp simd reduction(max : amax)
  for (int64_t d = 0; d < head_dim; ++d) amax = std::max(amax, std::fabs(x[d]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int64_t d = 0; d < head_dim; ++d)
    dst[d] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, std::nearbyint(x[d] * inv))));
  const float scale = amax / 127.f;
  std::memcpy(dst + head_dim, &scale, sizeof scale);
}

template <typename Kind>
void write_kv_rows(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& k_cache, torch::Tensor& v_cache,
                   const int64_t* slots) {
  const int64_t num_tokens = k.size(0), num_kv_heads = k.size(1), head_dim = k.size(2);
  const int64_t width = head_dim + Kind::kExtra, row = num_kv_heads * width;
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  auto* kc = const_cast<typename Kind::T*>(cache_data<Kind>(k_cache));
  auto* vc = const_cast<typename Kind::T*>(cache_data<Kind>(v_cache));
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      store_row<Kind>(kp + t * ks0 + h * ks1, kc + slot * row + h * width, head_dim);
      store_row<Kind>(vp + t * vs0 + h * vs1, vc + slot * row + h * width, head_dim);
    }
  }
}

// the cache's kind from its dtype; also checks that its rows are as wide as the kind needs
int cache_kind(const torch::Tensor& k_cache, const torch::Tensor& v_cache, int64_t head_dim) {
  TORCH_CHECK(k_cache.device().is_cpu() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "k_cache and v_cache must be contiguous CPU tensors");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && k_cache.sizes() == v_cache.sizes(),
              "k_cache and v_cache must share dtype and shape");
  const auto dtype = k_cache.scalar_type();
  const int kind = dtype == torch::kFloat32 ? 0 : dtype == torch::kBFloat16 ? 1 : dtype == torch::kInt8 ? 2 : -1;
  TORCH_CHECK(kind >= 0, "the KV cache must be float32, bfloat16 or int8 (kernels/kv_quant.py), got ", dtype);
  TORCH_CHECK(k_cache.size(3) == head_dim + (kind == 2 ? KvInt8::kExtra : 0),
              "KV cache rows of ", k_cache.size(3), " elements do not fit head_dim ", head_dim,
              " (int8 rows are head_dim + 4: codes, then the fp32 scale)");
  return kind;
}

}  // namespace

void write_kv_cpu(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                  torch::Tensor slot_mapping) {
  check_layout(k, "k");
  check_layout(v, "v");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous(),
              "slot_mapping must be a contiguous int64 tensor");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  switch (cache_kind(k_cache, v_cache, k.size(2))) {
    case 0: write_kv_rows<KvF32>(k, v, k_cache, v_cache, slots); break;
    case 1: write_kv_rows<KvBf16>(k, v, k_cache, v_cache, slots); break;
    default: write_kv_rows<KvInt8>(k, v, k_cache, v_cache, slots); break;
  }
}

namespace {

// Blocks sit at random addresses, so the hardware prefetcher cannot see the next one coming: each work item
// asks for its rows this many blocks ahead, which covers the DRAM latency of a decode step's cold cache.
constexpr int64_t kPrefetchBlocks = 2;
constexpr int64_t kLineBytes = 64;

// k, v: a block's first row of the KV head; row_bytes apart, head_bytes of each (codes and scale)
inline void prefetch_block(const void* k, const void* v, int64_t block_size, int64_t row_bytes, int64_t head_bytes) {
  const char* kc = static_cast<const char*>(k);
  const char* vc = static_cast<const char*>(v);
  for (int64_t j = 0; j < block_size; ++j)
    for (int64_t d = 0; d < head_bytes; d += kLineBytes) {
      __builtin_prefetch(kc + j * row_bytes + d);
      __builtin_prefetch(vc + j * row_bytes + d);
    }
}

// q·k over one head, k's codes widened to fp32 (its scale is applied by the caller). D > 0 is head_dim fixed
// at compile time (the loops unroll and the accumulator below stays in registers); D = 0 reads it at run time.
template <typename Kind, int D>
inline float head_dot(const float* a, const typename Kind::T* b, int64_t head_dim) {
  const int64_t n = D > 0 ? D : head_dim;
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < n; ++d) s += a[d] * Kind::load(b, d);
  return s;
}

// acc = acc * correction + sum_j p[j] * scale_j * v[j * row] for one query head over one block's n rows
template <typename Kind, int D>
inline void rescale_accumulate(float* __restrict acc, float correction, const float* __restrict p,
                               const typename Kind::T* __restrict v, int64_t row, int64_t n, int64_t head_dim) {
  if constexpr (D > 0) {
    float a[D];
#pragma omp simd
    for (int d = 0; d < D; ++d) a[d] = acc[d] * correction;
    for (int64_t j = 0; j < n; ++j) {
      const typename Kind::T* vr = v + j * row;
      const float pj = p[j] * Kind::scale(vr, D);
#pragma omp simd
      for (int d = 0; d < D; ++d) a[d] += pj * Kind::load(vr, d);
    }
#pragma omp simd
    for (int d = 0; d < D; ++d) acc[d] = a[d];
  } else {
#pragma omp simd
    for (int64_t d = 0; d < head_dim; ++d) acc[d] *= correction;
    for (int64_t j = 0; j < n; ++j) {
      const typename Kind::T* vr = v + j * row;
      const float pj = p[j] * Kind::scale(vr, head_dim);
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) acc[d] += pj * Kind::load(vr, d);
    }
  }
}

// One work item: the `group` query heads (q scaled, [group, head_dim]) that share one KV head, over one
// sequence's cached tokens first..len-1 (first > 0 under a sliding window; blocks wholly before it are
// skipped, the window's first block masks its older rows); softcap > 0 soft-caps each score (Gemma 2). Per block: scores, an online-softmax update (running max m, running
// sum l, rescaled accumulator acc [group, head_dim]), then the P·V accumulation. k, v point at the KV head's
// first row (block 0, token 0); row is the stride between tokens, in cache elements.
template <typename Kind, int D>
void attend_kv_head(const float* qs, int64_t group, int64_t head_dim, const typename Kind::T* k,
                    const typename Kind::T* v, int64_t row, const int32_t* table, int64_t first, int64_t len,
                    int64_t block_size, float softcap, float* scores, float* acc, float* m, float* l) {
  using T = typename Kind::T;
  const int64_t block_stride = block_size * row;
  const int64_t row_bytes = row * sizeof(T), head_bytes = (head_dim + Kind::kExtra) * sizeof(T);
  std::fill(m, m + group, -1e30f);
  std::fill(l, l + group, 0.f);
  std::fill(acc, acc + group * head_dim, 0.f);
  const int64_t num_blocks = (len + block_size - 1) / block_size;
  const int64_t first_block = first / block_size;
  for (int64_t b = first_block; b < std::min(first_block + kPrefetchBlocks, num_blocks); ++b)
    prefetch_block(k + table[b] * block_stride, v + table[b] * block_stride, block_size, row_bytes, head_bytes);
  for (int64_t b = first_block; b < num_blocks; ++b) {
    if (b + kPrefetchBlocks < num_blocks) {
      const int64_t ahead = table[b + kPrefetchBlocks];
      prefetch_block(k + ahead * block_stride, v + ahead * block_stride, block_size, row_bytes, head_bytes);
    }
    const int64_t n = std::min(block_size, len - b * block_size);
    const T* kb = k + table[b] * block_stride;
    const T* vb = v + table[b] * block_stride;
    for (int64_t h = 0; h < group; ++h)
      for (int64_t j = 0; j < n; ++j) {
        const T* kr = kb + j * row;
        scores[h * block_size + j] = head_dot<Kind, D>(qs + h * head_dim, kr, head_dim) * Kind::scale(kr, head_dim);
      }
    if (softcap > 0.f)
      for (int64_t h = 0; h < group; ++h)
        for (int64_t j = 0; j < n; ++j) scores[h * block_size + j] = softcap * std::tanh(scores[h * block_size + j] / softcap);
    // rows of the window's first block that fell out of it: exp(-1e30 - max) is 0 (finite: -ffast-math)
    for (int64_t j = 0; j < first - b * block_size; ++j)
      for (int64_t h = 0; h < group; ++h) scores[h * block_size + j] = -1e30f;
    for (int64_t h = 0; h < group; ++h) {
      float* sh = scores + h * block_size;
      float block_max = m[h];
      for (int64_t j = 0; j < n; ++j) block_max = std::max(block_max, sh[j]);
      const float correction = std::exp(m[h] - block_max);
      float block_sum = 0.f;
#pragma omp simd reduction(+ : block_sum)
      for (int64_t j = 0; j < n; ++j) {
        sh[j] = std::exp(sh[j] - block_max);
        block_sum += sh[j];
      }
      l[h] = l[h] * correction + block_sum;
      m[h] = block_max;
      rescale_accumulate<Kind, D>(acc + h * head_dim, correction, sh, vb, row, n, head_dim);
    }
  }
}

// every (sequence, KV head) work item of a batch over a cache of one kind
template <typename Kind>
void attend_batch(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                  const torch::Tensor& block_tables, const torch::Tensor& seq_lens, float scale, int64_t window,
                  float softcap, torch::Tensor& out) {
  const int64_t num_seqs = q.size(0), num_q_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_q_heads / num_kv_heads;
  const int64_t width = head_dim + Kind::kExtra, row = num_kv_heads * width;
  const float* qp = q.data_ptr<float>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const typename Kind::T* kp = cache_data<Kind>(k_cache);
  const typename Kind::T* vp = cache_data<Kind>(v_cache);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t table_stride = block_tables.stride(0);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const auto attend = head_dim == 64 ? attend_kv_head<Kind, 64>
                      : head_dim == 128 ? attend_kv_head<Kind, 128> : attend_kv_head<Kind, 0>;

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(group * head_dim), acc(group * head_dim), m(group), l(group), scores(group * block_size);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / num_kv_heads, g = item % num_kv_heads;
      for (int64_t h = 0; h < group; ++h) {
        const float* src = qp + s * qs0 + (g * group + h) * qs1;
        for (int64_t d = 0; d < head_dim; ++d) qs[h * head_dim + d] = src[d] * scale;
      }
      const int64_t first = window > 0 ? std::max<int64_t>(0, lens[s] - window) : 0;
      attend(qs.data(), group, head_dim, kp + g * width, vp + g * width, row, tables + s * table_stride,
             first, lens[s], block_size, softcap, scores.data(), acc.data(), m.data(), l.data());
      for (int64_t h = 0; h < group; ++h) {
        float* dst = op + (s * num_q_heads + g * group + h) * head_dim;
        const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;  // seq_lens 0: zeros
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = acc[h * head_dim + d] * inv;
      }
    }
  });
}

}  // namespace

// One work item is one (sequence, KV head) pair, so each cached K/V row of a head is read once, against all
// the query heads that share it (GQA), and a few sequences still give every thread work.
torch::Tensor paged_decode_attention_cpu(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                         torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                                         int64_t window, double softcap) {
  check_layout(q, "q");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.stride(1) == 1,
              "block_tables must be int32 with a contiguous last dimension");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt32 && seq_lens.is_contiguous(),
              "seq_lens must be a contiguous int32 tensor");
  const int kind = cache_kind(k_cache, v_cache, q.size(2));
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "num_q_heads must be a multiple of num_kv_heads");
  auto out = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  const float fscale = static_cast<float>(scale), fsoftcap = static_cast<float>(softcap);
  switch (kind) {
    case 0: attend_batch<KvF32>(q, k_cache, v_cache, block_tables, seq_lens, fscale, window, fsoftcap, out); break;
    case 1: attend_batch<KvBf16>(q, k_cache, v_cache, block_tables, seq_lens, fscale, window, fsoftcap, out); break;
    default: attend_batch<KvInt8>(q, k_cache, v_cache, block_tables, seq_lens, fscale, window, fsoftcap, out); break;
  }
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
