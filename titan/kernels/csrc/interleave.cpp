// The 8-row interleaved weight layout (interleave.h): a transpose of 2-byte words, block by block.
#include "interleave.h"

#include <algorithm>
#include <cstring>

#include "kernels.h"

bool interleavable(int32_t type) { return type == GGML_Q4_0 || type == GGML_Q4_1 || type == GGML_Q8_0; }

void interleave_rows8(const uint8_t* src, uint8_t* dst, int64_t rows, int64_t row_bytes, int64_t block_bytes) {
    const int64_t blocks = row_bytes / block_bytes, words = block_bytes / 2;
    for (int64_t g = 0; g < rows / 8; g++)
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t* unit = dst + g * 8 * row_bytes + b * 8 * block_bytes;
            for (int64_t r = 0; r < 8; r++) {
                const uint8_t* block = src + (8 * g + r) * row_bytes + b * block_bytes;
                for (int64_t w = 0; w < words; w++) std::memcpy(unit + 16 * w + 2 * r, block + 2 * w, 2);
            }
        }
}

void interleaved_row(const uint8_t* w, int64_t row, int64_t row_bytes, int64_t block_bytes, uint8_t* out) {
    const int64_t blocks = row_bytes / block_bytes, words = block_bytes / 2, r = row % 8;
    const uint8_t* group = w + (row / 8) * 8 * row_bytes;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t* unit = group + b * 8 * block_bytes;
        for (int64_t i = 0; i < words; i++) std::memcpy(out + b * block_bytes + 2 * i, unit + 16 * i + 2 * r, 2);
    }
}

// The block scales and sums of a chunk, side by side (both packings).
static void pack_scales(const float* d, const float* s, int64_t m0, int64_t rows, int64_t blocks, float* xd,
                        float* xs) {
    for (int64_t m = 0; m < rows; m++)
        for (int64_t blk = 0; blk < blocks; blk++) {
            xd[m0 * blocks + blk * rows + m] = d[(m0 + m) * blocks + blk];
            xs[m0 * blocks + blk * rows + m] = s[(m0 + m) * blocks + blk];
        }
}

void x8_pack(const int16_t* q, const float* d, const float* s, int64_t M, int64_t K, int chunk, int32_t* xw,
             float* xd, float* xs) {
    const int64_t blocks = K / 32;
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
        const int64_t rows = std::min<int64_t>(chunk, M - m0);
        int32_t* words = xw + m0 * (K / 2);
        for (int64_t m = 0; m < rows; m++) {
            const int16_t* row = q + (m0 + m) * K;
            for (int64_t i = 0; i < K / 2; i++) std::memcpy(words + i * rows + m, row + 2 * i, 4);
        }
        pack_scales(d, s, m0, rows, blocks, xd, xs);
    }
}

void x8_pack_bytes(const int8_t* q, const float* d, const float* s, int64_t M, int64_t K, int chunk, int32_t* xw,
                   float* xd, float* xs) {
    const int64_t blocks = K / 32;
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
        const int64_t rows = std::min<int64_t>(chunk, M - m0);
        int32_t* words = xw + m0 * (K / 4);
        for (int64_t m = 0; m < rows; m++)
            for (int64_t blk = 0; blk < blocks; blk++) {
                const int8_t* block = q + (m0 + m) * K + blk * 32;
                for (int64_t p = 0; p < 8; p++) {
                    const int8_t quad[4] = {block[2 * p], block[2 * p + 1], block[2 * p + 16], block[2 * p + 17]};
                    std::memcpy(words + (blk * 8 + p) * rows + m, quad, 4);
                }
            }
        pack_scales(d, s, m0, rows, blocks, xd, xs);
    }
}
