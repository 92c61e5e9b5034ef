// AVX-512 (F/BW/VL/DQ) build with 512-bit vectors; selected at runtime only where the CPU has them.
#include "kernels.h"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,prefer-vector-width=512")
#define TITAN_VW 16
#define TITAN_NS avx512_isa
#define TITAN_TABLE kAvx512Table
#define TITAN_NAME "avx512"
#include "kernels_impl.inc"
