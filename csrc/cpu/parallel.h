// OpenMP plumbing for the CPU kernels. Builds without OpenMP run every loop on one thread.
#pragma once
#include <cstdint>

#ifdef GS_HAVE_OPENMP
#include <omp.h>
#endif

namespace gs {
// Elements per chunk: the unit of work (and of counting) in the CPU kernels. A multiple of 16 so a
// chunk owns whole bitmap words. Output never depends on it: indices come out ascending regardless.
constexpr int64_t kChunk = int64_t(1) << 15;
// Below this many elements one thread is faster than waking a team.
constexpr int64_t kParallelMin = int64_t(1) << 16;

inline int64_t num_chunks(int64_t n) { return (n + kChunk - 1) / kChunk; }
}  // namespace gs

#ifdef GS_HAVE_OPENMP
#define GS_PRAGMA(x) _Pragma(#x)
#define GS_PARALLEL_FOR(cond) GS_PRAGMA(omp parallel for schedule(static) if (cond))
#else
#define GS_PARALLEL_FOR(cond)
#endif
