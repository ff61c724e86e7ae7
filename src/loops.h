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

/* acc = op(acc, src) [then * s for SUM when s != 1] for one native type T (in place: NAME), and
 * out = op(a, b) into a third array that overlaps neither operand (NAME##3, so out-of-place collectives skip
 * the copy of sendbuf into recvbuf). Two functions rather than one with out == a: restrict forbids that
 * aliasing, and without restrict the compiler guards the vector loop with an overlap test that out == a fails. */
#define TORUS_NATIVE_LOOPS(OUT, A, B, T, s, scaled)                                                         \
    if (op == TORUS_SUM && scaled) { for (i = 0; i < n; i++) OUT[i] = (A[i] + B[i]) * s; }                  \
    else if (op == TORUS_SUM) { for (i = 0; i < n; i++) OUT[i] = A[i] + B[i]; }                             \
    else if (op == TORUS_PROD) { for (i = 0; i < n; i++) OUT[i] = A[i] * B[i]; }                            \
    else if (op == TORUS_MIN) { for (i = 0; i < n; i++) OUT[i] = TORUS_MIN_OF(A[i], B[i]); }                \
    else { for (i = 0; i < n; i++) OUT[i] = TORUS_MAX_OF(A[i], B[i]); }

#define TORUS_NATIVE(T, NAME)                                                                               \
    TORUS_CLONES static void NAME(T *restrict acc, const T *restrict src, ptrdiff_t n, int op, T s,         \
                                  int scaled) {                                                             \
        ptrdiff_t i;                                                                                        \
        TORUS_NATIVE_LOOPS(acc, acc, src, T, s, scaled)                                                     \
    }                                                                                                       \
    TORUS_CLONES static void NAME##3(T *restrict out, const T *restrict a, const T *restrict b, ptrdiff_t n, \
                                     int op, T s, int scaled) {                                             \
        ptrdiff_t i;                                                                                        \
        TORUS_NATIVE_LOOPS(out, a, b, T, s, scaled)                                                         \
    }

TORUS_NATIVE(float, torus_reduce_f32)
TORUS_NATIVE(double, torus_reduce_f64)
TORUS_NATIVE(int32_t, torus_reduce_i32)
TORUS_NATIVE(int64_t, torus_reduce_i64)

/* 16-bit formats in float32 arithmetic with one rounding: W widens, N narrows; NAME in place, NAME##3 into
 * a third array, as above. */
#define TORUS_HALF_LOOPS(OUT, A, B, W, N)                                                                   \
    if (op == TORUS_SUM) { for (i = 0; i < n; i++) OUT[i] = N((W(A[i]) + W(B[i])) * s); }                  \
    else if (op == TORUS_PROD) { for (i = 0; i < n; i++) OUT[i] = N(W(A[i]) * W(B[i])); }                   \
    else if (op == TORUS_MIN) {                                                                             \
        for (i = 0; i < n; i++) { float a_ = W(A[i]), b_ = W(B[i]); OUT[i] = N(TORUS_MIN_OF(a_, b_)); }     \
    } else {                                                                                                \
        for (i = 0; i < n; i++) { float a_ = W(A[i]), b_ = W(B[i]); OUT[i] = N(TORUS_MAX_OF(a_, b_)); }     \
    }

#define TORUS_HALF(NAME, W, N)                                                                              \
    TORUS_CLONES static void NAME(uint16_t *restrict acc, const uint16_t *restrict src, ptrdiff_t n, int op, \
                                  float s) {                                                                \
        ptrdiff_t i;                                                                                        \
        TORUS_HALF_LOOPS(acc, acc, src, W, N)                                                               \
    }                                                                                                       \
    TORUS_CLONES static void NAME##3(uint16_t *restrict out, const uint16_t *restrict a,                    \
                                     const uint16_t *restrict b, ptrdiff_t n, int op, float s) {            \
        ptrdiff_t i;                                                                                        \
        TORUS_HALF_LOOPS(out, a, b, W, N)                                                                   \
    }

TORUS_HALF(torus_reduce_f16_portable, f16_to_f32, f32_to_f16)
TORUS_HALF(torus_reduce_bf16, bf16_to_f32, f32_to_bf16)

#ifdef TORUS_X86
/* out may equal a (the in-place call): each 8-lane block is loaded before it is stored. */
__attribute__((target("avx2,f16c,fma")))
static void torus_reduce_f16_f16c(uint16_t *out, const uint16_t *a, const uint16_t *restrict b, ptrdiff_t n,
                                  int op, float s) {
    const __m256 vs = _mm256_set1_ps(s);
    ptrdiff_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + i)));
        __m256 y = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + i)));
        __m256 r;
        if (op == TORUS_SUM) r = _mm256_mul_ps(_mm256_add_ps(x, y), vs);
        else if (op == TORUS_PROD) r = _mm256_mul_ps(x, y);
        else if (op == TORUS_MIN) r = _mm256_min_ps(y, x);  /* (y < x) ? y : x, as the scalar loop */
        else r = _mm256_max_ps(y, x);
        _mm_storeu_si128((__m128i *)(out + i), _mm256_cvtps_ph(r, _MM_FROUND_TO_NEAREST_INT));
    }
    if (out == a) torus_reduce_f16_portable(out + i, b + i, n - i, op, s);
    else torus_reduce_f16_portable3(out + i, a + i, b + i, n - i, op, s);
}

static inline int torus_has_f16c(void) {
    static int f16c = -1;
    if (f16c < 0) f16c = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx2");
    return f16c;
}

static inline void torus_reduce_f16(uint16_t *acc, const uint16_t *src, ptrdiff_t n, int op, float s) {
    if (torus_has_f16c()) torus_reduce_f16_f16c(acc, acc, src, n, op, s);
    else torus_reduce_f16_portable(acc, src, n, op, s);
}

static inline void torus_reduce_f163(uint16_t *out, const uint16_t *a, const uint16_t *b, ptrdiff_t n, int op,
                                     float s) {
    if (torus_has_f16c()) torus_reduce_f16_f16c(out, a, b, n, op, s);
    else torus_reduce_f16_portable3(out, a, b, n, op, s);
}
#else
#define torus_reduce_f16 torus_reduce_f16_portable
#define torus_reduce_f163 torus_reduce_f16_portable3
#endif

/* Casts between float32 and the 16-bit formats, and the in-place 16-bit scale (src/_convert.pyx calls them):
 * multi-versioned as above; float16's narrowing and scaling also have an F16C path (hardware rounding to
 * nearest even, the same bits as the portable path but for NaN payloads, which narrowing does not specify).
 * Widening stays portable: F16C quiets signalling NaNs, and widening keeps every payload, as numpy does. */
TORUS_CLONES static void torus_widen_f16(float *restrict dst, const uint16_t *restrict src, ptrdiff_t n) {
    for (ptrdiff_t i = 0; i < n; i++) dst[i] = f16_to_f32(src[i]);
}
TORUS_CLONES static void torus_widen_bf16(float *restrict dst, const uint16_t *restrict src, ptrdiff_t n) {
    for (ptrdiff_t i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
}
TORUS_CLONES static void torus_narrow_f16_portable(uint16_t *restrict dst, const float *restrict src,
                                                   ptrdiff_t n) {
    for (ptrdiff_t i = 0; i < n; i++) dst[i] = f32_to_f16(src[i]);
}
TORUS_CLONES static void torus_narrow_bf16(uint16_t *restrict dst, const float *restrict src, ptrdiff_t n) {
    for (ptrdiff_t i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
}
TORUS_CLONES static void torus_scale_f16_portable(uint16_t *restrict buf, ptrdiff_t n, float s) {
    for (ptrdiff_t i = 0; i < n; i++) buf[i] = f32_to_f16(f16_to_f32(buf[i]) * s);
}
TORUS_CLONES static void torus_scale_bf16(uint16_t *restrict buf, ptrdiff_t n, float s) {
    for (ptrdiff_t i = 0; i < n; i++) buf[i] = f32_to_bf16(bf16_to_f32(buf[i]) * s);
}

#ifdef TORUS_X86
__attribute__((target("avx2,f16c")))
static void torus_narrow_f16_f16c(uint16_t *restrict dst, const float *restrict src, ptrdiff_t n) {
    ptrdiff_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    torus_narrow_f16_portable(dst + i, src + i, n - i);
}

__attribute__((target("avx2,f16c")))
static void torus_scale_f16_f16c(uint16_t *restrict buf, ptrdiff_t n, float s) {
    const __m256 vs = _mm256_set1_ps(s);
    ptrdiff_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(buf + i)));
        _mm_storeu_si128((__m128i *)(buf + i), _mm256_cvtps_ph(_mm256_mul_ps(x, vs), _MM_FROUND_TO_NEAREST_INT));
    }
    torus_scale_f16_portable(buf + i, n - i, s);
}

static inline void torus_narrow_f16(uint16_t *dst, const float *src, ptrdiff_t n) {
    if (torus_has_f16c()) torus_narrow_f16_f16c(dst, src, n);
    else torus_narrow_f16_portable(dst, src, n);
}

static inline void torus_scale_f16(uint16_t *buf, ptrdiff_t n, float s) {
    if (torus_has_f16c()) torus_scale_f16_f16c(buf, n, s);
    else torus_scale_f16_portable(buf, n, s);
}
#else
#define torus_narrow_f16 torus_narrow_f16_portable
#define torus_scale_f16 torus_scale_f16_portable
#endif
#endif
