// Loops that gain from 256-bit vectors (the rescaling's square roots and divisions, ternary's per-element passes,
// the averaging) are compiled twice, for AVX2 and for the x86-64 baseline, and the loader picks the one the CPU
// runs (GCC's target_clones: an ifunc per function, on glibc). Both compute the same bits: the element logic has
// no FMA (-ffp-contract=off, and AVX2 alone enables none), square root and division round correctly in both, and
// the sums run in element.h's lane order whatever the vector width. Elsewhere (another compiler, target or C
// library, a build with -DGS_NO_SIMD) the baseline alone. Mark a function that a chunk's work calls once, not a
// per-element one: a call through the ifunc is not inlined.
#pragma once
#include <cstddef>  // defines __GLIBC__ where the C library is glibc (the loader's ifuncs are glibc's)

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__GLIBC__) && !defined(GS_NO_SIMD)
#define GS_AVX2_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define GS_AVX2_CLONES
#endif
