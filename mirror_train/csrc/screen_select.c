/* The largest screened logit of a row (the start of its candidates' threshold) */
static float screen_max(const float *a, int64_t n) {
    float m = -INFINITY;
    int64_t v = 0;
#if LANES == 16
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (; v + 16 <= n; v += 16) mv = _mm512_max_ps(_mm512_loadu_ps(a + v), mv);
    m = _mm512_reduce_max_ps(mv);
#elif LANES == 8
    __m256 mv = _mm256_set1_ps(-INFINITY);
    for (; v + 8 <= n; v += 8) mv = _mm256_max_ps(_mm256_loadu_ps(a + v), mv);
    float t[8];
    _mm256_storeu_ps(t, mv);
    for (int i = 0; i < 8; i++) m = t[i] > m ? t[i] : m;
#endif
    for (; v < n; v++) m = a[v] > m ? a[v] : m;
    return m;
}

/* The screen's candidates: every output v < n that could be the largest of a row's exact logits, in order, each
   once, into out; returns how many, or -1 where a bound is not finite (the caller takes the whole head).
   a: the screened logits (M rows, lda apart) of the float32 rows x (M x K); dot: x was rounded to bfloat16 (the
   dot product's screen), else read as it is (widened bfloat16 weights). c: the head's constants (screened_head.py):
   max over v of |w^_v - w_v| + g |w^_v|, max of |w_v|, g, what flushed subnormals add. With x^ the screen's x, a
   row's bound is e = |x^| c0 + (g |x| + |x^ - x|) c1 + c3 (norms in double), and v is a candidate iff
   a_v >= max_u a_u - 2e: the exact maximum is >= max a - e, and any v reaching it has a_v >= it - e. */
/* Each row's floor (above): 0, or -1 where a bound is not finite. */
static int screen_floors(const float *a, int64_t M, int64_t n, int64_t lda, const float *x, int64_t K, int dot,
                         const double *c, double *floors) {
    for (int64_t r = 0; r < M; r++) {
        double nx = 0, nl = 0, nd = 0;
        for (int64_t k = 0; k < K; k++) {
            double v = x[r * K + k], l = dot ? (double)screen_f32_of(screen_bf16_of(x[r * K + k])) : v;
            nx += v * v, nl += l * l, nd += (l - v) * (l - v);
        }
        double e = (sqrt(nl) * c[0] + (c[2] * sqrt(nx) + sqrt(nd)) * c[1] + c[3]) * (1 + 1e-9);
        floors[r] = (double)screen_max(a + r * lda, n) - 2 * e;
        if (!isfinite(floors[r])) return -1;
    }
    return 0;
}

/* A float32 threshold at or below the floor: never fewer candidates */
static inline float screen_threshold(double floor) {
    float t = (float)floor;
    return (double)t > floor ? nextafterf(t, -INFINITY) : t;
}

int64_t screen_select(const float *a, int64_t M, int64_t n, int64_t lda, const float *x, int64_t K, int dot,
                      const double *c, int64_t *out) {
    double floors[64];
    if (M > 64 || screen_floors(a, M, n, lda, x, K, dot, c, floors) < 0) return -1;
    int64_t count = 0, v = 0;
#if LANES == 16
    __m512 t[64];
    for (int64_t r = 0; r < M; r++) t[r] = _mm512_set1_ps(screen_threshold(floors[r]));
    for (; v + 16 <= n; v += 16) {
        __mmask16 hit = 0;
        for (int64_t r = 0; r < M; r++) hit |= _mm512_cmp_ps_mask(_mm512_loadu_ps(a + r * lda + v), t[r], _CMP_GE_OQ);
        while (hit) {
            out[count++] = v + __builtin_ctz(hit);
            hit &= hit - 1;
        }
    }
#endif
    for (; v < n; v++)
        for (int64_t r = 0; r < M; r++)
            if ((double)a[r * lda + v] >= floors[r]) {
                out[count++] = v;
                break;
            }
    return count;
}

/* Each row's greedy token through the screen, for a head served from float32 rows w (N x K, n <= N outputs): the
   first largest of the row's exact logits over its own candidates (screen_select's floor, row by row: the logits of
   every row at the rows' union of candidates, from a gathered copy of their weights, had cost 8 rows ~0.4 ms), each
   logit by the one-row linear's arithmetic (F32_narrow_1), which every call of linear_F32 gives that output
   (row-exact): the served head's bits. A candidate's weight row is read once for the rows that have it. ids: M.
   Returns the logits computed, or -1 where a bound is not finite, a logit is NaN or they would pass max_candidates
   (the caller then takes another path). */
int64_t screen_argmax_f32(const float *a, int64_t M, int64_t n, int64_t lda, const float *x, int64_t K, int dot,
                          const double *c, const float *w, int64_t max_candidates, int64_t *ids) {
    double floors[64];
    float best[64];
    if (M > 64 || screen_floors(a, M, n, lda, x, K, dot, c, floors) < 0) return -1;
    for (int64_t r = 0; r < M; r++) ids[r] = -1, best[r] = -INFINITY;
    int64_t count = 0;
#define SCREEN_EXACT(v, r)                                                                   \
    {                                                                                        \
        float y;                                                                             \
        if (++count > max_candidates) return -1;                                             \
        F32_narrow_1(x + (r) * K, K, w + (v) * K, K, 0, &y, 1, 0);                           \
        if (y != y) return -1;                                                               \
        if (ids[r] < 0 || y > best[r]) best[r] = y, ids[r] = (v); /* v ascending: the first */ \
    }
    int64_t v = 0;
#if LANES == 16
    __m512 t[64];
    for (int64_t r = 0; r < M; r++) t[r] = _mm512_set1_ps(screen_threshold(floors[r]));
    for (; v + 16 <= n; v += 16) {
        __mmask16 hit[64], any = 0;
        for (int64_t r = 0; r < M; r++) any |= hit[r] = _mm512_cmp_ps_mask(_mm512_loadu_ps(a + r * lda + v), t[r],
                                                                            _CMP_GE_OQ);
        for (; any; any &= any - 1) {
            int j = __builtin_ctz(any);
            for (int64_t r = 0; r < M; r++)
                if (hit[r] >> j & 1) SCREEN_EXACT(v + j, r)
        }
    }
#endif
    for (; v < n; v++)
        for (int64_t r = 0; r < M; r++)
            if ((double)a[r * lda + v] >= floors[r]) SCREEN_EXACT(v, r)
#undef SCREEN_EXACT
    for (int64_t r = 0; r < M; r++)
        if (ids[r] < 0) return -1;
    return count;
}
