// Per-element logic shared by the CPU kernels (csrc/cpu) and the CUDA kernels (csrc/cuda).
// Everything that decides a value lives here, so both paths compute bit-identical results.
#pragma once
#include <cmath>
#include <cstdint>
#include "gradshare/message.h"

namespace gs {

enum DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

GS_HD float half_bits_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1fu) {
    bits = sign | 0x7f800000u | (man << 13);  // inf / nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;  // +-0
  } else {  // subnormal half: normalise
    exp = 113u;
    while ((man & 0x400u) == 0) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
  }
  return bits_to_float((int32_t)bits);
}

GS_HD float bf16_bits_to_float(uint16_t b) { return bits_to_float((int32_t)((uint32_t)b << 16)); }

GS_HD float load_as_float(const void* p, int32_t dtype, int64_t i) {
  if (dtype == kFloat32) return static_cast<const float*>(p)[i];
  const uint16_t h = static_cast<const uint16_t*>(p)[i];
  return dtype == kFloat16 ? half_bits_to_float(h) : bf16_bits_to_float(h);
}

GS_HD bool is_finite(float x) {
  // Works under -ffast-math too: NaN and +-inf all have the exponent bits set.
  return (float_to_bits(x) & 0x7f800000) != 0x7f800000;
}

// The mean of an all-reduced sum, written where it is read next (a rank's gradient): *dst = src * scale.
// Whether that value is finite (NaN or Inf in any rank's gradient shows in the sum).
GS_HD bool scale_element(float src, float scale, float* dst) {
  const float v = src * scale;
  *dst = v;
  return is_finite(v);
}

// One step of Strom's threshold rule. u = residual + update.
// Returns +1 / -1 when u reaches +tau / -tau (and subtracts it), 0 otherwise; *kept is the new residual.
// `clip` > 0 limits the kept residual to [-clip, clip] (clip = c * tau, computed once by the caller).
GS_HD int threshold_step(float u, float tau, float clip, float* kept) {
  // Written as selects, not branches, so compilers vectorise it (and GPUs do not diverge).
  const bool pos = u >= tau, neg = u <= -tau;
  const float up = u - tau, un = u + tau;
  float r = pos ? up : (neg ? un : u);
  const float hi = r > clip ? clip : r;
  const float lo = hi < -clip ? -clip : hi;
  r = clip > 0.0f ? lo : r;
  *kept = r;
  return static_cast<int>(pos) - static_cast<int>(neg);
}

GS_HD bool reaches(float u, float tau) { return u >= tau || u <= -tau; }

// Deep Gradient Compression's momentum correction: the velocity after a step with gradient g, m * v + g,
// rounded as torch rounds velocity.mul(m).add_(g) (the build disables FMA contraction on CPU and GPU).
GS_HD float velocity_step(float v, float m, float g) { return m * v + g; }

// The value one message entry adds: tau * scale, rounded once to float32.
GS_HD float entry_value(float tau, float scale) { return tau * scale; }

// ---- top-k and ternary (csrc/cpu/chunked.cpp, csrc/cuda/chunked.cu)

// bfloat16 bits of a finite float, rounded to nearest even; a value past the largest bfloat16 is clamped to it
// (so a finite input never becomes inf).
GS_HD uint32_t bf16_bits(float u) {
  const uint32_t b = static_cast<uint32_t>(float_to_bits(u));
  uint32_t r = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
  if ((r & 0x7f80u) == 0x7f80u) r = (b >> 16 & 0x8000u) | 0x7f7fu;
  return r;
}

// The order top-k selects by: larger |u| first, then the lower local index. Unique within a chunk, so the
// selected set does not depend on how it is found (heap, sort or radix select). The index takes the low 32
// bits: a top-k signs chunk may be up to 2^31 - 1 elements long.
GS_HD uint64_t topk_key_of_magnitude(uint32_t magnitude_bits, int64_t local) {
  return (static_cast<uint64_t>(magnitude_bits) << 32) | (0xffffffffull - static_cast<uint64_t>(local));
}

GS_HD uint64_t topk_key(float u, int64_t local) {
  return topk_key_of_magnitude(static_cast<uint32_t>(float_to_bits(u)) & 0x7fffffffu, local);
}

// A top-k message word: the value's bfloat16 bits and the local index.
GS_HD int32_t topk_word(uint32_t bf16, int64_t local) {
  return static_cast<int32_t>((bf16 << 16) | static_cast<uint32_t>(local));
}

// 8-bit top-k: the chunk's scale is its largest selected |u| / 127; q = u / scale rounded to the nearest
// integer (ties to even), clamped to [-127, 127]; an entry adds q * scale, one float32 rounding.
GS_HD float topk8_scale(float max_abs) { return max_abs / 127.0f; }
GS_HD int topk8_quantize(float u, float scale) {
  if (!(scale > 0.0f)) return 0;
  const float x = u / scale;
#if defined(__CUDA_ARCH__)
  int q = __float2int_rn(x);
#else
  int q = static_cast<int>(std::nearbyint(x));
#endif
  return q > 127 ? 127 : (q < -127 ? -127 : q);
}
GS_HD float topk8_entry(int q, float scale) { return static_cast<float>(q) * scale; }

// Top-k signs: the chunk's scale is the mean |u| of its selected entries (summed in the lane order below over
// the entries in ascending index: lane i % 32 adds entry i), and an entry adds +-scale (message.h's sign_entry).
// An entry selected with u == 0 (a chunk with fewer non-zero elements than k_c) is sent as +scale; the residual
// takes the difference back.

// Ternary: an element is sent when |u| >= th and u != 0 (th = fraction * mean |u| of its chunk).
GS_HD bool ternary_sent(float u, float th) {
  const float a = u < 0.0f ? -u : u;
  return a >= th && a > 0.0f;
}

// Ternary chunk sums run in one order everywhere: 32 lanes, lane j adding elements j, j+32, ... in turn,
// then a pairwise tree over the lanes (16, 8, 4, 2, 1 apart). The CUDA kernel does the tree with warp shuffles.
constexpr int kLanes = 32;
inline float lane_tree(float* acc) {
  for (int step = kLanes / 2; step >= 1; step /= 2)
    for (int j = 0; j < step; ++j) acc[j] += acc[j + step];
  return acc[0];
}

// ---- the global batch's step (csrc/cpu/rescale.cpp, csrc/cuda/rescale.cu; gradshare/second_moment.py's rule)

// Scalars of one rescaled parameter, rounded to float32 once by the caller (as torch rounds a Python scalar).
struct RescaleArgs {
  float bias1 = 1.0f;  // 1 - beta1^t: exp_avg / bias1 is the bias-corrected mean m
  float bias2 = 1.0f;  // 1 - beta2^t: exp_avg_sq / bias2 is the bias-corrected second moment v
  float world = 1.0f;  // W, the ranks whose batches make the global batch, or the divisor that stands for it
                       // where the squared mean holds some of the noise (gradshare.reference.effective_world)
  float eps = 0.0f;    // the optimizer's eps (RAdam's already divided by sqrt(1 - beta2^t))
  float lr = 0.0f;     // Adam form only: the step's learning rate
  float decay = 0.0f;  // change form only: lr * weight_decay when the decay is decoupled (undivided), else 0
  float sign = 1.0f;   // +1: target += excess (a change, before - after); -1: target -= excess (parameters)
  float signal_weight = 0.0f;  // with a signal: 1 - beta2, the weight of this step's m^2 in its average
  float signal_bias = 1.0f;    // with a signal: 1 - beta2^k after its k-th step (the average's bias correction)
};

GS_HD float sqrt_rn(float x) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(x);
#else
  return std::sqrt(x);
#endif
}

// avg + (x - avg) * w: an exponential average's step (gradshare/reference.py: ema_).
GS_HD float ema(float avg, float x, float w) { return avg + (x - avg) * w; }

// v_global = s + max(v - s, 0) / W, s the squared mean of the gradient: the second moment a W times larger
// batch would have. A NaN stays NaN.
GS_HD float global_second_moment(float s, float v, float world) {
  const float d = v - s;
  return (d < 0.0f ? 0.0f : d) / world + s;
}

// The squared mean s of v_global: m^2 of this step alone (signal == nullptr), or the average of m^2 over v's
// own window (beta2), kept in *signal and updated here. v averages over up to 1 / (1 - beta2) steps and m
// over about 1 / (1 - beta1): m^2 alone would count how far the mean moved over v's window as noise.
// The same rule serves the tracked optimizers (tracked_excess), with their second moment's window.
GS_HD float squared_mean(float m, float* signal, float weight, float bias) {
  if (signal == nullptr) return m * m;
  const float s = ema(*signal, m * m, weight);
  *signal = s;
  return s / bias;
}
GS_HD float squared_mean(float m, float* signal, const RescaleArgs& a) {
  return squared_mean(m, signal, a.signal_weight, a.signal_bias);
}

// Adam / AdamW: lr * m * (1 / (sqrt(v_global) + eps) - 1 / (sqrt(v) + eps)), what the rank's step
// -lr * m / (sqrt(v) + eps) falls short of the global batch's, rounded step by step as the torch ops of
// gradshare/second_moment.py round it.
GS_HD float adam_excess(float exp_avg, float exp_avg_sq, float* signal, const RescaleArgs& a) {
  const float m = exp_avg / a.bias1, v = exp_avg_sq / a.bias2;
  const float wide = 1.0f / (sqrt_rn(global_second_moment(squared_mean(m, signal, a), v, a.world)) + a.eps);
  const float narrow = 1.0f / (sqrt_rn(v) + a.eps);
  return (wide - narrow) * m * a.lr;
}

// NAdam / RAdam: the step's divided change (change, less the decoupled decay lr * wd * the parameter before
// the step, after + change) times (sqrt(v) + eps) / (sqrt(v_global) + eps) - 1. Where v / bias2 overflows to
// inf the rank's step divided by inf, and so did the global batch's: the ratio is 0 there, as the Adam form's
// excess is, not inf / inf's NaN (which would reach the parameters).
GS_HD float change_excess(float exp_avg, float exp_avg_sq, float* signal, float change, float after,
                          const RescaleArgs& a) {
  const float m = exp_avg / a.bias1, v = exp_avg_sq / a.bias2;
  const float s = squared_mean(m, signal, a);
  const float narrow = sqrt_rn(v) + a.eps;
  const bool overflowed = narrow > 0.0f && !is_finite(narrow);   // +inf (a NaN v stays NaN below)
  const float ratio = overflowed ? 0.0f : narrow / (sqrt_rn(global_second_moment(s, v, a.world)) + a.eps) - 1.0f;
  const float divided = a.decay != 0.0f ? change - (after + change) * a.decay : change;
  return divided * ratio;
}

// The target after the excess: one rounding, t + e or t - e.
GS_HD float apply_excess(float t, float e, float sign) { return sign > 0.0f ? t + e : t - e; }

// ---- the same for optimizers whose mean gradient gradshare keeps (second_moment.py: OWN_MEAN, TRACKED)

// RMSprop, Adagrad, Adadelta divide by their own second moment, which is converted; Adamax and Adafactor by
// what is not a mean square, so their step is divided by r = sqrt(v_global / v) of gradshare's own moments.
enum TrackedKind : int32_t { kRmsprop = 0, kAdagrad = 1, kAdadelta = 2, kAdamax = 3, kAdafactor = 4 };
constexpr int32_t kTrackedKinds = 5;
constexpr float kFloatTiny = 1.17549435e-38f;  // the smallest normal float (torch.finfo(float32).tiny)

// Scalars of one parameter's step, rounded to float32 once by the caller.
struct TrackedArgs {
  int32_t kind = kRmsprop;
  float world = 1.0f;          // W, or the divisor that stands for it (RescaleArgs::world)
  float inv_world = 1.0f;      // 1 / W (the ranks): Adamax / Adafactor's lower bound of v_global / v
  float grad_sign = 1.0f;      // -1 when the optimizer maximizes
  float weight_decay = 0.0f;   // coupled (all but Adafactor): the gradient divided is grad + wd * before
  float decay = 0.0f;          // decoupled (Adafactor): lr * wd, the part of the change left undivided
  float mean_weight = 0.1f;    // gradshare's mean gradient: an average with this weight on the new gradient,
  float mean_bias = 1.0f;      //   divided by this bias correction (1 - beta^n, n counting this step)
  float offset = 0.0f;         // RMSprop / Adagrad / Adadelta: their second moment is offset + scale * v_hat
  float scale = 1.0f;          //   (v_hat bias-corrected; Adagrad: its initial value and its step count)
  float count = 1.0f;          // Adagrad: the steps its mean of m^2 runs over
  float eps = 0.0f;            // the optimizer's
  float momentum = 0.0f;       // RMSprop with a momentum buffer: its momentum
  float lr = 0.0f;             //   and learning rate
  float square_weight = 0.0f;  // Adamax / Adafactor: gradshare's mean square, the weight on g * g this step
  float square_bias = 1.0f;    //   and its bias correction (Adafactor: 1)
  float signal_weight = 0.0f;  // the squared mean over the second moment's window (squared_mean): the weight
  float signal_bias = 1.0f;    //   on this step's m^2 and its bias correction (used only with a signal)
  float sign = 1.0f;           // +1: target += excess (a change); -1: target -= excess (parameters)
};

// avg + (x - avg) * w: an exponential average, rounded the same on every path.
// min(s, cap) where cap < s (a NaN s stays NaN).
GS_HD float capped(float s, float cap) { return cap < s ? cap : s; }

// What an RMSprop / Adagrad / Adadelta step divides by for second moment x: sqrt(x + eps) (Adadelta),
// sqrt(max(x - grad_avg^2, 0)) + eps (centered RMSprop), sqrt(x) + eps.
template <int Kind, bool Centered>
GS_HD float own_divisor(float x, float grad_avg, float eps) {
  if (Kind == kAdadelta) return sqrt_rn(x + eps);
  if (Centered) {
    const float d = x - grad_avg * grad_avg;
    return sqrt_rn(d < 0.0f ? 0.0f : d) + eps;
  }
  return sqrt_rn(x) + eps;
}

// One element of a tracked step. g: the gradient the step divided; divided: the part of the step's change
// it divided; second / grad_avg: the optimizer's second moment and centered RMSprop's mean (own-mean kinds);
// mean, extra: gradshare's state, updated (extra: Adagrad's running sum of m^2, Adamax's / Adafactor's mean
// square, RMSprop's momentum of the step's difference). signal: nullptr (the squared mean is m^2), or the
// average of m^2 over the second moment's window, updated (not Adagrad's, whose sum of m^2 is that already,
// nor centered RMSprop's, which subtracts its own mean). Returns the excess (gradshare/second_moment.py).
template <int Kind, bool Centered, bool Momentum>
GS_HD float tracked_excess(float g, float divided, float second, float grad_avg, float& mean, float& extra,
                           float* signal, const TrackedArgs& a) {
  mean = ema(mean, g, a.mean_weight);
  const float m = mean / a.mean_bias;
  if (Kind == kAdamax || Kind == kAdafactor) {
    extra = ema(extra, g * g, a.square_weight);
    const float v = extra / a.square_bias;
    const float s = capped(squared_mean(m, signal, a.signal_weight, a.signal_bias), v);
    // v_global / v >= 1 / W; the floor on v also covers a gradient that was always 0
    const float q = ((v - s) / a.world + s) / (v < kFloatTiny ? kFloatTiny : v);
    const float r = sqrt_rn(q < a.inv_world ? a.inv_world : q);
    return divided * (1.0f / r - 1.0f);
  }
  float s;
  if (Kind == kAdagrad) {
    extra = extra + m * m;
    s = extra / a.count;
  } else if (Centered) {
    const float ga = grad_avg / a.scale;
    s = ga * ga;
  } else {
    s = squared_mean(m, signal, a.signal_weight, a.signal_bias);
  }
  const float v_hat = (second - a.offset) / a.scale;
  s = capped(s, v_hat);
  const float v_global = ((v_hat - s) / a.world + s) * a.scale + a.offset;
  const float narrow = own_divisor<Kind, Centered>(second, grad_avg, a.eps);
  const float wide = own_divisor<Kind, Centered>(v_global, grad_avg, a.eps);
  if (Momentum) {
    extra = extra * a.momentum + (g / wide - g / narrow);
    return extra * a.lr;
  }
  return (narrow / wide - 1.0f) * divided;
}

// The gradient a step divided and the part of its change it divided, from the raw gradient, the change and
// the parameters before the step (after + change; read only with Decay).
template <int Kind, bool Decay>
GS_HD void tracked_inputs(float grad, float change, float after, const TrackedArgs& a, float& g, float& divided) {
  g = grad * a.grad_sign;
  divided = change;
  if (Decay) {
    const float before = after + change;
    if (Kind == kAdafactor) divided = change - before * a.decay;
    else g = g + before * a.weight_decay;
  }
}

}  // namespace gs
