// 16-element code words on the CPU (bitmap and ternary payloads: bit b present, bit b + 16 negative), and the
// element selects around them, written so that they vectorise: which elements are sent is close to random, so
// branches and loops over set bits mispredict, and float selects do not vectorise without SSE4.1.
#pragma once
#include <cstdint>
#include <cstring>

#include "gradshare/element.h"

namespace gs {

// Bit b of a code word, as a table: AND-and-compare vectorises where per-lane variable shifts do not (SSE2).
alignas(64) constexpr uint32_t kBit[16] = {1u << 0, 1u << 1, 1u << 2, 1u << 3, 1u << 4, 1u << 5, 1u << 6, 1u << 7,
                                           1u << 8, 1u << 9, 1u << 10, 1u << 11, 1u << 12, 1u << 13, 1u << 14, 1u << 15};

// Bits j of the result = flags[j] for flags[0..64) each 0 or 1: eight bytes at a time, one multiply moves
// byte j's low bit to bit 56 + j (no two partial products overlap there).
inline uint64_t pack_flags(const uint8_t* flags) {
  uint64_t bits = 0;
  for (int k = 0; k < 8; ++k) {
    uint64_t x;
    std::memcpy(&x, flags + 8 * k, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    x = __builtin_bswap64(x);  // byte j must be the j-th least significant
#endif
    bits |= ((x * 0x0102040810204080ull) >> 56) << (8 * k);
  }
  return bits;
}

// `which` ? a : b, by integer masks on the bits: float selects do not vectorise here (SSE2), masks do.
inline float pick(bool which, float a, float b) {
  const uint32_t m = 0u - static_cast<uint32_t>(which);
  return bits_to_float(static_cast<int32_t>((static_cast<uint32_t>(float_to_bits(a)) & m) |
                                            (static_cast<uint32_t>(float_to_bits(b)) & ~m)));
}

// x where `keep`, else +0.0.
inline float keep_or_zero(float x, bool keep) { return pick(keep, x, 0.0f); }

// -x where `negative`, else x (the sign bit flipped by an integer xor).
inline float negated_if(float x, bool negative) {
  return bits_to_float(static_cast<int32_t>(static_cast<uint32_t>(float_to_bits(x)) ^
                                            (static_cast<uint32_t>(negative) << 31)));
}

// d[b] += v (or -v where bit b + 16 is set) for every present bit b of code word x, over the word's m <= 16
// elements. Every element gets the sum and an absent one its old bits back (adding 0.0 instead would turn -0.0
// into +0.0): the set-bit loop's result bit for bit, without its mispredictions.
inline void add_code_word(float* d, uint32_t x, float v, int64_t m) {
  if ((x & 0xffffu) == 0) return;  // nothing sent in these 16 (common in sparse bitmaps)
  auto add = [&](int64_t b) { d[b] = pick(x & kBit[b], d[b] + negated_if(v, (x >> 16) & kBit[b]), d[b]); };
  if (m == 16) {
    for (int b = 0; b < 16; ++b) add(b);  // a constant trip count: straight-line vector code
  } else {
    for (int64_t b = 0; b < m; ++b) add(b);
  }
}

// The first `words` (<= 4) code words of a 64-element block from its present and negative masks (bit j:
// element j).
inline void write_code_words(int32_t* w, uint64_t present, uint64_t negative, int64_t words) {
  for (int64_t k = 0; k < words; ++k)
    w[k] = static_cast<int32_t>((static_cast<uint32_t>(present >> (16 * k)) & 0xFFFFu) |
                                ((static_cast<uint32_t>(negative >> (16 * k)) & 0xFFFFu) << 16));
}

}  // namespace gs
