// Fused parameter averaging (CUDA): dst = sum_j w_j * src_j, or the mean, in one pass over memory.
// Same order of operations and roundings as csrc/cpu/average.cpp (nvcc runs with --fmad=false, so
// w * s + acc is a multiply and an add, never a fused multiply-add):
//   acc = s_0 (or w_0 * s_0);  acc = acc + s_j (or acc + w_j * s_j);  dst = acc / k (or acc).
// The buffer addresses and weights travel by value in the launch parameters (at most kMaxBuffers).
#include <string>

#include "cuda/common.cuh"
#include "gradshare/kernels.h"

namespace gs {
namespace {

using cuda::kThreads;
constexpr int kMaxBuffers = 128;  // 128 pointers + 128 weights: 1.5 KiB of kernel parameters

struct Sources {
  const float* src[kMaxBuffers];
  float weight[kMaxBuffers];
  int k;
  float kf;  // (float)k, the divisor of the mean
};

// One thread per element. Each thread reads all k sources at i before writing dst[i], so dst may be
// one of the sources.
template <bool Weighted>
__global__ void __launch_bounds__(kThreads) average_kernel(float* dst, int64_t n, const Sources a) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= n) return;
  float acc = Weighted ? a.weight[0] * a.src[0][i] : a.src[0][i];
  for (int j = 1; j < a.k; ++j) {
    if (Weighted) acc = acc + a.weight[j] * a.src[j][i];
    else acc = acc + a.src[j][i];
  }
  dst[i] = Weighted ? acc : acc / a.kf;
}

}  // namespace

void average_cuda(float* dst, const float* const* srcs, int64_t k, const float* weights, int64_t n, void* stream) {
  if (k < 1) throw std::invalid_argument("buffers: need at least one buffer to average");
  if (n < 0) throw std::invalid_argument("n must be >= 0");
  if (k > kMaxBuffers)
    throw std::invalid_argument("buffers: " + std::to_string(k) + " buffers; the CUDA kernel averages at most " +
                                std::to_string(kMaxBuffers) + " at once (average in groups)");
  if (n == 0) return;
  cuda::DeviceGuard guard(dst, "out");
  Sources a{};
  for (int64_t j = 0; j < k; ++j) {
    cuda::device_of(srcs[j], "buffers");
    a.src[j] = srcs[j];
    a.weight[j] = weights ? weights[j] : 1.0f;
  }
  a.k = static_cast<int>(k);
  a.kf = static_cast<float>(k);
  const cudaStream_t s = cuda::as_stream(stream);
  if (weights) average_kernel<true><<<cuda::blocks_for(n, kThreads), kThreads, 0, s>>>(dst, n, a);
  else average_kernel<false><<<cuda::blocks_for(n, kThreads), kThreads, 0, s>>>(dst, n, a);
  cuda::check_launch("average_kernel");
}

}  // namespace gs
