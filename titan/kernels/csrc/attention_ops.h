// Torch-facing paged attention ops (attention_binding.cpp), registered by binding.cpp, which passes the
// ISA name it has selected so that set_isa governs these kernels as it does the quantized ones.
#pragma once
#include <torch/extension.h>

#include <string>

// query [T, H, D] float32 (unit inner stride), key/value cache [S, Hkv, D] float32 or float16 contiguous, block_tables
// [B, max_blocks] int32/int64, query_starts [B + 1], context_lens [B] -> [T, H * D]. Row i of sequence b
// (n_b rows) sits at position context_lens[b] - n_b + i and attends to cache positions [0, that position].
torch::Tensor titan_paged_attention(const std::string& isa, const torch::Tensor& query, const torch::Tensor& key_cache,
                                    const torch::Tensor& value_cache, const torch::Tensor& block_tables,
                                    const torch::Tensor& query_starts, const torch::Tensor& context_lens,
                                    int64_t block_size, double scale);

// key_cache[slot_mapping[t]] = key[t] (and value likewise) for every row t of key/value [T, Hkv, D].
void titan_write_kv(const torch::Tensor& key, const torch::Tensor& value, const torch::Tensor& key_cache,
                    const torch::Tensor& value_cache, const torch::Tensor& slot_mapping);
