/* Products of a few rows with a weight matrix, y = x @ w.T * scale + bias, at the memory's read rate.
 *
 * A decode step multiplies one row per sequence with every weight of the model: the time is the bytes of
 * the weights over the rate memory is read at. These loops stream each weight row once (float32, bfloat16
 * or int8 with a float scale per row), multiply it with every input row while it is in L1, and spread the
 * weight's rows over torch's OpenMP threads (the same runtime: torch's libgomp is loaded first).
 *
 * Built by specvit/nn/gemv.py with -O3 -mavx2 -mfma -fopenmp on x86-64 CPUs with AVX2 and FMA.
 * Dims: M input rows (at most MAX_ROWS), N weight rows (outputs), K inputs. x (M, K) float32, w (N, K),
 * scale (N,) float32 or NULL, bias (N,) float32 or NULL, y (M, N) float32; all contiguous.
 */
#include <immintrin.h>
#include <stdint.h>

#define MAX_ROWS 8

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* eight weights as float32 */
static inline __m256 load_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 load_bf16(const uint16_t *p) {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); /* bfloat16 is float32's upper half */
}
static inline __m256 load_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* one weight as float32, for the last K % 8 */
static inline float one_f32(const float *p) { return *p; }
static inline float one_bf16(const uint16_t *p) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)*p << 16;
    return c.f;
}
static inline float one_i8(const int8_t *p) { return (float)*p; }

#define GEMV(NAME, T, LOAD, ONE)                                                                       \
    void NAME(const float *x, const T *w, const float *scale, const float *bias, float *y, int64_t M, \
              int64_t N, int64_t K) {                                                                 \
        _Pragma("omp parallel for schedule(static)") for (int64_t n = 0; n < N; n++) {                \
            const T *row = w + n * K;                                                                 \
            float acc[MAX_ROWS];                                                                      \
            int64_t k = 0;                                                                            \
            if (M == 1) { /* four sums in flight */                                                   \
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                           \
                for (; k + 32 <= K; k += 32) {                                                        \
                    a0 = _mm256_fmadd_ps(LOAD(row + k), _mm256_loadu_ps(x + k), a0);                  \
                    a1 = _mm256_fmadd_ps(LOAD(row + k + 8), _mm256_loadu_ps(x + k + 8), a1);          \
                    a2 = _mm256_fmadd_ps(LOAD(row + k + 16), _mm256_loadu_ps(x + k + 16), a2);        \
                    a3 = _mm256_fmadd_ps(LOAD(row + k + 24), _mm256_loadu_ps(x + k + 24), a3);        \
                }                                                                                     \
                for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(LOAD(row + k), _mm256_loadu_ps(x + k), a0); \
                acc[0] = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));           \
            } else { /* one sum per input row: each eight weights loaded once for all rows */         \
                __m256 a[MAX_ROWS];                                                                   \
                for (int64_t m = 0; m < M; m++) a[m] = _mm256_setzero_ps();                           \
                for (; k + 8 <= K; k += 8) {                                                          \
                    __m256 v = LOAD(row + k);                                                         \
                    for (int64_t m = 0; m < M; m++)                                                   \
                        a[m] = _mm256_fmadd_ps(v, _mm256_loadu_ps(x + m * K + k), a[m]);              \
                }                                                                                     \
                for (int64_t m = 0; m < M; m++) acc[m] = hsum(a[m]);                                  \
            }                                                                                         \
            for (int64_t m = 0; m < M; m++) {                                                         \
                float s = acc[m];                                                                     \
                for (int64_t j = k; j < K; j++) s += ONE(row + j) * x[m * K + j];                     \
                if (scale) s *= scale[n];                                                             \
                if (bias) s += bias[n];                                                               \
                y[m * N + n] = s;                                                                     \
            }                                                                                         \
        }                                                                                             \
    }

GEMV(specvit_gemv_f32, float, load_f32, one_f32)
GEMV(specvit_gemv_bf16, uint16_t, load_bf16, one_bf16)
GEMV(specvit_gemv_i8, int8_t, load_i8, one_i8)
