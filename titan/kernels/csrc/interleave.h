// Weights interleaved by 8 rows, for the kernels of kernels_x8.inc. A block is a sequence of 2-byte words
// (Q4_0: d, then 8 words of nibbles; Q4_1: d, m, 8 words; Q8_0: d, 16 words of bytes). Rows 8g .. 8g + 7
// become row group g: for each block b, a unit of 8 blocks whose words are transposed, word w of row
// 8g + r at byte 16 w + 2 r of the unit. The bytes of a group are exactly the bytes its 8 rows had, so the
// tensor keeps its [rows, row_bytes] shape; a row is rebuilt by the inverse transpose where one is needed
// (dequantizing a tile or an embedding row).
#pragma once
#include <cstdint>

// Whether `type` has the interleaved kernels (Q4_0, Q4_1, Q8_0).
bool interleavable(int32_t type);

// dst = src interleaved: `rows` (a multiple of 8) rows of `row_bytes`, blocks of `block_bytes`.
void interleave_rows8(const uint8_t* src, uint8_t* dst, int64_t rows, int64_t row_bytes, int64_t block_bytes);

// Row `row` of an interleaved matrix, in the plain block layout: `row_bytes` bytes into out.
void interleaved_row(const uint8_t* w, int64_t row, int64_t row_bytes, int64_t block_bytes, uint8_t* out);
