// ---- LoRA over rows grouped by adapter slot (CPU, fp32; kernels/lora_reference.py has the layout) ----
// y [T, out] += for each row of slot s: (a[s] · x[row]) · b[s], slice by slice, in place. For decode-sized
// batches: rows in parallel, each two GEMVs whose weights stay in cache across a group's rows; only the
// slot's own rank is computed (ranks[s]; a and b are zero past it), not max_lora_rank.
void lora_cpu(torch::Tensor y, torch::Tensor x, torch::Tensor a, torch::Tensor b, std::vector<int64_t> offsets,
              std::vector<int64_t> widths, torch::Tensor rows, torch::Tensor starts, torch::Tensor counts,
              torch::Tensor ranks) {
  check_layout(y, "y");
  check_layout(x, "x");
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && a.scalar_type() == torch::kFloat32 &&
                  b.scalar_type() == torch::kFloat32,
              "a and b must be contiguous float32");
  TORCH_CHECK(rows.scalar_type() == torch::kInt64 && starts.scalar_type() == torch::kInt32 &&
                  counts.scalar_type() == torch::kInt32 && ranks.scalar_type() == torch::kInt32,
              "rows must be int64; starts, counts and ranks int32");
  const int64_t num_slots = a.size(0), k_all = a.size(1), in = a.size(2), rank = b.size(2);
  const int64_t num_slices = static_cast<int64_t>(offsets.size());
  TORCH_CHECK(k_all == num_slices * rank && x.size(1) == in && y.size(1) == b.size(1),
              "lora_cpu: a, b, x, y and the slices disagree");
  TORCH_CHECK(starts.size(0) == num_slots && counts.size(0) == num_slots && ranks.size(0) == num_slots,
              "lora_cpu: starts, counts and ranks need one entry per slot");
  const int64_t n = rows.size(0), xs = x.stride(0), ys = y.stride(0);
  const float* xp = x.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int32_t* sp = starts.data_ptr<int32_t>();
  const int32_t* cp = counts.data_ptr<int32_t>();
  const int32_t* kp = ranks.data_ptr<int32_t>();
  const int64_t out = b.size(1);
  at::parallel_for(0, n, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> t(k_all);
    for (int64_t i = begin; i < end; ++i) {
      int64_t s = 0;
      while (s < num_slots && !(sp[s] <= i && i < sp[s] + cp[s])) ++s;
      TORCH_CHECK(s < num_slots, "lora_cpu: row ", i, " is in no slot's group");
      const int64_t r = std::min<int64_t>(kp[s], rank);
      const float* xr = xp + rp[i] * xs;
      float* yr = yp + rp[i] * ys;
      for (int64_t j = 0; j < num_slices; ++j) {
        for (int64_t k = 0; k < r; ++k) {
          const float* ar = ap + (s * k_all + j * rank + k) * in;
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t d = 0; d < in; ++d) sum += ar[d] * xr[d];
          t[j * rank + k] = sum;
        }
        const float* tj = t.data() + j * rank;
        for (int64_t o = offsets[j]; o < offsets[j] + widths[j]; ++o) {
          const float* br = bp + (s * out + o) * rank;
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t k = 0; k < r; ++k) sum += tj[k] * br[k];
          yr[o] += sum;
        }
      }
    }
  });
}
