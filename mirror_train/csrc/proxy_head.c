/* A per-position proxy head's candidates in one call (models/proxy_head.py, `ProxyHead.window_candidates`): over M
   rows of the target's exit states, the adapter (the MLP kind: x + fc2(silu(fc1(rms(x)))), or none: the logit lens),
   the target's final norm, the LM head's candidate rows, each row's log-softmax, its top kappa and the log-prob of
   the window's drafted token. Float32 activations over the linears as served (head_linear); it only proposes, so its
   bits need not be torch's. On the draft's side the torch version's ~30 small operations ran cold after each
   target step's weight stream and cost 3.1-3.3 ms a step against ~1.1 ms warm, out of the rollout's deadline
   (docs/engine.md, thirty-seventh session). */

/* y (M x N) = x . W^T for one of the head's linears, read as (wtype, wpanels): decoder_layer.c's linear_served, or
   wtype 3, int8 with a float32 scale per row (`scale`): as panels on the dot product of byte quads (wpanels 1,
   linear_q8.c: `wsum` their sums) or as rows widened to float32, each output scaled after its sum */
static inline void head_linear(const float *x, int64_t ldx, const void *w, int wtype, int wpanels, const float *scale,
                               const int32_t *wsum, float *y, int64_t M, int64_t N, int64_t K, uint32_t *pairs) {
    if (wtype != 3) {
        linear_served(x, ldx, w, 0, wtype, wpanels, y, N, M, N, K, pairs);
        return;
    }
    if (wpanels) {
        linear_q8(x, ldx, (const int8_t *)w, scale, wsum, y, N, M, N, K, pairs);
        return;
    }
    linear_I8(x, ldx, (const int8_t *)w, 0, y, N, M, N, K);
    for (int64_t m = 0; m < M; m++) {
        float *r = y + m * N;
        int64_t n = 0;
#if LANES > 1
        for (; n + LANES <= N; n += LANES) VSTORE(r + n, VMUL(VLOAD(r + n), VLOAD(scale + n)));
#endif
        for (; n < N; n++) r[n] *= scale[n];
    }
}

/* log(sum exp(l - m)) + m over a row of n logits */
static float head_logsumexp(const float *l, int64_t n) {
    float m = -INFINITY;
    for (int64_t v = 0; v < n; v++) m = l[v] > m ? l[v] : m;
    float s = 0.0f;
    int64_t v = 0;
#if LANES > 1
    vec acc = VZERO(), mv = VSET(m);
    for (; v + LANES <= n; v += LANES) acc = VADD(acc, vexp(VSUB(VLOAD(l + v), mv)));
    s = vsum(acc);
#endif
    for (; v < n; v++) s += expf(l[v] - m);
    return m + logf(s);
}

/* The kappa largest of a row's n logits, largest first (the lower index first among equals): ids and values */
static void head_top(const float *l, int64_t n, int64_t kappa, int64_t *ids, float *vals) {
    int64_t have = 0;
    for (int64_t v = 0; v < n; v++) {
        float x = l[v];
        if (have == kappa && !(x > vals[kappa - 1])) continue;
        int64_t i = have < kappa ? have++ : kappa - 1;
        for (; i > 0 && x > vals[i - 1]; i--) vals[i] = vals[i - 1], ids[i] = ids[i - 1];
        vals[i] = x, ids[i] = v;
    }
}

/* w: fc1 (I x H), fc2 (H x I), the LM head's rows (V x H), each read as (wtypes[i], wpanels[i]; wscales[i], wsums[i]:
   the row scales and sums of an int8 one, wtype 3); fc1 NULL: no
   adapter (the lens). pre: the adapter's norm weight (float32, H) and pre_eps, fin: the final norm's. softcap > 0:
   logits capped as cap tanh(l / cap). window: W <= M indices into the V logits (-1: outside them), row j's drafted
   token's; window_logp gets each one's log-prob (outside_logp for -1). noise (M x V, ldn apart; NULL at T = 0): the
   target's sampling noise at each row's output position (T times its Gumbel noise, read at the head's V ids), added
   to the logits before all of it: the target's sample there is argmax(logits + noise), so the candidates are the
   ones the proxy expects that sample to be, and their log-probs its odds under that noise. Returns 0, or -1 (kappa
   out of range, W > M or a row's logits not finite: the caller takes torch's path). top_ids, top_logp: M x kappa.
   scratch: head_scratch_floats(). */
int64_t head_scratch_floats(int64_t M, int64_t H, int64_t I, int64_t V) {
    return M * (3 * H + I + V) + M * ((H > I ? H : I) + 1) / 2 + 64;
}

int proxy_head_f32(const float *x, int64_t M, int64_t H, const float *pre, float pre_eps, const float *fin,
                   float fin_eps, const void *const *w, const int *wtypes, const int *wpanels, const float *const *wscales,
                   const int32_t *const *wsums, int64_t I, int64_t V,
                   float softcap, const float *noise, int64_t ldn, int64_t kappa, const int64_t *window, int64_t W,
                   float outside_logp, int64_t *top_ids, float *top_logp, float *window_logp, float *scratch) {
    if (kappa < 1 || kappa > V || W > M) return -1;
    float *n = scratch, *h = n + M * H, *o = h + M * H, *g = o + M * H, *l = g + M * I;
    uint32_t *pairs = (uint32_t *)(l + M * V);
    for (int64_t i = 0; i < M * H; i++) h[i] = x[i];
    if (w[0]) {  /* the MLP adapter */
        rms_norm(x, pre, pre_eps, n, M, H);
        head_linear(n, H, w[0], wtypes[0], wpanels[0], wscales[0], wsums[0], g, M, I, H, pairs);
        int64_t t = 0;
#if LANES > 1
        for (; t + LANES <= M * I; t += LANES) VSTORE(g + t, vsilu(VLOAD(g + t)));
#endif
        for (; t < M * I; t++) g[t] = g[t] / (1.0f + expf(-g[t]));
        head_linear(g, I, w[1], wtypes[1], wpanels[1], wscales[1], wsums[1], o, M, H, I, pairs);
        for (int64_t i = 0; i < M * H; i++) h[i] += o[i];
    }
    rms_norm(h, fin, fin_eps, n, M, H);
    head_linear(n, H, w[2], wtypes[2], wpanels[2], wscales[2], wsums[2], l, M, V, H, pairs);
    for (int64_t m = 0; m < M; m++) {
        float *lr = l + m * V;
        if (softcap > 0)
            for (int64_t v = 0; v < V; v++) lr[v] = softcap * tanhf(lr[v] / softcap);
        if (noise)
            for (int64_t v = 0; v < V; v++) lr[v] += noise[m * ldn + v];
        float lse = head_logsumexp(lr, V);
        if (!isfinite(lse)) return -1;
        head_top(lr, V, kappa, top_ids + m * kappa, top_logp + m * kappa);
        for (int64_t j = 0; j < kappa; j++) top_logp[m * kappa + j] -= lse;
        if (m < W) window_logp[m] = window[m] < 0 || window[m] >= V ? outside_logp : lr[window[m]] - lse;
    }
    return 0;
}
