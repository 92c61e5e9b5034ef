// Baseline x86-64 (SSE2) build of paged attention: correct everywhere, used when nothing better is present.
#include "attention.h"
#define TITAN_ATTN_NS attention_generic
#define TITAN_ATTN_TABLE kAttentionGeneric
#define TITAN_ATTN_NAME "generic"
#define TITAN_ATTN_VW 4
#define TITAN_ATTN_HALF_VW 4
#include "attention_impl.inc"
