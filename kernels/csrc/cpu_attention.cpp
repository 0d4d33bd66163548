// The CPU serving path's KV cache kernels: write_kv and paged decode attention over a float32, bfloat16 or
// int8 KV cache (same functions, layouts and results as kernels/reference.py and kernels/kv_quant.py).
// Built after cpu_kernels.cpp in the same translation unit (kernels/cpu.py), whose check_layout it uses;
// decode_layers.cpp calls both functions. tests/kernels/test_cpu_kernels.py and test_cpu_kv_dtypes.py compare
// them with the PyTorch versions.
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

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

// ---- KV cache element kinds (kernels/kv_quant.py has the layouts) ----
// Each kind says how a row's codes become floats (load) and the row's scale (1 for plain floats, else the fp32
// stored after the head_dim codes): int8 sign-extends and converts, bf16 is a 16-bit shift.

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

// ---- paged decode attention ----
// The loops over a block are templates over the kind of the rows they read. The fp32 cache is read in place.
// A bf16 or int8 block is first widened, once per (block, KV head), into a small per-thread fp32 scratch
// (its rows' scales folded in) that the fp32 loops then read for every query head of the group: widening
// inside those loops instead repeated the conversion once per query head (3× for SmolLM2's 9 q / 3 KV heads),
// and it lets int8 use the fp32 P·V loop with its accumulator in vector registers (GCC would not vectorise
// an int8 convert inside it). The scratch is a block of K and one of V (2 × 4 KiB at block 16, head_dim 64),
// so it stays in L1. With one query head per KV head there is nothing to share: the block's rows are widened
// in registers inside the loops, and each row's scale multiplies its score (K) or its softmax weight (V).
// docs/quantization.md has the measurements (benchmarks/bench_kv_kernel_ab.py).

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

// dst [n, head_dim] = the n rows (row elements apart) at src as fp32, each times its scale
template <typename Kind, int D>
inline void widen_rows(const typename Kind::T* __restrict src, int64_t row, int64_t n, int64_t head_dim,
                       float* __restrict dst) {
  const int64_t dim = D > 0 ? D : head_dim;
  for (int64_t j = 0; j < n; ++j) {
    const typename Kind::T* r = src + j * row;
    const float s = Kind::scale(r, dim);
    float* o = dst + j * dim;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) o[d] = s * Kind::load(r, d);
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
  if constexpr (D > 0 && std::is_same_v<Kind, KvF32>) {
    // fp32 rows (a cache's or a widened block's): the accumulator as GCC vectors, which stay in registers (one
    // zmm or two ymm each); GCC 12 kept the float a[D] below on the stack, a store and reload per row
    using Vec = float __attribute__((vector_size(64)));
    constexpr int kLanes = 16, kVecs = D / kLanes;
    static_assert(D % kLanes == 0);
    Vec a[kVecs];
#pragma GCC unroll 8
    for (int i = 0; i < kVecs; ++i) {
      std::memcpy(&a[i], acc + i * kLanes, sizeof(Vec));
      a[i] *= correction;
    }
    for (int64_t j = 0; j < n; ++j) {
      const float* vr = v + j * row;
      const float pj = p[j];
#pragma GCC unroll 8
      for (int i = 0; i < kVecs; ++i) {
        Vec x;
        std::memcpy(&x, vr + i * kLanes, sizeof x);
        a[i] += pj * x;
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < kVecs; ++i) std::memcpy(acc + i * kLanes, &a[i], sizeof(Vec));
  } else if constexpr (D > 0) {
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

// One block of n rows (kb, vb: its first K and V row of the KV head, row elements apart) against the `group`
// query heads qs [group, head_dim]: scores, soft-capped if softcap > 0; the first `masked` rows (older than a
// sliding window) set to -1e30, whose exp is 0 (finite: -ffast-math); then the online-softmax update of the
// running max m, sum l and accumulator acc [group, head_dim], and the P·V accumulation.
template <typename Kind, int D>
void attend_block(const float* qs, int64_t group, int64_t head_dim, const typename Kind::T* kb,
                  const typename Kind::T* vb, int64_t row, int64_t n, int64_t masked, int64_t block_size,
                  float softcap, float* scores, float* acc, float* m, float* l) {
  for (int64_t h = 0; h < group; ++h)
    for (int64_t j = 0; j < n; ++j) {
      const typename Kind::T* kr = kb + j * row;
      scores[h * block_size + j] = head_dot<Kind, D>(qs + h * head_dim, kr, head_dim) * Kind::scale(kr, head_dim);
    }
  if (softcap > 0.f)
    for (int64_t h = 0; h < group; ++h)
      for (int64_t j = 0; j < n; ++j) scores[h * block_size + j] = softcap * std::tanh(scores[h * block_size + j] / softcap);
  for (int64_t j = 0; j < masked; ++j)
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

// One work item: the `group` query heads (q scaled, [group, head_dim]) that share one KV head, over one
// sequence's cached tokens first..len-1 (first > 0 under a sliding window; blocks wholly before it are
// skipped, the window's first block masks its older rows); softcap > 0 soft-caps each score (Gemma 2).
// k, v point at the KV head's first row (block 0, token 0); row is the stride between tokens, in cache
// elements. widened: the scratch [2, block_size, head_dim] for bf16 and int8 blocks (unused for fp32).
template <typename Kind, int D>
void attend_kv_head(const float* qs, int64_t group, int64_t head_dim, const typename Kind::T* k,
                    const typename Kind::T* v, int64_t row, const int32_t* table, int64_t first, int64_t len,
                    int64_t block_size, float softcap, float* scores, float* acc, float* m, float* l,
                    float* widened) {
  using T = typename Kind::T;
  constexpr bool kInPlace = std::is_same_v<Kind, KvF32>;  // fp32 rows need no widening: no copy
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
    const int64_t n = std::min(block_size, len - b * block_size), masked = first - b * block_size;
    const T* kb = k + table[b] * block_stride;
    const T* vb = v + table[b] * block_stride;
    if (kInPlace || group == 1) {
      attend_block<Kind, D>(qs, group, head_dim, kb, vb, row, n, masked, block_size, softcap, scores, acc, m, l);
    } else {
      float* kw = widened;
      float* vw = widened + block_size * head_dim;
      widen_rows<Kind, D>(kb, row, n, head_dim, kw);
      widen_rows<Kind, D>(vb, row, n, head_dim, vw);
      attend_block<KvF32, D>(qs, group, head_dim, kw, vw, head_dim, n, masked, block_size, softcap, scores, acc, m, l);
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
  // attend_kv_head's scratch, plus a line's worth of floats: the widened rows start on a cache line, as an
  // fp32 cache's rows do (head_dim 64: 256 bytes apart)
  const bool widens = !std::is_same_v<Kind, KvF32> && group > 1;
  const int64_t scratch = widens ? 2 * block_size * head_dim + kLineBytes / static_cast<int64_t>(sizeof(float)) : 0;

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(group * head_dim), acc(group * head_dim), m(group), l(group), scores(group * block_size);
    std::vector<float> widened_buf(scratch);
    const auto line = (reinterpret_cast<uintptr_t>(widened_buf.data()) + kLineBytes - 1) & ~uintptr_t(kLineBytes - 1);
    float* widened = widens ? reinterpret_cast<float*>(line) : nullptr;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / num_kv_heads, g = item % num_kv_heads;
      for (int64_t h = 0; h < group; ++h) {
        const float* src = qp + s * qs0 + (g * group + h) * qs1;
        for (int64_t d = 0; d < head_dim; ++d) qs[h * head_dim + d] = src[d] * scale;
      }
      const int64_t first = window > 0 ? std::max<int64_t>(0, lens[s] - window) : 0;
      attend(qs.data(), group, head_dim, kp + g * width, vp + g * width, row, tables + s * table_stride,
             first, lens[s], block_size, softcap, scores.data(), acc.data(), m.data(), l.data(), widened);
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
