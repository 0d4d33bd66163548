// Cascade decode attention on the CPU (tokenbus_kernels/cascade.py has the definition and the PyTorch reference):
// decode rows that share their first tokens' K/V (a system prompt the prefix cache holds once) read those
// blocks once per step for all of them. Built after cpu_decode_attention.cpp in the same translation unit
// (tokenbus_kernels/cpu.py), whose attend_kv_head (the walk over one KV head's blocks) and start_state it runs;
// decode_layers.cpp calls it. tests/kernels/test_cascade.py compares it with the reference.
//
// Phase 1, per group and chunk of its shared prefix: matrix products. The chunk's K and V rows of every KV
// head are gathered once into contiguous fp32 [Hk, T, D] (bf16 and int8 rows widened, their scales folded
// in), the group's query rows into [Hk, members * group, D] (scaled), and then
//   scores = Q K^T   [Hk, R, T]   (at::bmm: MKL's sgemm, register-tiled, ~80 GFLOP/s a core here)
//   soft-cap, each row's window, softmax statistics (max, sum) and weights in place (vector exp)
//   acc    = P V     [Hk, R, D]   (at::bmm)
// so the shared part runs at matrix-product speed instead of a query row at a time over each block (what
// this kernel did first). Its FLOPs are plain decode's; what it saves is reading the prefix once per row.
// Each chunk leaves its rows' partial softmax (max, sum, unnormalised accumulator, fp32); a chunk is at most
// kChunkTokens tokens and its scores at most kScoreFloats floats, which bounds the scratch (a long prefix, a
// wide group).
// Phase 2, work items (sequence, KV head): the row's chunks merged by log-sum-exp into its running state,
// then its own blocks (suffix_start .. seq_len - 1) continue that online softmax, and the output is
// normalised once. A row in no group is plain decode (suffix_start 0).

namespace {

constexpr int64_t kChunkTokens = 1024;     // shared tokens per phase-1 product, at most
constexpr int64_t kScoreFloats = 1 << 21;  // one chunk's scores [Hk, R, T], at most (8 MiB)
// a score no row may weigh (before its window): far below the running maxima's -1e30 start (-ffast-math: no
// infinities), so a row with no visible key in a chunk gets weights e^(-1e38 + 1e30) = 0
constexpr float kHidden = -1e38f;

// n rows of `width` scores (q.k, scaled), row r's first visible key at first[r] (the chunk's first key is 0):
// soft-capped, masked, then replaced by their weights e^(s - max); m[r], l[r] the row's max (-1e30 with no
// visible key) and sum
inline void softmax_rows(float* s, int64_t n, int64_t width, const int64_t* first, float softcap, float* m,
                         float* l) {
  for (int64_t r = 0; r < n; ++r) {
    float* row = s + r * width;
    if (softcap > 0.f)
      for (int64_t j = 0; j < width; ++j) row[j] = softcap * std::tanh(row[j] / softcap);
    const int64_t hidden = std::min(width, std::max<int64_t>(0, first[r]));
    for (int64_t j = 0; j < hidden; ++j) row[j] = kHidden;
    int64_t j = 0;
    Lanes vmax = Lanes{} - 1e30f;
    for (; j + kLanes <= width; j += kLanes) vmax = lanes_max(vmax, load_lanes(row + j));
    float mx = across(vmax, lanes_max);
    for (; j < width; ++j) mx = std::max(mx, row[j]);
    Lanes vsum = {};
    for (j = 0; j + kLanes <= width; j += kLanes) {
      const Lanes e = exp_lanes(load_lanes(row + j) - mx);
      std::memcpy(row + j, &e, sizeof e);
      vsum += e;
    }
    float sum = across(vsum, lanes_add);
    for (; j < width; ++j) {
      row[j] = row[j] < -1e37f ? 0.f : std::exp(row[j] - mx);
      sum += row[j];
    }
    m[r] = mx;
    l[r] = sum;
  }
}

template <typename Kind>
void cascade_batch(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                   const torch::Tensor& block_tables, const torch::Tensor& seq_lens, const int32_t* group_rows,
                   const int32_t* group_starts, const int32_t* prefix_lens, int64_t num_groups,
                   const int32_t* suffix_starts, float scale, int64_t window, float softcap, torch::Tensor& out) {
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
  // chunks: the most any group's prefix splits into (a group with fewer leaves its other partials empty)
  int64_t chunks = 1;
  std::vector<int64_t> chunk_tokens(num_groups);
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t rows = (group_starts[g + 1] - group_starts[g]) * group;
    const int64_t budget = kScoreFloats / std::max<int64_t>(1, num_kv_heads * rows) / block_size * block_size;
    chunk_tokens[g] = std::max(block_size, std::min(kChunkTokens / block_size * block_size, budget));
    chunks = std::max(chunks, (prefix_lens[g] + chunk_tokens[g] - 1) / chunk_tokens[g]);
  }
  // partials [num_seqs, num_q_heads, chunks] (+ head_dim); only grouped rows' are written and read; an
  // unwritten chunk is an empty partial (max -1e30, sum 0), which the merge weighs 0
  std::vector<float> part_m(num_groups ? num_seqs * num_q_heads * chunks : 0, -1e30f), part_l(part_m.size());
  std::vector<float> part_acc(part_m.size() * head_dim);
  const int64_t line = kLineBytes / static_cast<int64_t>(sizeof(float));
  const auto aligned = [](std::vector<float>& buf) {  // widened rows start on a cache line (attend_batch)
    return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + kLineBytes - 1) &
                                    ~uintptr_t(kLineBytes - 1));
  };
  const auto f32 = q.options().dtype(torch::kFloat32);
  for (int64_t g = 0; g < num_groups; ++g) {
    const int32_t* members = group_rows + group_starts[g];
    const int64_t rows = (group_starts[g + 1] - group_starts[g]) * group;
    if (rows == 0 || prefix_lens[g] == 0) continue;
    // the group's query rows [Hk, R, D], scaled; row r: member r / group, query head h * group + r % group
    torch::Tensor qg = torch::empty({num_kv_heads, rows, head_dim}, f32);
    float* qgp = qg.data_ptr<float>();
    std::vector<int64_t> first(rows);  // each row's first visible position (its window), absolute
    for (int64_t r = 0; r < rows; ++r)
      first[r] = window > 0 ? std::max<int64_t>(0, lens[members[r / group]] - window) : 0;
    at::parallel_for(0, num_kv_heads * rows, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t h = i / rows, r = i % rows;
        const float* src = qp + members[r / group] * qs0 + (h * group + r % group) * qs1;
        for (int64_t d = 0; d < head_dim; ++d) qgp[i * head_dim + d] = src[d] * scale;
      }
    });
    const int32_t* table = kv.table(members[0]);
    const int64_t earliest = *std::min_element(first.begin(), first.end());
    for (int64_t c = 0; c * chunk_tokens[g] < prefix_lens[g]; ++c) {
      const int64_t lo = c * chunk_tokens[g], hi = std::min<int64_t>(lo + chunk_tokens[g], prefix_lens[g]);
      if (hi <= earliest) continue;  // every row's window starts past this chunk: its partials stay empty
      const int64_t t = hi - lo;
      // the chunk's K and V rows as fp32 [Hk, T, D]: one (KV head, block) per item
      torch::Tensor keys = torch::empty({num_kv_heads, t, head_dim}, f32), vals = torch::empty_like(keys);
      float* kp = keys.data_ptr<float>();
      float* vp = vals.data_ptr<float>();
      const int64_t b0 = lo / block_size, nb = (hi - 1) / block_size - b0 + 1;
      at::parallel_for(0, num_kv_heads * nb, 4, [&](int64_t begin, int64_t end) {
        const Ahead none = {nullptr, 0, 0};
        for (int64_t i = begin; i < end; ++i) {
          const int64_t h = i / nb, b = b0 + i % nb;
          const int64_t from = std::max(lo, b * block_size), to = std::min(hi, (b + 1) * block_size);
          const int64_t offset = (int64_t(table[b]) * block_size + from - b * block_size) * kv.row + h * kv.width;
          float* kd = kp + (h * t + from - lo) * head_dim;
          float* vd = vp + (h * t + from - lo) * head_dim;
          if (head_dim == 64) {
            widen_rows<Kind, 64>(kv.k + offset, kv.row, to - from, head_dim, kd, none);
            widen_rows<Kind, 64>(kv.v + offset, kv.row, to - from, head_dim, vd, none);
          } else {
            widen_rows<Kind, 0>(kv.k + offset, kv.row, to - from, head_dim, kd, none);
            widen_rows<Kind, 0>(kv.v + offset, kv.row, to - from, head_dim, vd, none);
          }
        }
      });
      torch::Tensor scores = at::bmm(qg, keys.transpose(1, 2));  // [Hk, R, T]
      float* sp = scores.data_ptr<float>();
      std::vector<float> m(num_kv_heads * rows), l(m.size());
      at::parallel_for(0, num_kv_heads * rows, 16, [&](int64_t begin, int64_t end) {
        std::vector<int64_t> firsts(end - begin);
        for (int64_t i = begin; i < end; ++i) firsts[i - begin] = first[i % rows] - lo;
        softmax_rows(sp + begin * t, end - begin, t, firsts.data(), softcap, m.data() + begin, l.data() + begin);
      });
      const torch::Tensor acc = at::bmm(scores, vals);  // [Hk, R, D], unnormalised
      const float* ap = acc.data_ptr<float>();
      at::parallel_for(0, num_kv_heads * rows, 64, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          const int64_t h = i / rows, r = i % rows;
          const int64_t slot = (members[r / group] * num_q_heads + h * group + r % group) * chunks + c;
          part_m[slot] = m[i];
          part_l[slot] = l[i];
          std::copy(ap + i * head_dim, ap + (i + 1) * head_dim, part_acc.begin() + slot * head_dim);
        }
      });
    }
  }

  const bool widens = !std::is_same_v<Kind, KvF32> && group > 1;
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(group * head_dim), acc(group * head_dim), m(group), l(group);
    std::vector<float> scores(group * (block_size + 1));
    std::vector<float> widened_buf(widens ? 2 * block_size * head_dim + line : 0);
    float* widened = widens ? aligned(widened_buf) : nullptr;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / num_kv_heads, h = item % num_kv_heads;
      for (int64_t r = 0; r < group; ++r) {
        const float* src = qp + s * qs0 + (h * group + r) * qs1;
        for (int64_t d = 0; d < head_dim; ++d) qs[r * head_dim + d] = src[d] * scale;
      }
      start_state(group, head_dim, acc.data(), m.data(), l.data());
      const int64_t own = suffix_starts[s];
      if (own > 0) {  // the shared part's chunks, merged: max first, then each weighed by e^(m_c - max)
        for (int64_t r = 0; r < group; ++r) {
          const int64_t base = (s * num_q_heads + h * group + r) * chunks;
          float mx = -1e30f;
          for (int64_t c = 0; c < chunks; ++c) mx = std::max(mx, part_m[base + c]);
          float sum = 0.f;
          float* a = acc.data() + r * head_dim;
          for (int64_t c = 0; c < chunks; ++c) {
            const float w = std::exp(part_m[base + c] - mx);
            sum += part_l[base + c] * w;
            const float* pa = part_acc.data() + (base + c) * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) a[d] += pa[d] * w;
          }
          m[r] = mx;
          l[r] = sum;
        }
      }
      const int64_t first = window > 0 ? std::max<int64_t>(own, lens[s] - window) : own;
      if (first < lens[s])
        attend(qs.data(), group, head_dim, kv.k + h * kv.width, kv.v + h * kv.width, kv.row, kv.table(s), first,
               lens[s], block_size, softcap, scores.data(), acc.data(), m.data(), l.data(), widened, nullptr);
      for (int64_t r = 0; r < group; ++r) {
        float* dst = op + (s * num_q_heads + h * group + r) * head_dim;
        const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = acc[r * head_dim + d] * inv;
      }
    }
  });
}

}  // namespace

// paged_decode_attention_cpu's result over a cascade layout (tokenbus_kernels/cascade.py CascadeLayout: group_rows,
// group_starts, prefix_lens, suffix_starts, int32, contiguous).
torch::Tensor cascade_decode_attention_cpu(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                           torch::Tensor block_tables, torch::Tensor seq_lens,
                                           torch::Tensor group_rows, torch::Tensor group_starts,
                                           torch::Tensor prefix_lens, torch::Tensor suffix_starts, double scale,
                                           int64_t window, double softcap) {
  const int kind = check_paged_attention(q, k_cache, v_cache, block_tables);
  for (const torch::Tensor* t : {&seq_lens, &group_rows, &group_starts, &prefix_lens, &suffix_starts})
    TORCH_CHECK(t->scalar_type() == torch::kInt32 && t->is_contiguous() && t->device().is_cpu(),
                "seq_lens and the cascade layout (tokenbus_kernels/cascade.py) must be contiguous int32 CPU tensors");
  const int64_t num_groups = prefix_lens.size(0);
  TORCH_CHECK(group_starts.size(0) == num_groups + 1 && suffix_starts.size(0) == q.size(0),
              "a cascade layout has num_groups + 1 group_starts and one suffix_start per row");
  auto out = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  with_cache_kind(kind, [&](auto k) {
    cascade_batch<decltype(k)>(q, k_cache, v_cache, block_tables, seq_lens, group_rows.data_ptr<int32_t>(),
                               group_starts.data_ptr<int32_t>(), prefix_lens.data_ptr<int32_t>(), num_groups,
                               suffix_starts.data_ptr<int32_t>(), static_cast<float>(scale), window,
                               static_cast<float>(softcap), out);
  });
  return out;
}
