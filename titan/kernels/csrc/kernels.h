// Plain-C interface between the torch binding and the per-ISA kernel translation units.
// The ISA units include no torch headers, so each compiles in a second and can carry its own
// `#pragma GCC target` without touching code that runs on every CPU.
#pragma once
#include <cstdint>
#include <type_traits>

#include <immintrin.h>

// GGML type ids (ggml.h numbering, as written in GGUF files).
enum GgmlType : int32_t {
    GGML_F32 = 0, GGML_F16 = 1, GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q8_0 = 8,
    GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14, GGML_BF16 = 30,
};

// Activation rows the fused kernel multiplies per pass over a weight row (more rows: several passes,
// over a row that is by then in L1).
constexpr int kMaxFusedRows = 8;

struct KernelTable {
    const char* name;
    // y[m * ldy + n] = dot(x[m * ldx .. + K], row n of w) for m < M n in [n0, n1).
    void (*gemv)(int32_t type, const uint8_t* w, int64_t row_bytes, int64_t K, const float* x, int64_t ldx,
                 int64_t M, float* y, int64_t ldy, int64_t n0, int64_t n1);
    // As gemv for Q4_0 / Q4_1 / Q8_0 with activations rounded per block of 32 to `bits`-bit integers (16,
    // or 8: llama.cpp's Q8 scheme) by quantize_rows: xq [M, K] int16 / int8, xd [M, K/32] block scales,
    // xs [M, K/32] scale * sum of the block's xq. Integer dot products; nullptr on the generic ISA.
    void (*gemv_int)(int32_t type, int bits, const uint8_t* w, int64_t row_bytes, int64_t K, const void* xq,
                     const float* xd, const float* xs, int64_t M, float* y, int64_t ldy, int64_t n0, int64_t n1);
    // As gemv_int over weights interleaved by 8 rows (interleave.h), for row groups [g0, g1) (output rows
    // 8 g0 .. 8 g1); the activations packed by x8_pack (16 bits) or x8_pack_bytes (8) in chunks of x8_rows.
    // nullptr on the generic ISA.
    void (*gemv_x8)(int32_t type, int bits, const uint8_t* w, int64_t row_bytes, int64_t K, const int32_t* xw,
                    const float* xd, const float* xs, int64_t M, float* y, int64_t ldy, int64_t g0, int64_t g1,
                    int64_t wide_rows);
    // out[(i - i0) * K ..] = row (rows ? rows[i] : i) of w dequantized, for i in [i0, i1).
    void (*dequant)(int32_t type, const uint8_t* w, int64_t row_bytes, int64_t K, const int64_t* rows,
                    int64_t i0, int64_t i1, float* out);
    // Rows [m0, m1) of x [M, K] rounded per block of 32 to `bits`-bit integers (see kernels_impl.inc): any
    // of xq [M, K] (int8 or int16), xd / xs [M, K/32] and xr [M, K] (the rounded values as float) may be null.
    void (*quantize_rows)(const float* x, int64_t ldx, int64_t m0, int64_t m1, int64_t K, int bits, void* xq,
                          float* xd, float* xs, float* xr);
    // SwiGLU of one row: out[i] = silu(gate[i]) * up[i] for i < n.
    void (*silu_mul)(const float* gate, const float* up, float* out, int64_t n);
    // Activation rows gemv_x8 multiplies per pass (its packing chunk): 4 with 16 vector registers, 8 with 32.
    int x8_rows;
};

// Rounded activations [M, K] (int16, with block scales d and sums s [M, K/32]) in gemv_x8's layout: chunks of
// `chunk` rows (the last may be shorter), each block by block and pair by pair with the chunk's rows side
// by side: word (blk * 16 + p) * rows + m of a chunk is elements 2p, 2p + 1 of block blk of its row m, and
// d / s entry blk * rows + m is that block's.
void x8_pack(const int16_t* q, const float* d, const float* s, int64_t M, int64_t K, int chunk, int32_t* xw,
             float* xd, float* xs);

// The same for 8-bit rounded activations: word (blk * 8 + p) * rows + m of a chunk holds elements 2p,
// 2p + 1, 2p + 16, 2p + 17 of block blk of its row m (the four bytes one lane of the 8-bit kernel takes).
void x8_pack_bytes(const int8_t* q, const float* d, const float* s, int64_t M, int64_t K, int chunk, int32_t* xw,
                   float* xd, float* xs);

// The table in use (binding.cpp: the best this CPU runs, or TITAN_KERNEL_ISA's).
const KernelTable& table();

extern const KernelTable kGenericTable;
extern const KernelTable kAvx2Table;
extern const KernelTable kAvx512Table;
extern const KernelTable kAvx512VnniTable;
