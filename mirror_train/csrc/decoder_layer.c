/* One pre-norm decoder layer (Llama, Mistral, Qwen2: RMSNorm, rotary q/k, grouped-query attention, SiLU-gated MLP)
   over M rows, in float32, every step a function of its row alone (the norms, the rotary, the gate, the linears and
   the attention above), so a window is still its one-token steps bit for bit. x (M x H) is updated in place; k and
   v of the rows are written into the cache buffers at positions past..past+M-1 (after rope, for k); L = past + M.
   One call a layer instead of ~40 torch ops and 7 linear calls (the Python around them cost ~5 ms of a ~23 ms
   one-token step of the testbed, Zen 5: docs/engine.md sixteenth session). */
static void rms_norm(const float *x, const float *w, float eps, float *out, int64_t M, int64_t H) {
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * H;
        vec acc = VZERO();
        int64_t d = 0;
        for (; d + LANES <= H; d += LANES) { vec v = VLOAD(xr + d); acc = VFMA(v, v, acc); }
        float ss = vsum(acc);
        for (; d < H; d++) ss = fmaf(xr[d], xr[d], ss);
        float r = 1.0f / sqrtf(ss / (float)H + eps);
        for (d = 0; d < H; d++) out[m * H + d] = w[d] * (xr[d] * r);
    }
}

/* q (M x heads x D) rotated in place: x*cos + rotate_half(x)*sin, rotate_half(x) = (-x[D/2:], x[:D/2]) */
static void rotary(float *q, int64_t M, int64_t heads, int64_t D, const float *cos, const float *sin) {
    int64_t half = D / 2;
    float tmp[512];
    for (int64_t m = 0; m < M; m++)
        for (int64_t h = 0; h < heads; h++) {
            float *r = q + (m * heads + h) * D;
            const float *c = cos + m * D, *s = sin + m * D;
            for (int64_t d = 0; d < D; d++) tmp[d] = r[d];
            for (int64_t d = 0; d < half; d++) r[d] = tmp[d] * c[d] + (-tmp[d + half]) * s[d];
            for (int64_t d = half; d < D; d++) r[d] = tmp[d] * c[d] + tmp[d - half] * s[d];
        }
}

#if LANES > 1
static inline vec vsilu(vec g) {  /* g / (1 + exp(-g)), exp over the whole float range */
    vec e = vexp(VSUB(VZERO(), VMAX(g, VSET(-88.0f))));
    return VDIV(g, VADD(VSET(1.0f), e));
}
#endif

/* y (M x N, ldy apart) = x . W^T (+ b) for a linear served as (wtype: float32 0, bfloat16 1, float16 2, rows only;
   wpanels: rows 0, panels 1, bfloat16 panels on the dot product 2, the inputs rounded to bfloat16 into pairs), the
   half-precision ones widened on load: every C caller's one dispatch (a decoder layer's, a proxy head's) */
static void linear_served(const float *x, int64_t ldx, const void *w, const float *b, int wtype, int wpanels,
                          float *y, int64_t ldy, int64_t M, int64_t N, int64_t K, uint32_t *pairs) {
    if (wpanels == 2)
        linear_dot(x, ldx, (const uint16_t *)w, b, y, ldy, M, N, K, pairs);
    else if (wpanels)
        wtype ? linear_panels_BF16(x, ldx, (const uint16_t *)w, b, y, ldy, M, N, K)
              : linear_panels_F32(x, ldx, (const float *)w, b, y, ldy, M, N, K);
    else if (wtype == 2)
        linear_F16(x, ldx, (const uint16_t *)w, b, y, ldy, M, N, K);
    else
        wtype ? linear_BF16(x, ldx, (const uint16_t *)w, b, y, ldy, M, N, K)
              : linear_F32(x, ldx, (const float *)w, b, y, ldy, M, N, K);
}

/* n linears one after another on the same M input rows (x: M x the largest K, ldx apart; y: M x the largest N, ldy
   apart; shapes: n (N, K) pairs), each read as (wtype, wpanels 0 or 1) as a decoder layer reads its own: what the
   per-machine measurements (kernels.layout_times, prefetch_times) time, so that they see the kernels' work over a
   stack's weights without a Python call a linear (~20 us each, a sizeable part of an 8-row layer's). */
void linear_many(const float *x, int64_t ldx, int64_t n, const void *const *w, const int64_t *shapes, int wtype,
                 int wpanels, float *y, int64_t ldy, int64_t M) {
    for (int64_t i = 0; i < n; i++)
        linear_served(x, ldx, w[i], NULL, wtype, wpanels, y, ldy, M, shapes[2 * i], shapes[2 * i + 1], NULL);
}

/* one of the layer's linears, all seven read as (wtype, wpanels) */
#define LAYER_LINEAR(x, ldx, i, y, ldy, N, K) linear_served(x, ldx, w[i], b[i], wtype, wpanels, y, ldy, M, N, K, pr)

void decoder_layer_f32(float *x, int64_t M, int64_t H, const float *ln1, const float *ln2, float eps,
                       const void *const *w, const float *const *b, int64_t I, int64_t NH, int64_t KVH, int64_t D,
                       const float *cos, const float *sin, float *kbuf, float *vbuf, int64_t kv_sh, int64_t kv_sl,
                       int64_t past, float scale, const int64_t *n1, const int64_t *s2, const int64_t *n2,
                       float *scratch, int wtype, int wpanels) {
    /* w: q, k, v, o, gate, up, down (N x K row-major, or as panels: wpanels 1, or bfloat16 panels on the dot product
       with the inputs rounded to bfloat16: wpanels 2; all float32, all bfloat16 or all float16: wtype);
       b: float32 biases or NULL. The activations, the cache and every sum are float32 either way. */
    int64_t QD = NH * D, KD = KVH * D, L = past + M;
    float *n = scratch, *q = n + M * H, *k = q + M * QD, *v = k + M * KD, *att = v + M * KD, *g = att + M * QD;
    /* pr: the dot product's bfloat16 inputs (wpanels 2), as: the attention's RB_MAX x L scores */
    int64_t PW = ((H > QD ? (H > I ? H : I) : (QD > I ? QD : I)) + 1) / 2;
    float *u = g + M * I, *o = u + M * I;
    uint32_t *pr = (uint32_t *)(o + M * H);
    float *as = (float *)(pr + M * PW);
    rms_norm(x, ln1, eps, n, M, H);
    LAYER_LINEAR(n, H, 0, q, QD, QD, H);
    LAYER_LINEAR(n, H, 1, k, KD, KD, H);
    LAYER_LINEAR(n, H, 2, v, KD, KD, H);
    rotary(q, M, NH, D, cos, sin);
    rotary(k, M, KVH, D, cos, sin);
    for (int64_t m = 0; m < M; m++)
        for (int64_t h = 0; h < KVH; h++)
            for (int64_t d = 0; d < D; d++) {
                kbuf[h * kv_sh + (past + m) * kv_sl + d] = k[(m * KVH + h) * D + d];
                vbuf[h * kv_sh + (past + m) * kv_sl + d] = v[(m * KVH + h) * D + d];
            }
    attention_f32(q, D, QD, kbuf, vbuf, kv_sh, kv_sl, att, as, M, NH, KVH, L, D, scale, n1, s2, n2);
    LAYER_LINEAR(att, QD, 3, o, H, H, QD);
    for (int64_t i = 0; i < M * H; i++) x[i] = x[i] + o[i];
    rms_norm(x, ln2, eps, n, M, H);
    LAYER_LINEAR(n, H, 4, g, I, I, H);
    LAYER_LINEAR(n, H, 5, u, I, I, H);
    for (int64_t m = 0; m < M; m++) {  /* row by row: a row's elements take the same path whatever M */
        float *gr = g + m * I, *ur = u + m * I;
        int64_t t = 0;
#if LANES > 1
        for (; t + LANES <= I; t += LANES) VSTORE(gr + t, VMUL(vsilu(VLOAD(gr + t)), VLOAD(ur + t)));
#endif
        for (; t < I; t++) gr[t] = gr[t] / (1.0f + expf(-gr[t])) * ur[t];
    }
    LAYER_LINEAR(g, I, 6, o, H, H, I);
    for (int64_t i = 0; i < M * H; i++) x[i] = x[i] + o[i];
}

/* One layer's part of a `decoder_stack_f32` call (kernels.StackLayer mirrors it field for field). */
typedef struct {
    const float *ln1, *ln2;
    const void *w[7];
    const float *b[7];
    float *kbuf, *vbuf;
    int64_t I, NH, KVH, D, kv_sh, kv_sl;
    float eps, scale;
    int32_t wtype, wpanels;
} stack_layer;

/* n consecutive decoder layers over the same M rows, one after the other in place on x: each exactly its own
   decoder_layer_f32 call (the same rows, positions, key runs and scratch), one call from Python for all of them
   instead of one a layer (fused_layer.FusedStack). */
void decoder_stack_f32(float *x, int64_t M, int64_t H, int64_t n, const stack_layer *layers, const float *cos,
                       const float *sin, int64_t past, const int64_t *n1, const int64_t *s2, const int64_t *n2,
                       float *scratch) {
    for (int64_t l = 0; l < n; l++) {
        const stack_layer *a = layers + l;
        decoder_layer_f32(x, M, H, a->ln1, a->ln2, a->eps, a->w, a->b, a->I, a->NH, a->KVH, a->D, cos, sin, a->kbuf,
                          a->vbuf, a->kv_sh, a->kv_sl, past, a->scale, n1, s2, n2, scratch, a->wtype, a->wpanels);
    }
}
