// The CPU serving path's paged prefill attention over a float32, bfloat16 or int8 KV cache: the causal
// attention of each sequence's newest q_len tokens over all its cached tokens (the same function and results
// as kernels/reference.py's paged_prefill_attention over the cache dequantized). Built after
// cpu_decode_attention.cpp in the same translation unit (kernels/cpu.py), whose cache kinds, vectors, exp,
// softmax step and P·V loops (cpu_attention.cpp, cpu_attention_block.cpp) it reuses. worker/engine/backends/
// cpu.py calls it; tests/kernels/test_cpu_prefill.py compares it with the reference.
//
// Layout: the top of cpu_attention.cpp, plus
//   q             [num_tokens, num_q_heads, head_dim] fp32, sequences' new tokens back to back (head_dim
//                 contiguous, any token/head strides)
//   cu_seqlens_q  int32 [num_seqs + 1]: sequence s's new tokens are q[cu[s] : cu[s + 1]]
//   seq_lens      int32 [num_seqs]: cached tokens, the new ones included; new token i of sequence s sits at
//                 position seq_lens[s] - q_len + i and sees keys at positions <= its own (and, with a sliding
//                 window, > its own - window)
//
// Why not one decode per query token (what the backend ran before): each query then re-read and re-widened
// the whole context and summed each score across lanes. Here one work item is (sequence, KV head, tile of up
// to kTileRows query rows: tokens × the group's query heads), and each context block is widened once per
// item into a per-thread fp32 scratch, K transposed (Kt [head_dim, block_size]) and V as rows. A block's
// scores for a query row are then whole vectors: scores += q[d] (broadcast) * Kt[d][:] over d, kScoreAccs
// independent accumulators (rows × vectors of a block) at a time, no horizontal sums; the online softmax
// (softmax_heads) and P·V (pv_heads) treat each query row like a decode's query head. Causal and window masks
// set scores to -1e30 (finite: -ffast-math); a block is only visited by the tile's tokens that see one of its
// keys, so every visited row has a real maximum. Blocks of other widths (not a multiple of the vector,
// or more than 4 vectors) and run-time head_dims take per-row loops.

namespace {

constexpr int kScoreAccs = 8;       // score accumulators per pass: rows × vectors of a block (8 chains)
constexpr int64_t kTileRows = 64;   // query rows (tokens × group) per work item: acc [64, 64] is 16 KiB

// x [kLanes] rows of kLanes lanes, transposed in place: log2(kLanes) rounds of pairwise interleaves of rows i
// and i + kLanes / 2 (each round rotates the bits of a lane's (row, column) address by one; after log2(kLanes)
// rounds row and column have swapped). kLanes / 2 * 2 two-source shuffles a round: 64 for 16 × 16 (vpermt2ps).
TB_INLINE void transpose_lanes(Lanes* x) {
  LaneIdx lo, hi;
  for (int i = 0; i < kLanes / 2; ++i) {
    lo[2 * i] = i, lo[2 * i + 1] = i + kLanes;
    hi[2 * i] = i + kLanes / 2, hi[2 * i + 1] = i + kLanes / 2 + kLanes;
  }
  for (int round = 1; round < kLanes; round *= 2) {
    Lanes y[kLanes];
#pragma GCC unroll 16
    for (int i = 0; i < kLanes / 2; ++i) {
      y[2 * i] = __builtin_shuffle(x[i], x[i + kLanes / 2], lo);
      y[2 * i + 1] = __builtin_shuffle(x[i], x[i + kLanes / 2], hi);
    }
#pragma GCC unroll 16
    for (int i = 0; i < kLanes; ++i) x[i] = y[i];
  }
}

// kt [dim, bs] = the n rows at src (row elements apart) as fp32, each times its scale, transposed; columns
// n..bs zero (their scores are masked, but must be finite). Whole kLanes × kLanes tiles go through
// registers (transpose_lanes: a quarter of the instructions of a lane-by-lane scatter); other shapes go
// lane by lane.
template <typename Kind>
inline void widen_transposed(const typename Kind::T* __restrict src, int64_t row, int64_t n, int64_t dim,
                             int64_t bs, float* __restrict kt) {
  if (dim % kLanes == 0 && bs % kLanes == 0) {
    for (int64_t j0 = 0; j0 < n; j0 += kLanes) {
      const int64_t rows = std::min<int64_t>(kLanes, n - j0);
      float scales[kLanes];
      for (int64_t i = 0; i < rows; ++i) scales[i] = Kind::scale(src + (j0 + i) * row, dim);
      for (int64_t d0 = 0; d0 < dim; d0 += kLanes) {
        Lanes x[kLanes];
#pragma GCC unroll 16
        for (int i = 0; i < kLanes; ++i) x[i] = i < rows ? load_lanes(src + (j0 + i) * row + d0) * scales[i] : Lanes{};
        transpose_lanes(x);
#pragma GCC unroll 16
        for (int i = 0; i < kLanes; ++i) std::memcpy(kt + (d0 + i) * bs + j0, &x[i], sizeof(Lanes));
      }
    }
    for (int64_t j0 = (n + kLanes - 1) / kLanes * kLanes; j0 < bs; j0 += kLanes)
      for (int64_t d = 0; d < dim; ++d) std::fill(kt + d * bs + j0, kt + d * bs + j0 + kLanes, 0.f);
    return;
  }
  for (int64_t j = 0; j < n; ++j) {
    const typename Kind::T* r = src + j * row;
    const float s = Kind::scale(r, dim);
    int64_t d = 0;
    for (; d + kLanes <= dim; d += kLanes) {
      const Lanes x = load_lanes(r + d) * s;
#pragma GCC unroll 16
      for (int i = 0; i < kLanes; ++i) kt[(d + i) * bs + j] = x[i];
    }
    for (; d < dim; ++d) kt[d * bs + j] = s * Kind::load(r, d);
  }
  if (n < bs)
    for (int64_t d = 0; d < dim; ++d) std::fill(kt + d * bs + n, kt + (d + 1) * bs, 0.f);
}

// out [R, V * kLanes] (rows bs apart) = q [R, dim] (rows dim apart) times kt [dim, bs]: one broadcast FMA per
// (row, vector, d), R * V independent accumulators
template <int V, int R>
TB_INLINE void score_rows(const float* __restrict q, int64_t dim, const float* __restrict kt, int64_t bs,
                          float* __restrict out) {
  Lanes acc[R][V];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) acc[r][v] = Lanes{};
#pragma GCC unroll 4
  for (int64_t d = 0; d < dim; ++d) {
    Lanes k[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) k[v] = load_lanes(kt + d * bs + v * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float x = q[r * dim + d];
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[r][v] += x * k[v];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) std::memcpy(out + r * bs + v * kLanes, &acc[r][v], sizeof(Lanes));
}

// The per-row fallback for block widths score_rows does not take: out[r][j] for j < ncols
inline void score_rows_any(const float* __restrict q, int64_t rows, int64_t dim, const float* __restrict kt,
                           int64_t bs, int64_t ncols, float* __restrict out) {
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out + r * bs;
    std::fill(o, o + ncols, 0.f);
    for (int64_t d = 0; d < dim; ++d) {
      const float x = q[r * dim + d];
#pragma omp simd
      for (int64_t j = 0; j < ncols; ++j) o[j] += x * kt[d * bs + j];
    }
  }
}

// A thread's buffers: the widened block (kt [dim, bs], vw [bs, dim]), one tile's scaled queries qs and scores
// (kScoreAccs rows of padding each: score_rows runs in whole passes), and its softmax state
struct Scratch {
  std::vector<float> kt, vw, qs, scores, corr, acc, m, l;
  Scratch(int64_t dim, int64_t bs, int64_t rows)
      : kt(dim * bs), vw(bs * dim), qs((rows + kScoreAccs) * dim), scores((rows + kScoreAccs) * bs), corr(rows),
        acc(rows * dim), m(rows), l(rows) {}
};

// One work item: `tokens` query tokens (qs [tokens * group, dim], row t * group + h: token t, query head h of
// the group, scaled), the first at position pos0, over the KV head's cached keys up to the last one's
// position. k, v: the KV head's first row (block 0, token 0), rows `row` elements apart. Leaves the
// unnormalised output in w.acc and the softmax sums in w.l.
template <typename Kind, int D>
void attend_tile(int64_t tokens, int64_t group, int64_t dim, int64_t pos0, const typename Kind::T* k,
                 const typename Kind::T* v, int64_t row, const int32_t* table, int64_t bs, int64_t window,
                 float softcap, Scratch& w) {
  using T = typename Kind::T;
  constexpr bool kInPlace = std::is_same_v<Kind, KvF32>;  // fp32 V rows are read where they are
  const int64_t rows = tokens * group, last = pos0 + tokens - 1;
  const int64_t vecs = bs % kLanes == 0 ? bs / kLanes : 0;
  std::fill(w.m.begin(), w.m.begin() + rows, -1e30f);
  std::fill(w.l.begin(), w.l.begin() + rows, 0.f);
  std::fill(w.acc.begin(), w.acc.begin() + rows * dim, 0.f);
  const int64_t first_key = window > 0 ? std::max<int64_t>(0, pos0 - window + 1) : 0;
  const Ahead none = {nullptr, 0, 0};
  for (int64_t b = first_key / bs; b <= last / bs; ++b) {
    const int64_t base = b * bs, n = std::min(bs, last + 1 - base);
    // the tile's tokens that see a key of this block: position >= base, and (window) > base + n - 1 - window
    const int64_t t_lo = std::max<int64_t>(0, base - pos0);
    const int64_t t_hi = window > 0 ? std::min(tokens - 1, base + n - 2 + window - pos0) : tokens - 1;
    if (t_lo > t_hi) continue;
    const T* kb = k + table[b] * bs * row;
    const T* vb = v + table[b] * bs * row;
    widen_transposed<Kind>(kb, row, n, dim, bs, w.kt.data());
    const float* vrows = reinterpret_cast<const float*>(vb);
    int64_t vstride = row;
    if constexpr (!kInPlace) {
      widen_rows<Kind, D>(vb, row, n, dim, w.vw.data(), none);
      vrows = w.vw.data();
      vstride = dim;
    }
    const int64_t ncols = vecs ? bs : n;  // whole vectors: columns past n are masked
    const int64_t r_lo = t_lo * group, count = (t_hi - t_lo + 1) * group;
    const float* q = w.qs.data() + r_lo * dim;
    float* s = w.scores.data() + r_lo * bs;
    switch (vecs) {
      case 1: for (int64_t r = 0; r < count; r += kScoreAccs) score_rows<1, kScoreAccs>(q + r * dim, dim,
                                                                  w.kt.data(), bs, s + r * bs); break;
      case 2: for (int64_t r = 0; r < count; r += kScoreAccs / 2) score_rows<2, kScoreAccs / 2>(q + r * dim, dim,
                                                                  w.kt.data(), bs, s + r * bs); break;
      case 4: for (int64_t r = 0; r < count; r += kScoreAccs / 4) score_rows<4, kScoreAccs / 4>(q + r * dim, dim,
                                                                  w.kt.data(), bs, s + r * bs); break;
      default: score_rows_any(q, count, dim, w.kt.data(), bs, ncols, s); break;
    }
    if (softcap > 0.f)
      for (int64_t r = 0; r < count; ++r)
        for (int64_t j = 0; j < n; ++j) s[r * bs + j] = softcap * std::tanh(s[r * bs + j] / softcap);
    for (int64_t t = t_lo; t <= t_hi; ++t) {  // keys this token must not see: later, or out of its window
      const int64_t p = pos0 + t;
      const int64_t j_lo = window > 0 ? std::clamp<int64_t>(p - window + 1 - base, 0, ncols) : 0;
      const int64_t j_hi = std::clamp<int64_t>(p + 1 - base, 0, n);
      if (j_lo == 0 && j_hi == ncols) continue;
      for (int64_t h = 0; h < group; ++h) {
        float* sr = s + ((t - t_lo) * group + h) * bs;
        for (int64_t j = 0; j < j_lo; ++j) sr[j] = -1e30f;
        for (int64_t j = j_hi; j < ncols; ++j) sr[j] = -1e30f;
      }
    }
    float* corr = w.corr.data();
    softmax_heads(s, count, bs, ncols, w.m.data() + r_lo, w.l.data() + r_lo, corr);
    float* acc = w.acc.data() + r_lo * dim;
    if constexpr (D > 0 && D % kLanes == 0) {
      for (int64_t r = 0; r < count; r += 4) {
        float* ar = acc + r * D;
        const float* pr = s + r * bs;
        switch (std::min<int64_t>(4, count - r)) {
          case 1: pv_heads<D, 1>(ar, corr + r, pr, bs, vrows, vstride, n, none); break;
          case 2: pv_heads<D, 2>(ar, corr + r, pr, bs, vrows, vstride, n, none); break;
          case 3: pv_heads<D, 3>(ar, corr + r, pr, bs, vrows, vstride, n, none); break;
          default: pv_heads<D, 4>(ar, corr + r, pr, bs, vrows, vstride, n, none); break;
        }
      }
    } else {
      for (int64_t r = 0; r < count; ++r)
        rescale_accumulate<KvF32, 0>(acc + r * dim, corr[r], s + r * bs, vrows, vstride, n, dim, none);
    }
  }
}

// every (sequence, KV head, tile) work item of a batch over a cache of one kind
template <typename Kind>
void prefill_batch(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                   const torch::Tensor& block_tables, const torch::Tensor& cu_seqlens_q,
                   const torch::Tensor& seq_lens, float scale, int64_t window, float softcap, torch::Tensor& out) {
  const int64_t num_seqs = seq_lens.size(0), num_q_heads = q.size(1), dim = q.size(2);
  const int64_t bs = k_cache.size(1), num_kv_heads = k_cache.size(2), group = num_q_heads / num_kv_heads;
  const int64_t width = dim + Kind::kExtra, row = num_kv_heads * width;
  const int64_t tile_tokens = std::max<int64_t>(1, kTileRows / group);
  const int32_t* cu = cu_seqlens_q.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  std::vector<std::array<int64_t, 3>> tiles;  // (sequence, first new token, tokens)
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = cu[s + 1] - cu[s];
    TORCH_CHECK(q_len >= 0 && q_len <= lens[s], "sequence ", s, " has ", q_len, " new tokens but seq_lens ",
                lens[s], ": seq_lens counts the new tokens too");
    for (int64_t t = 0; t < q_len; t += tile_tokens) tiles.push_back({s, t, std::min(tile_tokens, q_len - t)});
  }
  const float* qp = q.data_ptr<float>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const typename Kind::T* kp = cache_data<Kind>(k_cache);
  const typename Kind::T* vp = cache_data<Kind>(v_cache);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t table_stride = block_tables.stride(0);
  float* op = out.data_ptr<float>();
  const auto attend = dim == 64 ? attend_tile<Kind, 64> : dim == 128 ? attend_tile<Kind, 128> : attend_tile<Kind, 0>;
  const int64_t items = static_cast<int64_t>(tiles.size()) * num_kv_heads;

  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    Scratch w(dim, bs, tile_tokens * group);  // group > kTileRows: one token per tile
    for (int64_t item = begin; item < end; ++item) {
      const auto [s, first, tokens] = tiles[item / num_kv_heads];
      const int64_t g = item % num_kv_heads, token0 = cu[s] + first;
      for (int64_t t = 0; t < tokens; ++t)
        for (int64_t h = 0; h < group; ++h) {
          const float* src = qp + (token0 + t) * qs0 + (g * group + h) * qs1;
          float* dst = w.qs.data() + (t * group + h) * dim;
          for (int64_t d = 0; d < dim; ++d) dst[d] = src[d] * scale;
        }
      const int64_t pos0 = lens[s] - (cu[s + 1] - cu[s]) + first;
      attend(tokens, group, dim, pos0, kp + g * width, vp + g * width, row, tables + s * table_stride, bs, window,
             softcap, w);
      for (int64_t t = 0; t < tokens; ++t)
        for (int64_t h = 0; h < group; ++h) {
          const int64_t r = t * group + h;
          float* dst = op + ((token0 + t) * num_q_heads + g * group + h) * dim;
          const float inv = 1.f / w.l[r];  // every row saw its own key: l >= 1
          for (int64_t d = 0; d < dim; ++d) dst[d] = w.acc[r * dim + d] * inv;
        }
    }
  });
}

}  // namespace

torch::Tensor paged_prefill_attention_cpu(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                          torch::Tensor block_tables, torch::Tensor cu_seqlens_q,
                                          torch::Tensor seq_lens, double scale, int64_t window, double softcap) {
  check_layout(q, "q");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.stride(1) == 1,
              "block_tables must be int32 with a contiguous last dimension");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt32 && seq_lens.is_contiguous() &&
                  cu_seqlens_q.scalar_type() == torch::kInt32 && cu_seqlens_q.is_contiguous(),
              "seq_lens and cu_seqlens_q must be contiguous int32 tensors");
  TORCH_CHECK(cu_seqlens_q.size(0) == seq_lens.size(0) + 1, "cu_seqlens_q must have num_seqs + 1 entries");
  const int kind = cache_kind(k_cache, v_cache, q.size(2));
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "num_q_heads must be a multiple of num_kv_heads");
  auto out = torch::zeros({q.size(0), q.size(1), q.size(2)}, q.options());
  const float fscale = static_cast<float>(scale), fsoftcap = static_cast<float>(softcap);
  const auto& c = cu_seqlens_q;
  switch (kind) {
    case 0: prefill_batch<KvF32>(q, k_cache, v_cache, block_tables, c, seq_lens, fscale, window, fsoftcap, out); break;
    case 1: prefill_batch<KvBf16>(q, k_cache, v_cache, block_tables, c, seq_lens, fscale, window, fsoftcap, out); break;
    default: prefill_batch<KvInt8>(q, k_cache, v_cache, block_tables, c, seq_lens, fscale, window, fsoftcap, out); break;
  }
  return out;
}
