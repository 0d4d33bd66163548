// The CPU serving path's paged prefill attention over a float32, bfloat16 or int8 KV cache: the causal (or,
// for an encoder, bidirectional) attention of each sequence's newest q_len tokens over all its cached tokens (the same function and results
// as tokenbus_kernels/reference.py's paged_prefill_attention over the cache dequantized). Built after
// cpu_decode_attention.cpp in the same translation unit (tokenbus_kernels/cpu.py), whose cache kinds, vectors, exp and
// row widening (cpu_attention.cpp, cpu_attention_block.cpp, cpu_decode_attention.cpp) it reuses.
// worker/engine/backends/cpu.py calls it; tests/kernels/test_cpu_prefill.py compares it with the reference.
//
// Layout: the top of cpu_attention.cpp, plus
//   q             [num_tokens, num_q_heads, head_dim] fp32, sequences' new tokens back to back (head_dim
//                 contiguous, any token/head strides)
//   cu_seqlens_q  int32 [num_seqs + 1]: sequence s's new tokens are q[cu[s] : cu[s + 1]]
//   seq_lens      int32 [num_seqs]: cached tokens, the new ones included; new token i of sequence s sits at
//                 position seq_lens[s] - q_len + i and sees keys at positions <= its own (and, with a sliding
//                 window, > its own - window); causal false: every new token sees all seq_lens[s] keys
//                 (it is treated as sitting at the last position, so the causal mask hides nothing; no window)
//
// Why not one decode per query token (what the backend ran before): each query then re-read and re-widened
// the whole context, and each score was a dot product summed across lanes. Here one work item is (sequence,
// KV head, tile of up to kTileRows query rows: tokens × the group's query heads, row t * group + h), and
// each context block is read (fp32) or widened (bf16, int8: rows times their scales, into a per-thread fp32
// scratch) once per item. The item's queries are held TRANSPOSED, in chunks of kLanes rows (qt [dim,
// kLanes], once per item), so that a lane is a query row throughout:
//   - scores: for each key j of a block, st[j] = sum_d K[j][d] (broadcast) * qt[d] — the kLanes rows' scores
//     for that key in one vector, kKeys keys × 2 chunks (independent accumulators) at a time; no
//     horizontal sums.
//   - mask (causal, window) by comparing each lane's position with the key's; online softmax lane-wise: the
//     block max is an element-wise max over the keys' vectors, each key's weights one exp_lanes, the
//     running max, sum and correction of kLanes rows one vector each.
//   - P·V: acc[row] += p[j][row] (broadcast) * V[j] for up to 4 rows at a time over the block's V rows
//     (pv_rows).
// This was measured against the design the issue proposed (K transposed per block, q broadcast, scores of a
// row as a vector, decode's softmax_heads per row): that one spent a quarter of its time in the per-row
// softmax (horizontal max and sum) and transposed K once per block and item; docs/quantization.md has both.
// Any block size and head_dim work; head_dim 32, 64 and 128 are compile-time in P·V.

namespace {

// keys per score pass (× 2 chunks: 16 accumulators of the 32 zmm; AVX2's 16 ymm hold 8)
constexpr int kKeys = kLanes == 16 ? 8 : 4;
constexpr int64_t kTileRows = 64;   // query rows (tokens × group) per work item: acc [64, 64] is 16 KiB

// st [C][J, kLanes] (chunks bs * kLanes apart) = the J keys' rows (K, row elements apart) times the C chunks'
// qt [dim, kLanes] (dim * kLanes apart): a broadcast FMA per (key, chunk, d). Two chunks share each key's
// broadcast: one load per FMA was more than the two load ports give with the two FMA units busy.
template <int J, int C>
TB_INLINE void score_keys(const float* __restrict k, int64_t row, const float* __restrict qt, int64_t dim,
                          float* __restrict st, int64_t bs) {
  Lanes acc[C][J];
#pragma GCC unroll 2
  for (int c = 0; c < C; ++c)
#pragma GCC unroll 8
    for (int j = 0; j < J; ++j) acc[c][j] = Lanes{};
#pragma GCC unroll 2
  for (int64_t d = 0; d < dim; ++d) {
    Lanes q[C];
#pragma GCC unroll 2
    for (int c = 0; c < C; ++c) q[c] = load_lanes(qt + c * dim * kLanes + d * kLanes);
#pragma GCC unroll 8
    for (int j = 0; j < J; ++j) {
      const float x = k[j * row + d];
#pragma GCC unroll 2
      for (int c = 0; c < C; ++c) acc[c][j] += x * q[c];
    }
  }
#pragma GCC unroll 2
  for (int c = 0; c < C; ++c)
#pragma GCC unroll 8
    for (int j = 0; j < J; ++j) std::memcpy(st + c * bs * kLanes + j * kLanes, &acc[c][j], sizeof(Lanes));
}

// the scores of C chunks (see score_keys) for a block's n keys
template <int C>
inline void score_block(const float* k, int64_t row, int64_t n, const float* qt, int64_t dim, float* st,
                        int64_t bs) {
  int64_t j = 0;
  for (; j + kKeys <= n; j += kKeys) score_keys<kKeys, C>(k + j * row, row, qt, dim, st + j * kLanes, bs);
  for (; j < n; ++j) score_keys<1, C>(k + j * row, row, qt, dim, st + j * kLanes, bs);
}

// acc_h = acc_h * corr[h] + sum_j pt[j * kLanes + h] * v[j * row] for H rows (acc [H, D]), over n V rows
// (fp32: a cache's or the widened scratch); the accumulators stay in registers, each V vector is loaded once
// for the H rows
template <int D, int H>
TB_INLINE void pv_rows(float* __restrict acc, const float* corr, const float* __restrict pt,
                       const float* __restrict v, int64_t row, int64_t n) {
  constexpr int kVecs = D / kLanes;
  Lanes a[H][kVecs];
#pragma GCC unroll 4
  for (int h = 0; h < H; ++h)
#pragma GCC unroll 16
    for (int i = 0; i < kVecs; ++i) a[h][i] = load_lanes(acc + h * D + i * kLanes) * corr[h];
  for (int64_t j = 0; j < n; ++j) {
#pragma GCC unroll 16
    for (int i = 0; i < kVecs; ++i) {
      const Lanes x = load_lanes(v + j * row + i * kLanes);
#pragma GCC unroll 4
      for (int h = 0; h < H; ++h) a[h][i] += pt[j * kLanes + h] * x;
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < H; ++h)
#pragma GCC unroll 16
    for (int i = 0; i < kVecs; ++i) std::memcpy(acc + h * D + i * kLanes, &a[h][i], sizeof(Lanes));
}

// A thread's buffers: the widened block (kw, vw [bs, dim]: bf16/int8 only), one item's transposed queries
// (qt [chunks, dim, kLanes]) and two chunks' scores, then weights (st [2, bs, kLanes]); per row (padded to
// whole chunks) the accumulator, running max, sum and correction
struct Scratch {
  std::vector<float> kw, vw, qt, st, acc, m, l, corr;
  std::vector<LaneIdx> pos;  // per chunk, its rows' positions
  Scratch(int64_t dim, int64_t bs, int64_t rows)
      : kw(bs * dim), vw(bs * dim), qt(rows * dim), st(2 * bs * kLanes), acc(rows * dim), m(rows), l(rows),
        corr(rows), pos(rows / kLanes) {}
};

// One chunk of kLanes query rows (their positions pos) over one block's n keys at positions base.. (st
// [n, kLanes]: their scores; V rows, row elements apart, fp32): soft-cap, mask, the online-softmax update of
// m, l (kLanes each) and acc [kLanes, dim]. A row that sees none of the block's keys gets weights
// 0 and correction 1 (its max is left as it was), so a chunk's rows need not agree on which blocks they see.
template <int D>
void softmax_pv(LaneIdx pos, const float* vb, int64_t row, int64_t n, int64_t base, int64_t dim, int64_t window,
                float softcap, float* st, float* acc, float* m, float* l, float* corr) {
  int64_t j = 0;
  if (softcap > 0.f)
    for (int64_t i = 0; i < n * kLanes; ++i) st[i] = softcap * std::tanh(st[i] / softcap);
  const Lanes masked = Lanes{} - 1e30f, zero = {};
  const LaneIdx oldest = window > 0 ? pos - static_cast<int32_t>(window) : pos - pos - 1;  // keys > oldest
  int32_t pos_min = pos[0], pos_max = pos[0];
  for (int i = 1; i < kLanes; ++i) pos_min = std::min(pos_min, pos[i]), pos_max = std::max(pos_max, pos[i]);
  // every row sees every key of the block (most blocks of a long context): no masks
  const bool full = pos_min >= base + n - 1 && (window <= 0 || pos_max - window < base);
  Lanes mx = load_lanes(m);
  for (j = 0; j < n; ++j) {
    const int32_t key = static_cast<int32_t>(base + j);
    Lanes s = load_lanes(st + j * kLanes);
    if (!full) {
      s = (key <= pos) & (key > oldest) ? s : masked;
      std::memcpy(st + j * kLanes, &s, sizeof s);
    }
    mx = lanes_max(mx, s);
  }
  const Lanes c = exp_lanes(load_lanes(m) - mx);
  Lanes sum = load_lanes(l) * c;
  for (j = 0; j < n; ++j) {
    const int32_t key = static_cast<int32_t>(base + j);
    Lanes e = exp_lanes(load_lanes(st + j * kLanes) - mx);
    if (!full) e = (key <= pos) & (key > oldest) ? e : zero;  // rows that see no key here: e^(-1e30 - -1e30)
    std::memcpy(st + j * kLanes, &e, sizeof e);
    sum += e;
  }
  std::memcpy(m, &mx, sizeof mx);
  std::memcpy(l, &sum, sizeof sum);
  std::memcpy(corr, &c, sizeof c);
  if constexpr (D > 0) {
    // rows per pass: their accumulators within ~3/4 of the registers (32 zmm, or 16 ymm), at most 4
    constexpr int kRows = std::clamp((kLanes == 16 ? 24 : 12) / (D / kLanes), 1, 4);
    int h = 0;
    for (; h + kRows <= kLanes; h += kRows) pv_rows<D, kRows>(acc + h * D, corr + h, st + h, vb, row, n);
    // a remainder only where kRows does not divide the lanes: g++ warned (aggressive-loop-optimizations) of
    // overflow in the loop that never runs
    if constexpr (kLanes % kRows != 0)
      for (; h < kLanes; ++h) pv_rows<D, 1>(acc + h * D, corr + h, st + h, vb, row, n);
  } else {
    for (int h = 0; h < kLanes; ++h) {
      float* a = acc + h * dim;
      for (int64_t d = 0; d < dim; ++d) a[d] *= corr[h];
      for (j = 0; j < n; ++j) {
        const float p = st[j * kLanes + h];
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) a[d] += p * vb[j * row + d];
      }
    }
  }
}

// One work item: `tokens` query tokens, the first at position pos0 and each next one `advance` further (1:
// causal; 0: non-causal, every token at pos0, the last key's position) (w.qt: their rows transposed and scaled,
// chunks of kLanes rows), over the KV head's cached keys up to the last one's position. k, v: the KV head's
// first row (block 0, token 0), rows `row` elements apart. Leaves the unnormalised output in w.acc and the
// softmax sums in w.l.
template <typename Kind, int D>
void attend_tile(int64_t tokens, int64_t group, int64_t dim, int64_t pos0, int64_t advance,
                 const typename Kind::T* k, const typename Kind::T* v, int64_t row, const int32_t* table, int64_t bs,
                 int64_t window, float softcap, Scratch& w) {
  using T = typename Kind::T;
  constexpr bool kInPlace = std::is_same_v<Kind, KvF32>;  // fp32 rows are read where they are
  const int64_t chunks = (tokens * group + kLanes - 1) / kLanes, last = pos0 + (tokens - 1) * advance;
  std::fill(w.m.begin(), w.m.begin() + chunks * kLanes, -1e30f);
  std::fill(w.l.begin(), w.l.begin() + chunks * kLanes, 0.f);
  std::fill(w.acc.begin(), w.acc.begin() + chunks * kLanes * dim, 0.f);
  for (int64_t c = 0; c < chunks; ++c)
    for (int i = 0; i < kLanes; ++i)
      w.pos[c][i] = static_cast<int32_t>(pos0 + (c * kLanes + i) / group * advance);
  const int64_t first_key = window > 0 ? std::max<int64_t>(0, pos0 - window + 1) : 0;
  const Ahead none = {nullptr, 0, 0};
  for (int64_t b = first_key / bs; b <= last / bs; ++b) {
    const int64_t base = b * bs, n = std::min(bs, last + 1 - base);
    const T* kb = k + table[b] * bs * row;
    const T* vb = v + table[b] * bs * row;
    const float* kr = reinterpret_cast<const float*>(kb);
    const float* vr = reinterpret_cast<const float*>(vb);
    int64_t stride = row;
    if constexpr (!kInPlace) {
      widen_rows<Kind, D>(kb, row, n, dim, w.kw.data(), none);
      widen_rows<Kind, D>(vb, row, n, dim, w.vw.data(), none);
      kr = w.kw.data(), vr = w.vw.data(), stride = dim;
    }
    // the chunks whose rows see a key of this block (pos[c]: the positions of chunk c's rows), two at a time
    // where both do
    const auto sees = [&](int64_t c) {
      const int64_t t_first = c * kLanes / group, t_last = std::min(tokens - 1, ((c + 1) * kLanes - 1) / group);
      return pos0 + t_last * advance >= base && !(window > 0 && pos0 + t_first - window >= base + n - 1);
    };
    for (int64_t c = 0; c < chunks;) {
      const bool one = sees(c), two = c + 1 < chunks && sees(c + 1);
      const float* qt = w.qt.data() + c * dim * kLanes;
      if (one && two) score_block<2>(kr, stride, n, qt, dim, w.st.data(), bs);
      else if (one || two) score_block<1>(kr, stride, n, qt + (one ? 0 : dim * kLanes), dim, w.st.data(), bs);
      for (int64_t i = 0; i < 2 && c + i < chunks; ++i) {
        if (!(i == 0 ? one : two)) continue;
        const int64_t ci = c + i;
        softmax_pv<D>(w.pos[ci], vr, stride, n, base, dim, window, softcap,
                      w.st.data() + (one && two ? i * bs * kLanes : 0), w.acc.data() + ci * kLanes * dim,
                      w.m.data() + ci * kLanes, w.l.data() + ci * kLanes, w.corr.data() + ci * kLanes);
      }
      c += 2;
    }
  }
}

// every (sequence, KV head, tile) work item of a batch over a cache of one kind
template <typename Kind>
void prefill_batch(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                   const torch::Tensor& block_tables, const torch::Tensor& cu_seqlens_q,
                   const torch::Tensor& seq_lens, float scale, int64_t window, float softcap, bool causal,
                   torch::Tensor& out) {
  const int64_t num_seqs = seq_lens.size(0), num_q_heads = q.size(1), dim = q.size(2);
  const int64_t bs = k_cache.size(1), num_kv_heads = k_cache.size(2), group = num_q_heads / num_kv_heads;
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
  const PagedKv<Kind> kv(k_cache, v_cache, block_tables);
  float* op = out.data_ptr<float>();
  // head_dim 32 too: the small encoders' (all-MiniLM-L6-v2: 12 heads of 32), whose P·V ran the generic loop
  const auto attend = dim == 64    ? attend_tile<Kind, 64>
                      : dim == 128 ? attend_tile<Kind, 128>
                      : dim == 32  ? attend_tile<Kind, 32>
                                   : attend_tile<Kind, 0>;
  const int64_t items = static_cast<int64_t>(tiles.size()) * num_kv_heads;

  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    // group > kTileRows: one token per tile; rows padded to whole chunks (the padding's output is not used)
    Scratch w(dim, bs, (tile_tokens * group + kLanes - 1) / kLanes * kLanes);
    for (int64_t item = begin; item < end; ++item) {
      const auto [s, first, tokens] = tiles[item / num_kv_heads];
      const int64_t g = item % num_kv_heads, token0 = cu[s] + first;
      for (int64_t t = 0; t < tokens; ++t)
        for (int64_t h = 0; h < group; ++h) {
          const float* src = qp + (token0 + t) * qs0 + (g * group + h) * qs1;
          const int64_t r = t * group + h;  // row r is lane r % kLanes of chunk r / kLanes
          float* dst = w.qt.data() + r / kLanes * dim * kLanes + r % kLanes;
          for (int64_t d = 0; d < dim; ++d) dst[d * kLanes] = src[d] * scale;
        }
      const int64_t pos0 = causal ? lens[s] - (cu[s + 1] - cu[s]) + first : lens[s] - 1;
      attend(tokens, group, dim, pos0, causal ? 1 : 0, kv.k + g * kv.width, kv.v + g * kv.width, kv.row,
             kv.table(s), bs, window, softcap, w);
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
                                          torch::Tensor seq_lens, double scale, int64_t window, double softcap,
                                          bool causal) {
  const int kind = check_paged_attention(q, k_cache, v_cache, block_tables);
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt32 && seq_lens.is_contiguous() &&
                  cu_seqlens_q.scalar_type() == torch::kInt32 && cu_seqlens_q.is_contiguous(),
              "seq_lens and cu_seqlens_q must be contiguous int32 tensors");
  TORCH_CHECK(cu_seqlens_q.size(0) == seq_lens.size(0) + 1, "cu_seqlens_q must have num_seqs + 1 entries");
  TORCH_CHECK(causal || window <= 0, "non-causal prefill attention takes no sliding window, got window ", window);
  // every query row is written: each sees at least its own key
  auto out = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  with_cache_kind(kind, [&](auto k) {
    prefill_batch<decltype(k)>(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, static_cast<float>(scale),
                               window, static_cast<float>(softcap), causal, out);
  });
  return out;
}
