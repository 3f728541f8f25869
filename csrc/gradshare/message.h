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
// Two formats carry magnitudes. Both split the buffer into chunks of `chunk` elements (the last one may
// be shorter: len_c elements) and have a length fixed by (n, chunk, k), the same for every rank:
//   top-k (3)   word 3 = chunk (1..65536), word 4 = k (entries per full chunk, 0..chunk);
//               per chunk k_c = ceil(k * len_c / chunk) words, local indices strictly ascending, each word
//               (bf16 bits of the value << 16) | local index; values finite.
//   ternary (4) word 3 = chunk (a multiple of 16), word 4 = entries (present bits in all chunks);
//               per chunk one word (float32 bits of its scale, finite, >= 0), then ceil(len_c/16) code
//               words laid out like the bitmap; a present element decodes as +-scale.
//   top-k8 (5) word 3 = chunk (1..65536), word 4 = k; per chunk one word (float32 bits of its scale s,
//               finite, >= 0), ceil(k_c/2) words of 16-bit local indices (ascending, the first in the
//               low half), ceil(k_c/4) words of int8 values q in [-127, 127] (the first in the low
//               byte); an entry adds q * s. Unused halves and bytes are zero.
//   top-k signs (7) word 3 = chunk (1..2^31-1: its indices are Elias-Fano coded, not 16-bit), word 4 = k;
//               per chunk one word (float32 bits of its scale s, finite, >= 0), then, when k_c > 0, a bit
//               stream (bit b in word b / 32 at bit b % 32) of ceil(bits / 32) words: the k_c local indices
//               p_0 < p_1 < ... Elias-Fano coded with l = floor(log2(len_c / k_c)) low bits (entry i's low
//               bits at bits [i*l, i*l + l)), then k_c + ((len_c - 1) >> l) high bits (bit (p_i >> l) + i set
//               for each entry, no other), then k_c sign bits (set: the entry adds -s, else +s); bits past the
//               stream are zero. About 3 + log2(len_c / k_c) bits an entry where a 16-bit index and an 8-bit
//               value take 24.
// A rank whose update is not finite sends a marker of the same length (header, then zeros).
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

// kFailed: a rank whose encoder raised (written and read in Python only; the decoder rejects it like any
// format it does not decode).
enum Format : int32_t { kSparse = 0, kBitmap = 1, kNonFinite = 2, kTopK = 3, kTernary = 4, kTopK8 = 5, kFailed = 6, kTopKSign = 7 };
constexpr int64_t kMaxTopKChunk = 65536;  // local indices are 16 bits
// The signs layout codes its local indices in as many bits as the chunk needs: one chunk may be the whole
// buffer, whose top k then compete over all of it (no quota per 65536 elements).
constexpr int64_t kMaxTopKSignChunk = kMaxElements;
constexpr int64_t kMaxTernaryChunk = int64_t(1) << 30;
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

// ---- chunked formats: sizes (shared by encoders, decoders and the Python side, gradshare/message.py)
GS_HD int64_t chunk_len(int64_t n, int64_t chunk, int64_t c) {
  const int64_t lo = c * chunk;
  return n - lo < chunk ? n - lo : chunk;
}
GS_HD int64_t topk_k(int64_t k, int64_t len, int64_t chunk) { return (k * len + chunk - 1) / chunk; }
GS_HD int64_t topk_entries(int64_t n, int64_t chunk, int64_t k) {
  const int64_t full = n / chunk, rest = n % chunk;
  return full * k + (rest ? topk_k(k, rest, chunk) : 0);
}
GS_HD int64_t topk_words(int64_t n, int64_t chunk, int64_t k) { return kHeaderWords + topk_entries(n, chunk, k); }
GS_HD int64_t ternary_chunk_words(int64_t len) { return 1 + (len + 15) / 16; }
GS_HD int64_t topk8_chunk_words(int64_t kc) { return 1 + (kc + 1) / 2 + (kc + 3) / 4; }
GS_HD int64_t topk8_words(int64_t n, int64_t chunk, int64_t k) {
  const int64_t full = n / chunk, rest = n % chunk;
  return kHeaderWords + full * topk8_chunk_words(k) + (rest ? topk8_chunk_words(topk_k(k, rest, chunk)) : 0);
}
// Top-k signs: the Elias-Fano split of a chunk with kc > 0 entries among len elements, and its sizes.
GS_HD int ef_low_bits(int64_t len, int64_t kc) {
  int l = 0;
  if (kc > 0)
    while ((kc << (l + 1)) <= len) ++l;
  return l;
}
GS_HD int64_t ef_high_bits(int64_t len, int64_t kc, int l) { return kc + ((len - 1) >> l); }
GS_HD int64_t topks_chunk_bits(int64_t len, int64_t kc) {
  if (kc <= 0) return 0;
  const int l = ef_low_bits(len, kc);
  return kc * l + ef_high_bits(len, kc, l) + kc;
}
GS_HD int64_t topks_chunk_words(int64_t len, int64_t kc) { return 1 + (topks_chunk_bits(len, kc) + 31) / 32; }
GS_HD int64_t topks_words(int64_t n, int64_t chunk, int64_t k) {
  const int64_t full = n / chunk, rest = n % chunk;
  return kHeaderWords + full * topks_chunk_words(chunk, k) +
         (rest ? topks_chunk_words(rest, topk_k(k, rest, chunk)) : 0);
}
GS_HD bool is_topk(int32_t format) { return format == kTopK || format == kTopK8 || format == kTopKSign; }
GS_HD int64_t max_topk_chunk(int32_t format) { return format == kTopKSign ? kMaxTopKSignChunk : kMaxTopKChunk; }
GS_HD bool is_chunked(int32_t format) { return is_topk(format) || format == kTernary; }
// Words of full chunk c's part of a chunked payload start at c * this (every earlier chunk is full).
GS_HD int64_t chunk_stride(int32_t format, int64_t chunk, int64_t k) {
  return format == kTopK ? k
                         : (format == kTopK8 ? topk8_chunk_words(k)
                                             : (format == kTopKSign ? topks_chunk_words(chunk, k)
                                                                    : ternary_chunk_words(chunk)));
}
GS_HD int64_t ternary_words(int64_t n, int64_t chunk) {
  const int64_t full = n / chunk, rest = n % chunk;
  return kHeaderWords + full * ternary_chunk_words(chunk) + (rest ? ternary_chunk_words(rest) : 0);
}
// Words of a top-k, 8-bit top-k, top-k signs or ternary message (k is ignored for ternary).
GS_HD int64_t chunked_words(int32_t format, int64_t n, int64_t chunk, int64_t k) {
  return format == kTopK    ? topk_words(n, chunk, k)
         : format == kTopK8   ? topk8_words(n, chunk, k)
         : format == kTopKSign ? topks_words(n, chunk, k)
                               : ternary_words(n, chunk);
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

// Header checks of the chunked formats (top-k, ternary): nullptr when sound, else what is wrong.
inline const char* check_chunked_header(const int32_t* h, int64_t row_words, int64_t n) {
  if (h[2] < 0 || (int64_t)h[2] != n) return "message length n does not match the destination buffer";
  const int64_t chunk = h[3], k = h[4];
  int64_t words;
  if (is_topk(h[1])) {
    if (chunk < 1 || chunk > max_topk_chunk(h[1]) || k < 0 || k > chunk)
      return "top-k message: chunk must be in [1, 65536] (signs: [1, 2^31-1]) and k in [0, chunk]";
  } else {
    if (chunk < 16 || chunk > kMaxTernaryChunk || chunk % 16 != 0 || k < 0 || k > n)
      return "ternary message: chunk must be a multiple of 16 and the entry count in [0, n]";
  }
  words = chunked_words(h[1], n, chunk, k);
  if (words > row_words) return "message payload runs past the end of its row";
  return nullptr;
}

// Header checks shared by every decoder. Returns nullptr when the header is sound for a destination
// of n elements in a row of row_words words, decoded with `scale`, else what is wrong.
inline const char* check_header(const int32_t* h, int64_t row_words, int64_t n, float scale) {
  if (row_words < kHeaderWords) return "message is shorter than its 5-word header";
  if (h[0] != kMagicVersion) return "bad magic/version word (not a gradshare v1 message)";
  if (h[1] == kNonFinite) return "message is a non-finite marker: its sender saw NaN/Inf and sent no update";
  if (is_chunked(h[1])) return check_chunked_header(h, row_words, n);
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

// A top-k entry: local index below the chunk's length and above the previous entry's; a finite value.
GS_HD bool topk_entry_ok(uint32_t w, int64_t prev_local, int64_t len) {
  const int64_t local = w & 0xffffu;
  const uint32_t exp = (w >> 23) & 0xffu;  // bf16 exponent bits (value bits 30..23 of the float)
  return local < len && local > prev_local && exp != 0xffu;
}

GS_HD bool bitmap_word_ok(uint32_t w, int64_t word_index, int64_t n);
GS_HD int popcount16(uint32_t x);
GS_HD float bits_to_float(int32_t b);
// The local index and int8 value of entry i of an 8-bit top-k chunk with kc entries.
GS_HD int64_t topk8_index(const int32_t* w, int64_t i) {
  return (static_cast<uint32_t>(w[1 + i / 2]) >> (16 * (i % 2))) & 0xffffu;
}
GS_HD int topk8_value(const int32_t* w, int64_t kc, int64_t i) {
  return static_cast<int8_t>((static_cast<uint32_t>(w[1 + (kc + 1) / 2 + i / 4]) >> (8 * (i % 4))) & 0xffu);
}

// Bits [off, off + nbits) of a bit stream (nbits in [0, 32]; bit b in word b / 32 at bit b % 32).
GS_HD uint32_t stream_bits(const int32_t* s, int64_t off, int nbits) {
  if (nbits <= 0) return 0u;
  const int64_t q = off >> 5;
  const int b = static_cast<int>(off & 31);
  uint32_t x = static_cast<uint32_t>(s[q]) >> b;
  if (b + nbits > 32) x |= static_cast<uint32_t>(s[q + 1]) << (32 - b);
  return nbits == 32 ? x : x & ((1u << nbits) - 1u);
}
GS_HD int lowest_bit(uint32_t x);
GS_HD int popcount32(uint32_t x);
// A top-k signs entry: +s, or -s when its sign bit is set.
GS_HD float sign_entry(float s, bool negative) { return negative ? -s : s; }

// The 32-bit windows a top-k signs chunk's high bits span (0 when it has no entry).
GS_HD int64_t topks_windows(int64_t len, int64_t kc) {
  return kc > 0 ? (ef_high_bits(len, kc, ef_low_bits(len, kc)) + 31) / 32 : 0;
}

// Walks a top-k signs chunk's high bits from window `q0` (32 bits each) to `q1`, entry `i` being the first
// set bit met: f(i, local index, negative) for each entry, in ascending order; stops at the first f that
// returns false (and returns false). The GPU decoder runs it on each thread's windows after a scan of their counts;
// topks_for_each walks a whole chunk.
template <typename F>
GS_HD bool topks_walk(const int32_t* stream, int64_t len, int64_t kc, int64_t q0, int64_t q1, int64_t i, F&& f) {
  const int l = ef_low_bits(len, kc);
  const int64_t hs = kc * l, hbits = ef_high_bits(len, kc, l), ss = hs + hbits;
  for (int64_t q = q0; q < q1; ++q) {
    const int64_t b = q * 32;
    uint32_t x = stream_bits(stream, hs + b, hbits - b < 32 ? static_cast<int>(hbits - b) : 32);
    while (x) {
      const int t = lowest_bit(x);
      x &= x - 1;
      const bool ok = i < kc;  // an entry past k_c is reported, never read
      const int64_t p = ok ? (((b + t - i) << l) | stream_bits(stream, i * l, l)) : len;
      if (!f(i, p, ok && (stream_bits(stream, ss + i, 1) != 0))) return false;
      ++i;
    }
  }
  return true;
}

template <typename F>
GS_HD bool topks_for_each(const int32_t* stream, int64_t len, int64_t kc, F&& f) {
  return topks_walk(stream, len, kc, 0, topks_windows(len, kc), 0, f);
}

struct TopksCheck {  // validation state of one chunk: the entries so far and the last local index
  int64_t len, kc, count = 0, prev = -1;
  GS_HD bool operator()(int64_t i, int64_t p, bool) {
    if (i >= kc || p >= len || p <= prev) return false;
    prev = p;
    ++count;
    return true;
  }
};

// A top-k signs chunk's stream: exactly k_c entries, local indices below len_c and strictly ascending, zero
// bits past its end. 0 when sound, else 1.
GS_HD int topks_stream_why(const int32_t* w, int64_t kc, int64_t len) {
  if (kc <= 0) return 0;
  TopksCheck check{len, kc};
  if (!topks_for_each(w + 1, len, kc, check) || check.count != kc) return 1;
  const int64_t bits = topks_chunk_bits(len, kc);
  if ((bits & 31) && (static_cast<uint32_t>(w[1 + bits / 32]) >> (bits & 31)) != 0) return 1;
  return 0;
}

// A chunk's validation runs over items, in this order: the scale (8-bit top-k, ternary), then each entry
// (top-k) or code word (ternary), then the padding (8-bit top-k). Items are independent of one another (an
// entry is compared with the one before it as written), so the first failing item is the same whether they
// are checked in turn (the CPU) or all at once (the GPU: one thread per item).
GS_HD int64_t chunk_items(int32_t format, int64_t k, int64_t len, int64_t chunk) {
  if (format == kTopK) return topk_k(k, len, chunk);
  if (format == kTopK8) return topk_k(k, len, chunk) + 2;
  if (format == kTopKSign) return 2;  // the scale, then the stream (one walk: entries depend on those before)
  return 1 + (len + 15) / 16;
}

// The checks of one item, each returning 0 when sound, else why (the decoders' complaints: 1 an entry's index or
// value, 2 a value times scale overflows, 3 the scale, 4 a code word). An entry is compared with the local index
// of the one before it as written (`prev`, -1 for the first).
constexpr float kMaxFinite = 3.4028234663852886e38f;
GS_HD int64_t topk_local(const int32_t* w, int64_t i) { return static_cast<uint32_t>(w[i]) & 0xffffu; }
GS_HD int topk_entry_why(const int32_t* w, int64_t i, int64_t prev, int64_t len, float scale) {  // prev: -1 first
  const uint32_t e = static_cast<uint32_t>(w[i]);
  if (!topk_entry_ok(e, prev, len)) return 1;
  const float v = bits_to_float(static_cast<int32_t>(e & 0xffff0000u)) * scale;
  return (v <= kMaxFinite && v >= -kMaxFinite) ? 0 : 2;
}
GS_HD int scale_why(const int32_t* w, float factor, float scale) {  // factor: 127 (8-bit top-k) or 1 (ternary)
  const float sc = bits_to_float(w[0]), v = sc * factor * scale;
  return (!(sc >= 0.0f && sc <= kMaxFinite) || !(v <= kMaxFinite && v >= -kMaxFinite)) ? 3 : 0;
}
GS_HD int topk8_entry_why(const int32_t* w, int64_t kc, int64_t i, int64_t prev, int64_t len) {
  const int64_t local = topk8_index(w, i);
  return (local >= len || local <= prev || topk8_value(w, kc, i) == -128) ? 1 : 0;
}
GS_HD int topk8_padding_why(const int32_t* w, int64_t kc) {  // unused halves and bytes must be zero
  if ((kc % 2) && (static_cast<uint32_t>(w[1 + kc / 2]) >> 16) != 0) return 1;
  if ((kc % 4) && (static_cast<uint32_t>(w[1 + (kc + 1) / 2 + kc / 4]) >> (8 * (kc % 4))) != 0) return 1;
  return 0;
}
GS_HD int ternary_word_why(const int32_t* w, int64_t q, int64_t len) {
  return bitmap_word_ok(static_cast<uint32_t>(w[1 + q]), q, len) ? 0 : 4;
}

// Item `item` of the chunk whose payload starts at `w`, in chunk_items' order (what a GPU thread checks).
GS_HD int check_chunk_item(const int32_t* w, int32_t format, int64_t k, int64_t len, int64_t chunk, float scale,
                           int64_t item) {
  if (format == kTopK) return topk_entry_why(w, item, item ? topk_local(w, item - 1) : -1, len, scale);
  if (format == kTopK8) {
    const int64_t kc = topk_k(k, len, chunk), i = item - 1;
    if (item == 0) return scale_why(w, 127.0f, scale);
    return item <= kc ? topk8_entry_why(w, kc, i, i ? topk8_index(w, i - 1) : -1, len) : topk8_padding_why(w, kc);
  }
  if (format == kTopKSign) return item == 0 ? scale_why(w, 1.0f, scale) : topks_stream_why(w, topk_k(k, len, chunk), len);
  return item == 0 ? scale_why(w, 1.0f, scale) : ternary_word_why(w, item - 1, len);
}

// One chunk, its items in turn: 0 when sound, else the first failing item's reason. Ternary chunks add their
// entries to *entries.
GS_HD int check_chunk(const int32_t* w, int32_t format, int64_t k, int64_t len, int64_t chunk, float scale,
                      int64_t* entries) {
  int why = 0;
  if (format == kTopK) {
    const int64_t kc = topk_k(k, len, chunk);
    for (int64_t i = 0, prev = -1; i < kc; prev = topk_local(w, i), ++i)
      if ((why = topk_entry_why(w, i, prev, len, scale))) return why;
    return 0;
  }
  if (format == kTopK8) {
    const int64_t kc = topk_k(k, len, chunk);
    if ((why = scale_why(w, 127.0f, scale))) return why;
    for (int64_t i = 0, prev = -1; i < kc; prev = topk8_index(w, i), ++i)
      if ((why = topk8_entry_why(w, kc, i, prev, len))) return why;
    return topk8_padding_why(w, kc);
  }
  if (format == kTopKSign) {
    if ((why = scale_why(w, 1.0f, scale))) return why;
    return topks_stream_why(w, topk_k(k, len, chunk), len);
  }
  if ((why = scale_why(w, 1.0f, scale))) return why;
  for (int64_t q = 0; q < (len + 15) / 16; ++q) {
    if ((why = ternary_word_why(w, q, len))) return why;
    *entries += popcount16(static_cast<uint32_t>(w[1 + q]));
  }
  return 0;
}

// What check_chunk's codes mean, in the decoders' error messages.
inline const char* chunk_complaint(int why) {
  switch (why) {
    case 1: return "has an entry whose index is outside its chunk or not strictly ascending, or whose value is not "
                   "finite or out of range (or padding that is not zero)";
    case 2: return "has an entry whose value times scale overflows float32";
    case 3: return "has a scale that is not finite and >= 0 (or overflows times scale)";
    default: return "has a code word with a sign bit without its present bit or a bit past its end";
  }
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

GS_HD int popcount32(uint32_t x) {
#if defined(__CUDA_ARCH__)
  return __popc(x);
#elif defined(__GNUC__) || defined(__clang__)
  return __builtin_popcount(x);
#else
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
