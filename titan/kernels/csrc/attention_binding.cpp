// Torch binding of paged attention: argument checks, the job list (sequence x kv heads x runs of context parts),
// scheduling on torch's intra-op pool, and the merge of the parts (flash-decoding).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "attention.h"
#include "attention_ops.h"
#include "pool.h"

namespace {

// A context longer than this is computed in parts on a fixed grid of this many cache positions (0-511,
// 512-1023, ...), each part's sums kept apart and the parts merged flash-decoding style; a job (a thread's
// unit of work) covers one part or several in a row. The grid depends on the positions alone, never on the
// batch, the thread count or a row's place in a verify chunk, so a row's numbers are the same in every step:
// a speculative verify row equals the decode row it replaces, and a greedy request gives the same tokens
// alone or beside others. (Splits that followed the batch's work, as before, made a decode at context 600
// differ in the last bit between a step alone and one beside 15 others, at 2 threads.)
constexpr int64_t kPartPositions = 512;
// Jobs per thread to aim for when splitting, so uneven jobs still balance.
constexpr int64_t kJobsPerThread = 2;
// Below this many (query x position) pairs in the whole call, waking the thread pool costs more than the
// arithmetic: run on the calling thread. In a decode step the K/V come from memory (the step's weights
// have evicted them from the caches), which makes the break-even low: 16k -> 2k took a context-1024
// decode step (2 threads) from 11.5-13.6 to 8.3-9.4 ms and left context 128 (1.2k pairs) as it was.
constexpr int64_t kInlinePairs = 2048;

const AttentionTable& attention_table(const std::string& isa) {
    if (isa == "avx512" || isa == "avx512vnni") return kAttentionAvx512;  // VNNI adds nothing to attention
    if (isa == "avx2") return kAttentionAvx2;
    return kAttentionGeneric;
}

bool cache_dtype_ok(const torch::Tensor& cache) {
    return cache.scalar_type() == torch::kFloat32 || cache.scalar_type() == torch::kFloat16;
}

torch::Tensor as_int64(const torch::Tensor& t, const char* name) {
    TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == torch::kInt32 || t.scalar_type() == torch::kInt64),
                name, " must be a CPU int32 or int64 tensor");
    return t.to(torch::kInt64).contiguous();
}

}  // namespace

torch::Tensor titan_paged_attention(const std::string& isa, const torch::Tensor& query, const torch::Tensor& key_cache,
                                    const torch::Tensor& value_cache, const torch::Tensor& block_tables,
                                    const torch::Tensor& query_starts, const torch::Tensor& context_lens,
                                    int64_t block_size, double scale) {
    TORCH_CHECK(query.device().is_cpu() && query.scalar_type() == torch::kFloat32 && query.dim() == 3 &&
                    query.stride(2) == 1,
                "query must be a CPU float32 [T, H, D] tensor with unit inner stride");
    TORCH_CHECK(key_cache.device().is_cpu() && cache_dtype_ok(key_cache) && key_cache.dim() == 3 &&
                    key_cache.is_contiguous() && value_cache.sizes() == key_cache.sizes() &&
                    value_cache.scalar_type() == key_cache.scalar_type() && value_cache.is_contiguous() &&
                    value_cache.device().is_cpu(),
                "key/value cache must be contiguous CPU float32 or float16 [slots, kv_heads, head_dim] tensors of one "
                "shape and dtype");
    const bool half = key_cache.scalar_type() == torch::kFloat16;
    const int64_t element_bytes = half ? 2 : 4;
    const int64_t T = query.size(0), H = query.size(1), D = query.size(2);
    const int64_t S = key_cache.size(0), Hkv = key_cache.size(1);
    TORCH_CHECK(key_cache.size(2) == D, "cache head_dim ", key_cache.size(2), " != query head_dim ", D);
    TORCH_CHECK(D > 0 && D % 8 == 0, "head_dim must be a positive multiple of 8, not ", D);
    TORCH_CHECK(Hkv > 0 && H > 0 && H % Hkv == 0, "query heads (", H, ") must be a positive multiple of kv heads (",
                Hkv, ")");
    TORCH_CHECK(block_size > 0, "block_size must be positive");
    TORCH_CHECK(block_tables.dim() == 2, "block_tables must be [B, max_blocks]");
    const torch::Tensor tables = as_int64(block_tables, "block_tables");
    const torch::Tensor starts = as_int64(query_starts, "query_starts");
    const torch::Tensor contexts = as_int64(context_lens, "context_lens");
    const int64_t B = tables.size(0), max_blocks = tables.size(1);
    TORCH_CHECK(starts.dim() == 1 && starts.size(0) == B + 1 && contexts.dim() == 1 && contexts.size(0) == B,
                "query_starts must be [B + 1] and context_lens [B] for B = block_tables.size(0)");
    const int64_t* tp = tables.data_ptr<int64_t>();
    const int64_t* sp = starts.data_ptr<int64_t>();
    const int64_t* cp = contexts.data_ptr<int64_t>();
    TORCH_CHECK(sp[0] == 0 && sp[B] == T, "query_starts must run from 0 to the query rows (", T, ")");
    // Every page a job will read must lie inside the cache: a bad table is an error, never a wild read.
    int64_t total_pairs = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t rows = sp[b + 1] - sp[b], context = cp[b];
        TORCH_CHECK(rows >= 0 && rows <= context && context <= max_blocks * block_size,
                    "sequence ", b, ": ", rows, " rows, context ", context, " (at most ", max_blocks * block_size,
                    " and at least its rows)");
        for (int64_t k = 0; k * block_size < context; k++) {
            const int64_t page = tp[b * max_blocks + k], used = std::min(block_size, context - k * block_size);
            // Divided rather than multiplied: a huge page number wrapped the product past the check.
            TORCH_CHECK(page >= 0 && used <= S && page <= (S - used) / block_size, "sequence ", b, ": block ",
                        page, " lies outside the cache");
        }
        total_pairs += rows * context;
    }

    const int64_t group = H / Hkv;
    auto out = torch::empty({T, H * D}, query.options().memory_format(torch::MemoryFormat::Contiguous));
    float* op = out.data_ptr<float>();
    const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
    const bool parallel = threads > 1 && total_pairs * H >= kInlinePairs;

    // Jobs take every kv head of a sequence (its K/V rows are read whole and in order: fewer, longer
    // memory streams). With threads to feed, a long context's parts are dealt out over several jobs, and
    // where that still leaves fewer jobs than wanted, every kv head becomes a job of its own. How the parts
    // are dealt out changes which thread computes them, never a number.
    const int64_t wanted_jobs = threads * kJobsPerThread;
    std::vector<int64_t> parts(B, 1), splits(B, 1);
    for (int64_t b = 0; b < B; b++) parts[b] = std::max<int64_t>(1, (cp[b] + kPartPositions - 1) / kPartPositions);
    auto plan = [&](int64_t heads_per_job) {
        const int64_t target = std::max<int64_t>(1, total_pairs * (Hkv / heads_per_job) / wanted_jobs);
        int64_t planned = 0;
        for (int64_t b = 0; b < B; b++) {
            const int64_t rows = sp[b + 1] - sp[b], wanted = (rows * cp[b] + target - 1) / target;
            splits[b] = std::clamp<int64_t>(wanted, 1, parts[b]);
            planned += rows > 0 ? splits[b] * (Hkv / heads_per_job) : 0;
        }
        return planned;
    };
    int64_t heads_per_job = Hkv;
    if (parallel && plan(Hkv) < wanted_jobs) {
        heads_per_job = 1;
        plan(1);
    }
    const int64_t chunks = Hkv / heads_per_job, job_heads = heads_per_job * group;

    std::vector<int64_t> partial_offset(B, 0);
    int64_t partial_floats = 0;
    for (int64_t b = 0; b < B; b++) {
        if (parts[b] > 1) {
            partial_offset[b] = partial_floats;
            partial_floats += parts[b] * chunks * (sp[b + 1] - sp[b]) * job_heads * (D + 2);
        }
    }
    // Every part's sums are written by its job before the merge reads them: no need to zero them first.
    std::unique_ptr<float[]> partial(new float[partial_floats]);
    std::vector<AttentionJob> jobs;
    const float* qp = query.data_ptr<float>();
    for (int64_t b = 0; b < B; b++) {
        const int64_t rows = sp[b + 1] - sp[b], context = cp[b];
        if (rows == 0) continue;
        const int64_t part = rows * job_heads * (D + 2);
        for (int64_t chunk = 0; chunk < chunks; chunk++) {
            const int64_t first_kv = chunk * heads_per_job, first_head = first_kv * group;
            for (int64_t s = 0; s < splits[b]; s++) {
                AttentionJob job{};
                job.query = qp + sp[b] * query.stride(0) + first_head * query.stride(1);
                job.query_row_stride = query.stride(0);
                job.query_head_stride = query.stride(1);
                job.rows = (int32_t)rows;
                job.group = (int32_t)group;
                job.kv_heads = (int32_t)heads_per_job;
                job.head_dim = (int32_t)D;
                job.scale = (float)scale;
                job.key_cache = (const char*)key_cache.data_ptr() + first_kv * D * element_bytes;
                job.value_cache = (const char*)value_cache.data_ptr() + first_kv * D * element_bytes;
                job.cache_half = half;
                job.slot_stride = Hkv * D;
                job.block_table = tp + b * max_blocks;
                job.block_size = block_size;
                job.context = context;
                // Parts [first, last) of the sequence, dealt out evenly.
                const int64_t first = parts[b] * s / splits[b], last = parts[b] * (s + 1) / splits[b];
                job.begin = first * kPartPositions;
                job.end = std::min(context, last * kPartPositions);
                job.part_positions = kPartPositions;
                if (parts[b] == 1) {
                    job.out = op + sp[b] * H * D + first_head * D;
                    job.out_row_stride = H * D;
                    job.stats = nullptr;
                } else {
                    float* base = partial.get() + partial_offset[b] + (chunk * parts[b] + first) * part;
                    job.out = base;
                    job.out_row_stride = job_heads * D;
                    job.stats = base + rows * job_heads * D;
                    job.part_stride = part;
                }
                jobs.push_back(job);
            }
        }
    }

    const AttentionTable& table = attention_table(isa);
    const int64_t count = (int64_t)jobs.size();
    if (!parallel || count == 1) {
        for (const AttentionJob& job : jobs) table.attend(job);
    } else {
        // Longest first, handed out one at a time: jobs differ in cost by their context lengths.
        std::vector<int64_t> order(count);
        for (int64_t i = 0; i < count; i++) order[i] = i;
        auto cost = [&](int64_t i) { return (jobs[i].end - jobs[i].begin) * jobs[i].rows; };
        std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return cost(x) > cost(y); });
        parallel_chunks(count, 1, [&](int64_t i0, int64_t i1) {
            for (int64_t i = i0; i < i1; i++) table.attend(jobs[order[i]]);
        });
    }

    // Merge the parts of each long sequence, always the same way: rescale each part to the common max, then
    // normalize (a part no position of which is visible to a query adds nothing).
    for (int64_t b = 0; b < B; b++) {
        if (parts[b] <= 1) continue;
        const int64_t rows = sp[b + 1] - sp[b], queries = rows * job_heads, part = queries * (D + 2);
        for (int64_t chunk = 0; chunk < chunks; chunk++) {
            const float* base = partial.get() + partial_offset[b] + chunk * parts[b] * part;
            for (int64_t q = 0; q < queries; q++) {
                float best = -std::numeric_limits<float>::infinity();
                for (int64_t s = 0; s < parts[b]; s++) best = std::max(best, base[s * part + queries * D + 2 * q]);
                float* dst = op + (sp[b] + q / job_heads) * H * D + (chunk * job_heads + q % job_heads) * D;
                std::fill(dst, dst + D, 0.0f);
                float total = 0.0f;
                for (int64_t s = 0; s < parts[b]; s++) {
                    const float* stats = base + s * part + queries * D + 2 * q;
                    if (stats[1] == 0.0f) continue;
                    const float weight = std::exp(stats[0] - best);
                    total += weight * stats[1];
                    const float* acc = base + s * part + q * D;
                    for (int64_t d = 0; d < D; d++) dst[d] += weight * acc[d];
                }
                const float inverse = 1.0f / total;
                for (int64_t d = 0; d < D; d++) dst[d] *= inverse;
            }
        }
    }
    return out;
}

void titan_write_kv(const torch::Tensor& key, const torch::Tensor& value, const torch::Tensor& key_cache,
                    const torch::Tensor& value_cache, const torch::Tensor& slot_mapping) {
    TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key.scalar_type() == torch::kFloat32 &&
                    value.scalar_type() == torch::kFloat32 && key.device().is_cpu() && value.device().is_cpu() &&
                    key.stride(2) == 1 && value.stride(2) == 1,
                "key/value must be CPU float32 [T, Hkv, D] tensors of one shape with unit inner stride");
    TORCH_CHECK(key_cache.dim() == 3 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                    key_cache.sizes() == value_cache.sizes() && cache_dtype_ok(key_cache) &&
                    value_cache.scalar_type() == key_cache.scalar_type() && key_cache.size(1) == key.size(1) &&
                    key_cache.size(2) == key.size(2),
                "key/value cache must be contiguous float32 or float16 [slots, Hkv, D] matching key/value");
    const torch::Tensor slots = as_int64(slot_mapping, "slot_mapping");
    const int64_t T = key.size(0), Hkv = key.size(1), D = key.size(2), S = key_cache.size(0);
    TORCH_CHECK(slots.dim() == 1 && slots.size(0) == T, "slot_mapping must be [T]");
    const int64_t* sp = slots.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; t++) TORCH_CHECK(sp[t] >= 0 && sp[t] < S, "slot ", sp[t], " outside the cache");
    const float* kp = key.data_ptr<float>();
    const float* vp = value.data_ptr<float>();
    if (key_cache.scalar_type() == torch::kFloat16) {
        // Rounded to nearest even, as torch's float32 -> float16 conversion does.
        at::Half* kc = key_cache.data_ptr<at::Half>();
        at::Half* vc = value_cache.data_ptr<at::Half>();
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < Hkv; h++)
                for (int64_t d = 0; d < D; d++) {
                    kc[(sp[t] * Hkv + h) * D + d] = at::Half(kp[t * key.stride(0) + h * key.stride(1) + d]);
                    vc[(sp[t] * Hkv + h) * D + d] = at::Half(vp[t * value.stride(0) + h * value.stride(1) + d]);
                }
        return;
    }
    float* kc = key_cache.data_ptr<float>();
    float* vc = value_cache.data_ptr<float>();
    for (int64_t t = 0; t < T; t++) {
        for (int64_t h = 0; h < Hkv; h++) {
            std::memcpy(kc + (sp[t] * Hkv + h) * D, kp + t * key.stride(0) + h * key.stride(1), sizeof(float) * D);
            std::memcpy(vc + (sp[t] * Hkv + h) * D, vp + t * value.stride(0) + h * value.stride(1), sizeof(float) * D);
        }
    }
}
