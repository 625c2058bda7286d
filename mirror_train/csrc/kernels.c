/* mirror-train's row-exact CPU kernels: one translation unit (so the compiler inlines across the parts), built by
   kernels.py with `cc -O3 -march=native -ffp-contract=off -shared -fPIC` and loaded with ctypes. The parts in the
   order each needs the ones before it; the exported functions are the ones without `static`. */
#include "simd.h"          /* the vector type and its operations: AVX-512, AVX2 + FMA, or scalar */
#include "linear_rows.c"   /* y = x . W^T on weights as rows (linear_F32, linear_BF16, linear_F16, linear_I8) */
#include "linear_panels.c" /* the same on weights as panels (linear_panels_F32, linear_panels_BF16) */

int kernel_lanes(void) { return LANES; }

#include "dot.c"           /* AVX512-BF16's dot product of pairs: the LM head's screen and a draft's linears */
#include "attention.c"     /* causal attention over a KV cache, row by row */
#include "decoder_layer.c" /* a whole decoder layer, and consecutive layers, in one call */
#include "linear_q8.c"     /* int8 weights on AVX512-VNNI's dot product of byte quads: a proxy head's copy */
#include "screen_q8.c"     /* the LM head's screen in int8, each input row in two bytes a value; on AMX tiles */
#include "screen_argmax.c" /* greedy tokens through the LM head's screen (screened_head.py) */
#include "proxy_head.c"    /* a per-position proxy head's candidates in one call */
#include "noise.c"         /* the target's sampling noise, a row a position */
