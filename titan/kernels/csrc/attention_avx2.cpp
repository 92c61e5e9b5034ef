// AVX2 + FMA build of paged attention; selected at runtime only where the CPU has them.
#include "attention.h"
#pragma GCC target("avx2,fma,f16c")
#define TITAN_ATTN_NS attention_avx2
#define TITAN_ATTN_TABLE kAttentionAvx2
#define TITAN_ATTN_NAME "avx2"
#define TITAN_ATTN_VW 8
#define TITAN_ATTN_HALF_VW 8
#include "attention_impl.inc"
