// The decoder stack of one narrow step in one native call (decoder.cpp), registered by binding.cpp.
#pragma once
#include <torch/extension.h>

#include <vector>

// Llama-family decoder layers over T rows (decode rows, short chunks, speculative verify rows) whose
// attention is one native run: embeddings [T, hidden] -> final-normed hidden states [T, hidden].
// Per layer l: weights[4l .. 4l + 3] are the quantized qkv, o, gate_up and down matrices (types alike),
// interleaved (the 8-row layout of interleave.h) and biases likewise (None: no bias), norms[2l], norms[2l + 1] the input and post-attention norms, and
// norms[2L] the final one. cos / sin [T, head_dim / 2]; the rest as titan_paged_attention / write_kv take.
torch::Tensor decode_stack(const torch::Tensor& embeddings, const torch::Tensor& cos, const torch::Tensor& sin,
                           const std::vector<torch::Tensor>& weights, const std::vector<int64_t>& types,
                           const std::vector<bool>& interleaved,
                           const std::vector<c10::optional<torch::Tensor>>& biases,
                           const std::vector<torch::Tensor>& norms, const std::vector<torch::Tensor>& key_caches,
                           const std::vector<torch::Tensor>& value_caches, const torch::Tensor& slot_mapping,
                           const torch::Tensor& block_tables, const torch::Tensor& query_starts,
                           const torch::Tensor& context_lens, int64_t block_size, int64_t num_heads,
                           int64_t num_kv_heads, double scale, double eps);
