/* Flags of the shared-memory transport (src/_shm.pyx): 64-bit sequence numbers in a shared window, one
 * writer each, each followed in its cache line by a 32-bit count of the ranks sleeping on it.
 *
 * A store-release publishes every write the rank made before it (its copy-in, its reduced chunk); a
 * load-acquire that sees the number orders the reader's later reads after those writes, and the reader's own
 * earlier reads of that buffer before the release it makes next (so the writer may reuse it). On x86-64 both
 * are plain moves plus a compiler barrier; on AArch64, stlr / ldar.
 *
 * Sleeping (Linux): a waiter that has polled long enough counts itself in, looks at the flag once more and
 * sleeps in futex(FUTEX_WAIT) on its low 32 bits while they still hold the value it saw; a writer, after its
 * store, wakes the flag's sleepers if it sees any. Both sides put a full fence between their write and
 * their read (the waiter's atomic increment is one), so either the waiter sees the new number or the writer
 * sees the waiter: no wake-up is lost, and the sleep is bounded anyway. Without futex (not Linux) a sleep is
 * a sched_yield. Sleeping rather than yielding matters when the node has more runnable processes than
 * cores: a yielding rank stays runnable and takes its share of a core from the peer it waits for.
 */
#ifndef TORUS_SHM_FLAGS_H
#define TORUS_SHM_FLAGS_H
#include <stdint.h>
#include <sched.h>
#if defined(__linux__)
#include <limits.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#endif

/* The 32-bit word futex compares: the low half of the number on either byte order. */
static inline uint32_t *torus_flag_word(const uint64_t *flag) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    return (uint32_t *)flag + 1;
#else
    return (uint32_t *)flag;
#endif
}

static inline uint32_t *torus_flag_sleepers(const uint64_t *flag) { return (uint32_t *)(flag + 1); }

static inline uint64_t torus_flag_load(const uint64_t *flag) { return __atomic_load_n(flag, __ATOMIC_ACQUIRE); }

static inline void torus_flag_store(uint64_t *flag, uint64_t value) {
    __atomic_store_n(flag, value, __ATOMIC_RELEASE);
#if defined(__linux__)
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (__atomic_load_n(torus_flag_sleepers(flag), __ATOMIC_RELAXED))
        syscall(SYS_futex, torus_flag_word(flag), FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
#endif
}

/* Sleep until the flag no longer holds `seen`, a writer wakes us, or `seconds` pass (whichever first; a
 * spurious return is possible: the caller looks again). */
static inline void torus_flag_sleep(const uint64_t *flag, uint64_t seen, double seconds) {
#if defined(__linux__)
    struct timespec ts;
    ts.tv_sec = (time_t)seconds;
    ts.tv_nsec = (long)((seconds - (double)ts.tv_sec) * 1e9);
    __atomic_fetch_add(torus_flag_sleepers(flag), 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(flag, __ATOMIC_SEQ_CST) == seen)
        syscall(SYS_futex, torus_flag_word(flag), FUTEX_WAIT, (uint32_t)seen, &ts, NULL, 0);
    __atomic_fetch_sub(torus_flag_sleepers(flag), 1, __ATOMIC_SEQ_CST);
#else
    (void)flag; (void)seen; (void)seconds;
    sched_yield();
#endif
}

/* A spin-wait hint (x86 pause, AArch64 yield): lets the sibling hyperthread run and saves power while a
 * rank polls a flag for a few microseconds before it sleeps. */
static inline void torus_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}
#endif
