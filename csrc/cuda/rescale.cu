// A rank's optimizer step made the global batch's (CUDA): gradshare/second_moment.py's rule for Adam, AdamW,
// NAdam and RAdam, one thread per element. Same element logic (element.h) and roundings as
// csrc/cpu/rescale.cpp: nvcc runs with --fmad=false and the square roots round to nearest (__fsqrt_rn).
#include "cuda/common.cuh"
#include "gradshare/kernels.h"

namespace gs {
namespace {

using cuda::kThreads;

// Form 0: Adam (from the moments); 1: the change, no decoupled decay; 2: the change less its decoupled decay.
template <int Form>
__global__ void __launch_bounds__(kThreads) rescale_kernel(const float* __restrict__ exp_avg,
                                                           const float* __restrict__ exp_avg_sq, const float* change,
                                                           const float* after, float* target, int64_t n,
                                                           const RescaleArgs a) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= n) return;
  float e;
  if (Form == 0) e = adam_excess(exp_avg[i], exp_avg_sq[i], a);
  else e = change_excess(exp_avg[i], exp_avg_sq[i], change[i], Form == 2 ? after[i] : 0.0f, a);
  target[i] = apply_excess(target[i], e, a.sign);
}

}  // namespace

void rescale_cuda(const float* exp_avg, const float* exp_avg_sq, const float* change, const float* after,
                  float* target, int64_t n, const RescaleArgs& a, void* stream) {
  check_rescale_args(exp_avg, exp_avg_sq, change, after, target, n, a);
  if (n == 0) return;
  cuda::DeviceGuard guard(target, "target");
  cuda::device_of(exp_avg, "exp_avg");
  cuda::device_of(exp_avg_sq, "exp_avg_sq");
  const cudaStream_t s = cuda::as_stream(stream);
  const unsigned int blocks = cuda::blocks_for(n, kThreads);
  if (change == nullptr) rescale_kernel<0><<<blocks, kThreads, 0, s>>>(exp_avg, exp_avg_sq, change, after, target, n, a);
  else if (a.decay != 0.0f) rescale_kernel<2><<<blocks, kThreads, 0, s>>>(exp_avg, exp_avg_sq, change, after, target, n, a);
  else rescale_kernel<1><<<blocks, kThreads, 0, s>>>(exp_avg, exp_avg_sq, change, after, target, n, a);
  cuda::check_launch("rescale_kernel");
}

}  // namespace gs
