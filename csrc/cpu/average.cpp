// Fused parameter averaging (CPU): dst = sum_j w_j * src_j, or the mean, in one pass over memory.
#include <algorithm>
#include <string>
#include "cpu/clones.h"
#include "cpu/parallel.h"
#include "gradshare/kernels.h"

namespace gs {

namespace {

constexpr int64_t kBlock = 2048;  // an L1-sized block: accumulate, then write dst once

// dst[lo, lo + len) for one block.
GS_AVX2_CLONES void average_block(float* dst, const float* const* srcs, int64_t k, const float* weights, int64_t lo,
                                  int64_t len) {
  float acc[kBlock];
  const float* s0 = srcs[0] + lo;
  if (weights) {
    const float w0 = weights[0];
    for (int64_t i = 0; i < len; ++i) acc[i] = w0 * s0[i];
  } else {
    for (int64_t i = 0; i < len; ++i) acc[i] = s0[i];
  }
  for (int64_t j = 1; j < k; ++j) {
    const float* s = srcs[j] + lo;
    if (weights) {
      const float w = weights[j];
      for (int64_t i = 0; i < len; ++i) acc[i] = acc[i] + w * s[i];
    } else {
      for (int64_t i = 0; i < len; ++i) acc[i] = acc[i] + s[i];
    }
  }
  float* d = dst + lo;
  if (weights) {
    for (int64_t i = 0; i < len; ++i) d[i] = acc[i];
  } else {
    const float kf = static_cast<float>(k);
    for (int64_t i = 0; i < len; ++i) d[i] = acc[i] / kf;
  }
}

}  // namespace

void average_cpu(float* dst, const float* const* srcs, int64_t k, const float* weights, int64_t n) {
  if (k < 1) throw std::invalid_argument("buffers: need at least one buffer to average");
  if (n < 0) throw std::invalid_argument("n must be >= 0");
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  GS_PARALLEL_FOR(n >= kParallelMin)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = b * kBlock;
    average_block(dst, srcs, k, weights, lo, std::min(kBlock, n - lo));
  }
}

}  // namespace gs
