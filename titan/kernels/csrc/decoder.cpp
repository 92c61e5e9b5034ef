// The decoder stack of one narrow step in one native call. A decode step of the default model makes ~300
// small calls (4 products, attention, KV write, rotary, 2 norms, SwiGLU per layer, x 30 layers); from
// Python each costs 5-10 us of interpreter and module dispatch around the kernel, ~2 ms a step, a quarter
// of it. Here the same kernels run in the same order on the same tensors, so the numbers are identical to
// the layer-by-layer path (tests/test_native_decoder.py compares them bit for bit).
#include "decoder.h"

#include "attention_ops.h"
#include "fused.h"
#include "linear_ops.h"

namespace {

torch::Tensor project(const torch::Tensor& x, const torch::Tensor& w, int64_t type, bool interleaved,
                      const c10::optional<torch::Tensor>& bias) {
    torch::Tensor y = quantized_gemv(x, w, type, x.size(1), interleaved);
    return bias.has_value() ? y + *bias : y;  // out-of-place, as Linear.forward adds it
}

}  // namespace

torch::Tensor decode_stack(const torch::Tensor& embeddings, const torch::Tensor& cos, const torch::Tensor& sin,
                           const std::vector<torch::Tensor>& weights, const std::vector<int64_t>& types,
                           const std::vector<bool>& interleaved,
                           const std::vector<c10::optional<torch::Tensor>>& biases,
                           const std::vector<torch::Tensor>& norms, const std::vector<torch::Tensor>& key_caches,
                           const std::vector<torch::Tensor>& value_caches, const torch::Tensor& slot_mapping,
                           const torch::Tensor& block_tables, const torch::Tensor& query_starts,
                           const torch::Tensor& context_lens, int64_t block_size, int64_t num_heads,
                           int64_t num_kv_heads, double scale, double eps) {
    const int64_t L = (int64_t)key_caches.size();
    TORCH_CHECK(L > 0 && (int64_t)value_caches.size() == L, "one key and one value cache per layer");
    TORCH_CHECK((int64_t)weights.size() == 4 * L && (int64_t)types.size() == 4 * L && (int64_t)biases.size() == 4 * L &&
                    (int64_t)interleaved.size() == 4 * L,
                "four matrices (qkv, o, gate_up, down), types, layouts and biases per layer");
    TORCH_CHECK((int64_t)norms.size() == 2 * L + 1, "two norms per layer and a final one");
    TORCH_CHECK(embeddings.dim() == 2 && embeddings.scalar_type() == torch::kFloat32 && embeddings.is_contiguous(),
                "embeddings must be contiguous float32 [T, hidden]");
    const int64_t T = embeddings.size(0), D = key_caches[0].size(2);
    const int64_t query_key = (num_heads + num_kv_heads) * D, width = query_key + num_kv_heads * D;
    const std::string isa = kernel_isa();

    torch::Tensor hidden = embeddings, residual, normed;
    auto linear = [&](const torch::Tensor& x, int64_t i) {
        return project(x, weights[i], types[i], interleaved[i], biases[i]);
    };
    for (int64_t l = 0; l < L; l++) {
        if (l == 0) {
            residual = hidden;  // the first layer starts from the embeddings (see LlamaDecoderLayer)
            normed = rms_norm(hidden, norms[0], eps);
        } else {
            auto pair = add_rms_norm(hidden, residual, norms[2 * l], eps);
            normed = pair[0];
            residual = pair[1];
        }
        const torch::Tensor qkv = linear(normed, 4 * l);
        TORCH_CHECK(qkv.size(1) == width, "layer ", l, ": qkv has ", qkv.size(1), " columns, expected ", width);
        // q and k are adjacent in the fused output: one rotary pass over both; v is read in place.
        const torch::Tensor rotated = rotary(qkv.as_strided({T, num_heads + num_kv_heads, D}, {width, D, 1}), cos, sin);
        const torch::Tensor value =
            qkv.as_strided({T, num_kv_heads, D}, {width, D, 1}, qkv.storage_offset() + query_key);
        titan_write_kv(rotated.narrow(1, num_heads, num_kv_heads), value, key_caches[l], value_caches[l], slot_mapping);
        const torch::Tensor attended =
            titan_paged_attention(isa, rotated.narrow(1, 0, num_heads), key_caches[l], value_caches[l], block_tables,
                                  query_starts, context_lens, block_size, scale);
        const torch::Tensor out = linear(attended, 4 * l + 1);
        auto pair = add_rms_norm(out, residual, norms[2 * l + 1], eps);
        residual = pair[1];
        const torch::Tensor gate_up = linear(pair[0], 4 * l + 2);
        hidden = linear(silu_and_mul(gate_up), 4 * l + 3);
    }
    return add_rms_norm(hidden, residual, norms[2 * L], eps)[0];
}
