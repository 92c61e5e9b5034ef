// AVX-512 build with VNNI (Ice Lake / Zen 4 and later): the interleaved kernels fuse each madd and its add
// into one vpdpwssd. Selected at runtime only where the CPU has AVX-512 F/BW/VL/DQ and VNNI.
#include "kernels.h"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,prefer-vector-width=512")
#define TITAN_VW 16
#define TITAN_VNNI 1
#define TITAN_NS avx512vnni_isa
#define TITAN_TABLE kAvx512VnniTable
#define TITAN_NAME "avx512vnni"
#include "kernels_impl.inc"
