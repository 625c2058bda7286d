/* The target's sampling noise (engine/acceptance.py, sample_noise): T times Gumbel noise, -T log(-log u), a row of
   the vocabulary for each output position, every value a function of (seed, position, id) alone. The engine draws
   a row for every position a window verifies, on the target's side and on the draft's (which couples its tokens
   and the proxy head's candidates to it): torch's generator and float64 logs took ~0.5 ms a row of 49,152 ids,
   longer than the wait for a branch that is ready. Here a counter-based generator (splitmix64's finalizer over a
   key of (seed, position) plus a counter of the id) and a logarithm of IEEE operations alone, which the compiler vectorises;
   -ffp-contract=off keeps every operation rounded on its own, so these are the bits of acceptance.py's torch
   version of the same function (the fallback where no kernel builds) on any x86 machine. */

#include <string.h>

static inline uint64_t noise_mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

#define NOISE_GOLDEN 0x9E3779B97F4A7C15ull
#define NOISE_SQRT2 1.4142135623730951
#define NOISE_LN2 0.6931471805599453

/* log x for a normal x > 0: x = 2^k m, m in [sqrt(1/2), sqrt(2)], log m = 2 atanh(s) = 2 (s + s^3/3 + ... + s^11/11)
   with s = (m - 1) / (m + 1), |s| <= 0.172: the series' remainder is ~5e-11 of log m at most, relative accuracy that holds
   as m -> 1 (where log u of a u near 1 needs it: the second logarithm reads e = -log u as small as 1e-16), far
   inside a float32 noise value's rounding; six terms instead of eleven made a row ~1.4x faster. */
static inline double noise_log(double x) {
    uint64_t b;
    memcpy(&b, &x, 8);
    int64_t k = (int64_t)(b >> 52) - 1023;
    uint64_t mb = (b & 0x000FFFFFFFFFFFFFull) | 0x3FF0000000000000ull;
    double m;
    memcpy(&m, &mb, 8);
    int big = m > NOISE_SQRT2;
    m = big ? m * 0.5 : m;
    k += big;
    double s = (m - 1.0) / (m + 1.0), s2 = s * s;
    double p = 1.0 / 11;
    p = p * s2 + 1.0 / 9;
    p = p * s2 + 1.0 / 7;
    p = p * s2 + 1.0 / 5;
    p = p * s2 + 1.0 / 3;
    p = p * s2 + 1.0;
    return (double)k * NOISE_LN2 + (2.0 * s) * p;
}

/* out (n x V): row i the noise of output position positions[i]. u = (z / 2^12 + 1/2) 2^-52 from the top 52 bits of
   the id's 64 random ones: in [2^-53, 1 - 2^-53], never 0 or 1, so the noise is finite (-3.6 to 36.7, times T). */
void gumbel_noise(uint64_t seed, const int64_t *positions, int64_t n, int64_t V, double temperature, float *out) {
    for (int64_t i = 0; i < n; i++) {
        uint64_t key = noise_mix(noise_mix(seed * NOISE_GOLDEN + 1) + (uint64_t)positions[i] * NOISE_GOLDEN);
        float *row = out + i * V;
        for (int64_t v = 0; v < V; v++) {
            uint64_t z = noise_mix(key + (uint64_t)(v + 1) * NOISE_GOLDEN);
            double u = ((double)(int64_t)(z >> 12) + 0.5) * 0x1p-52;
            double e = -noise_log(u);
            row[v] = (float)(-temperature * noise_log(e));
        }
    }
}
