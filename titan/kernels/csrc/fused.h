// Fused element-wise decoder ops (fused.cpp), registered by binding.cpp.
#pragma once
#include <torch/extension.h>

#include <vector>

// [T, heads, head_dim] (inner stride 1, any row / head strides) rotated by per-token cos / sin
// [T, head_dim / 2], rotate-half pairing; returns a contiguous tensor.
torch::Tensor rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);

// SwiGLU on a fused [T, 2 * I] gate/up projection: silu(gate) * up -> [T, I].
torch::Tensor silu_and_mul(const torch::Tensor& gate_up);

// RMSNorm of float32 rows: at decode sizes (one row of ~1k floats) torch's composite op spends ~30 us in
// dispatch and thread wake-ups for ~1 us of arithmetic. Sums of squares accumulate in double.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);

// The residual add and the RMSNorm after it: returns {rms_norm(residual + x) * weight, residual + x}.
std::vector<torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& residual,
                                        const torch::Tensor& weight, double eps);
