// AVX2 + FMA + F16C build (Haswell / Zen and later); selected at runtime only where the CPU has them.
#include "kernels.h"
#pragma GCC target("avx2,fma,f16c")
#define TITAN_VW 8
#define TITAN_NS avx2_isa
#define TITAN_TABLE kAvx2Table
#define TITAN_NAME "avx2"
#include "kernels_impl.inc"
