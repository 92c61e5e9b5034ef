// The quantized product and the selected ISA, for native callers outside binding.cpp (decoder.cpp).
#pragma once
#include <torch/extension.h>

#include <string>

// x [M, K] float32 times the quantized weight [N, K]^T -> [M, N] (the narrow-step kernel; binding.cpp);
// `interleaved`: w is in the 8-row layout of interleave.h.
torch::Tensor quantized_gemv(const torch::Tensor& x, const torch::Tensor& w, int64_t type, int64_t K,
                             bool interleaved);

// The ISA name set_isa chose ("avx512", "avx2", "generic").
std::string kernel_isa();
