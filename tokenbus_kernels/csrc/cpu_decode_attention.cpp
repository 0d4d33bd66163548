// The CPU serving path's paged decode attention over a float32, bfloat16 or int8 KV cache (the same function
// and results as tokenbus_kernels/reference.py's paged_decode_attention over the cache dequantized). Built after
// cpu_attention.cpp in the same translation unit (tokenbus_kernels/cpu.py), whose cache kinds (KvF32, KvBf16, KvInt8)
// and cache_kind it uses, and cpu_kernels.cpp's check_layout; decode_layers.cpp calls it. Layouts: the top of
// cpu_attention.cpp. tests/kernels/test_cpu_kernels.py and test_cpu_kv_dtypes.py compare it with the reference.
//
// The loops over a block (cpu_attention_block.cpp) are templates over the kind of the rows they read. The
// fp32 cache is read in place. A bf16 or int8 block is first widened, once per (block, KV head), into a small
// per-thread fp32 scratch (its rows' scales folded in) that the fp32 loops then read for every query head of
// the group: widening inside those loops instead repeated the conversion once per query head (3× for
// SmolLM2's 9 q / 3 KV heads). The scratch is a block of K and one of V (2 × 4 KiB at block 16, head_dim
// 64), so it stays in L1. With one query head per KV head there is nothing to share: the block's rows are
// widened in registers inside the loops, and each row's scale multiplies its score (K) or its softmax
// weight (V). docs/quantization.md has the measurements (benchmarks/bench_kv_kernel_ab.py at commit 6e4505d).

namespace {

// Blocks sit at random addresses, so the hardware prefetcher cannot see the next one coming: each work item
// asks for its rows this many blocks ahead, which covers the DRAM latency of a decode step's cold cache (the
// first blocks at once, prefetch_block; then a row at a time, Ahead in cpu_attention_block.cpp).
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

// dst [n, head_dim] = the n rows (row elements apart) at src as fp32, each times its scale; whole vectors
// (load_lanes: one sign-extend per 16 codes with AVX-512, where GCC's loop took two steps in ymm halves)
template <typename Kind, int D>
inline void widen_rows(const typename Kind::T* __restrict src, int64_t row, int64_t n, int64_t head_dim,
                       float* __restrict dst, Ahead pf) {
  const int64_t dim = D > 0 ? D : head_dim;
  for (int64_t j = 0; j < n; ++j) {
    const typename Kind::T* r = src + j * row;
    pf.row(j);
    const float s = Kind::scale(r, dim);
    float* o = dst + j * dim;
    if constexpr (D > 0 && D % kLanes == 0) {
#pragma GCC unroll 16
      for (int i = 0; i < D / kLanes; ++i) {
        const Lanes x = load_lanes(r + i * kLanes) * s;
        std::memcpy(o + i * kLanes, &x, sizeof x);
      }
    } else {
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) o[d] = s * Kind::load(r, d);
    }
  }
}

// The online softmax's state before any key: running maxima -1e30 (no infinities: -ffast-math), sums and
// accumulators 0, for `group` query rows
inline void start_state(int64_t group, int64_t head_dim, float* acc, float* m, float* l) {
  std::fill(m, m + group, -1e30f);
  std::fill(l, l + group, 0.f);
  std::fill(acc, acc + group * head_dim, 0.f);
}

// One work item: the `group` query heads (q scaled, [group, head_dim]) that share one KV head, over one
// sequence's cached tokens first..len-1 (first > 0 under a sliding window; blocks wholly before it are
// skipped, the window's first block masks its older rows); softcap > 0 soft-caps each score (Gemma 2).
// k, v point at the KV head's first row (block 0, token 0); row is the stride between tokens, in cache
// elements. widened: the scratch [2, block_size, head_dim] for bf16 and int8 blocks (unused for fp32).
// It continues the online softmax in m, l, acc (start_state, or a cascade's shared part before it);
// head_first (null: none) gives each query row its own first key (attend_block).
template <typename Kind, int D>
void attend_kv_head(const float* qs, int64_t group, int64_t head_dim, const typename Kind::T* k,
                    const typename Kind::T* v, int64_t row, const int32_t* table, int64_t first, int64_t len,
                    int64_t block_size, float softcap, float* scores, float* acc, float* m, float* l,
                    float* widened, const int64_t* head_first = nullptr) {
  using T = typename Kind::T;
  constexpr bool kInPlace = std::is_same_v<Kind, KvF32>;  // fp32 rows need no widening: no copy
  const int64_t block_stride = block_size * row;
  const int64_t row_bytes = row * sizeof(T), head_bytes = (head_dim + Kind::kExtra) * sizeof(T);
  const int64_t num_blocks = (len + block_size - 1) / block_size;
  const int64_t first_block = first / block_size;
  for (int64_t b = first_block; b < std::min(first_block + kPrefetchBlocks, num_blocks); ++b)
    prefetch_block(k + table[b] * block_stride, v + table[b] * block_stride, block_size, row_bytes, head_bytes);
  for (int64_t b = first_block; b < num_blocks; ++b) {
    Ahead pf_k = {nullptr, row_bytes, head_bytes}, pf_v = pf_k;  // block b + kPrefetchBlocks, row by row
    if (b + kPrefetchBlocks < num_blocks) {
      const int64_t ahead = table[b + kPrefetchBlocks];
      pf_k.base = reinterpret_cast<const char*>(k + ahead * block_stride);
      pf_v.base = reinterpret_cast<const char*>(v + ahead * block_stride);
    }
    const int64_t n = std::min(block_size, len - b * block_size), masked = first - b * block_size;
    const T* kb = k + table[b] * block_stride;
    const T* vb = v + table[b] * block_stride;
    if (kInPlace || group == 1) {
      attend_block<Kind, D>(qs, group, head_dim, kb, vb, row, n, masked, block_size, softcap, scores, acc, m, l,
                            pf_k, pf_v, head_first, b * block_size);
    } else {
      float* kw = widened;
      float* vw = widened + block_size * head_dim;
      widen_rows<Kind, D>(kb, row, n, head_dim, kw, pf_k);
      widen_rows<Kind, D>(vb, row, n, head_dim, vw, pf_v);
      const Ahead none = {nullptr, 0, 0};
      attend_block<KvF32, D>(qs, group, head_dim, kw, vw, head_dim, n, masked, block_size, softcap, scores, acc, m, l,
                             none, none, head_first, b * block_size);
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
  const PagedKv<Kind> kv(k_cache, v_cache, block_tables);
  const float* qp = q.data_ptr<float>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const auto attend = head_dim == 64 ? attend_kv_head<Kind, 64>
                      : head_dim == 128 ? attend_kv_head<Kind, 128> : attend_kv_head<Kind, 0>;
  // attend_kv_head's scratch, plus a line's worth of floats: the widened rows start on a cache line, as an
  // fp32 cache's rows do (head_dim 64: 256 bytes apart)
  const bool widens = !std::is_same_v<Kind, KvF32> && group > 1;
  const int64_t scratch = widens ? 2 * block_size * head_dim + kLineBytes / static_cast<int64_t>(sizeof(float)) : 0;

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(group * head_dim), acc(group * head_dim), m(group), l(group);
    std::vector<float> scores(group * (block_size + 1));  // the scores, then each head's correction
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
      start_state(group, head_dim, acc.data(), m.data(), l.data());
      attend(qs.data(), group, head_dim, kv.k + g * kv.width, kv.v + g * kv.width, kv.row, kv.table(s),
             first, lens[s], block_size, softcap, scores.data(), acc.data(), m.data(), l.data(), widened, nullptr);
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
  const int kind = check_paged_attention(q, k_cache, v_cache, block_tables);
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt32 && seq_lens.is_contiguous(),
              "seq_lens must be a contiguous int32 tensor");
  auto out = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  with_cache_kind(kind, [&](auto k) {
    attend_batch<decltype(k)>(q, k_cache, v_cache, block_tables, seq_lens, static_cast<float>(scale), window,
                              static_cast<float>(softcap), out);
  });
  return out;
}
