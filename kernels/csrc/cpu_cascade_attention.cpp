// Cascade decode attention on the CPU (kernels/cascade.py has the definition and the PyTorch reference):
// decode rows that share their first tokens' K/V (a system prompt the prefix cache holds once) read those
// blocks once per step for all of them. Built after cpu_decode_attention.cpp in the same translation unit
// (kernels/cpu.py), whose attend_kv_head (the walk over one KV head's blocks) and start_state it runs;
// decode_layers.cpp calls it. tests/kernels/test_cascade.py compares it with the reference.
//
// Phase 1, work items (group, KV head, chunk of the shared blocks): the query rows of every member and every
// GQA head of that KV head ([members * group, head_dim]) against the chunk's blocks, each K/V row read once
// for all of them (from DRAM once; the block stays in L1 while its rows are scored and summed for every query
// row). A sliding window gives each query row its own first key (attend_block's head_first). Each item
// writes its rows' partial softmax (max, sum, unnormalised accumulator, fp32). The chunks split a long
// shared prefix so that a step of one group still gives every thread work.
// Phase 2, work items (sequence, KV head): the row's chunks merged by log-sum-exp into its running state,
// then its own blocks (suffix_start .. seq_len - 1) continue that online softmax, and the output is
// normalised once. A row in no group is plain decode (suffix_start 0).

namespace {

// per chunk of the shared part, at least this many blocks: below it the partials' merge costs more than the
// parallelism gains
constexpr int64_t kMinChunkBlocks = 4;

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
  int64_t widest = 1, prefix_blocks = 0;  // the largest group's query rows, the longest prefix's blocks
  for (int64_t g = 0; g < num_groups; ++g) {
    widest = std::max<int64_t>(widest, (group_starts[g + 1] - group_starts[g]) * group);
    prefix_blocks = std::max<int64_t>(prefix_blocks, (prefix_lens[g] + block_size - 1) / block_size);
  }
  // chunks per group: a few items per thread, each of at least kMinChunkBlocks blocks
  const int64_t wanted = (2 * at::get_num_threads() + num_groups * num_kv_heads - 1) /
                         std::max<int64_t>(1, num_groups * num_kv_heads);
  const int64_t chunks = std::max<int64_t>(1, std::min(wanted, prefix_blocks / kMinChunkBlocks));
  // partials [num_seqs, num_q_heads, chunks] (+ head_dim); only grouped rows' are written and read
  std::vector<float> part_m(num_groups ? num_seqs * num_q_heads * chunks : 0), part_l(part_m.size());
  std::vector<float> part_acc(part_m.size() * head_dim);
  const int64_t line = kLineBytes / static_cast<int64_t>(sizeof(float));
  const auto aligned = [](std::vector<float>& buf) {  // widened rows start on a cache line (attend_batch)
    return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + kLineBytes - 1) &
                                    ~uintptr_t(kLineBytes - 1));
  };

  at::parallel_for(0, num_groups * num_kv_heads * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(widest * head_dim), acc(widest * head_dim), m(widest), l(widest);
    std::vector<float> scores(widest * (block_size + 1));
    std::vector<int64_t> first(widest);
    const bool widens = !std::is_same_v<Kind, KvF32>;
    std::vector<float> widened_buf(widens ? 2 * block_size * head_dim + line : 0);
    float* widened = widens ? aligned(widened_buf) : nullptr;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / (num_kv_heads * chunks), h = item / chunks % num_kv_heads, c = item % chunks;
      const int32_t* members = group_rows + group_starts[g];
      const int64_t rows = (group_starts[g + 1] - group_starts[g]) * group;
      if (rows == 0) continue;
      const int64_t per_chunk = ((prefix_lens[g] + block_size - 1) / block_size + chunks - 1) / chunks;
      int64_t lo = c * per_chunk * block_size;
      const int64_t hi = std::min<int64_t>((c + 1) * per_chunk * block_size, prefix_lens[g]);
      int64_t earliest = hi;  // under a window: the first key any row sees
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t s = members[r / group];
        const float* src = qp + s * qs0 + (h * group + r % group) * qs1;
        for (int64_t d = 0; d < head_dim; ++d) qs[r * head_dim + d] = src[d] * scale;
        first[r] = window > 0 ? std::max<int64_t>(0, lens[s] - window) : 0;
        earliest = std::min(earliest, first[r]);
      }
      lo = std::max(lo, earliest);
      start_state(rows, head_dim, acc.data(), m.data(), l.data());
      if (lo < hi)
        attend(qs.data(), rows, head_dim, kv.k + h * kv.width, kv.v + h * kv.width, kv.row, kv.table(members[0]),
               lo, hi, block_size, softcap, scores.data(), acc.data(), m.data(), l.data(), widened,
               window > 0 ? first.data() : nullptr);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t slot = (members[r / group] * num_q_heads + h * group + r % group) * chunks + c;
        part_m[slot] = m[r];
        part_l[slot] = l[r];
        std::copy(acc.begin() + r * head_dim, acc.begin() + (r + 1) * head_dim, part_acc.begin() + slot * head_dim);
      }
    }
  });

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

// paged_decode_attention_cpu's result over a cascade layout (kernels/cascade.py CascadeLayout: group_rows,
// group_starts, prefix_lens, suffix_starts, int32, contiguous).
torch::Tensor cascade_decode_attention_cpu(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                           torch::Tensor block_tables, torch::Tensor seq_lens,
                                           torch::Tensor group_rows, torch::Tensor group_starts,
                                           torch::Tensor prefix_lens, torch::Tensor suffix_starts, double scale,
                                           int64_t window, double softcap) {
  const int kind = check_paged_attention(q, k_cache, v_cache, block_tables);
  for (const torch::Tensor* t : {&seq_lens, &group_rows, &group_starts, &prefix_lens, &suffix_starts})
    TORCH_CHECK(t->scalar_type() == torch::kInt32 && t->is_contiguous() && t->device().is_cpu(),
                "seq_lens and the cascade layout (kernels/cascade.py) must be contiguous int32 CPU tensors");
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
