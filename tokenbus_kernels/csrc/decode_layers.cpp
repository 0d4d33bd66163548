// A pure decode step's decoder layers in one call (CPU, fp32): worker/engine/backends/cpu_decode.py.
// Built last in the same translation unit, and composed of the other files' functions only, in the
// order worker/engine/models/llama.py calls them, so it computes exactly what the per-layer Python path computes.
//
// Why: at a decode step's few rows each op takes microseconds, and the Python around it (module calls,
// dispatch checks, argument conversion: ~10 calls a layer) cost about as much again; one call for all
// layers pays that once per step.
//
// Arguments (L layers):
//   x             [n, hidden], the embedded tokens of the step (one per sequence)
//   cos, sin      [n, 1, head_dim], this step's rotary tables
//   slot_mapping, block_tables, seq_lens: the decode part of the step's AttentionMetadata
//   weights       7 per layer: input norm, qkv panels, qkv bias (or an empty tensor), o panels,
//                 post-attention norm, gate_up panels, down panels (panels as cpu_linear.pack_panels makes them)
//   scales        4 per layer, one per linear (qkv, o, gate_up, down): empty for fp32 panels, the per-channel
//                 scales of int8 panels (tokenbus_kernels/csrc/cpu_quant.cpp), or the scales and column sums of W8A8
//                 panels (tokenbus_kernels/csrc/cpu_w8a8.cpp)
//   kv_caches     2 per layer: k_cache, v_cache
//   window        every layer's sliding window (0 = none: Mistral, Qwen2 and Phi-3 use one for all layers)
//   cascade       empty, or the step's cascade layout (tokenbus_kernels/cascade.py: group_rows, group_starts,
//                 prefix_lens, suffix_starts): every layer's decode attention then runs as a cascade
//   lora          empty, or the step's LoRA adapter rows and slots (cpu_lora.cpp's LoraStep): each linear's
//                 output then takes its adapter rows' deltas, as LoraLinear adds them on the per-layer path
// Returns {x, residual}: the last layer's output and the residual stream before it (the final norm adds them).

std::vector<torch::Tensor> decode_layers_cpu(torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                                             torch::Tensor slot_mapping, torch::Tensor block_tables,
                                             torch::Tensor seq_lens, std::vector<torch::Tensor> weights,
                                             std::vector<torch::Tensor> kv_caches, std::vector<torch::Tensor> scales,
                                             int64_t num_heads,
                                             int64_t num_kv_heads, int64_t head_dim, int64_t intermediate_size,
                                             double eps, double scale, int64_t window,
                                             std::vector<torch::Tensor> cascade, std::vector<torch::Tensor> lora) {
  constexpr size_t kPerLayer = 7;
  TORCH_CHECK(weights.size() % kPerLayer == 0, "weights must hold 7 tensors per layer");
  const size_t num_layers = weights.size() / kPerLayer;
  TORCH_CHECK(kv_caches.size() == 2 * num_layers, "kv_caches must hold a k and a v cache per layer");
  TORCH_CHECK(scales.size() == 4 * num_layers, "scales must hold 4 tensors per layer (empty for fp32 panels)");
  TORCH_CHECK(cascade.empty() || cascade.size() == 4, "cascade must be empty or hold a layout's 4 tensors");
  check_layout(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [num_tokens, hidden] tensor");
  // the ops below take no Python objects: the engine's helper threads may run meanwhile, as during torch ops
  pybind11::gil_scoped_release no_gil;
  const int64_t n = x.size(0), hidden = x.size(1);
  const int64_t q_size = num_heads * head_dim, qkv_size = (num_heads + 2 * num_kv_heads) * head_dim;
  const LoraStep adapters(lora, num_layers, q_size, num_kv_heads * head_dim, hidden, intermediate_size);
  torch::Tensor residual;
  for (size_t layer = 0; layer < num_layers; ++layer) {
    const torch::Tensor* w = weights.data() + layer * kPerLayer;
    const torch::Tensor* sc = scales.data() + layer * 4;
    const c10::optional<torch::Tensor> qkv_bias = w[2].numel() > 0 ? c10::optional<torch::Tensor>(w[2]) : c10::nullopt;
    const torch::Tensor& k_cache = kv_caches[2 * layer];
    const torch::Tensor& v_cache = kv_caches[2 * layer + 1];
    torch::Tensor h;
    if (layer == 0) {
      residual = x;
      h = rms_norm_cpu(x, w[0], eps);
    } else {
      add_rms_norm_cpu(x, residual, w[0], eps);  // x becomes the normed sum, residual the sum
      h = x;
    }
    const torch::Tensor qkv = panel_linear_any_cpu(h, w[1], sc[0], qkv_size, qkv_bias);
    adapters.apply(layer, 0, qkv, h);
    const torch::Tensor heads = qkv.view({n, num_heads + 2 * num_kv_heads, head_dim});
    torch::Tensor q = heads.narrow(1, 0, num_heads);
    torch::Tensor k = heads.narrow(1, num_heads, num_kv_heads);
    torch::Tensor v = heads.narrow(1, num_heads + num_kv_heads, num_kv_heads);
    rotary_cpu(q, k, cos, sin);
    write_kv_cpu(k, v, k_cache, v_cache, slot_mapping);
    const torch::Tensor attn =
        cascade.empty() ? paged_decode_attention_cpu(q, k_cache, v_cache, block_tables, seq_lens, scale, window, 0.0)
                        : cascade_decode_attention_cpu(q, k_cache, v_cache, block_tables, seq_lens, cascade[0],
                                                       cascade[1], cascade[2], cascade[3], scale, window, 0.0);
    const torch::Tensor attn_rows = attn.view({n, q_size});
    torch::Tensor o = panel_linear_any_cpu(attn_rows, w[3], sc[1], hidden, c10::nullopt);
    adapters.apply(layer, 1, o, attn_rows);
    add_rms_norm_cpu(o, residual, w[4], eps);
    const torch::Tensor gate_up = panel_linear_any_cpu(o, w[5], sc[2], 2 * intermediate_size, c10::nullopt);
    adapters.apply(layer, 2, gate_up, o);
    const torch::Tensor act = silu_and_mul_cpu(gate_up);
    x = panel_linear_any_cpu(act, w[6], sc[3], hidden, c10::nullopt);
    adapters.apply(layer, 3, x, act);
  }
  return {x, residual};
}
