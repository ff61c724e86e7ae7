/* Copies of the shared-memory transport (src/_shm.pyx) into the caller's output.
 *
 * torus_copy_stream: a copy with non-temporal stores (SSE2 movntdq, baseline on x86-64) for outputs larger
 * than the caches: an ordinary store first reads the destination line into the cache (read for ownership),
 * so a copy out of n bytes moves 3n bytes through memory instead of 2n. The stores are weakly ordered:
 * torus_stream_fence (sfence) must come before a flag store-release that publishes them, and before the
 * call returns. Elsewhere (AArch64 and others) both are memcpy and nothing.
 */
#ifndef TORUS_SHM_COPY_H
#define TORUS_SHM_COPY_H
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

static inline void torus_copy_stream(char *dst, const char *src, size_t n) {
#if defined(__SSE2__)
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15, body, i;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    body = n & ~(size_t)63;
    for (i = 0; i < body; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + body, src + body, n - body);
#else
    memcpy(dst, src, n);
#endif
}

static inline void torus_stream_fence(void) {
#if defined(__SSE2__)
    _mm_sfence();
#endif
}
#endif
