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
// selected set does not depend on how it is found (heap, sort or radix select).
GS_HD uint64_t topk_key(float u, int64_t local) {
  const uint64_t mag = static_cast<uint32_t>(float_to_bits(u)) & 0x7fffffffu;
  return (mag << 16) | static_cast<uint64_t>(0xffff - local);
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
  float world = 1.0f;  // W, the ranks whose batches make the global batch
  float eps = 0.0f;    // the optimizer's eps (RAdam's already divided by sqrt(1 - beta2^t))
  float lr = 0.0f;     // Adam form only: the step's learning rate
  float decay = 0.0f;  // change form only: lr * weight_decay when the decay is decoupled (undivided), else 0
  float sign = 1.0f;   // +1: target += excess (a change, before - after); -1: target -= excess (parameters)
};

GS_HD float sqrt_rn(float x) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(x);
#else
  return std::sqrt(x);
#endif
}

// v_global = m^2 + max(v - m^2, 0) / W: the second moment a W times larger batch would have. A NaN stays NaN.
GS_HD float global_second_moment(float m, float v, float world) {
  const float m2 = m * m;
  const float d = v - m2;
  return (d < 0.0f ? 0.0f : d) / world + m2;
}

// Adam / AdamW: lr * m * (1 / (sqrt(v_global) + eps) - 1 / (sqrt(v) + eps)), what the rank's step
// -lr * m / (sqrt(v) + eps) falls short of the global batch's, rounded step by step as the torch ops of
// gradshare/second_moment.py round it.
GS_HD float adam_excess(float exp_avg, float exp_avg_sq, const RescaleArgs& a) {
  const float m = exp_avg / a.bias1, v = exp_avg_sq / a.bias2;
  const float wide = 1.0f / (sqrt_rn(global_second_moment(m, v, a.world)) + a.eps);
  const float narrow = 1.0f / (sqrt_rn(v) + a.eps);
  return (wide - narrow) * m * a.lr;
}

// NAdam / RAdam: the step's divided change (change, less the decoupled decay lr * wd * the parameter before
// the step, after + change) times (sqrt(v) + eps) / (sqrt(v_global) + eps) - 1.
GS_HD float change_excess(float exp_avg, float exp_avg_sq, float change, float after, const RescaleArgs& a) {
  const float m = exp_avg / a.bias1, v = exp_avg_sq / a.bias2;
  const float ratio = (sqrt_rn(v) + a.eps) / (sqrt_rn(global_second_moment(m, v, a.world)) + a.eps) - 1.0f;
  const float divided = a.decay != 0.0f ? change - (after + change) * a.decay : change;
  return divided * ratio;
}

// The target after the excess: one rounding, t + e or t - e.
GS_HD float apply_excess(float t, float e, float sign) { return sign > 0.0f ? t + e : t - e; }

}  // namespace gs
