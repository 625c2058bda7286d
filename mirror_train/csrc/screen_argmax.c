/* The first id of a row's largest screened logit (where its exact logit is a lower bound of the exact maximum).
   Any id would give a true lower bound (its served logit): the largest screened one gives the tightest, and which
   of equal or NaN ones is taken changes only the candidates' count, never the token. */
static int64_t screen_first_max(const float *a, int64_t n) {
    float m = -INFINITY;
    int64_t v = 0;
#if LANES == 16
    if (n >= 16) {  /* the maximum 16 lanes at a time, then its first id: ~5x fewer instructions than one by one */
        __m512 mv = _mm512_loadu_ps(a);
        for (v = 16; v + 16 <= n; v += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(a + v));
        m = _mm512_reduce_max_ps(mv);
    }
#endif
    for (; v < n; v++) m = a[v] > m ? a[v] : m;
    for (v = 0; v < n; v++)
        if (a[v] == m) return v;
    return 0;
}

/* The same of a row's screened logits plus its noise z (a sample's Gumbel noise, screen_sample), and the largest
   |z| (zmax) in the same pass */
static int64_t screen_first_max_z(const float *a, const float *z, int64_t n, double *zmax) {
    float m = -INFINITY, big = 0;
    int64_t best = 0;
    for (int64_t v = 0; v < n; v++) {
        float t = a[v] + z[v];
        if (t > m) m = t, best = v;
        big = fabsf(z[v]) > big ? fabsf(z[v]) : big;
    }
    *zmax = big;
    return best;
}

/* The screen's candidates: every output v < n that could be the largest of a row's exact logits.
   a: the screened logits (M rows, lda apart) of the float32 rows x (M x K); mode: how the screen read x: 0 as it is
   (widened bfloat16 weights), 1 rounded to bfloat16 (the dot product's screen), 2 in two int8 bytes a value
   (screen_q8.c: x^ = s (h + Q8_LO l)). With x^ the screen's x, a screened logit
   is within e_v = |x^| s_v + (g |x| + |x^ - x|) n_v + c3 of the exact one (screened_head.py), s_v = |w^_v - w_v| +
   g |w^_v| and n_v = |w_v| the head's per-id constants (sv, nv: rounded up), c: max s_v, max n_v, g, what flushed
   subnormals add. lower: each row's exact logit at one id (its screened argmax): the exact maximum is at least
   that, and any v reaching it has a_v >= lower - e_v, so v is a candidate iff a_v + e_v >= lower (screen_keeps).
   Against a bound from the largest screened logit and the largest norms (a_v >= max a - 2 max e, the thirty-third
   session's) this keeps ~30x fewer ids on the testbed's flat rows (random-token contexts: ~150 a row -> ~3). */
/* Each row's scales (alpha: of s_v, beta: of n_v) and base (the threshold before e_v: lower less c3 and a slack that
   covers float32's rounding of a_v + e_v); -1 where one is not finite. */
/* In mode 2 the screen's sums are integers, exact, and so is their conversion to float32 for K < 1040 (|S| < 2^24;
   past it each is rounded once); with the combination's three roundings the screened logit is within 6u of
   s ws sum_k (|h_k| + Q8_LO |l_k|) |wq_k| <= 3 |x^| |w^_v| (each |h| + Q8_LO |l| is at most 3 |h + Q8_LO l|: |l| / 254 <=
   1/2 <= |h| where h != 0): inside the g |x^| |w^_v| that alpha s_v already holds (g = (2K + 2) u). */
static int screen_scales(const float *x, int64_t M, int64_t K, int mode, const double *c, const double *lower,
                         const double *zmax, float *alpha, float *beta, float *base) {
    for (int64_t r = 0; r < M; r++) {
        double nx = 0, nl = 0, nd = 0;
        float s = mode == 2 ? q8_row_scale(x + r * K, K) : 1.0f, inv = 1.0f / s, h, lo;
        for (int64_t k = 0; k < K; k++) {
            double v = x[r * K + k], l = v;
            if (mode == 1)
                l = (double)screen_f32_of(screen_bf16_of(x[r * K + k]));
            else if (mode == 2)
                q8_split(x[r * K + k], inv, &h, &lo), l = (double)s * ((double)h + (double)Q8_LO * (double)lo);
            nx += v * v, nl += l * l, nd += (l - v) * (l - v);
        }
        double al = sqrt(nl) * (1 + 1e-6), be = (c[2] * sqrt(nx) + sqrt(nd)) * (1 + 1e-6);
        /* zmax: the largest |noise| of the row (0 for greedy): a_v + z_v and y_v + z_v are rounded at its scale */
        double slack = 1e-5 * (fabs(lower[r]) + al * c[0] + be * c[1] + zmax[r] + 1);
        double b = lower[r] - c[3] - slack;
        if (!isfinite(al) || !isfinite(be) || !isfinite(b) || al > 1e30 || be > 1e30 || fabs(b) > 1e30) return -1;
        alpha[r] = (float)al, beta[r] = (float)be, base[r] = (float)b;
        /* float rounding of the scales and the base: the slack (1e-5 of their magnitudes) covers it many times */
    }
    return 0;
}

/* Whether v is a candidate of row r: a_v >= base - (alpha s_v + beta n_v) */
static inline int screen_keeps(float a, float alpha, float beta, float base, float s, float n) {
    return (double)a >= (double)base - ((double)alpha * s + (double)beta * n);
}

/* Whether this library's screen takes per-id bounds and rows' lower bounds (an older revision's, timed by
   bench_target.py --baseline, does not) */
int screen_per_id(void) { return 1; }

/* A served logit: output v of the row xr (K) of a head served from float32 rows (layout 0: the one-row linear's
   arithmetic, F32_narrow_1, which every call of linear_F32 gives that output), float32 panels (1) or bfloat16 panels
   (2: the panel's one-row tile, each lane the chain fma(x[k], w[k], s) from s = 0 that every tile gives it): the
   served head's bits, whichever call computes them (row-exact). */
static inline float screen_exact(const float *xr, int64_t K, const void *w, int layout, int64_t v) {
    float y[LANES];
    if (layout == 0) {
        F32_narrow_1(xr, K, (const float *)w + v * K, K, 0, y, 1, 0);
        return y[0];
    }
    if (layout == 1)
        F32_ptile_1_one_np(xr, K, (const float *)w + v / LANES * F32_PSTRIDE(K), K, 0, y, LANES);
    else
        BF16_ptile_1_one_np(xr, K, (const uint16_t *)w + v / LANES * BF16_PSTRIDE(K), K, 0, y, LANES);
    return y[v % LANES];
}

/* screen_argmax's and screen_sample's selection (below): z NULL for greedy tokens, else each row's noise */
static int64_t screen_pick(const float *a, int64_t M, int64_t n, int64_t lda, const float *x, int64_t K, int mode,
                           const double *c, const float *sv, const float *nv, const void *w, int layout,
                           const float *z, int64_t ldz, int64_t max_candidates, int64_t *ids) {
    double lower[64], zmax[64];
    float best[64], alpha[64], beta[64], base[64];
    if (M > 64 || layout < 0 || layout > 2 || mode < 0 || mode > 2) return -1;
    int64_t count = 0;
    for (int64_t r = 0; r < M; r++) {
        zmax[r] = 0;
        if (z == NULL) {
            int64_t v = screen_first_max(a + r * lda, n);
            lower[r] = screen_exact(x + r * K, K, w, layout, v); /* NaN: screen_scales says not finite */
        } else {
            const float *zr = z + r * ldz;
            int64_t v = screen_first_max_z(a + r * lda, zr, n, &zmax[r]);
            lower[r] = screen_exact(x + r * K, K, w, layout, v) + zr[v]; /* the float32 sum every path rounds */
        }
        count++;
    }
    if (screen_scales(x, M, K, mode, c, lower, zmax, alpha, beta, base) < 0) return -1;
    for (int64_t r = 0; r < M; r++) ids[r] = -1, best[r] = -INFINITY;
#define SCREEN_EXACT(v, r)                                                                   \
    {                                                                                        \
        if (++count > max_candidates) return -1;                                             \
        float y = screen_exact(x + (r) * K, K, w, layout, (v));                              \
        if (y != y) return -1;                                                               \
        if (z != NULL) y = y + z[(r) * ldz + (v)];                                           \
        if (ids[r] < 0 || y > best[r]) best[r] = y, ids[r] = (v); /* v ascending: the first */ \
    }
    int64_t v = 0;
#if LANES == 16
    for (; v + 16 <= n; v += 16) {
        __m512 s = _mm512_loadu_ps(sv + v), nn = _mm512_loadu_ps(nv + v);
        __mmask16 hit[64], any = 0;
        for (int64_t r = 0; r < M; r++) {
            __m512 e = _mm512_fmadd_ps(_mm512_set1_ps(alpha[r]), s, _mm512_mul_ps(_mm512_set1_ps(beta[r]), nn));
            __m512 t = _mm512_sub_ps(_mm512_set1_ps(base[r]), e);
            __m512 av = _mm512_loadu_ps(a + r * lda + v);
            if (z != NULL) av = _mm512_add_ps(av, _mm512_loadu_ps(z + r * ldz + v));
            any |= hit[r] = _mm512_cmp_ps_mask(av, t, _CMP_GE_OQ);
        }
        for (; any; any &= any - 1) {
            int j = __builtin_ctz(any);
            for (int64_t r = 0; r < M; r++)
                if (hit[r] >> j & 1) SCREEN_EXACT(v + j, r)
        }
    }
#endif
    for (; v < n; v++)
        for (int64_t r = 0; r < M; r++) {
            float av = a[r * lda + v] + (z != NULL ? z[r * ldz + v] : 0.0f);
            if (screen_keeps(av, alpha[r], beta[r], base[r], sv[v], nv[v])) SCREEN_EXACT(v, r)
        }
#undef SCREEN_EXACT
    for (int64_t r = 0; r < M; r++)
        if (ids[r] < 0) return -1;
    return count;
}

/* Each row's greedy token through the screen: the first largest of the row's served logits over its own candidates
   (screen_keeps, row by row), each by screen_exact from the served weight w (`layout`, above); a row's lower
   bound is its served logit at its screened argmax. One call a step: the candidates' selection and their logits
   once done in torch cost 8 rows ~0.6 ms of small operations (thirty-eighth session). ids: M. Returns the logits
   computed, or -1 where a bound is not finite, a logit is NaN or they would pass max_candidates (the caller then
   takes the whole head). */
int64_t screen_argmax(const float *a, int64_t M, int64_t n, int64_t lda, const float *x, int64_t K, int mode,
                      const double *c, const float *sv, const float *nv, const void *w, int layout,
                      int64_t max_candidates, int64_t *ids) {
    return screen_pick(a, M, n, lda, x, K, mode, c, sv, nv, w, layout, NULL, 0, max_candidates, ids);
}

/* Each row's sampled token through the screen: the first largest of its served logits plus its noise z (M rows, ldz
   apart; T times Gumbel noise: Gumbel-max, acceptance.py), the candidates those that could reach the largest sum.
   The sums are float32's, as `(logits + z).argmax()` rounds them, so the token is the whole head's. */
int64_t screen_sample(const float *a, int64_t M, int64_t n, int64_t lda, const float *x, int64_t K, int mode,
                      const double *c, const float *sv, const float *nv, const void *w, int layout, const float *z,
                      int64_t ldz, int64_t max_candidates, int64_t *ids) {
    return screen_pick(a, M, n, lda, x, K, mode, c, sv, nv, w, layout, z, ldz, max_candidates, ids);
}
