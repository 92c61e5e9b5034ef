// Torch binding of the quantized kernels: runtime ISA selection, threading (torch's intra-op pool, so
// torch.set_num_threads / --threads governs it) and the wide-step path (dequantized tiles into a GEMM).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "attention_ops.h"
#include "decoder.h"
#include "fused.h"
#include "interleave.h"
#include "kernels.h"
#include "linear_ops.h"
#include "pool.h"

namespace {

const KernelTable* g_table = nullptr;

bool cpu_has_avx2() {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

bool cpu_has_avx512() {
    return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

bool cpu_has_avx512vnni() { return cpu_has_avx512() && __builtin_cpu_supports("avx512vnni"); }

const KernelTable* best_table() {
    if (cpu_has_avx512vnni()) return &kAvx512VnniTable;
    if (cpu_has_avx512()) return &kAvx512Table;
    if (cpu_has_avx2()) return &kAvx2Table;
    return &kGenericTable;
}

}  // namespace

const KernelTable& table() {
    if (g_table == nullptr) g_table = best_table();
    return *g_table;
}

namespace {

// "auto" picks the best the CPU supports; naming an ISA the CPU lacks is an error, never a crash later.
std::string set_isa(const std::string& name) {
    if (name == "auto") {
        g_table = best_table();
    } else if (name == "generic") {
        g_table = &kGenericTable;
    } else if (name == "avx2") {
        TORCH_CHECK(cpu_has_avx2(), "this CPU lacks AVX2/FMA/F16C");
        g_table = &kAvx2Table;
    } else if (name == "avx512") {
        TORCH_CHECK(cpu_has_avx512(), "this CPU lacks AVX-512 F/BW/VL/DQ");
        g_table = &kAvx512Table;
    } else if (name == "avx512vnni") {
        TORCH_CHECK(cpu_has_avx512vnni(), "this CPU lacks AVX-512 F/BW/VL/DQ + VNNI");
        g_table = &kAvx512VnniTable;
    } else {
        TORCH_CHECK(false, "unknown ISA '", name, "' (auto, generic, avx2, avx512, avx512vnni)");
    }
    return g_table->name;
}

std::string get_isa() { return table().name; }

std::vector<std::string> cpu_features() {
    std::vector<std::string> found;
    if (__builtin_cpu_supports("avx2")) found.push_back("avx2");
    if (__builtin_cpu_supports("fma")) found.push_back("fma");
    if (__builtin_cpu_supports("avx512f")) found.push_back("avx512f");
    if (__builtin_cpu_supports("avx512bw")) found.push_back("avx512bw");
    if (__builtin_cpu_supports("avx512vnni")) found.push_back("avx512vnni");
    if (__builtin_cpu_supports("avx512bf16")) found.push_back("avx512bf16");
    if (__builtin_cpu_supports("amx-bf16")) found.push_back("amx-bf16");
    if (__builtin_cpu_supports("avx512fp16")) found.push_back("avx512fp16");
    return found;
}

// Bytes of a row of K elements of `type`, or 0 for a type the kernels do not compute on (or a width that is
// not whole blocks of it).
int64_t row_bytes_of(int64_t type, int64_t K) {
    int64_t block = 32, bytes;
    switch (type) {
        case GGML_F32: bytes = 128; break;
        case GGML_F16: case GGML_BF16: bytes = 64; break;
        case GGML_Q4_0: bytes = 18; break;
        case GGML_Q4_1: bytes = 20; break;
        case GGML_Q8_0: bytes = 34; break;
        case GGML_Q4_K: block = 256, bytes = 144; break;
        case GGML_Q5_K: block = 256, bytes = 176; break;
        case GGML_Q6_K: block = 256, bytes = 210; break;
        default: return 0;
    }
    return K % block == 0 ? K / block * bytes : 0;
}

// An unsupported type fell through the kernels' dispatch and returned the uninitialised output, and a row
// narrower than K blocks was read past its end: both are errors now.
void check_weight(const torch::Tensor& w, int64_t type, int64_t K) {
    TORCH_CHECK(w.dtype() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous() && w.device().is_cpu(),
                "quantized weight must be a contiguous CPU uint8 [rows, row_bytes] tensor");
    TORCH_CHECK(K > 0 && K % 32 == 0, "in_features must be a positive multiple of 32");
    const int64_t expected = row_bytes_of(type, K);
    TORCH_CHECK(expected > 0, "GGML type ", type, " with ", K, " in_features is not one the kernels compute on");
    TORCH_CHECK(w.size(1) == expected, "rows of ", w.size(1), " bytes, but GGML type ", type, " x ", K,
                " in_features takes ", expected);
}

// Rows of output per task: enough work to amortize scheduling, enough tasks to balance the threads.
int64_t grain_for(int64_t N) {
    const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
    return std::max<int64_t>(8, N / (threads * 8));
}

// Q4_0 / Q4_1 / Q8_0 weights multiply activations rounded per block of 32 to 16-bit integers (or 8-bit,
// llama.cpp's scheme), in narrow and wide steps alike, so a row's numbers never depend on the batch it
// rides in. Set from TITAN_ACTIVATION_BITS by titan/kernels/build.py; 0: float32 activations everywhere.
int g_activation_bits = 16;

int set_activation_bits(int64_t bits) {
    TORCH_CHECK(bits == 0 || bits == 8 || bits == 16, "activation bits must be 0 (float), 8 or 16");
    g_activation_bits = (int)bits;
    return g_activation_bits;
}

// Steps of at least this many rows multiply interleaved weights two row groups at a time in 512-bit
// registers (kernels_x8.inc); narrower ones one group at a time in 256-bit registers. Both do the same
// operations per output lane, so only the speed depends on it. Where a 512-bit multiply-add costs two
// 256-bit ones (Zen 4) the 256-bit kernel was faster below 16 rows (2 rows 6.1 vs 7.7 ms, 8 rows 15.4 vs
// 17.5, whole decoder stack, 2 threads); on an Intel Xeon with AVX-512 VNNI the 512-bit one was faster at
// every width (all the model's products 1.11x at 1 row, 1.11-1.25x at 2-3; decode steps of 1-24 sequences
// 1.1-1.4x, benchmarks/wide_rows.py). 0 in set_wide_rows: this CPU's default; TITAN_WIDE_ROWS sets it
// (titan/kernels/build.py).
int64_t default_wide_rows() {
    __builtin_cpu_init();  // g_wide_rows is set during static initialization, maybe before libgcc's own
    return __builtin_cpu_is("intel") ? 1 : 16;
}

int64_t g_wide_rows = default_wide_rows();

int64_t set_wide_rows(int64_t rows) {
    TORCH_CHECK(rows >= 0, "wide rows must be 0 (this CPU's default) or positive");
    g_wide_rows = rows == 0 ? default_wide_rows() : rows;
    return g_wide_rows;
}

int64_t get_wide_rows() { return g_wide_rows; }

bool rounds_activations(int64_t type) {
    return g_activation_bits != 0 && (type == GGML_Q4_0 || type == GGML_Q4_1 || type == GGML_Q8_0);
}

// x rounded per block and back to float32 (the values the integer kernels multiply).
torch::Tensor round_activations(const torch::Tensor& x) {
    TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) % 32 == 0 && x.stride(1) == 1,
                "x must be float32 [M, K] with K a multiple of 32 and unit inner stride");
    const int64_t M = x.size(0), K = x.size(1), ldx = x.stride(0);
    auto out = torch::empty({M, K}, x.options());
    if (g_activation_bits == 0) return out.copy_(x);
    const KernelTable& t = table();
    const float* xp = x.data_ptr<float>();
    float* op = out.data_ptr<float>();
    at::parallel_for(0, M, 64, [&](int64_t m0, int64_t m1) {
        t.quantize_rows(xp, ldx, m0, m1, K, g_activation_bits, nullptr, nullptr, nullptr, op);
    });
    return out;
}

int64_t block_bytes_of(int64_t type) { return type == GGML_Q4_1 ? 20 : type == GGML_Q8_0 ? 34 : 18; }

// Rows [i0, i1) (of `rows`, or all) of w dequantized to float32; interleaved weights row by row through
// the inverse transpose.
void dequant_rows(const KernelTable& t, int64_t type, const uint8_t* w, int64_t row_bytes, int64_t K,
                  const int64_t* rows, int64_t i0, int64_t i1, float* out, bool interleaved) {
    if (!interleaved) return t.dequant((int32_t)type, w, row_bytes, K, rows, i0, i1, out);
    std::vector<uint8_t> row(row_bytes);
    for (int64_t i = i0; i < i1; i++) {
        interleaved_row(w, rows ? rows[i] : i, row_bytes, block_bytes_of(type), row.data());
        t.dequant((int32_t)type, row.data(), row_bytes, K, nullptr, 0, 1, out + (i - i0) * K);
    }
}

// The weight interleaved by 8 rows (interleave.h) for the narrow-step kernels, as a new tensor.
torch::Tensor interleave(const torch::Tensor& w, int64_t type, int64_t K) {
    check_weight(w, type, K);
    TORCH_CHECK(interleavable((int32_t)type) && table().gemv_x8 != nullptr,
                "interleaved kernels cover Q4_0, Q4_1 and Q8_0 on AVX2 / AVX-512 only");
    TORCH_CHECK(w.size(0) % 8 == 0, "interleaving needs a multiple of 8 rows, not ", w.size(0));
    TORCH_CHECK(w.size(1) == K / 32 * block_bytes_of(type), "row bytes do not match the type and width");
    auto out = torch::empty_like(w);
    interleave_rows8(w.data_ptr<uint8_t>(), out.data_ptr<uint8_t>(), w.size(0), w.size(1), block_bytes_of(type));
    return out;
}

// Rows of x rounded per block of 32 as the integer kernels take them: q [M, K] (int16, or int8 packed in
// the first half), block scales d and d * sum(q).
struct RoundedRows {
    std::vector<int16_t> q;
    std::vector<float> d, s;

    RoundedRows(const KernelTable& t, const torch::Tensor& x, int64_t K, int bits)
        : q(x.size(0) * K), d(x.size(0) * (K / 32)), s(x.size(0) * (K / 32)) {
        t.quantize_rows(x.data_ptr<float>(), x.stride(0), 0, x.size(0), K, bits, q.data(), d.data(), s.data(), nullptr);
    }
};

torch::Tensor gemm(const torch::Tensor& x, const torch::Tensor& w, int64_t type, int64_t K, int64_t tile_rows,
                   bool use_bf16, bool interleaved);

// x [M, K] float32 times weight [N, K]^T -> [M, N]; every weight byte read from memory once.
torch::Tensor gemv(const torch::Tensor& x, const torch::Tensor& w, int64_t type, int64_t K, bool interleaved) {
    check_weight(w, type, K);
    TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) == K && x.stride(1) == 1,
                "x must be float32 [M, in_features] with unit inner stride");
    const int64_t M = x.size(0), N = w.size(0), row_bytes = w.size(1);
    auto y = torch::empty({M, N}, x.options());
    const KernelTable& t = table();
    const uint8_t* wp = w.data_ptr<uint8_t>();
    float* yp = y.data_ptr<float>();
    if (interleaved) {
        TORCH_CHECK(t.gemv_x8 != nullptr && N % 8 == 0, "interleaved weights need the AVX2 / AVX-512 kernels");
        // Float activations (TITAN_ACTIVATION_BITS=0): the whole matrix dequantized into one GEMM, slowly.
        if (!rounds_activations(type)) return gemm(x, w, type, K, N, false, true);
        const int bits = g_activation_bits;
        const RoundedRows xr(t, x, K, bits);
        // One 16-bit row (every decode product) is already in the packed layout: no copy on the hottest path.
        // 8-bit rows are reordered into quads, a copy of K bytes.
        std::vector<int32_t> xw;
        std::vector<float> xd, xs;
        const bool pack = bits == 8 || M > 1;
        if (pack) {
            xw.resize(M * K / (bits == 8 ? 4 : 2));
            xd.resize(xr.d.size());
            xs.resize(xr.s.size());
            if (bits == 8)
                x8_pack_bytes(reinterpret_cast<const int8_t*>(xr.q.data()), xr.d.data(), xr.s.data(), M, K, t.x8_rows,
                              xw.data(), xd.data(), xs.data());
            else
                x8_pack(xr.q.data(), xr.d.data(), xr.s.data(), M, K, t.x8_rows, xw.data(), xd.data(), xs.data());
        }
        const int32_t* pw = pack ? xw.data() : reinterpret_cast<const int32_t*>(xr.q.data());
        const float* pd = pack ? xd.data() : xr.d.data();
        const float* ps = pack ? xs.data() : xr.s.data();
        const int64_t groups = N / 8, threads = std::max<int64_t>(1, at::get_num_threads());
        parallel_chunks(groups, std::max<int64_t>(1, groups / (threads * 8)), [&](int64_t g0, int64_t g1) {
            t.gemv_x8((int32_t)type, bits, wp, row_bytes, K, pw, pd, ps, M, yp, N, g0, g1, g_wide_rows);
        });
        return y;
    }
    if (rounds_activations(type) && t.gemv_int != nullptr) {
        const int bits = g_activation_bits;
        const RoundedRows xr(t, x, K, bits);
        parallel_chunks(N, grain_for(N), [&](int64_t n0, int64_t n1) {
            t.gemv_int((int32_t)type, bits, wp, row_bytes, K, xr.q.data(), xr.d.data(), xr.s.data(), M, yp, N, n0, n1);
        });
        return y;
    }
    // No integer kernel on this ISA (generic): the same rounded values, multiplied in float32.
    const torch::Tensor xin = rounds_activations(type) ? round_activations(x) : x;
    const float* xp = xin.data_ptr<float>();
    const int64_t ldx = xin.stride(0);
    parallel_chunks(N, grain_for(N), [&](int64_t n0, int64_t n1) {
        t.gemv((int32_t)type, wp, row_bytes, K, xp, ldx, M, yp, N, n0, n1);
    });
    return y;
}

// The whole weight (rows == None) or the given rows, dequantized to float32 [rows, K].
torch::Tensor dequantize(const torch::Tensor& w, int64_t type, int64_t K, const c10::optional<torch::Tensor>& rows,
                         bool interleaved) {
    check_weight(w, type, K);
    const int64_t row_bytes = w.size(1);
    const int64_t* rp = nullptr;
    torch::Tensor ids;
    int64_t count = w.size(0);
    if (rows.has_value()) {
        ids = rows->to(torch::kInt64).contiguous();
        TORCH_CHECK(ids.dim() == 1, "rows must be 1-D");
        count = ids.size(0);
        if (count > 0) {
            TORCH_CHECK(ids.min().item<int64_t>() >= 0 && ids.max().item<int64_t>() < w.size(0), "row index out of range");
        }
        rp = ids.data_ptr<int64_t>();
    }
    auto out = torch::empty({count, K}, torch::dtype(torch::kFloat32));
    const KernelTable& t = table();
    const uint8_t* wp = w.data_ptr<uint8_t>();
    float* op = out.data_ptr<float>();
    at::parallel_for(0, count, grain_for(count), [&](int64_t i0, int64_t i1) {
        dequant_rows(t, type, wp, row_bytes, K, rp, i0, i1, op + i0 * K, interleaved);
    });
    return out;
}

// Wide steps: dequantize `tile_rows` weight rows at a time (kept cache-sized) and multiply them with x in
// one GEMM per tile, in float32 or, where the caller chose it, bfloat16.
torch::Tensor gemm(const torch::Tensor& x, const torch::Tensor& w, int64_t type, int64_t K, int64_t tile_rows,
                   bool use_bf16, bool interleaved) {
    check_weight(w, type, K);
    TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) == K, "x must be float32 [M, in_features]");
    const int64_t M = x.size(0), N = w.size(0), row_bytes = w.size(1);
    auto y = torch::empty({M, N}, x.options());
    const KernelTable& t = table();
    const uint8_t* wp = w.data_ptr<uint8_t>();
    tile_rows = std::max<int64_t>(1, std::min(tile_rows, N));
    auto tile = torch::empty({tile_rows, K}, torch::dtype(torch::kFloat32));
    const torch::Tensor rounded = rounds_activations(type) ? round_activations(x.contiguous()) : x.contiguous();
    const torch::Tensor xin = use_bf16 ? rounded.to(torch::kBFloat16) : rounded;
    for (int64_t n0 = 0; n0 < N; n0 += tile_rows) {
        const int64_t rows = std::min(tile_rows, N - n0);
        float* tp = tile.data_ptr<float>();
        at::parallel_for(0, rows, grain_for(rows), [&](int64_t i0, int64_t i1) {
            dequant_rows(t, type, wp, row_bytes, K, nullptr, n0 + i0, n0 + i1, tp + i0 * K, interleaved);
        });
        auto wt = tile.narrow(0, 0, rows);
        auto part = use_bf16 ? at::mm(xin, wt.to(torch::kBFloat16).t()).to(torch::kFloat32) : at::mm(xin, wt.t());
        y.narrow(1, n0, rows).copy_(part);
    }
    return y;
}

// How many times the pool ran each index of [0, total), cut into chunks of `chunk`: 1 everywhere, and at
// return, or a claim ran twice or was still running (tests/test_kernel_pool.py). With `inner` > 0 each index
// counts itself from a nested job of `inner` indices, which the pool runs inline: `inner` everywhere.
torch::Tensor pool_run_counts(int64_t total, int64_t chunk, int64_t inner) {
    torch::Tensor counts = torch::zeros({total}, torch::kInt32);
    int32_t* c = counts.data_ptr<int32_t>();
    parallel_chunks(total, chunk, [c, inner](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; i++) {
            if (inner == 0) __atomic_fetch_add(&c[i], 1, __ATOMIC_RELAXED);
            else parallel_chunks(inner, 1, [c, i](int64_t b, int64_t e) {
                __atomic_fetch_add(&c[i], (int32_t)(e - b), __ATOMIC_RELAXED);
            });
        }
    });
    return counts;
}

}  // namespace

torch::Tensor quantized_gemv(const torch::Tensor& x, const torch::Tensor& w, int64_t type, int64_t K,
                             bool interleaved) {
    return gemv(x, w, type, K, interleaved);
}

std::string kernel_isa() { return table().name; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("set_isa", &set_isa, "select the kernel ISA: auto | generic | avx2 | avx512 | avx512vnni");
    m.def("get_isa", &get_isa, "the kernel ISA in use");
    m.def("cpu_features", &cpu_features, "SIMD features this CPU reports");
    // The matrix products release the GIL, as torch's own ops do: the server's event loop (SSE writes,
    // tokenizing) runs on another core meanwhile instead of waiting for the interpreter's switch interval.
    const auto no_gil = py::call_guard<py::gil_scoped_release>();
    m.def("gemv", &gemv, "fused dequantize-and-dot (narrow steps)", py::arg("x"), py::arg("w"), py::arg("type"),
          py::arg("K"), py::arg("interleaved") = false, no_gil);
    m.def("dequantize", &dequantize, "dequantize all or some rows to float32", py::arg("w"), py::arg("type"),
          py::arg("K"), py::arg("rows") = py::none(), py::arg("interleaved") = false);
    m.def("gemm", &gemm, "dequantized tiles into a GEMM for wide steps", py::arg("x"), py::arg("w"), py::arg("type"),
          py::arg("K"), py::arg("tile_rows"), py::arg("use_bf16"), py::arg("interleaved") = false, no_gil);
    m.def("interleave", &interleave, "Q4_0 / Q4_1 / Q8_0 rows interleaved by 8 for the narrow-step kernels");
    m.def("rms_norm", &rms_norm, "RMSNorm of float32 rows");
    m.def("set_wide_rows", &set_wide_rows,
          "interleaved products of this many rows or more take the 512-bit two-group kernel (0: this CPU's default)");
    m.def("get_wide_rows", &get_wide_rows, "rows from which interleaved products take the 512-bit two-group kernel");
    m.def("set_activation_bits", &set_activation_bits,
          "Q4_0/Q4_1/Q8_0 weights: round activations per block to 16- or 8-bit integers (0: float32)");
    m.def("round_activations", &round_activations, "float32 [M, K] rounded per block of 32 as those weights see it");
    m.def("rotary", &rotary, "rotate-half rotary embedding of [T, heads, head_dim] by cos / sin [T, head_dim / 2]");
    m.def("silu_and_mul", &silu_and_mul, "SwiGLU of a fused [T, 2 * I] gate/up output");
    m.def("add_rms_norm", &add_rms_norm, "(rms_norm(residual + x) * weight, residual + x)");
    m.attr("max_fused_rows") = kMaxFusedRows;
    m.def("paged_attention", [](const torch::Tensor& query, const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                                const torch::Tensor& block_tables, const torch::Tensor& query_starts,
                                const torch::Tensor& context_lens, int64_t block_size, double scale) {
              return titan_paged_attention(table().name, query, key_cache, value_cache, block_tables, query_starts,
                                           context_lens, block_size, scale);
          }, "paged attention of decode rows and short chunks, reading K/V through the block table (csrc/attention_ops.h)",
          no_gil);
    m.def("write_kv", &titan_write_kv, "key/value rows into their cache slots");
    m.def("pool_run_counts", &pool_run_counts, "runs of each index by the kernels' pool (a test of csrc/pool.cpp)",
          py::arg("total"), py::arg("chunk"), py::arg("inner") = 0, no_gil);
    m.def("decode_stack", &decode_stack, "every decoder layer of a narrow step in one call (csrc/decoder.h)", no_gil);
}
