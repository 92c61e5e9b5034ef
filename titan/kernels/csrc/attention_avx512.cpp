// AVX-512 build of paged attention with 512-bit vectors (256-bit where head_dim is not a multiple of 16);
// selected at runtime only where the CPU has AVX-512 F/BW/VL/DQ.
#include "attention.h"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,prefer-vector-width=512")
#define TITAN_ATTN_NS attention_avx512
#define TITAN_ATTN_TABLE kAttentionAvx512
#define TITAN_ATTN_NAME "avx512"
#define TITAN_ATTN_VW 16
#define TITAN_ATTN_HALF_VW 8
#include "attention_impl.inc"
