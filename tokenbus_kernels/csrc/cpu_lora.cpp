// ---- LoRA over rows grouped by adapter slot (CPU, fp32; tokenbus_kernels/lora_reference.py has the layout) ----
// y [T, out] += for each row of slot s: (a[s] · x[row]) · b[s], slice by slice, in place. For decode-sized
// batches: the rows of a slot's group go in blocks of up to 6, each block one shrink (a GEMV on a[s] for its
// rows: every weight loaded once for the block) and one expand (an AXPY per rank over output tiles, the tile's
// sums in registers for the block's rows); blocks run in parallel. Only the slot's own rank is computed
// (ranks[s]; a and b are zero past it), not max_lora_rank.
//
// bt is b transposed, [slots, max_rank, out] (the manager keeps b on the CPU as a view of it: LoraLinear.b is
// bt.transpose(1, 2)): the expand then runs along an output row of b, which vectorises, instead of one
// rank-long dot product per output with its horizontal sum (2x slower at rank 16, SmolLM2's gate_up).
// Each row's delta is summed on its own, then added (as PEFT adds lora_B(lora_A(x)) to the base output).

namespace {

// The native vector (GCC's vector extension: zmm with AVX-512, ymm under AVX2), loaded and stored unaligned;
// may_alias as the intrinsics' own __m512: it reads and writes float tensors
#ifdef __AVX512F__
constexpr int64_t kLoraLanes = 16;
#else
constexpr int64_t kLoraLanes = 8;
#endif
typedef float lora_vec __attribute__((vector_size(kLoraLanes * 4), aligned(4), __may_alias__));
constexpr int64_t kLoraBlock = 6;       // rows of one slot that share each weight load
constexpr int64_t kLoraTileVecs = kLoraLanes == 16 ? 4 : 2;  // the expand's sums: 6 x 4 zmm (6 x 2 ymm)
constexpr int64_t kLoraTile = kLoraTileVecs * kLoraLanes;  // output columns per expand tile

// NR rows (x rows xr, y rows yr) of one slot, one slice: a the slice's shrink rows [r, in], bt its expand
// weights (row k at bt + k * bt_stride, the slice's w columns), t scratch [NR * r]
template <int NR>
void lora_block(const float* const* xr, float* const* yr, const float* a, const float* bt, int64_t bt_stride,
                int64_t in, int64_t r, int64_t w, float* t) {
  const float* __restrict__ x0 = xr[0];  // the rows a block lacks alias row 0 (never read: if constexpr)
  const float* __restrict__ x1 = xr[NR > 1 ? 1 : 0];
  const float* __restrict__ x2 = xr[NR > 2 ? 2 : 0];
  const float* __restrict__ x3 = xr[NR > 3 ? 3 : 0];
  const float* __restrict__ x4 = xr[NR > 4 ? 4 : 0];
  const float* __restrict__ x5 = xr[NR > 5 ? 5 : 0];
  for (int64_t k = 0; k < r; ++k) {  // shrink: t[i, k] = a[k] · x[i]
    const float* __restrict__ ak = a + k * in;
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f, s4 = 0.f, s5 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3, s4, s5)
    for (int64_t d = 0; d < in; ++d) {
      const float av = ak[d];
      s0 += av * x0[d];
      if constexpr (NR > 1) s1 += av * x1[d];
      if constexpr (NR > 2) s2 += av * x2[d];
      if constexpr (NR > 3) s3 += av * x3[d];
      if constexpr (NR > 4) s4 += av * x4[d];
      if constexpr (NR > 5) s5 += av * x5[d];
    }
    const float sums[6] = {s0, s1, s2, s3, s4, s5};
    for (int i = 0; i < NR; ++i) t[i * r + k] = sums[i];
  }
  int64_t o0 = 0;
  for (; o0 + kLoraTile <= w; o0 += kLoraTile) {  // expand: y[i, tile] += sum_k t[i, k] * bt[k, tile]
    lora_vec acc[NR][kLoraTileVecs];
    for (int i = 0; i < NR; ++i)
      for (int q = 0; q < kLoraTileVecs; ++q) acc[i][q] = lora_vec{};
    for (int64_t k = 0; k < r; ++k) {
      const lora_vec* bk = reinterpret_cast<const lora_vec*>(bt + k * bt_stride + o0);
      lora_vec bv[kLoraTileVecs];
      for (int q = 0; q < kLoraTileVecs; ++q) bv[q] = bk[q];
      for (int i = 0; i < NR; ++i) {
        const float c = t[i * r + k];
        for (int q = 0; q < kLoraTileVecs; ++q) acc[i][q] += c * bv[q];
      }
    }
    for (int i = 0; i < NR; ++i) {
      lora_vec* yo = reinterpret_cast<lora_vec*>(yr[i] + o0);
      for (int q = 0; q < kLoraTileVecs; ++q) yo[q] += acc[i][q];
    }
  }
  for (int i = 0; i < NR; ++i) {  // the columns past the last whole tile
    const float* ti = t + i * r;
    for (int64_t o = o0; o < w; ++o) {
      float sum = 0.f;
      for (int64_t k = 0; k < r; ++k) sum += ti[k] * bt[k * bt_stride + o];
      yr[i][o] += sum;
    }
  }
}

}  // namespace

void lora_cpu(torch::Tensor y, torch::Tensor x, torch::Tensor a, torch::Tensor bt, std::vector<int64_t> offsets,
              std::vector<int64_t> widths, torch::Tensor rows, torch::Tensor starts, torch::Tensor counts,
              torch::Tensor ranks) {
  check_layout(y, "y");
  check_layout(x, "x");
  TORCH_CHECK(a.is_contiguous() && bt.is_contiguous() && a.scalar_type() == torch::kFloat32 &&
                  bt.scalar_type() == torch::kFloat32,
              "a and bt must be contiguous float32");
  TORCH_CHECK(rows.scalar_type() == torch::kInt64 && starts.scalar_type() == torch::kInt32 &&
                  counts.scalar_type() == torch::kInt32 && ranks.scalar_type() == torch::kInt32,
              "rows must be int64; starts, counts and ranks int32");
  TORCH_CHECK(rows.is_contiguous() && starts.is_contiguous() && counts.is_contiguous() && ranks.is_contiguous(),
              "rows, starts, counts and ranks must be contiguous");
  const int64_t num_slots = a.size(0), k_all = a.size(1), in = a.size(2), rank = bt.size(1), out = bt.size(2);
  const int64_t num_slices = static_cast<int64_t>(offsets.size());
  TORCH_CHECK(k_all == num_slices * rank && x.size(1) == in && y.size(1) == out && bt.size(0) == num_slots,
              "lora_cpu: a [slots, slices * rank, in], bt [slots, rank, out], x, y and the slices disagree");
  TORCH_CHECK(starts.size(0) == num_slots && counts.size(0) == num_slots && ranks.size(0) == num_slots,
              "lora_cpu: starts, counts and ranks need one entry per slot");
  for (int64_t j = 0; j < num_slices; ++j)
    TORCH_CHECK(offsets[j] >= 0 && widths[j] >= 0 && offsets[j] + widths[j] <= out, "lora_cpu: slice ", j,
                " is outside the output");
  const int64_t n = rows.size(0), xs = x.stride(0), ys = y.stride(0), num_x = x.size(0), num_y = y.size(0);
  const float* xp = x.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  const float* bp = bt.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int32_t* sp = starts.data_ptr<int32_t>();
  const int32_t* cp = counts.data_ptr<int32_t>();
  const int32_t* kp = ranks.data_ptr<int32_t>();
  // the work: blocks of up to kLoraBlock rows of one slot, as (slot, first index into rows, rows in it)
  std::vector<std::array<int64_t, 3>> blocks;
  int64_t grouped = 0;
  for (int64_t s = 0; s < num_slots; ++s) {
    TORCH_CHECK(sp[s] >= 0 && cp[s] >= 0 && sp[s] + cp[s] <= n, "lora_cpu: slot ", s, "'s group is outside rows");
    grouped += cp[s];
    for (int64_t i = sp[s]; i < sp[s] + cp[s]; i += kLoraBlock)
      blocks.push_back({s, i, std::min<int64_t>(kLoraBlock, sp[s] + cp[s] - i)});
  }
  TORCH_CHECK(grouped == n, "lora_cpu: the slots' groups cover ", grouped, " of ", n, " rows");
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(rp[i] >= 0 && rp[i] < std::min(num_x, num_y), "lora_cpu: row ", rp[i], " is outside x or y");
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> t(kLoraBlock * rank);
    for (int64_t u = begin; u < end; ++u) {
      const auto [s, first, nr] = blocks[u];
      const int64_t r = std::min<int64_t>(kp[s], rank);
      const float* xr[kLoraBlock];
      float* yr[kLoraBlock];
      for (int64_t i = 0; i < nr; ++i) {
        xr[i] = xp + rp[first + i] * xs;
        yr[i] = yp + rp[first + i] * ys;
      }
      for (int64_t j = 0; j < num_slices; ++j) {
        const float* aj = ap + (s * k_all + j * rank) * in;
        const float* bj = bp + s * rank * out + offsets[j];
        float* yj[kLoraBlock];
        for (int64_t i = 0; i < nr; ++i) yj[i] = yr[i] + offsets[j];
        switch (nr) {
          case 1: lora_block<1>(xr, yj, aj, bj, out, in, r, widths[j], t.data()); break;
          case 2: lora_block<2>(xr, yj, aj, bj, out, in, r, widths[j], t.data()); break;
          case 3: lora_block<3>(xr, yj, aj, bj, out, in, r, widths[j], t.data()); break;
          case 4: lora_block<4>(xr, yj, aj, bj, out, in, r, widths[j], t.data()); break;
          case 5: lora_block<5>(xr, yj, aj, bj, out, in, r, widths[j], t.data()); break;
          default: lora_block<6>(xr, yj, aj, bj, out, in, r, widths[j], t.data()); break;
        }
      }
    }
  });
}

// The adapter rows of a fused decode step (decode_layers.cpp), as every wrapped linear of it takes them. lora:
// empty (no adapter row), or {rows, starts, counts, ranks, then per layer a and bt of qkv, o, gate_up and down}.
// The slices are the fused linears' own (worker/engine/lora/targets.py): q, k, v; one; gate, up; one.
struct LoraStep {
  const std::vector<torch::Tensor>& lora;
  std::vector<int64_t> offsets[4], widths[4];

  LoraStep(const std::vector<torch::Tensor>& lora, size_t num_layers, int64_t q_size, int64_t kv_size,
           int64_t hidden, int64_t intermediate)
      : lora(lora),
        offsets{{0, q_size, q_size + kv_size}, {0}, {0, intermediate}, {0}},
        widths{{q_size, kv_size, kv_size}, {hidden}, {intermediate, intermediate}, {hidden}} {
    TORCH_CHECK(lora.empty() || lora.size() == 4 + 8 * num_layers,
                "lora must be empty or hold rows, starts, counts, ranks and 8 tensors per layer");
  }

  // y += the adapter rows' deltas of linear `which` (0 qkv, 1 o, 2 gate_up, 3 down) of `layer`, x its input
  void apply(size_t layer, int which, const torch::Tensor& y, const torch::Tensor& x) const {
    if (lora.empty()) return;
    const torch::Tensor* ab = lora.data() + 4 + 8 * layer + 2 * which;
    lora_cpu(y, x, ab[0], ab[1], offsets[which], widths[which], lora[0], lora[1], lora[2], lora[3]);
  }
};
