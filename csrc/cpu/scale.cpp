// An all-reduced sum scaled to the mean straight into the gradients (CPU), with the non-finite check in the
// same pass: scaling the sum in place and then copying it out read and wrote it twice.
#include <stdexcept>
#include "cpu/clones.h"
#include "cpu/parallel.h"
#include "gradshare/kernels.h"

namespace gs {
namespace {

GS_AVX2_CLONES int scale_range(float* dst, const float* src, int64_t n, float scale) {
  int bad = 0;
#ifdef GS_HAVE_OPENMP
#pragma omp parallel for schedule(static) reduction(| : bad) if (n >= kParallelMin)
#endif
  for (int64_t i = 0; i < n; ++i) bad |= scale_element(src[i], scale, &dst[i]) ? 0 : 1;
  return bad;
}

}  // namespace

bool scale_into_cpu(float* const* dsts, const float* const* srcs, const int64_t* ns, int64_t k, float scale) {
  if (k < 0) throw std::invalid_argument("scale_into: a negative number of tensors");
  for (int64_t j = 0; j < k; ++j) {
    if (ns[j] < 0) throw std::invalid_argument("scale_into: a negative size");
  }
  int bad = 0;
  for (int64_t j = 0; j < k; ++j) bad |= scale_range(dsts[j], srcs[j], ns[j], scale);
  return bad != 0;
}

}  // namespace gs
