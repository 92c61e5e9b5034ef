// Plain-C interface between the torch binding of paged attention (attention_binding.cpp) and its per-ISA
// translation units (attention_{generic,avx2,avx512}.cpp), which include no torch headers so each can
// carry its own `#pragma GCC target`.
#pragma once
#include <cstdint>

// One unit of work: the query rows of one sequence for `kv_heads` consecutive kv heads (each with its `group`
// query heads), against cache positions [begin, end) of that sequence. Query q = row * heads + head, for
// heads = kv_heads * group query heads, head h reading kv head h / group of the job.
struct AttentionJob {
    const float* query;         // row 0, first query head of the group
    int64_t query_row_stride;   // floats between consecutive query rows
    int64_t query_head_stride;  // floats between consecutive query heads
    int32_t rows;               // new rows of the sequence; row i sits at position context - rows + i
    int32_t group;              // query heads per kv head
    int32_t kv_heads;           // consecutive kv heads in this job
    int32_t head_dim;           // a multiple of 8
    float scale;
    // Slot 0, first kv head of the job: element s * slot_stride + k * head_dim .. of float32 or (with
    // cache_half) IEEE fp16 values.
    const void* key_cache;
    const void* value_cache;
    bool cache_half;
    int64_t slot_stride;        // kv heads * head_dim, in elements
    const int64_t* block_table;  // physical block of each logical block of the sequence
    int64_t block_size;
    int64_t context;            // tokens in the cache for the sequence, its new rows included
    int64_t begin, end;         // the cache positions this job covers
    // Output of query q: out[row * out_row_stride + head * head_dim ..]. With stats == nullptr the
    // normalized attention output ([begin, end) lies within one part). Otherwise one result per part of
    // `part_positions` cache positions ([k * part_positions, (k + 1) * part_positions), the grid fixed by
    // position) that the job covers, the j-th at out + j * part_stride and stats + j * part_stride: the
    // unnormalized sum of exp(score - max) * value, with stats[2q] = that max and stats[2q + 1] = the sum
    // of exp(score - max), for the merge of the parts.
    float* out;
    int64_t out_row_stride;
    float* stats;
    int64_t part_positions;
    int64_t part_stride;
};

struct AttentionTable {
    const char* name;
    void (*attend)(const AttentionJob& job);
};

extern const AttentionTable kAttentionGeneric;
extern const AttentionTable kAttentionAvx2;
extern const AttentionTable kAttentionAvx512;
