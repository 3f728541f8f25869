// The gradshare message: one int32 array that carries one rank's encoded update across the wire.
//
//   word 0  magic + version   0x47530001  ('G' 'S', version 1)
//   word 1  format            0 = sparse, 1 = bitmap, 2 = non-finite marker (no payload)
//   word 2  n                 length of the dense buffer the message encodes (0 <= n < 2^31)
//   word 3  count             number of +-tau entries in the payload
//   word 4  tau               float32 bits of the threshold
//   word 5.. payload
//     sparse: `count` signed 1-based indices, strictly ascending in |index|:
//             +(i+1) means element i gets +tau, -(i+1) means -tau.
//     bitmap: ceil(n/16) words; element i lives in word i/16 at bit b = i%16:
//             bit b = present, bit b+16 = negative (a sign bit without its present bit is invalid;
//             bits past n must be zero).
//
// A message may sit in a longer row (padded all-gather): the header says how many words are used.
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define GS_HD __host__ __device__ __forceinline__
#else
#define GS_HD inline
#endif

namespace gs {

constexpr int32_t kMagicVersion = 0x47530001;
constexpr int64_t kHeaderWords = 5;
constexpr int64_t kMaxElements = 2147483647;  // indices are signed 1-based int32

enum Format : int32_t { kSparse = 0, kBitmap = 1, kNonFinite = 2 };
// What the caller asks the encoder for; kAuto picks the smaller payload.
enum FormatChoice : int32_t { kChooseAuto = -1, kChooseSparse = 0, kChooseBitmap = 1 };

struct Header {
  int32_t magic_version;
  int32_t format;
  int32_t n;
  int32_t count;
  int32_t tau_bits;
};

GS_HD int64_t bitmap_words(int64_t n) { return (n + 15) / 16; }

// Sparse whenever its payload is no larger than the bitmap's (DL4J switches at count = n/16 too).
GS_HD bool prefer_sparse(int64_t count, int64_t n) { return count <= bitmap_words(n); }

GS_HD int64_t payload_words(int32_t format, int64_t n, int64_t count) {
  return format == kSparse ? count : (format == kBitmap ? bitmap_words(n) : 0);
}

GS_HD float bits_to_float(int32_t b) {
#if defined(__CUDA_ARCH__)
  return __int_as_float(b);
#else
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
#endif
}

GS_HD int32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_int(f);
#else
  int32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
#endif
}

GS_HD void write_header(int32_t* out, int32_t format, int64_t n, int64_t count, float tau) {
  out[0] = kMagicVersion;
  out[1] = format;
  out[2] = static_cast<int32_t>(n);
  out[3] = static_cast<int32_t>(count);
  out[4] = float_to_bits(tau);
}

}  // namespace gs

namespace gs {

// Header checks shared by every decoder. Returns nullptr when the header is sound for a destination
// of n elements in a row of row_words words, decoded with `scale`, else what is wrong.
inline const char* check_header(const int32_t* h, int64_t row_words, int64_t n, float scale) {
  if (row_words < kHeaderWords) return "message is shorter than its 5-word header";
  if (h[0] != kMagicVersion) return "bad magic/version word (not a gradshare v1 message)";
  if (h[1] == kNonFinite) return "message is a non-finite marker: its sender saw NaN/Inf and sent no update";
  if (h[1] != kSparse && h[1] != kBitmap) return "unknown message format";
  if (h[2] < 0 || (int64_t)h[2] != n) return "message length n does not match the destination buffer";
  if (h[3] < 0 || (int64_t)h[3] > n) return "message count is negative or larger than n";
  const float tau = bits_to_float(h[4]);
  constexpr float kMax = 3.4028234663852886e38f;
  if (!(tau > 0.0f) || !(tau <= kMax)) return "message tau is not a positive finite float";
  const float v = tau * scale;  // what one entry adds (entry_value): must not overflow into dst
  if (!(v <= kMax && v >= -kMax)) return "message tau * scale overflows float32";
  if (kHeaderWords + payload_words(h[1], n, h[3]) > row_words) return "message payload runs past the end of its row";
  return nullptr;
}

// A sparse entry is valid when 1 <= |idx| <= n and |idx| > the previous entry's |idx| (strictly ascending).
GS_HD bool sparse_entry_ok(int32_t idx, int64_t prev_abs, int64_t n) {
  if (idx == 0 || idx == INT32_MIN) return false;
  const int64_t a = idx < 0 ? -(int64_t)idx : (int64_t)idx;
  return a <= n && a > prev_abs;
}

// A bitmap word is valid when no sign bit stands without its present bit and no bit lies past n.
GS_HD bool bitmap_word_ok(uint32_t w, int64_t word_index, int64_t n) {
  const uint32_t present = w & 0xffffu, negative = w >> 16;
  if (negative & ~present) return false;
  const int64_t valid = n - word_index * 16;
  if (valid >= 16) return true;
  const uint32_t mask = valid <= 0 ? 0u : ((1u << valid) - 1u);
  return (present & ~mask) == 0;
}

GS_HD int popcount16(uint32_t x) {
#if defined(__CUDA_ARCH__)
  return __popc(x & 0xffffu);
#elif defined(__GNUC__) || defined(__clang__)
  return __builtin_popcount(x & 0xffffu);
#else
  x &= 0xffffu;
  int c = 0;
  for (; x; x &= x - 1) ++c;
  return c;
#endif
}

// Index of the lowest set bit of a non-zero word.
GS_HD int lowest_bit(uint32_t x) {
#if defined(__CUDA_ARCH__)
  return __ffs(x) - 1;
#elif defined(__GNUC__) || defined(__clang__)
  return __builtin_ctz(x);
#else
  int b = 0;
  while (!(x & 1u)) {
    x >>= 1;
    ++b;
  }
  return b;
#endif
}

}  // namespace gs
