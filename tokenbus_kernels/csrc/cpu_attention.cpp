// The CPU serving path's KV cache kernels: write_kv and paged decode attention over a float32, bfloat16 or
// int8 KV cache (same functions, layouts and results as tokenbus_kernels/reference.py and tokenbus_kernels/kv_quant.py).
// This file has the cache kinds and write_kv; the attention is in cpu_decode_attention.cpp, next in the same
// translation unit (tokenbus_kernels/cpu.py), built after cpu_kernels.cpp, whose check_layout both use;
// decode_layers.cpp calls both functions. tests/kernels/test_cpu_kernels.py and test_cpu_kv_dtypes.py compare
// them with the PyTorch versions.
//
// Layout (as everywhere in tokenbus_kernels/):
//   k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim], contiguous; int8: head_dim + 4
//                     (a row's codes, then its fp32 scale: tokenbus_kernels/kv_quant.py)
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

// ---- KV cache element kinds (tokenbus_kernels/kv_quant.py has the layouts) ----
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
  TORCH_CHECK(kind >= 0, "the KV cache must be float32, bfloat16 or int8 (tokenbus_kernels/kv_quant.py), got ", dtype);
  TORCH_CHECK(k_cache.size(3) == head_dim + (kind == 2 ? KvInt8::kExtra : 0),
              "KV cache rows of ", k_cache.size(3), " elements do not fit head_dim ", head_dim,
              " (int8 rows are head_dim + 4: codes, then the fp32 scale)");
  return kind;
}

// f(Kind{}) for the kind cache_kind returned: the one switch every entry point (write, decode, prefill) shares
template <typename F>
void with_cache_kind(int kind, F&& f) {
  switch (kind) {
    case 0: f(KvF32{}); break;
    case 1: f(KvBf16{}); break;
    default: f(KvInt8{}); break;
  }
}

// The arguments the paged attention kernels (decode, prefill) share, checked: q [tokens, q heads, head_dim]
// fp32, the caches, int32 block tables whose rows are contiguous, whole GQA groups. Returns the cache kind.
int check_paged_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                          const torch::Tensor& block_tables) {
  check_layout(q, "q");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.stride(1) == 1,
              "block_tables must be int32 with a contiguous last dimension");
  const int kind = cache_kind(k_cache, v_cache, q.size(2));
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "num_q_heads must be a multiple of num_kv_heads");
  return kind;
}

// A paged cache as the attention loops walk it: KV head g's rows of block b start at
// k + (table[b] * block_size * row) + g * width, a row `row` elements after the previous token's
template <typename Kind>
struct PagedKv {
  const typename Kind::T* k;
  const typename Kind::T* v;
  const int32_t* tables;
  int64_t table_stride;
  int64_t width;  // one head's row: head_dim, plus the int8 scale
  int64_t row;    // one token's rows of every KV head

  PagedKv(const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& block_tables)
      : k(cache_data<Kind>(k_cache)), v(cache_data<Kind>(v_cache)), tables(block_tables.data_ptr<int32_t>()),
        table_stride(block_tables.stride(0)), width(k_cache.size(3)), row(k_cache.size(2) * k_cache.size(3)) {}
  const int32_t* table(int64_t seq) const { return tables + seq * table_stride; }
};

}  // namespace

void write_kv_cpu(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                  torch::Tensor slot_mapping) {
  check_layout(k, "k");
  check_layout(v, "v");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous(),
              "slot_mapping must be a contiguous int64 tensor");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  with_cache_kind(cache_kind(k_cache, v_cache, k.size(2)), [&](auto kind) {
    write_kv_rows<decltype(kind)>(k, v, k_cache, v_cache, slots);
  });
}
