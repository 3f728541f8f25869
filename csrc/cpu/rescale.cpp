// A rank's optimizer step made the global batch's (CPU): gradshare/second_moment.py's rule in one pass over
// memory, where torch ops pass over it ten to twenty times. Adam, AdamW, NAdam and RAdam from their own
// moments and the squared mean gradshare keeps for them (rescale_cpu); RMSprop, Adagrad, Adadelta, Adamax and Adafactor from the mean gradient gradshare
// keeps for them (rescale_tracked_cpu). The element logic is element.h's (adam_excess, change_excess,
// tracked_excess), shared with csrc/cuda/rescale.cu.
#include "cpu/clones.h"
#include "cpu/parallel.h"
#include "gradshare/kernels.h"

namespace gs {
namespace {

// One chunk. The sharing core passes its change buffer as the target and local steps the parameters as
// both target and `after`: an aliased operand is read through `target` (the flags), so that every pointer
// used here is distinct (restrict) and the loop vectorises without overlap checks. Whether a signal is kept
// is a template flag too, and its element goes through a local: the element functions' null test of the
// signal then folds away at compile time (a test per element kept these loops from vectorising, 3-4x slower).
template <bool Adam, bool ChangeIsTarget, bool Decay, bool AfterIsTarget, bool Signal>
GS_AVX2_CLONES void rescale_chunk(const float* __restrict__ exp_avg, const float* __restrict__ exp_avg_sq,
                                  const float* __restrict__ change, const float* __restrict__ after,
                                  float* __restrict__ signal, float* __restrict__ target, int64_t lo, int64_t hi,
                                  const RescaleArgs a) {
  for (int64_t i = lo; i < hi; ++i) {
    const float t = target[i];
    float sv = Signal ? signal[i] : 0.0f;
    float* s = Signal ? &sv : nullptr;
    float e;
    if (Adam) {
      e = adam_excess(exp_avg[i], exp_avg_sq[i], s, a);
    } else {
      const float c = ChangeIsTarget ? t : change[i];
      const float p = Decay ? (AfterIsTarget ? t : after[i]) : 0.0f;
      e = change_excess(exp_avg[i], exp_avg_sq[i], s, c, p, a);
    }
    if (Signal) signal[i] = sv;
    target[i] = apply_excess(t, e, a.sign);
  }
}

using Chunk = void (*)(const float*, const float*, const float*, const float*, float*, float*, int64_t, int64_t,
                       const RescaleArgs);

template <bool ChangeIsTarget, bool Decay, bool Signal>
Chunk change_form(bool after_is_target) {
  return after_is_target ? rescale_chunk<false, ChangeIsTarget, Decay, true, Signal>
                         : rescale_chunk<false, ChangeIsTarget, Decay, false, Signal>;
}

template <bool Signal>
Chunk rescale_form(bool adam, bool decay, bool cit, bool ait) {
  if (adam) return rescale_chunk<true, false, false, false, Signal>;
  if (decay) return cit ? change_form<true, true, Signal>(ait) : change_form<false, true, Signal>(ait);
  return cit ? change_form<true, false, Signal>(false) : change_form<false, false, Signal>(false);
}

// One chunk of a tracked step. Alias 1: change is the target; 2: after is the target (read through it, as
// above); 0: neither.
template <int Kind, bool Centered, bool Momentum, bool Decay, int Alias, bool Signal>
GS_AVX2_CLONES void tracked_chunk(const float* __restrict__ grad, const float* __restrict__ change,
                                  const float* __restrict__ after, const float* __restrict__ second,
                                  const float* __restrict__ grad_avg, float* __restrict__ mean,
                                  float* __restrict__ extra, float* __restrict__ signal, float* __restrict__ target,
                                  int64_t lo, int64_t hi, const TrackedArgs a) {
  const bool own = Kind == kRmsprop || Kind == kAdagrad || Kind == kAdadelta;
  const bool has_extra = Kind == kAdagrad || Kind == kAdamax || Kind == kAdafactor || Momentum;
  for (int64_t i = lo; i < hi; ++i) {
    const float t = target[i];
    float g, divided;
    tracked_inputs<Kind, Decay>(grad[i], Alias == 1 ? t : change[i], Decay ? (Alias == 2 ? t : after[i]) : 0.0f, a,
                                g, divided);
    float mu = mean[i], x = has_extra ? extra[i] : 0.0f, sv = Signal ? signal[i] : 0.0f;
    const float e = tracked_excess<Kind, Centered, Momentum>(g, divided, own ? second[i] : 0.0f,
                                                             Centered ? grad_avg[i] : 0.0f, mu, x,
                                                             Signal ? &sv : nullptr, a);
    mean[i] = mu;
    if (has_extra) extra[i] = x;
    if (Signal) signal[i] = sv;
    target[i] = apply_excess(t, e, a.sign);
  }
}

using TrackedChunk = void (*)(const float*, const float*, const float*, const float*, const float*, float*, float*,
                              float*, float*, int64_t, int64_t, const TrackedArgs);

template <int Kind, bool Centered, bool Momentum, bool Decay, bool Signal>
TrackedChunk tracked_alias(int alias) {
  return alias == 1 ? tracked_chunk<Kind, Centered, Momentum, Decay, 1, Signal>
                    : alias == 2 ? tracked_chunk<Kind, Centered, Momentum, Decay, 2, Signal>
                                 : tracked_chunk<Kind, Centered, Momentum, Decay, 0, Signal>;
}

template <int Kind, bool Centered, bool Momentum, bool Signal>
TrackedChunk tracked_decay_form(bool decay, int alias) {
  return decay ? tracked_alias<Kind, Centered, Momentum, true, Signal>(alias)
               : tracked_alias<Kind, Centered, Momentum, false, Signal>(alias);
}

// Adagrad and centered RMSprop keep no signal (kernels.h refuses one): no form with it.
template <int Kind, bool Centered, bool Momentum>
TrackedChunk tracked_form(bool decay, int alias, bool signal) {
  if (Kind == kAdagrad || Centered || !signal) return tracked_decay_form<Kind, Centered, Momentum, false>(decay, alias);
  return tracked_decay_form<Kind, Centered, Momentum, true>(decay, alias);
}

TrackedChunk tracked_pick(const TrackedArgs& a, bool centered, bool momentum, bool decay, int alias, bool signal) {
  switch (a.kind) {
    case kRmsprop:
      if (centered) return momentum ? tracked_form<kRmsprop, true, true>(decay, alias, signal)
                                    : tracked_form<kRmsprop, true, false>(decay, alias, signal);
      return momentum ? tracked_form<kRmsprop, false, true>(decay, alias, signal)
                      : tracked_form<kRmsprop, false, false>(decay, alias, signal);
    case kAdagrad: return tracked_form<kAdagrad, false, false>(decay, alias, signal);
    case kAdadelta: return tracked_form<kAdadelta, false, false>(decay, alias, signal);
    case kAdamax: return tracked_form<kAdamax, false, false>(decay, alias, signal);
    default: return tracked_form<kAdafactor, false, false>(decay, alias, signal);
  }
}

}  // namespace

void rescale_cpu(const float* exp_avg, const float* exp_avg_sq, const float* change, const float* after,
                 float* signal, float* target, int64_t n, const RescaleArgs& a) {
  check_rescale_args(exp_avg, exp_avg_sq, change, after, signal, target, n, a);
  const bool decay = change != nullptr && a.decay != 0.0f;
  const bool cit = change == target, ait = decay && after == target;
  const Chunk run = signal != nullptr ? rescale_form<true>(change == nullptr, decay, cit, ait)
                                      : rescale_form<false>(change == nullptr, decay, cit, ait);
  const int64_t chunks = num_chunks(n);
  GS_PARALLEL_FOR(n >= kParallelMin)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t lo = c * kChunk, hi = lo + kChunk < n ? lo + kChunk : n;
    run(exp_avg, exp_avg_sq, cit ? nullptr : change, ait ? nullptr : after, signal, target, lo, hi, a);
  }
}

void rescale_tracked_cpu(const TrackedTensors& t, int64_t n, const TrackedArgs& a) {
  check_tracked_args(t, n, a);
  const bool decay = tracked_decay(a);
  const int alias = t.change == t.target ? 1 : (decay && t.after == t.target ? 2 : 0);
  const TrackedChunk run = tracked_pick(a, t.grad_avg != nullptr, tracked_momentum(a), decay, alias,
                                       t.signal != nullptr);
  const int64_t chunks = num_chunks(n);
  GS_PARALLEL_FOR(n >= kParallelMin)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t lo = c * kChunk, hi = lo + kChunk < n ? lo + kChunk : n;
    run(t.grad, alias == 1 ? nullptr : t.change, alias == 2 ? nullptr : t.after, t.second, t.grad_avg, t.mean, t.extra,
        t.signal, t.target, lo, hi, a);
  }
}

}  // namespace gs
