// A rank's optimizer step made the global batch's (CUDA): gradshare/second_moment.py's rule, one thread per
// element: Adam, AdamW, NAdam and RAdam (rescale_cuda), RMSprop, Adagrad, Adadelta, Adamax and Adafactor
// (rescale_tracked_cuda). Same element logic (element.h) and roundings as
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
                                                           const float* after, float* signal, float* target,
                                                           int64_t n, const RescaleArgs a) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= n) return;
  float* sig = signal == nullptr ? nullptr : signal + i;
  float e;
  if (Form == 0) e = adam_excess(exp_avg[i], exp_avg_sq[i], sig, a);
  else e = change_excess(exp_avg[i], exp_avg_sq[i], sig, change[i], Form == 2 ? after[i] : 0.0f, a);
  target[i] = apply_excess(target[i], e, a.sign);
}

template <int Kind, bool Centered, bool Momentum, bool Decay>
__global__ void __launch_bounds__(kThreads) tracked_kernel(const TrackedTensors t, int64_t n, const TrackedArgs a) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= n) return;
  const bool own = Kind == kRmsprop || Kind == kAdagrad || Kind == kAdadelta;
  const bool has_extra = Kind == kAdagrad || Kind == kAdamax || Kind == kAdafactor || Momentum;
  const float target = t.target[i];
  float g, divided;
  tracked_inputs<Kind, Decay>(t.grad[i], t.change[i], Decay ? t.after[i] : 0.0f, a, g, divided);
  float mu = t.mean[i], x = has_extra ? t.extra[i] : 0.0f;
  const float e = tracked_excess<Kind, Centered, Momentum>(g, divided, own ? t.second[i] : 0.0f,
                                                           Centered ? t.grad_avg[i] : 0.0f, mu, x,
                                                           t.signal == nullptr ? nullptr : t.signal + i, a);
  t.mean[i] = mu;
  if (has_extra) t.extra[i] = x;
  t.target[i] = apply_excess(target, e, a.sign);
}

template <int Kind, bool Centered, bool Momentum>
void launch_tracked(const TrackedTensors& t, int64_t n, const TrackedArgs& a, bool decay, cudaStream_t s) {
  const unsigned int blocks = cuda::blocks_for(n, kThreads);
  if (decay) tracked_kernel<Kind, Centered, Momentum, true><<<blocks, kThreads, 0, s>>>(t, n, a);
  else tracked_kernel<Kind, Centered, Momentum, false><<<blocks, kThreads, 0, s>>>(t, n, a);
}

}  // namespace

void rescale_tracked_cuda(const TrackedTensors& t, int64_t n, const TrackedArgs& a, void* stream) {
  check_tracked_args(t, n, a);
  if (n == 0) return;
  cuda::DeviceGuard guard(t.target, "target");
  const void* inputs[] = {t.grad, t.change, t.after, t.second, t.grad_avg, t.mean, t.extra, t.signal};
  const char* names[] = {"grad", "change", "after", "second", "grad_avg", "mean", "extra", "signal"};
  for (int k = 0; k < 8; ++k)
    if (inputs[k] != nullptr) cuda::device_of(inputs[k], names[k]);
  const cudaStream_t s = cuda::as_stream(stream);
  const bool decay = tracked_decay(a), centered = t.grad_avg != nullptr, momentum = tracked_momentum(a);
  switch (a.kind) {
    case kRmsprop:
      if (centered) momentum ? launch_tracked<kRmsprop, true, true>(t, n, a, decay, s)
                             : launch_tracked<kRmsprop, true, false>(t, n, a, decay, s);
      else momentum ? launch_tracked<kRmsprop, false, true>(t, n, a, decay, s)
                    : launch_tracked<kRmsprop, false, false>(t, n, a, decay, s);
      break;
    case kAdagrad: launch_tracked<kAdagrad, false, false>(t, n, a, decay, s); break;
    case kAdadelta: launch_tracked<kAdadelta, false, false>(t, n, a, decay, s); break;
    case kAdamax: launch_tracked<kAdamax, false, false>(t, n, a, decay, s); break;
    default: launch_tracked<kAdafactor, false, false>(t, n, a, decay, s); break;
  }
  cuda::check_launch("tracked_kernel");
}

void rescale_cuda(const float* exp_avg, const float* exp_avg_sq, const float* change, const float* after,
                  float* signal, float* target, int64_t n, const RescaleArgs& a, void* stream) {
  check_rescale_args(exp_avg, exp_avg_sq, change, after, signal, target, n, a);
  if (n == 0) return;
  cuda::DeviceGuard guard(target, "target");
  cuda::device_of(exp_avg, "exp_avg");
  cuda::device_of(exp_avg_sq, "exp_avg_sq");
  if (signal != nullptr) cuda::device_of(signal, "signal");
  const cudaStream_t s = cuda::as_stream(stream);
  const unsigned int blocks = cuda::blocks_for(n, kThreads);
  if (change == nullptr)
    rescale_kernel<0><<<blocks, kThreads, 0, s>>>(exp_avg, exp_avg_sq, change, after, signal, target, n, a);
  else if (a.decay != 0.0f)
    rescale_kernel<2><<<blocks, kThreads, 0, s>>>(exp_avg, exp_avg_sq, change, after, signal, target, n, a);
  else rescale_kernel<1><<<blocks, kThreads, 0, s>>>(exp_avg, exp_avg_sq, change, after, signal, target, n, a);
  cuda::check_launch("rescale_kernel");
}

}  // namespace gs
