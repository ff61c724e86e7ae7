/* Inner loops of the host reduction kernels (src/_reduce.pyx calls them; no validation here).
 *
 * Each loop is a plain C loop over restrict pointers, compiled three times through GCC/Clang function multi-
 * versioning: x86-64-v4 (AVX-512, what numpy itself dispatches to), x86-64-v3 (AVX2/FMA) and the baseline;
 * the loader picks one per CPU at start-up, so one build runs everywhere and uses the wide vectors where they
 * exist. float16 has, in addition, an F16C path
 * (hardware half<->float conversion, 8 lanes at a time) chosen at run time; both round to nearest even, so
 * results are bit-identical to the portable path except for NaN payloads, which no caller relies on.
 */
#ifndef TORUS_LOOPS_H
#define TORUS_LOOPS_H
#include <stddef.h>
#include <stdint.h>
#include "half.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(TORUS_NO_CLONES)
#define TORUS_X86 1
#define TORUS_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#include <immintrin.h>
#else
#define TORUS_CLONES
#endif

enum { TORUS_SUM = 0, TORUS_PROD = 1, TORUS_MIN = 2, TORUS_MAX = 3 };

#define TORUS_MIN_OF(a, b) ((b) < (a) ? (b) : (a))
#define TORUS_MAX_OF(a, b) ((b) > (a) ? (b) : (a))

/* acc = op(acc, src) [then * s for SUM when s != 1] for one native type T. */
#define TORUS_NATIVE(T, NAME)                                                                               \
    TORUS_CLONES static void NAME(T *restrict acc, const T *restrict src, ptrdiff_t n, int op, T s,         \
                                  int scaled) {                                                             \
        ptrdiff_t i;                                                                                        \
        if (op == TORUS_SUM && scaled) { for (i = 0; i < n; i++) acc[i] = (acc[i] + src[i]) * s; }          \
        else if (op == TORUS_SUM) { for (i = 0; i < n; i++) acc[i] = acc[i] + src[i]; }                    \
        else if (op == TORUS_PROD) { for (i = 0; i < n; i++) acc[i] = acc[i] * src[i]; }                    \
        else if (op == TORUS_MIN) { for (i = 0; i < n; i++) acc[i] = TORUS_MIN_OF(acc[i], src[i]); }        \
        else { for (i = 0; i < n; i++) acc[i] = TORUS_MAX_OF(acc[i], src[i]); }                             \
    }

TORUS_NATIVE(float, torus_reduce_f32)
TORUS_NATIVE(double, torus_reduce_f64)
TORUS_NATIVE(int32_t, torus_reduce_i32)
TORUS_NATIVE(int64_t, torus_reduce_i64)

/* 16-bit formats in float32 arithmetic with one rounding: W widens, N narrows. */
#define TORUS_HALF(NAME, W, N)                                                                              \
    TORUS_CLONES static void NAME(uint16_t *restrict acc, const uint16_t *restrict src, ptrdiff_t n, int op, \
                                  float s) {                                                                \
        ptrdiff_t i;                                                                                        \
        if (op == TORUS_SUM) { for (i = 0; i < n; i++) acc[i] = N((W(acc[i]) + W(src[i])) * s); }           \
        else if (op == TORUS_PROD) { for (i = 0; i < n; i++) acc[i] = N(W(acc[i]) * W(src[i])); }           \
        else if (op == TORUS_MIN) {                                                                         \
            for (i = 0; i < n; i++) { float a = W(acc[i]), b = W(src[i]); acc[i] = N(TORUS_MIN_OF(a, b)); } \
        } else {                                                                                            \
            for (i = 0; i < n; i++) { float a = W(acc[i]), b = W(src[i]); acc[i] = N(TORUS_MAX_OF(a, b)); } \
        }                                                                                                   \
    }

TORUS_HALF(torus_reduce_f16_portable, f16_to_f32, f32_to_f16)
TORUS_HALF(torus_reduce_bf16, bf16_to_f32, f32_to_bf16)

#ifdef TORUS_X86
__attribute__((target("avx2,f16c,fma")))
static void torus_reduce_f16_f16c(uint16_t *restrict acc, const uint16_t *restrict src, ptrdiff_t n, int op,
                                  float s) {
    const __m256 vs = _mm256_set1_ps(s);
    ptrdiff_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(acc + i)));
        __m256 b = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i)));
        __m256 r;
        if (op == TORUS_SUM) r = _mm256_mul_ps(_mm256_add_ps(a, b), vs);
        else if (op == TORUS_PROD) r = _mm256_mul_ps(a, b);
        else if (op == TORUS_MIN) r = _mm256_min_ps(b, a);  /* (b < a) ? b : a, as the scalar loop */
        else r = _mm256_max_ps(b, a);
        _mm_storeu_si128((__m128i *)(acc + i), _mm256_cvtps_ph(r, _MM_FROUND_TO_NEAREST_INT));
    }
    torus_reduce_f16_portable(acc + i, src + i, n - i, op, s);
}

static inline void torus_reduce_f16(uint16_t *acc, const uint16_t *src, ptrdiff_t n, int op, float s) {
    static int f16c = -1;
    if (f16c < 0) f16c = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx2");
    if (f16c) torus_reduce_f16_f16c(acc, src, n, op, s);
    else torus_reduce_f16_portable(acc, src, n, op, s);
}
#else
#define torus_reduce_f16 torus_reduce_f16_portable
#endif
#endif
