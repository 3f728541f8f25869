// Per-element logic shared by the CPU kernels (csrc/cpu) and the CUDA kernels (csrc/cuda).
// Everything that decides a value lives here, so both paths compute bit-identical results.
#pragma once
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

// The value one message entry adds: tau * scale, rounded once to float32.
GS_HD float entry_value(float tau, float scale) { return tau * scale; }

}  // namespace gs
