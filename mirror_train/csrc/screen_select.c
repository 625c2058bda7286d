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
int64_t screen_select(const float *a, int64_t M, int64_t n, int64_t lda, const float *x, int64_t K, int dot,
                      const double *c, int64_t *out) {
    double floors[64];
    if (M > 64) return -1;
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
    int64_t count = 0, v = 0;
#if LANES == 16
    for (; v + 16 <= n; v += 16) {
        __mmask16 hit = 0;
        for (int64_t r = 0; r < M; r++) {  /* a float32 threshold at or below the floor: never fewer candidates */
            float t = (float)floors[r];
            if ((double)t > floors[r]) t = nextafterf(t, -INFINITY);
            hit |= _mm512_cmp_ps_mask(_mm512_loadu_ps(a + r * lda + v), _mm512_set1_ps(t), _CMP_GE_OQ);
        }
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
