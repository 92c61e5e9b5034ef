// Small fused element-wise ops of a decoder layer. At decode sizes (a few rows of ~1k floats) each torch
// op costs 5-30 us of dispatch and allocation for well under 1 us of arithmetic, and a layer runs a dozen
// of them; these do the same arithmetic, in the same order of float operations, in one call each.
#include "fused.h"

#include "kernels.h"

#include <ATen/Parallel.h>

#include <cmath>

namespace {

// Rows per task: decode-sized inputs run inline, without waking the thread pool.
constexpr int64_t kRowGrain = 64;

void check_rows(const torch::Tensor& x, const char* what) {
    TORCH_CHECK(x.dtype() == torch::kFloat32 && x.device().is_cpu(), what, " must be a CPU float32 tensor");
}

// A norm row costs more than an element-wise one: split 16 rows per task, once there are enough rows.
template <typename Body>
void for_norm_rows(int64_t rows, const Body& body) {
    if (rows < kRowGrain) {
        body(0, rows);
    } else {
        at::parallel_for(0, rows, kRowGrain / 4, body);
    }
}

// out = v / rms(v) * w over one row of H; the sum of squares accumulates in double.
void norm_row(const float* v, const float* w, float* out, int64_t H, double eps) {
    double squares = 0.0;
    for (int64_t i = 0; i < H; i++) squares += (double)v[i] * v[i];
    const float scale = (float)(1.0 / std::sqrt(squares / H + eps));
    for (int64_t i = 0; i < H; i++) out[i] = v[i] * scale * w[i];
}

}  // namespace

torch::Tensor rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
    check_rows(x, "x");
    TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "x must be [T, heads, head_dim], inner stride 1");
    const int64_t T = x.size(0), heads = x.size(1), D = x.size(2), half = D / 2;
    TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T * half && sin.numel() == T * half,
                "cos and sin must be contiguous [T, head_dim / 2]");
    auto out = torch::empty({T, heads, D}, x.options());
    const float* xp = x.data_ptr<float>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const int64_t s0 = x.stride(0), s1 = x.stride(1);
    at::parallel_for(0, T, kRowGrain, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; t++) {
            const float* c = cp + t * half;
            const float* s = sp + t * half;
            for (int64_t h = 0; h < heads; h++) {
                const float* in = xp + t * s0 + h * s1;
                float* o = op + (t * heads + h) * D;
                // rotate-half: pair i with i + half (as titan/model/rope.py, same float operations).
                for (int64_t i = 0; i < half; i++) {
                    const float first = in[i], second = in[i + half];
                    const float a = first * c[i], b = second * c[i];
                    o[i] = a - second * s[i];
                    o[i + half] = b + first * s[i];
                }
            }
        }
    });
    return out;
}

torch::Tensor silu_and_mul(const torch::Tensor& gate_up) {
    check_rows(gate_up, "gate_up");
    TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
                "gate_up must be contiguous [T, 2 * intermediate]");
    const int64_t T = gate_up.size(0), width = gate_up.size(1) / 2;
    auto out = torch::empty({T, width}, gate_up.options());
    const float* gp = gate_up.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const KernelTable& isa = table();  // the exp vectorizes at the ISA's width (generic: scalar-speed SSE2)
    at::parallel_for(0, T, kRowGrain, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; t++) {
            const float* gate = gp + t * 2 * width;
            isa.silu_mul(gate, gate + width, op + t * width, width);
        }
    });
    return out;
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
    TORCH_CHECK(x.dtype() == torch::kFloat32 && weight.dtype() == torch::kFloat32 && x.is_contiguous() &&
                    weight.is_contiguous() && x.size(-1) == weight.numel(),
                "rms_norm takes contiguous float32 x [..., H] and weight [H]");
    const int64_t H = weight.numel(), rows = x.numel() / std::max<int64_t>(H, 1);
    auto out = torch::empty_like(x);
    const float* xp = x.data_ptr<float>();
    const float* wp = weight.data_ptr<float>();
    float* op = out.data_ptr<float>();
    for_norm_rows(rows, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; r++) norm_row(xp + r * H, wp, op + r * H, H, eps);
    });
    return out;
}

std::vector<torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& residual,
                                        const torch::Tensor& weight, double eps) {
    check_rows(x, "x");
    check_rows(residual, "residual");
    check_rows(weight, "weight");
    TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous() &&
                    x.sizes() == residual.sizes() && x.size(-1) == weight.numel(),
                "add_rms_norm takes contiguous float32 x and residual [..., H] and weight [H]");
    const int64_t H = weight.numel(), rows = x.numel() / std::max<int64_t>(H, 1);
    auto sum = torch::empty_like(x);
    auto normed = torch::empty_like(x);
    const float* xp = x.data_ptr<float>();
    const float* rp = residual.data_ptr<float>();
    const float* wp = weight.data_ptr<float>();
    float* sp = sum.data_ptr<float>();
    float* np = normed.data_ptr<float>();
    for_norm_rows(rows, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; r++) {
            for (int64_t i = 0; i < H; i++) sp[r * H + i] = rp[r * H + i] + xp[r * H + i];
            norm_row(sp + r * H, wp, np + r * H, H, eps);
        }
    });
    return {normed, sum};
}
