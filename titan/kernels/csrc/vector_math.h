// Element-wise math in arithmetic the compiler vectorizes at the including unit's ISA (std::exp is a
// scalar libm call: SwiGLU of one decode row took 7 us per layer of a ~6 ms step with it).
#pragma once
#include <cstdint>
#include <cstring>

// Cephes' expf: 2^k exp(r) with k = round(x / ln 2) by the 1.5 x 2^23 trick, r reduced in two parts, a
// degree-5 polynomial; within 2 ulp on the clamped range. From x = 88.38 on, k = 128 makes the scale's
// bits +inf's, as the exact result's overflow (near 88.72) would: silu of a very negative gate is -0.
// Loops over it vectorize because the build has -fno-trapping-math (build.py). Static: each ISA unit keeps
// its own copy, compiled for its target (one shared inline definition could be the AVX-512 one running on
// an AVX2 machine). attention_impl.inc's exp_nonpositive is the explicit-vector twin for x <= 0 only.
static inline float vector_exp(float x) {
    x = x > -87.0f ? x : -87.0f;  // not fmin / fmax: their NaN rules keep the loop scalar
    x = x < 89.0f ? x : 89.0f;
    const float shifter = 12582912.0f;  // 1.5 x 2^23: adding it rounds to an integer in the low mantissa bits
    const float shifted = x * 1.44269504088896341f + shifter;
    int32_t k;
    std::memcpy(&k, &shifted, sizeof k);
    k -= 0x4B400000;  // the bits of the shifter itself
    const float kf = shifted - shifter;
    const float r = x - kf * 0.693359375f - kf * -2.12194440e-4f;
    const float z = r * r;
    const float p = (((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r +
                      1.6666665459e-1f) * r + 5.0000001201e-1f) * z + r + 1.0f;
    const int32_t bits = (k + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}
