/* IEEE binary16 and bfloat16 <-> binary32 conversions, round-to-nearest-even.
 *
 * Branch-light bit manipulation so the compiler can vectorize the loops that call them; results match
 * numpy's float16 casts and ml_dtypes' bfloat16 casts bit for bit (tests/test_kernels.py checks all 65,536
 * half values). The float->half algorithm is F. Giesen's "float_to_half_fast3_rtne" (public domain, 2016).
 */
#ifndef TORUS_HALF_H
#define TORUS_HALF_H
#include <stdint.h>
#include <string.h>

static inline uint32_t torus_f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float torus_u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline float f16_to_f32(uint16_t h) {
    const uint32_t shifted_exp = 0x7c00u << 13;
    uint32_t o = ((uint32_t)h & 0x7fffu) << 13;
    uint32_t exp = shifted_exp & o;
    o += (uint32_t)(127 - 15) << 23;
    if (exp == shifted_exp) {            /* Inf or NaN */
        o += (uint32_t)(128 - 16) << 23;
    } else if (exp == 0) {               /* zero or subnormal: renormalize through the FPU */
        o += 1u << 23;
        o = torus_f2u(torus_u2f(o) - torus_u2f(113u << 23));
    }
    o |= ((uint32_t)h & 0x8000u) << 16;
    return torus_u2f(o);
}

static inline uint16_t f32_to_f16(float f) {
    const uint32_t f32infty = 255u << 23;
    const uint32_t f16max = (127u + 16u) << 23;
    const uint32_t denorm_magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
    uint32_t x = torus_f2u(f);
    uint32_t sign = x & 0x80000000u;
    uint16_t o;
    x ^= sign;
    if (x >= f16max) {                   /* overflow to Inf, or NaN (quiet) */
        o = (x > f32infty) ? 0x7e00 : 0x7c00;
    } else if (x < (113u << 23)) {       /* result is subnormal or zero: let the FPU round */
        x = torus_f2u(torus_u2f(x) + torus_u2f(denorm_magic));
        o = (uint16_t)(x - denorm_magic);
    } else {
        uint32_t mant_odd = (x >> 13) & 1u;
        x += (uint32_t)(15 - 127) * (1u << 23) + 0xfffu;
        x += mant_odd;
        o = (uint16_t)(x >> 13);
    }
    return (uint16_t)(o | (sign >> 16));
}

static inline float bf16_to_f32(uint16_t h) { return torus_u2f((uint32_t)h << 16); }

static inline uint16_t f32_to_bf16(float f) {
    uint32_t x = torus_f2u(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);  /* quiet NaN */
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}
#endif
