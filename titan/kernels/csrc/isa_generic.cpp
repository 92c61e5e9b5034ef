// Baseline x86-64 (SSE2) build of the kernels: correct everywhere, used when nothing better is present.
#include "kernels.h"
#define TITAN_VW 4
#define TITAN_NS generic_isa
#define TITAN_TABLE kGenericTable
#define TITAN_NAME "generic"
#include "kernels_impl.inc"
