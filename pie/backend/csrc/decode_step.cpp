// Every decoder layer of a bf16 step of at most 16 tokens in one C++ call: the same
// kernels, in the same order, as the Python loop of pie/backend/llama.py (add + RMSNorm,
// fused q/k/v, RoPE, KV write, paged attention, o, add + RMSNorm, gate/up, SiLU * up, down),
// so the result is bit-identical to it. Why: the loop made ~270 Python-dispatched calls per
// step, ~2.5 ms of a 14 ms batch-1 step on the Xeon of 2026-11-26 (figures:
// pie/backend/decode_step.py).
// The kernels' sources are included (their bindings compiled out) so this is one extension.
#define PIE_NO_BINDINGS
#include "bf16_gemv.cpp"
#include "fused_ops.cpp"
#include "paged_attention.cpp"

// x: [T, hidden] bf16 embeddings. layers: 10 tensors per layer (input norm, q/k/v, o, post
// norm, gate/up, down; then the four projections' pack_wide() weights, empty where none).
// The attention arguments are those of paged_attention(). Returns the last layer's residual
// stream (x + the last MLP output), before the final norm.
torch::Tensor decode_layers(torch::Tensor x, const std::vector<torch::Tensor>& layers,
                            const std::vector<torch::Tensor>& k_pools,
                            const std::vector<torch::Tensor>& v_pools, torch::Tensor cos,
                            torch::Tensor sin, torch::Tensor write_slots, torch::Tensor q_indptr,
                            torch::Tensor kv_indptr, torch::Tensor kv_slots, torch::Tensor visible,
                            torch::Tensor mask_offsets, torch::Tensor masks, torch::Tensor enabled,
                            torch::Tensor groups, torch::Tensor scratch,
                            int64_t heads, int64_t kv_heads, int64_t head_dim, double eps) {
  const int64_t n_layers = static_cast<int64_t>(k_pools.size());
  TORCH_CHECK(static_cast<int64_t>(layers.size()) == 10 * n_layers && v_pools.size() == k_pools.size(),
              "decode_layers: 10 weights and one key and value pool per layer");
  const int64_t tokens = x.size(0), q_size = heads * head_dim, kv_size = kv_heads * head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  c10::optional<torch::Tensor> delta;
  for (int64_t i = 0; i < n_layers; ++i) {
    const torch::Tensor* w = layers.data() + 10 * i;
    auto xh = add_rms_norm(x, delta, w[0], eps);
    x = xh[0];
    const auto qkv = gemv(xh[1], w[1], w[6]);
    const auto qk = rope(qkv.slice(1, 0, q_size + kv_size).view({tokens, -1, head_dim}), cos, sin);
    const auto q = qk.slice(1, 0, heads), k = qk.slice(1, heads);
    const auto v = qkv.slice(1, q_size + kv_size).view({tokens, kv_heads, head_dim});
    write_kv(k_pools[i], v_pools[i], write_slots, k.contiguous(), v.contiguous());
    const auto attn = paged_attention(q.to(at::kFloat).contiguous(), k_pools[i], v_pools[i], q_indptr,
                                      kv_indptr, kv_slots, visible, mask_offsets, masks, enabled, groups, scratch, scale)
                          .to(at::kBFloat16);
    xh = add_rms_norm(x, gemv(attn.reshape({tokens, q_size}), w[2], w[7]), w[3], eps);
    x = xh[0];
    delta = gemv(silu_mul(gemv(xh[1], w[4], w[8])), w[5], w[9]);
  }
  return delta.has_value() ? x + *delta : x;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_layers", &decode_layers, "all decoder layers of a bf16 decode step (CPU)");
}
