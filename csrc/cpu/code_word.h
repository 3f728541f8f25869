// 16-element code words on the CPU (bitmap and ternary payloads: bit b present, bit b + 16 negative), and the
// element selects around them, written so that they vectorise: which elements are sent is close to random, so
// branches and loops over set bits mispredict, and float selects do not vectorise without SSE4.1.
#pragma once
#include <cstdint>

#include "gradshare/element.h"

namespace gs {

// Bit b of a code word, as a table: AND-and-compare vectorises where per-lane variable shifts do not (SSE2).
alignas(64) constexpr uint32_t kBit[16] = {1u << 0, 1u << 1, 1u << 2, 1u << 3, 1u << 4, 1u << 5, 1u << 6, 1u << 7,
                                           1u << 8, 1u << 9, 1u << 10, 1u << 11, 1u << 12, 1u << 13, 1u << 14, 1u << 15};

// x where `keep`, else +0.0, by an integer mask: float selects do not vectorise here (SSE2), masks do.
inline float keep_or_zero(float x, bool keep) {
  return bits_to_float(static_cast<int32_t>(static_cast<uint32_t>(float_to_bits(x)) & (0u - static_cast<uint32_t>(keep))));
}

// -x where `negative`, else x (the sign bit flipped by an integer xor).
inline float negated_if(float x, bool negative) {
  return bits_to_float(static_cast<int32_t>(static_cast<uint32_t>(float_to_bits(x)) ^
                                            (static_cast<uint32_t>(negative) << 31)));
}

// d[b] += v (or -v where bit b + 16 is set) for every present bit b of code word x, over the word's m <= 16
// elements. Every element gets the sum and an absent one its old bits back, by integer masks (float selects do
// not vectorise here, and adding 0.0 instead would turn -0.0 into +0.0): the set-bit loop's result bit for bit.
template <int M>
inline void add_code_word_fixed(float* d, uint32_t x, float v) {
  const uint32_t vb = static_cast<uint32_t>(float_to_bits(v));
  for (int b = 0; b < M; ++b) {
    const uint32_t present = 0u - static_cast<uint32_t>((x & kBit[b]) != 0);
    const uint32_t sign = ((x >> 16) & kBit[b]) ? 0x80000000u : 0u;
    const float y = d[b] + bits_to_float(static_cast<int32_t>(vb ^ sign));
    const uint32_t kept = static_cast<uint32_t>(float_to_bits(d[b]));
    d[b] = bits_to_float(static_cast<int32_t>((static_cast<uint32_t>(float_to_bits(y)) & present) | (kept & ~present)));
  }
}

inline void add_code_word(float* d, uint32_t x, float v, int64_t m) {
  if ((x & 0xffffu) == 0) return;  // nothing sent in these 16 (common in sparse bitmaps)
  if (m == 16) {
    add_code_word_fixed<16>(d, x, v);
    return;
  }
  for (int64_t b = 0; b < m; ++b)
    if (x & kBit[b]) d[b] += (x >> 16) & kBit[b] ? -v : v;
}

}  // namespace gs
