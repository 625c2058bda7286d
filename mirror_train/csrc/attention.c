/* exp(x) for x <= 0 (a softmax's shifted scores): Cephes' expf polynomial after x = n ln2 + r, times 2^n. */
#if LANES == 16
#define VSET(c) _mm512_set1_ps(c)
#define VMAX(a, b) _mm512_max_ps(a, b)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VFNMADD(a, b, c) _mm512_fnmadd_ps(a, b, c)
#define VROUND(a) _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define VPOW2(p, n) _mm512_scalef_ps(p, n)
#define VDIV(a, b) _mm512_div_ps(a, b)
#elif LANES == 8
#define VSET(c) _mm256_set1_ps(c)
#define VMAX(a, b) _mm256_max_ps(a, b)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VFNMADD(a, b, c) _mm256_fnmadd_ps(a, b, c)
#define VROUND(a) _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define VDIV(a, b) _mm256_div_ps(a, b)
#define VPOW2(p, n) /* the exponent field of 2^n built directly */ \
    _mm256_mul_ps(p, _mm256_castsi256_ps(                           \
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23)))
#endif
#if LANES > 1
/* x's lower half to lo, its upper half to hi */
static inline void vstore_halves(float *lo, float *hi, vec x) {
#if LANES == 16
    _mm256_storeu_ps(lo, _mm512_castps512_ps256(x));
    _mm256_storeu_ps(hi, _mm512_extractf32x8_ps(x, 1));
#else
    _mm_storeu_ps(lo, _mm256_castps256_ps128(x));
    _mm_storeu_ps(hi, _mm256_extractf128_ps(x, 1));
#endif
}

static inline vec vexp(vec x) {
    x = VMAX(x, VSET(-87.0f));
    vec n = VROUND(VMUL(x, VSET(1.44269504f)));
    vec r = VFNMADD(n, VSET(0.693359375f), x);
    r = VFNMADD(n, VSET(-2.12194440e-4f), r);
    vec p = VSET(1.9875691500e-4f);
    p = VFMA(p, r, VSET(1.3981999507e-3f));
    p = VFMA(p, r, VSET(8.3334519073e-3f));
    p = VFMA(p, r, VSET(4.1665795894e-2f));
    p = VFMA(p, r, VSET(1.6666665459e-1f));
    p = VFMA(p, r, VSET(5.0000001201e-1f));
    p = VFMA(p, VMUL(r, r), VADD(r, VSET(1.0f)));
    return VPOW2(p, n);
}
#else
static inline vec vexp(vec x) { return expf(x); }
#endif

static inline float dot(const float *a, const float *b, int64_t D) {
    vec acc = VZERO();
    int64_t d = 0;
    for (; d + LANES <= D; d += LANES) acc = VFMA(VLOAD(a + d), VLOAD(b + d), acc);
    float s = vsum(acc);
    for (; d < D; d++) s = fmaf(a[d], b[d], s);
    return s;
}

/* Causal attention of M query rows at the end of a cache of L positions (row i sees keys 0..L-M+i), grouped-query
   heads: q (H heads x M rows x D, strides q_sh, q_sm), k / v (KVH heads x L x D, strides kv_sh, kv_sl),
   out (M x H x D, contiguous), scratch: RB_MAX x L floats. Every (head, row) is a function of its query and the
   keys it sees alone: the same arithmetic in the same order whatever M.
   A forked window (two chains verified at once, kernels.attention's `rows`): row i sees keys 0..n1[i]-1 and then
   s2[i]..s2[i]+n2[i]-1, in that order; its scores fill the scratch from index 0 exactly as the contiguous keys of
   the same path would in one-token decoding, so the row is bit for bit that decoding step. n1 NULL: causal.

   Per (head, row): s_l = vsum(sum over the D/LANES chunks of q*k_l, in order) * scale; the max; e_l = exp(s_l - max)
   and their total, in order; o = sum_l e_l v_l accumulated in l order (one FMA per element and key); o / total.
   Up to RB_MAX rows of a head go together over the keys they all see (`att_rows`): each key and value row is loaded
   once for all of them, and their sums stay in registers, instead of re-reading K and V from the cache once a row
   and storing the partial output every key (measured 4-7x slower a row at 800-1600 keys, docs/engine.md). Every
   row still does exactly its own arithmetic in its own order, so grouping changes no bit. */
#define RB_MAX 6
#define NV_MAX 16
int attention_rows_max(void) { return RB_MAX; }

/* One row's keys from `from` to `seen` (and its first run's before it when from = 0), its exponentials, its output:
   the general path (a head size that is not a multiple of the vector width, the rows' own keys past a group's). */
static void att_scores_tail(const float *qi, const float *kh, int64_t kv_sl, float *s, int64_t from, int64_t seen,
                            int64_t first, int64_t jump, int64_t D, float scale, float *mx) {
    for (int64_t l = from; l < seen; l++) {
        s[l] = dot(qi, kh + (l < first ? l : l + jump) * kv_sl, D) * scale;
        *mx = s[l] > *mx ? s[l] : *mx;
    }
}

static float att_exp(float *s, int64_t seen, float mx) {
    vec vmx = VSET(mx), vtot = VZERO();
    int64_t l = 0;
    for (; l + LANES <= seen; l += LANES) {
        vec e = vexp(VSUB(VLOAD(s + l), vmx));
        VSTORE(s + l, e);
        vtot = VADD(vtot, e);
    }
    float total = vsum(vtot);
    for (; l < seen; l++) {
        s[l] = expf(s[l] - mx);
        total += s[l];
    }
    return total;
}

static void att_values_tail(const float *vh, int64_t kv_sl, const float *s, float *o, int64_t from, int64_t seen,
                            int64_t first, int64_t jump, int64_t D) {
    for (int64_t l2 = from; l2 < seen; l2++) {
        vec p = VSET(s[l2]);
        const float *vl = vh + (l2 < first ? l2 : l2 + jump) * kv_sl;
        int64_t d = 0;
        for (; d + LANES <= D; d += LANES) VSTORE(o + d, VFMA(p, VLOAD(vl + d), VLOAD(o + d)));
        for (; d < D; d++) o[d] = fmaf(s[l2], vl[d], o[d]);
    }
}

#if LANES > 1
/* Rows r0..r1-1's scores over keys `from`..J-1 a key at a time (each key loaded once for all of them; vsum a sum):
   what the blocks below leave over. */
static inline __attribute__((always_inline)) void att_keys_scores(int nv, int r0, int r1, vec (*qv)[NV_MAX],
                                                                  const float *kh, int64_t kv_sl, float *const *s,
                                                                  int64_t from, int64_t J, float scale, float *mx) {
    for (int64_t l = from; l < J; l++) {
        const float *kl = kh + l * kv_sl;
        vec kv[NV_MAX];
        for (int c = 0; c < nv; c++) kv[c] = VLOAD(kl + c * LANES);
        for (int r = r0; r < r1; r++) {
            vec acc = VZERO();
            for (int c = 0; c < nv; c++) acc = VFMA(qv[r][c], kv[c], acc);
            float x = vsum(acc) * scale;
            s[r][l] = x;
            mx[r] = x > mx[r] ? x : mx[r];
        }
    }
}

/* Rows r..r+R-1 (R = 1 or 2) over blocks of LANES / R keys, their LANES sums reduced together (`vsums`: vsum's
   additions in vsum's order; a block's result holds row r's scores in its first LANES / R lanes, row r+1's in the
   rest), each key vector loaded once for the R rows; then the keys the blocks leave over, a key at a time. */
static inline __attribute__((always_inline)) void att_block_scores(int nv, int R, int r, vec (*qv)[NV_MAX],
                                                                   const float *kh, int64_t kv_sl, float *const *s,
                                                                   int64_t J, float scale, float *mx) {
    const int keys = LANES / R;
    int64_t Jb = J - J % keys;
    vec vmx = VSET(-INFINITY);
    for (int64_t l = 0; l < Jb; l += keys) {
        vec a[LANES];
        for (int j = 0; j < keys; j++) {
            const float *kl = kh + (l + j) * kv_sl;
            for (int t = 0; t < R; t++) a[t * keys + j] = VZERO();
            for (int c = 0; c < nv; c++) {
                vec k = VLOAD(kl + c * LANES);
                for (int t = 0; t < R; t++) a[t * keys + j] = VFMA(qv[r + t][c], k, a[t * keys + j]);
            }
        }
        vec x = VMUL(vsums(a), VSET(scale));
        if (R == 2)
            vstore_halves(s[r] + l, s[r + 1] + l, x);
        else
            VSTORE(s[r] + l, x);
        vmx = VMAX(vmx, x);
    }
    float m[LANES];
    VSTORE(m, vmx);
    for (int t = 0; t < R; t++)
        for (int j = 0; j < keys; j++) mx[r + t] = m[t * keys + j] > mx[r + t] ? m[t * keys + j] : mx[r + t];
    att_keys_scores(nv, r, r + R, qv, kh, kv_sl, s, Jb, J, scale, mx);
}

/* rb rows of one head over their shared keys 0..J-1 (nv = D / LANES vectors a row): their scores and maxima, then,
   after the caller's exponentials, their outputs. Inlined with constant nv and rb so the sums live in registers. */
static inline __attribute__((always_inline)) void att_rows_scores(int nv, int rb, const float *const *q,
                                                                  const float *kh, int64_t kv_sl, float *const *s,
                                                                  int64_t J, float scale, float *mx) {
    vec qv[RB_MAX][NV_MAX];
    for (int r = 0; r < rb; r++)
        for (int c = 0; c < nv; c++) qv[r][c] = VLOAD(q[r] + c * LANES);
    /* Rows two at a time, so that each key vector is loaded once for both: the scores took 1.5x as long one row at
       a time over blocks of LANES keys, a load an FMA (AVX-512, Zen 4, docs/engine.md thirty-sixth session). An odd
       last row (every row where the registers hold one row's query: AVX2's head size 64) goes alone. */
    for (int r = 0; r + 1 < rb; r += 2) att_block_scores(nv, 2, r, qv, kh, kv_sl, s, J, scale, mx);
    if (rb % 2) att_block_scores(nv, 1, rb - 1, qv, kh, kv_sl, s, J, scale, mx);
}

static inline __attribute__((always_inline)) void att_rows_values(int nv, int rb, const float *vh, int64_t kv_sl,
                                                                  const float *const *s, float *const *o, int64_t J) {
    vec acc[RB_MAX][NV_MAX];
    for (int r = 0; r < rb; r++)
        for (int c = 0; c < nv; c++) acc[r][c] = VZERO();
    for (int64_t l = 0; l < J; l++) {
        const float *vl = vh + l * kv_sl;
        for (int c = 0; c < nv; c++) {
            vec v = VLOAD(vl + c * LANES);
            for (int r = 0; r < rb; r++) acc[r][c] = VFMA(VSET(s[r][l]), v, acc[r][c]);
        }
    }
    for (int r = 0; r < rb; r++)
        for (int c = 0; c < nv; c++) VSTORE(o[r] + c * LANES, acc[r][c]);
}

/* The instances: nv in {2, 4, 8, 16} (head sizes 2..16 vectors), as many rows as the registers hold. */
#define ATT_INSTANCE(NV, RB)                                                                                       \
static void att_scores_##NV##_##RB(const float *const *q, const float *kh, int64_t kv_sl, float *const *s,          \
                                   int64_t J, float scale, float *mx) {                                            \
    att_rows_scores(NV, RB, q, kh, kv_sl, s, J, scale, mx);                                                        \
}                                                                                                                  \
static void att_values_##NV##_##RB(const float *vh, int64_t kv_sl, const float *const *s, float *const *o,          \
                                   int64_t J) {                                                                    \
    att_rows_values(NV, RB, vh, kv_sl, s, o, J);                                                                   \
}
#define ATT_NV(NV)                                                                                                  \
    ATT_INSTANCE(NV, 1) ATT_INSTANCE(NV, 2) ATT_INSTANCE(NV, 3) ATT_INSTANCE(NV, 4) ATT_INSTANCE(NV, 5) ATT_INSTANCE(NV, 6)
ATT_NV(2) ATT_NV(4) ATT_NV(8) ATT_NV(16)
typedef void (*att_scores_fn)(const float *const *, const float *, int64_t, float *const *, int64_t, float, float *);
typedef void (*att_values_fn)(const float *, int64_t, const float *const *, float *const *, int64_t);
#define ATT_ROW(NV) \
    {0, att_scores_##NV##_1, att_scores_##NV##_2, att_scores_##NV##_3, att_scores_##NV##_4, att_scores_##NV##_5, \
     att_scores_##NV##_6}
#define ATT_VROW(NV) \
    {0, att_values_##NV##_1, att_values_##NV##_2, att_values_##NV##_3, att_values_##NV##_4, att_values_##NV##_5, \
     att_values_##NV##_6}
static const att_scores_fn ATT_SCORES[4][RB_MAX + 1] = {ATT_ROW(2), ATT_ROW(4), ATT_ROW(8), ATT_ROW(16)};
static const att_values_fn ATT_VALUES[4][RB_MAX + 1] = {ATT_VROW(2), ATT_VROW(4), ATT_VROW(8), ATT_VROW(16)};
#endif

void attention_f32(const float *q, int64_t q_sh, int64_t q_sm, const float *k, const float *v, int64_t kv_sh,
                   int64_t kv_sl, float *out, float *scratch, int64_t M, int64_t H, int64_t KVH, int64_t L, int64_t D,
                   float scale, const int64_t *n1, const int64_t *s2, const int64_t *n2) {
    int64_t group = H / KVH;
    int which = -1, rb_max = 1;  /* the grouped instance for this head size, and its rows a group */
#if LANES > 1
    if (D % LANES == 0) {
        int64_t nv = D / LANES;
        which = nv == 2 ? 0 : nv == 4 ? 1 : nv == 8 ? 2 : nv == 16 ? 3 : -1;
        /* the registers: rb rows' queries (or sums) of nv vectors each, and a key's nv vectors */
        rb_max = nv <= (LANES == 16 ? 4 : 2) ? RB_MAX : nv <= (LANES == 16 ? 8 : 4) ? 2 : 1;
    }
#endif
    /* The (head, row) pairs that read one KV head go in groups of rb_max, rows within a head first: a one-row step
       reads each KV head once for the `group` query heads that share it, not once a query head. */
    int64_t pairs = group * M;
    for (int64_t g = 0; g < KVH; g++) {
        const float *kh = k + g * kv_sh, *vh = v + g * kv_sh;
        for (int64_t p0 = 0; p0 < pairs; p0 += rb_max) {
            int rb = pairs - p0 < rb_max ? (int)(pairs - p0) : rb_max;
            const float *qs[RB_MAX];
            float *ss[RB_MAX], *os[RB_MAX], mx[RB_MAX], total[RB_MAX];
            int64_t first[RB_MAX], seen[RB_MAX], jump[RB_MAX], shared = L;
            for (int r = 0; r < rb; r++) {
                int64_t h = g * group + (p0 + r) / M, i = (p0 + r) % M;
                qs[r] = q + h * q_sh + i * q_sm;
                ss[r] = scratch + r * L;
                os[r] = out + (i * H + h) * D;
                first[r] = n1 ? n1[i] : L - M + i + 1;  /* keys 0..first-1, then the second run */
                seen[r] = n1 ? first[r] + n2[i] : first[r];
                jump[r] = n1 ? s2[i] - first[r] : 0;    /* key index = l for l < first, l + jump after */
                mx[r] = -INFINITY;
                shared = first[r] < shared ? first[r] : shared;  /* keys every row of the group sees, in order */
            }
            if (which < 0) shared = 0;
#if LANES > 1
            if (shared > 0) ATT_SCORES[which][rb](qs, kh, kv_sl, ss, shared, scale, mx);
#endif
            for (int r = 0; r < rb; r++) {
                att_scores_tail(qs[r], kh, kv_sl, ss[r], shared, seen[r], first[r], jump[r], D, scale, &mx[r]);
                total[r] = att_exp(ss[r], seen[r], mx[r]);
            }
#if LANES > 1
            if (shared > 0) ATT_VALUES[which][rb](vh, kv_sl, (const float *const *)ss, os, shared);
#endif
            for (int r = 0; r < rb; r++) {
                float *o = os[r];
                if (shared == 0)
                    for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
                att_values_tail(vh, kv_sl, ss[r], o, shared, seen[r], first[r], jump[r], D);
                float inv = 1.0f / total[r];
                for (int64_t d = 0; d < D; d++) o[d] *= inv;
            }
        }
    }
}
