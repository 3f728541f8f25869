// A rank's optimizer step made the global batch's (CPU): gradshare/second_moment.py's rule for Adam, AdamW,
// NAdam and RAdam in one pass over memory, where the torch ops it replaces pass over it about fifteen times.
// The element logic is element.h's (adam_excess, change_excess), shared with csrc/cuda/rescale.cu.
#include "cpu/parallel.h"
#include "gradshare/kernels.h"

namespace gs {
namespace {

// One chunk. The sharing core passes its change buffer as the target and local steps the parameters as
// both target and `after`: an aliased operand is read through `target` (the flags), so that every pointer
// used here is distinct (restrict) and the loop vectorises without overlap checks.
template <bool Adam, bool ChangeIsTarget, bool Decay, bool AfterIsTarget>
void rescale_chunk(const float* __restrict__ exp_avg, const float* __restrict__ exp_avg_sq,
                   const float* __restrict__ change, const float* __restrict__ after, float* __restrict__ target,
                   int64_t lo, int64_t hi, const RescaleArgs a) {
  for (int64_t i = lo; i < hi; ++i) {
    const float t = target[i];
    float e;
    if (Adam) {
      e = adam_excess(exp_avg[i], exp_avg_sq[i], a);
    } else {
      const float c = ChangeIsTarget ? t : change[i];
      const float p = Decay ? (AfterIsTarget ? t : after[i]) : 0.0f;
      e = change_excess(exp_avg[i], exp_avg_sq[i], c, p, a);
    }
    target[i] = apply_excess(t, e, a.sign);
  }
}

using Chunk = void (*)(const float*, const float*, const float*, const float*, float*, int64_t, int64_t,
                       const RescaleArgs);

template <bool ChangeIsTarget, bool Decay>
Chunk change_form(bool after_is_target) {
  return after_is_target ? rescale_chunk<false, ChangeIsTarget, Decay, true>
                         : rescale_chunk<false, ChangeIsTarget, Decay, false>;
}

}  // namespace

void rescale_cpu(const float* exp_avg, const float* exp_avg_sq, const float* change, const float* after,
                 float* target, int64_t n, const RescaleArgs& a) {
  check_rescale_args(exp_avg, exp_avg_sq, change, after, target, n, a);
  const bool decay = change != nullptr && a.decay != 0.0f;
  const bool cit = change == target, ait = decay && after == target;
  Chunk run;
  if (change == nullptr) run = rescale_chunk<true, false, false, false>;
  else if (decay) run = cit ? change_form<true, true>(ait) : change_form<false, true>(ait);
  else run = cit ? change_form<true, false>(false) : change_form<false, false>(false);
  const int64_t chunks = num_chunks(n);
  GS_PARALLEL_FOR(n >= kParallelMin)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t lo = c * kChunk, hi = lo + kChunk < n ? lo + kChunk : n;
    run(exp_avg, exp_avg_sq, cit ? nullptr : change, ait ? nullptr : after, target, lo, hi, a);
  }
}

}  // namespace gs
