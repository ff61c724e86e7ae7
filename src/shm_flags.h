/* Flags of the shared-memory transport (src/_shm.pyx): 64-bit sequence numbers in a shared window, one
 * writer each. A store-release publishes every write the rank made before it (its copy-in, its reduced
 * chunk); a load-acquire that sees the number orders the reader's later reads after those writes, and the
 * reader's own earlier reads of that buffer before the release it makes next (so the writer may reuse it).
 * On x86-64 both are plain moves plus a compiler barrier; on AArch64, stlr / ldar.
 */
#ifndef TORUS_SHM_FLAGS_H
#define TORUS_SHM_FLAGS_H
#include <stdint.h>

static inline uint64_t torus_flag_load(const uint64_t *flag) { return __atomic_load_n(flag, __ATOMIC_ACQUIRE); }

static inline void torus_flag_store(uint64_t *flag, uint64_t value) {
    __atomic_store_n(flag, value, __ATOMIC_RELEASE);
}

/* A spin-wait hint (x86 pause, AArch64 yield): lets the sibling hyperthread run and saves power while a
 * rank polls a flag for a few microseconds before giving its core away. */
static inline void torus_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}
#endif
