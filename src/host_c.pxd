# C declarations shared by the GIL-free host loops (_step_loop.pyx, _shm.pyx): the yield and the monotonic
# clock of their stall timeouts, and the signature of _reduce's raw kernel (its capsule "torus._ext._reduce.raw").

cdef extern from "sched.h" nogil:
    int sched_yield()

cdef extern from "time.h" nogil:
    ctypedef long time_t
    struct timespec:
        time_t tv_sec
        long tv_nsec
    int CLOCK_MONOTONIC
    int clock_gettime(int, timespec*)
    int nanosleep(const timespec*, timespec*)

ctypedef void (*reduce_t)(int, char*, const char*, const char*, Py_ssize_t, Py_ssize_t, int, double,
                          int) noexcept nogil


cdef inline double monotonic_s() noexcept nogil:
    """CLOCK_MONOTONIC in seconds."""
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9
