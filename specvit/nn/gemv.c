/* Products of a few rows with a weight matrix, y = x @ w.T * scale + bias, at the memory's read rate.
 *
 * A decode step multiplies one row per sequence with every weight of the model: the time is the bytes of
 * the weights over the rate memory is read at. These loops stream each weight row once (float32, bfloat16
 * or int8 with a float scale per row), multiply it with every input row while it is in L1, and spread the
 * weight's rows over torch's OpenMP threads (the same runtime: torch's libgomp is loaded first).
 *
 * Built by specvit/nn/gemv.py with -O3 -mavx2 -mfma -fopenmp on x86-64 CPUs with AVX2 and FMA, and with
 * -mavx512f too where torch's CPU capability is AVX512 (sixteen lanes: half the instructions per weight).
 * Dims: M input rows (at most MAX_ROWS), N weight rows (outputs), K inputs. x (M, K) float32, w (N, K),
 * scale (N,) float32 or NULL, bias (N,) float32 or NULL, y (M, N) float32; all contiguous.
 *
 * Then the elementwise steps a decode layer runs around its products (RMSNorm, SwiGLU, RoPE), one call
 * each where torch runs several ops; at the end, a whole decode step as one program of these steps.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_ROWS 8

#ifdef __AVX512F__ /* built with -mavx512f where torch's CPU capability is AVX512: sixteen lanes */
#define W 16
typedef __m512 vec;
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline float hsum(vec v) { return _mm512_reduce_add_ps(v); }
/* W weights as float32 */
static inline vec load_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline vec load_bf16(const uint16_t *p) {
    __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); /* bfloat16 is float32's upper half */
}
static inline vec load_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
/* for exp: a * b, a - b, a / b, min, max, W copies of a, round to nearest, y * 2^n, store */
static inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
static inline vec vdiv(vec a, vec b) { return _mm512_div_ps(a, b); }
static inline vec vmin(vec a, vec b) { return _mm512_min_ps(a, b); }
static inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
static inline vec vset(float a) { return _mm512_set1_ps(a); }
static inline vec vround(vec a) {
    return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
static inline vec vpow2(vec y, vec n) { return _mm512_scalef_ps(y, n); }
static inline vec vabs(vec a) { return _mm512_abs_ps(a); }
static inline vec vsmall(vec a, float bound, vec yes, vec no) { /* |a| <= bound ? yes : no */
    __mmask16 small = _mm512_cmp_ps_mask(vabs(a), _mm512_set1_ps(bound), _CMP_LE_OQ);
    return _mm512_mask_blend_ps(small, no, yes);
}
static inline void store_f32(float *p, vec v) { _mm512_storeu_ps(p, v); }
#else /* AVX2 and FMA: eight lanes */
#define W 8
typedef __m256 vec;
static inline vec vzero(void) { return _mm256_setzero_ps(); }
static inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline float hsum(vec v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
/* W weights as float32 */
static inline vec load_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline vec load_bf16(const uint16_t *p) {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); /* bfloat16 is float32's upper half */
}
static inline vec load_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
/* for exp: a * b, a - b, a / b, min, max, W copies of a, round to nearest, y * 2^n, store */
static inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
static inline vec vdiv(vec a, vec b) { return _mm256_div_ps(a, b); }
static inline vec vmin(vec a, vec b) { return _mm256_min_ps(a, b); }
static inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
static inline vec vset(float a) { return _mm256_set1_ps(a); }
static inline vec vround(vec a) {
    return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
static inline vec vpow2(vec y, vec n) { /* n in [-126, 128] (exp's clamp): 2^n from its exponent bits */
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}
static inline vec vabs(vec a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
static inline vec vsmall(vec a, float bound, vec yes, vec no) { /* |a| <= bound ? yes : no */
    return _mm256_blendv_ps(no, yes, _mm256_cmp_ps(vabs(a), _mm256_set1_ps(bound), _CMP_LE_OQ));
}
static inline void store_f32(float *p, vec v) { _mm256_storeu_ps(p, v); }
#endif

/* one weight as float32, for the last K % W */
static inline float one_f32(const float *p) { return *p; }
static inline float one_bf16(const uint16_t *p) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)*p << 16;
    return c.f;
}
static inline float one_i8(const int8_t *p) { return (float)*p; }

/* Bytes ahead of the weight being read that each loop asks the cache for. The weights stream from memory
 * once per call, and the hardware prefetcher alone does not keep far enough ahead: the loads stall and the
 * multiplications wait, so memory and arithmetic take turns. Streaming SmolLM-135M's layer shapes (120
 * weights, one row) on a 2-core AVX-512 Xeon whose sum reads 21 GB/s, the median of 11 passes went from
 * 19.0 to 20.5 GB/s for float32, 15.2 to 20.3 for bfloat16 and 15.0 to 22.9 for int8 (the int8 weights fit
 * its L3 cache); 2048 and 8192 bytes ahead measured the same as 4096. Past a row's end it reads the next
 * rows, which this thread reads next (its last rows ask for a few lines it never reads); a prefetch
 * never faults. */
#define AHEAD 4096

/* The sums of one weight row with M input rows, acc[m] = w . x[m] over the first K - K % W inputs (the
 * caller adds the rest). Always inlined with a constant M, so the M sums live in registers. */
#define DOTS(NAME, T, LOAD)                                                                            \
    static inline __attribute__((always_inline)) void NAME(const float *x, const T *row, int64_t K,    \
                                                            int64_t M, float *acc) {                   \
        int64_t k = 0;                                                                                 \
        if (M == 1) { /* four sums in flight */                                                        \
            vec a0 = vzero(), a1 = a0, a2 = a0, a3 = a0;                                               \
            for (; k + 4 * W <= K; k += 4 * W) {                                                       \
                for (int64_t b = 0; b < 4 * W * (int64_t)sizeof(T); b += 64) /* each line of 4 W */    \
                    _mm_prefetch((const char *)(row + k) + AHEAD + b, _MM_HINT_T0);                    \
                a0 = vfma(LOAD(row + k), load_f32(x + k), a0);                                         \
                a1 = vfma(LOAD(row + k + W), load_f32(x + k + W), a1);                                 \
                a2 = vfma(LOAD(row + k + 2 * W), load_f32(x + k + 2 * W), a2);                         \
                a3 = vfma(LOAD(row + k + 3 * W), load_f32(x + k + 3 * W), a3);                         \
            }                                                                                          \
            for (; k + W <= K; k += W) a0 = vfma(LOAD(row + k), load_f32(x + k), a0);                  \
            acc[0] = hsum(vadd(vadd(a0, a1), vadd(a2, a3)));                                           \
            return;                                                                                    \
        }                                                                                              \
        vec a[MAX_ROWS]; /* one sum per input row: each W weights loaded once for all rows */          \
        for (int64_t m = 0; m < M; m++) a[m] = vzero();                                                \
        for (; k + W <= K; k += W) {                                                                   \
            _mm_prefetch((const char *)(row + k) + AHEAD, _MM_HINT_T0);                                \
            vec v = LOAD(row + k);                                                                     \
            for (int64_t m = 0; m < M; m++) a[m] = vfma(v, load_f32(x + m * K + k), a[m]);             \
        }                                                                                              \
        for (int64_t m = 0; m < M; m++) acc[m] = hsum(a[m]);                                           \
    }

/* The sums of two adjacent weight rows with one input row, over the first K - K % W inputs: each W inputs
 * loaded once for both rows, and one row end (the horizontal sums, the store) per two rows. On a 2-core
 * AVX-512 Xeon, streaming SmolLM-135M's weights, three runs: 2-5% faster for float32, 3-9% for bfloat16
 * and 1-12% for int8 than one row at a time with four sums in flight. */
#define PAIR(NAME, T, LOAD)                                                                            \
    static inline __attribute__((always_inline)) void NAME(const float *x, const T *r0, int64_t K,     \
                                                            float *acc) {                              \
        const T *r1 = r0 + K;                                                                          \
        vec a0 = vzero(), a1 = a0, b0 = a0, b1 = a0;                                                   \
        int64_t k = 0;                                                                                 \
        for (; k + 2 * W <= K; k += 2 * W) {                                                           \
            for (int64_t b = 0; b < 2 * W * (int64_t)sizeof(T); b += 64) { /* each line of 2 W */      \
                _mm_prefetch((const char *)(r0 + k) + AHEAD + b, _MM_HINT_T0);                         \
                _mm_prefetch((const char *)(r1 + k) + AHEAD + b, _MM_HINT_T0);                         \
            }                                                                                          \
            vec x0 = load_f32(x + k), x1 = load_f32(x + k + W);                                        \
            a0 = vfma(LOAD(r0 + k), x0, a0);                                                           \
            a1 = vfma(LOAD(r0 + k + W), x1, a1);                                                       \
            b0 = vfma(LOAD(r1 + k), x0, b0);                                                           \
            b1 = vfma(LOAD(r1 + k + W), x1, b1);                                                       \
        }                                                                                              \
        for (; k + W <= K; k += W) {                                                                   \
            vec x0 = load_f32(x + k);                                                                  \
            a0 = vfma(LOAD(r0 + k), x0, a0);                                                           \
            b0 = vfma(LOAD(r1 + k), x0, b0);                                                           \
        }                                                                                              \
        acc[0] = hsum(vadd(a0, a1));                                                                   \
        acc[1] = hsum(vadd(b0, b1));                                                                   \
    }

/* y[m, n] from the sum acc of weight row n with input row m over the first K - K % W inputs: the rest of
 * the inputs, the scale and the bias. */
#define FINISH(NAME, T, ONE)                                                                           \
    static inline void NAME(float s, const T *row, const float *xm, int64_t K, const float *scale,     \
                            const float *bias, int64_t n, float *out) {                                \
        for (int64_t j = K - K % W; j < K; j++) s += ONE(row + j) * xm[j];                             \
        if (scale) s *= scale[n];                                                                      \
        if (bias) s += bias[n];                                                                        \
        *out = s;                                                                                      \
    }

#define GEMV(NAME, T, DOTS_OF, PAIR_OF, FINISH_OF)                                                     \
    void NAME(const float *x, const T *w, const float *scale, const float *bias, float *y, int64_t M, \
              int64_t N, int64_t K) {                                                                 \
        if (M == 1) { /* weight rows two at a time, the last alone when N is odd */                   \
            _Pragma("omp parallel for schedule(static)") for (int64_t p = 0; p < (N + 1) / 2; p++) {  \
                int64_t n = 2 * p, rows = N - n < 2 ? 1 : 2;                                          \
                float acc[2];                                                                         \
                if (rows == 2)                                                                        \
                    PAIR_OF(x, w + n * K, K, acc);                                                    \
                else                                                                                  \
                    DOTS_OF(x, w + n * K, K, 1, acc);                                                 \
                for (int64_t i = 0; i < rows; i++)                                                    \
                    FINISH_OF(acc[i], w + (n + i) * K, x, K, scale, bias, n + i, y + n + i);          \
            }                                                                                         \
            return;                                                                                   \
        }                                                                                             \
        _Pragma("omp parallel for schedule(static)") for (int64_t n = 0; n < N; n++) {                \
            const T *row = w + n * K;                                                                 \
            float acc[MAX_ROWS];                                                                      \
            switch (M) { /* a constant M for each inlined copy */                                     \
            case 2: DOTS_OF(x, row, K, 2, acc); break;                                                \
            case 3: DOTS_OF(x, row, K, 3, acc); break;                                                \
            case 4: DOTS_OF(x, row, K, 4, acc); break;                                                \
            case 5: DOTS_OF(x, row, K, 5, acc); break;                                                \
            case 6: DOTS_OF(x, row, K, 6, acc); break;                                                \
            case 7: DOTS_OF(x, row, K, 7, acc); break;                                                \
            case 8: DOTS_OF(x, row, K, 8, acc); break;                                                \
            default: break; /* M is 1 to MAX_ROWS (gemv.py checks) */                                 \
            }                                                                                         \
            for (int64_t m = 0; m < M; m++)                                                           \
                FINISH_OF(acc[m], row, x + m * K, K, scale, bias, n, y + m * N + n);                  \
        }                                                                                             \
    }

DOTS(dots_f32, float, load_f32)
DOTS(dots_bf16, uint16_t, load_bf16)
DOTS(dots_i8, int8_t, load_i8)
PAIR(pair_f32, float, load_f32)
PAIR(pair_bf16, uint16_t, load_bf16)
PAIR(pair_i8, int8_t, load_i8)
FINISH(finish_f32, float, one_f32)
FINISH(finish_bf16, uint16_t, one_bf16)
FINISH(finish_i8, int8_t, one_i8)
GEMV(specvit_gemv_f32, float, dots_f32, pair_f32, finish_f32)
GEMV(specvit_gemv_bf16, uint16_t, dots_bf16, pair_bf16, finish_bf16)
GEMV(specvit_gemv_i8, int8_t, dots_i8, pair_i8, finish_i8)

/* The elementwise steps of a decode layer around its products, each one call where torch runs 3-8 ops of
 * a few microseconds each on a few rows. Each computes what torch computes, in its order (the build's
 * -ffp-contract=off keeps a product and a sum two roundings, as torch's separate ops are): RoPE to the bit;
 * the norm sums its squares in another order, and SwiGLU takes an exp of its own. */

/* RMSNorm of M rows of D: y = x * (1 / sqrt(mean(x^2) + eps)) * (offset + w); w may be NULL (no weight). */
void specvit_rms_norm_f32(const float *x, const float *w, float *y, int64_t M, int64_t D, float eps,
                          float offset) {
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * D;
        float *ym = y + m * D;
        vec a0 = vzero(), a1 = a0;
        int64_t k = 0;
        for (; k + 2 * W <= D; k += 2 * W) {
            vec v0 = load_f32(xm + k), v1 = load_f32(xm + k + W);
            a0 = vfma(v0, v0, a0);
            a1 = vfma(v1, v1, a1);
        }
        float s = hsum(vadd(a0, a1));
        for (; k < D; k++) s += xm[k] * xm[k];
        float r = 1.0f / _mm_cvtss_f32(_mm_sqrt_ss(_mm_set_ss(s / (float)D + eps))); /* as torch's rsqrt */
        if (w)
            for (k = 0; k < D; k++) ym[k] = (xm[k] * r) * (offset + w[k]);
        else
            for (k = 0; k < D; k++) ym[k] = xm[k] * r;
    }
}

/* e^x as Cephes' expf computes it: x = n ln2 + r with |r| <= ln2 / 2, e^r a degree-6 polynomial, times
 * 2^n; x clamped to where e^x is a normal float. */
static inline vec vexp(vec x) {
    x = vmin(vmax(x, vset(-87.3365447505f)), vset(88.3762626647949f));
    vec n = vround(vmul(x, vset(1.44269504088896341f)));
    vec r = vsub(vsub(x, vmul(n, vset(0.693359375f))), vmul(n, vset(-2.12194440e-4f))); /* ln2 in two parts */
    vec p = vset(1.9875691500e-4f);
    p = vfma(p, r, vset(1.3981999507e-3f));
    p = vfma(p, r, vset(8.3334519073e-3f));
    p = vfma(p, r, vset(4.1665795894e-2f));
    p = vfma(p, r, vset(1.6666665459e-1f));
    p = vfma(p, r, vset(5.0000001201e-1f));
    p = vfma(p, vmul(r, r), vadd(r, vset(1.0f)));
    return vpow2(p, n);
}

/* LayerNorm of M rows of D as torch computes it, y = (x * r + (-r * mean)) * (offset + w) + b with r =
 * 1 / sqrt(var + eps), the variance biased; w and b may be NULL. The moments sum in another order. */
static void layer_norm_rows(const float *x, const float *w, const float *b, float *y, int64_t M, int64_t D,
                            float eps, float offset) {
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * D;
        float *ym = y + m * D;
        vec a = vzero();
        int64_t k = 0;
        for (; k + W <= D; k += W) a = vadd(a, load_f32(xm + k));
        float s = hsum(a);
        for (; k < D; k++) s += xm[k];
        float mean = s / (float)D;
        vec q = vzero();
        for (k = 0; k + W <= D; k += W) {
            vec d = vsub(load_f32(xm + k), vset(mean));
            q = vfma(d, d, q);
        }
        float var = hsum(q);
        for (; k < D; k++) var += (xm[k] - mean) * (xm[k] - mean);
        float r = 1.0f / _mm_cvtss_f32(_mm_sqrt_ss(_mm_set_ss(var / (float)D + eps))), shift = -r * mean;
        for (k = 0; k < D; k++) {
            float v = xm[k] * r + shift;
            if (w) v *= offset + w[k];
            ym[k] = b ? v + b[k] : v;
        }
    }
}

/* -1, 0 or 1 by a's sign (a * 1e30 clamped: 0 only for |a| < 1e-30, where the callers' results are 0 too) */
static inline vec vsign(vec a) { return vmin(vmax(vmul(a, vset(1e30f)), vset(-1.0f)), vset(1.0f)); }

/* erf(z), Abramowitz and Stegun 7.1.26: within 1.5e-7 of the exact value (absolutely), the exp Cephes'. */
static inline vec verf(vec z) {
    vec a = vabs(z);
    vec t = vdiv(vset(1.0f), vadd(vset(1.0f), vmul(vset(0.3275911f), a)));
    vec p = vset(1.061405429f);
    p = vfma(p, t, vset(-1.453152027f));
    p = vfma(p, t, vset(1.421413741f));
    p = vfma(p, t, vset(-0.284496736f));
    p = vfma(p, t, vset(0.254829592f));
    vec y = vsub(vset(1.0f), vmul(vmul(p, t), vexp(vsub(vzero(), vmul(a, a)))));
    return vmul(y, vsign(z));
}

/* tanh(y) as Cephes' tanhf computes it: an odd polynomial where |y| <= 0.625, else 1 - 2 / (e^2|y| + 1) with
 * y's sign. */
static inline vec vtanh(vec y) {
    vec z = vmul(y, y), p = vset(-5.70498872745e-3f);
    p = vfma(p, z, vset(2.06390887954e-2f));
    p = vfma(p, z, vset(-5.37397155531e-2f));
    p = vfma(p, z, vset(1.33314422036e-1f));
    p = vfma(p, z, vset(-3.33332819422e-1f));
    vec small = vadd(vmul(vmul(p, z), y), y);
    vec a = vabs(y), big = vsub(vset(1.0f), vdiv(vset(2.0f), vadd(vexp(vadd(a, a)), vset(1.0f))));
    return vsmall(y, 0.625f, small, vmul(big, vsign(y)));
}

/* The activations, by the code program.py writes (ACTIVATIONS there), each as torch writes it: GELU
 * 0.5 x (1 + erf(x / sqrt 2)), its tanh form 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), quick GELU
 * x sigmoid(1.702 x), ReLU, squared ReLU, SiLU x / (1 + e^-x) (within 2.75 ulp of the exact silu over
 * [-80, 80], torch's own within 2.27; the GELUs within 1e-6 of torch's), and Gemma 2's soft-capping. */
enum { ACT_GELU, ACT_GELU_TANH, ACT_QUICK_GELU, ACT_RELU, ACT_RELU2, ACT_SILU, ACT_SOFTCAP };

static inline vec activate(vec x, int64_t kind, float cap) {
    vec one = vset(1.0f), half = vset(0.5f);
    switch (kind) {
    case ACT_GELU:
        return vmul(vmul(half, x), vadd(one, verf(vmul(x, vset(0.70710678118654752f)))));
    case ACT_GELU_TANH: {
        vec y = vmul(vset(0.79788456080286536f), vadd(x, vmul(vset(0.044715f), vmul(vmul(x, x), x))));
        return vmul(vmul(half, x), vadd(one, vtanh(y)));
    }
    case ACT_QUICK_GELU:
        return vmul(x, vdiv(one, vadd(one, vexp(vmul(vset(-1.702f), x)))));
    case ACT_RELU:
        return vmax(x, vzero());
    case ACT_RELU2:
        return vmul(vmax(x, vzero()), vmax(x, vzero()));
    case ACT_SOFTCAP: /* Gemma 2's cap * tanh(x / cap), as torch's tanh(x / cap) * cap */
        return vmul(vtanh(vdiv(x, vset(cap))), vset(cap));
    default: /* ACT_SILU */
        return vdiv(x, vadd(one, vexp(vsub(vzero(), x))));
    }
}

/* out[i] = act(x[i]) * (v ? v[i] : 1) over n floats, the last n % W through a buffer of W (cap: the
 * soft-capping's); out may be x. */
static void activate_times(const float *x, const float *v, float *out, int64_t n, int64_t kind, float cap) {
    int64_t k = 0;
    for (; k + W <= n; k += W) {
        vec a = activate(load_f32(x + k), kind, cap);
        store_f32(out + k, v ? vmul(a, load_f32(v + k)) : a);
    }
    if (k < n) {
        float g[W] = {0}, u[W] = {0}, y[W];
        memcpy(g, x + k, (size_t)(n - k) * sizeof(float));
        if (v) memcpy(u, v + k, (size_t)(n - k) * sizeof(float));
        vec a = activate(load_f32(g), kind, cap);
        store_f32(y, v ? vmul(a, load_f32(u)) : a);
        memcpy(out + k, y, (size_t)(n - k) * sizeof(float));
    }
}

/* A gated MLP's hidden rows: M rows of a packed (gate, value) projection h (M, 2F) -> out (M, F) =
 * act(gate) * value. */
static void glu_rows(const float *h, float *out, int64_t M, int64_t F, int64_t kind) {
    for (int64_t m = 0; m < M; m++)
        activate_times(h + m * 2 * F, h + m * 2 * F + F, out + m * F, F, kind, 0.0f);
}

/* SwiGLU: silu(gate) * value, within 1e-6 of torch's, relatively. */
void specvit_swiglu_f32(const float *h, float *out, int64_t M, int64_t F) {
    glu_rows(h, out, M, F, ACT_SILU);
}

/* The first 2 * half channels of one head x rotated into y (the rest of y left as it is): channel i < half
 * pairs with i + half, ``x * cos + rotate_half(x) * sin``; x and y do not overlap. */
static inline void rotate_half(const float *x, const float *c, const float *s, float *y, int64_t half) {
    for (int64_t i = 0; i < half; i++) {
        y[i] = x[i] * c[i] + (-x[i + half]) * s[i];
        y[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
    }
}

/* Rotate-half RoPE of a packed projection: out = t, with the first r channels of each of its first `heads`
 * heads (hd wide) rotated: channel i < r/2 pairs with i + r/2, ``x * cos + rotate_half(x) * sin``. t and out
 * are R rows of `width`; row i is position i % L of the (L, r) tables. */
void specvit_rope_half_f32(const float *t, const float *cos, const float *sin, float *out, int64_t R,
                           int64_t L, int64_t width, int64_t heads, int64_t hd, int64_t r) {
    int64_t half = r / 2;
    for (int64_t row = 0; row < R; row++) {
        const float *c = cos + (row % L) * r, *s = sin + (row % L) * r, *src = t + row * width;
        float *dst = out + row * width;
        memcpy(dst, src, (size_t)width * sizeof(float)); /* the channels not rotated, the values */
        for (int64_t h = 0; h < heads; h++) rotate_half(src + h * hd, c, s, dst + h * hd, half);
    }
}

/* A decode step run as one program: the ops below over buffers the caller holds, in order (specvit/nn/
 * program.py lowers a model's graph into them). One call per step instead of a Python call, a module call
 * and a few torch ops per graph node: between two products, the interpreter's work runs with the caches
 * the streamed weights just evicted (a bfloat16 step spends 4.4 ms beside its products with them stubbed
 * out, 5.9-7.7 with them). Each op's fields: */
enum {
    OP_EMBED,    /* p: table (V, D), ids (M,) int64, out (M, D); n: M, D; f: the factor (1: none) */
    OP_NORM,     /* p: x, weight or NULL, bias or NULL, y (y may be x); n: M, D, kind (0 RMSNorm,
                  * 1 LayerNorm), the floats from a row to the next, the groups of D normalised apart in a row
                  * (QK-norm's heads); f: eps, offset */
    OP_GEMV,     /* p: x, w, scale or NULL, bias or NULL, y; n: M, N, K, the weight's type (0 f32, 1 bf16,
                  * 2 i8) */
    OP_ADD,      /* p: a, b, out; n: the count */
    OP_GLU,      /* p: h, out; n: M, F, the activation (glu_rows) */
    OP_ATTEND,   /* the new token's attention, below */
    OP_ACT,      /* p: x, out; n: the count, the activation; f: the cap (ACT_SOFTCAP) */
    OP_POSITION, /* p: x, table (rows, D), out; n: M, D, the row of position 0: out = x + table[row + pos] */
};

typedef struct {
    int64_t code;
    int64_t n[8];
    float f[2];
    void *p[8];
} Op;

/* w . x over n floats */
static inline float dot(const float *w, const float *x, int64_t n) {
    vec a = vzero();
    int64_t k = 0;
    for (; k + W <= n; k += W) a = vfma(load_f32(w + k), load_f32(x + k), a);
    float s = hsum(a);
    for (; k < n; k++) s += w[k] * x[k];
    return s;
}

/* One query q (hd) over the keys and values of positions lo..hi, held in rings K and V (S, hd) of S slots
 * (position p in slot p % S): out = softmax(softcap(q.K^T * scale + slope * p)) V, with ALiBi's bias
 * slope * p (slope 0: none) and Gemma 2's soft-capping cap * tanh(s / cap) (cap 0: none). The weights' exps
 * go in `scores` (hi - lo + 1). */
static void attend_one(const float *q, const float *K, const float *V, int64_t lo, int64_t hi, int64_t S,
                       int64_t hd, float scale, float slope, float cap, float *scores, float *out) {
    int64_t T = hi - lo + 1, j, slot;
    float top = -INFINITY, total = 0.0f;
    for (j = 0, slot = lo % S; j < T; j++, slot = slot + 1 == S ? 0 : slot + 1)
        scores[j] = dot(q, K + slot * hd, hd) * scale + slope * (float)(lo + j);
    if (cap > 0.0f) activate_times(scores, NULL, scores, T, ACT_SOFTCAP, cap);
    for (j = 0; j < T; j++) top = scores[j] > top ? scores[j] : top;
    vec sums = vzero();
    for (j = 0; j + W <= T; j += W) {
        vec e = vexp(vsub(load_f32(scores + j), vset(top)));
        store_f32(scores + j, e);
        sums = vadd(sums, e);
    }
    if (j < T) { /* the last T % W through a buffer of W (the padding's exps unused) */
        float b[W] = {0};
        for (int64_t i = 0; j + i < T; i++) b[i] = scores[j + i] - top;
        vec e = vexp(load_f32(b));
        store_f32(b, e);
        for (int64_t i = 0; j + i < T; i++) scores[j + i] = b[i], total += b[i];
    }
    total += hsum(sums);
    memset(out, 0, (size_t)hd * sizeof(float));
    for (j = 0, slot = lo % S; j < T; j++, slot = slot + 1 == S ? 0 : slot + 1) {
        vec p = vset(scores[j]);
        const float *v = V + slot * hd;
        int64_t k = 0;
        for (; k + W <= hd; k += W) store_f32(out + k, vfma(p, load_f32(v + k), load_f32(out + k)));
        for (; k < hd; k++) out[k] += scores[j] * v[k];
    }
    for (int64_t k = 0; k < hd; k++) out[k] /= total;
}

/* The attention of one new token per row at position pos over the keys and values of positions pos - window
 * + 1..pos (0..pos without a window): p: qkv (M, (H + 2 Hkv) hd) projections (q heads, k heads, v heads), cos
 * and sin (capacity, r) tables or NULL (no RoPE), the keys and values (M, Hkv, S, hd) cached in rings of S
 * slots (position pos written in slot pos % S), out (M, H hd), scratch (M, H, S + hd), ALiBi's slopes (H) or
 * NULL; n: M, H, Hkv, hd, r, capacity, window (0: none), S; f: the scores' scale, their cap (0: none). Query
 * head h reads key head h / (H / Hkv). */
static void attend_step(const Op *op, int64_t pos) {
    const float *qkv = op->p[0], *cos = op->p[1], *sin = op->p[2], *slopes = op->p[7];
    float *keys = op->p[3], *values = op->p[4], *out = op->p[5], *scratch = op->p[6];
    int64_t M = op->n[0], H = op->n[1], Hkv = op->n[2], hd = op->n[3], r = op->n[4], S = op->n[7];
    int64_t width = (H + 2 * Hkv) * hd, lo = op->n[6] && pos + 1 > op->n[6] ? pos + 1 - op->n[6] : 0;
    const float *c = cos ? cos + pos * r : NULL, *s = sin ? sin + pos * r : NULL;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < Hkv; g++) { /* the new key (rotated) and value into the cache */
            const float *k = qkv + m * width + (H + g) * hd, *v = k + Hkv * hd;
            int64_t at = ((m * Hkv + g) * S + pos % S) * hd; /* slot pos % S of row m's key head g */
            float *kc = keys + at, *vc = values + at;
            memcpy(kc, k, (size_t)hd * sizeof(float));
            if (c) rotate_half(k, c, s, kc, r / 2);
            memcpy(vc, v, (size_t)hd * sizeof(float));
        }
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t m = 0; m < M; m++)
        for (int64_t h = 0; h < H; h++) {
            int64_t g = h / (H / Hkv);
            float *scores = scratch + (m * H + h) * (S + hd), *q = scores + S;
            memcpy(q, qkv + m * width + h * hd, (size_t)hd * sizeof(float));
            if (c) rotate_half(qkv + m * width + h * hd, c, s, q, r / 2);
            const float *kc = keys + (m * Hkv + g) * S * hd, *vc = values + (m * Hkv + g) * S * hd;
            float slope = slopes ? slopes[h] : 0.0f;
            float *o = out + (m * H + h) * hd;
            attend_one(q, kc, vc, lo, pos, S, hd, op->f[0], slope, op->f[1], scores, o);
        }
}

void specvit_program(const Op *ops, int64_t count, int64_t pos) {
    for (const Op *op = ops; op < ops + count; op++) {
        const int64_t *n = op->n;
        switch (op->code) {
        case OP_EMBED:
            for (int64_t m = 0; m < n[0]; m++) {
                const float *row = (const float *)op->p[0] + ((const int64_t *)op->p[1])[m] * n[1];
                float *o = (float *)op->p[2] + m * n[1];
                for (int64_t k = 0; k < n[1]; k++) o[k] = row[k] * op->f[0];
            }
            break;
        case OP_NORM:
            for (int64_t m = 0; m < n[0]; m++)
                for (int64_t g = 0; g < n[4]; g++) {
                    const float *x = (const float *)op->p[0] + m * n[3] + g * n[1];
                    float *y = (float *)op->p[3] + m * n[3] + g * n[1];
                    if (n[2] == 0)
                        specvit_rms_norm_f32(x, op->p[1], y, 1, n[1], op->f[0], op->f[1]);
                    else
                        layer_norm_rows(x, op->p[1], op->p[2], y, 1, n[1], op->f[0], op->f[1]);
                }
            break;
        case OP_GEMV:
            if (n[3] == 0)
                specvit_gemv_f32(op->p[0], op->p[1], op->p[2], op->p[3], op->p[4], n[0], n[1], n[2]);
            else if (n[3] == 1)
                specvit_gemv_bf16(op->p[0], op->p[1], op->p[2], op->p[3], op->p[4], n[0], n[1], n[2]);
            else
                specvit_gemv_i8(op->p[0], op->p[1], op->p[2], op->p[3], op->p[4], n[0], n[1], n[2]);
            break;
        case OP_ADD: {
            const float *a = op->p[0], *b = op->p[1];
            float *o = op->p[2];
            for (int64_t k = 0; k < n[0]; k++) o[k] = a[k] + b[k];
            break;
        }
        case OP_GLU:
            glu_rows(op->p[0], op->p[1], n[0], n[1], n[2]);
            break;
        case OP_ACT:
            activate_times(op->p[0], NULL, op->p[1], n[0], n[1], op->f[0]);
            break;
        case OP_POSITION: {
            const float *row = (const float *)op->p[1] + (n[2] + pos) * n[1];
            for (int64_t m = 0; m < n[0]; m++) {
                const float *x = (const float *)op->p[0] + m * n[1];
                float *o = (float *)op->p[2] + m * n[1];
                for (int64_t k = 0; k < n[1]; k++) o[k] = x[k] + row[k];
            }
            break;
        }
        case OP_ATTEND:
            attend_step(op, pos);
            break;
        default:
            break;
        }
    }
}
