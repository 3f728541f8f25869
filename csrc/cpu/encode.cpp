// Threshold encoding with fused residual accumulation (CPU). See csrc/gradshare/message.h for the
// format and csrc/gradshare/element.h for the per-element rule shared with the CUDA kernels.
//
// Two passes over the data. The count pass reads update + residual, counts per chunk, checks finiteness and
// stores a hit mask: one bit per element (one uint64_t per 64-element block) telling whether u reaches tau.
// The write pass then works in 64-element blocks: a block whose mask word is 0 (almost all of them at the
// usual densities) only stores kept = u (clipped) (into `kept`: the residual itself, or another buffer so
// that the residual is only read), and the signed indices / bitmap words are built from the
// hit mask and a negative-sign mask of the block instead of being searched for element by element.
#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>
#include "cpu/parallel.h"
#include "gradshare/kernels.h"

// SSE2 (every x86-64 CPU) for the float32 mask loops; other targets, and builds with -DGS_NO_SIMD (used to
// test the fallback on x86), use the portable loops, which produce the same masks.
#if defined(__SSE2__) && !defined(GS_NO_SIMD)
#include <emmintrin.h>
#define GS_SSE2 1
#endif

namespace gs {
namespace {

constexpr int64_t kBlock = 64;  // elements per mask word; kChunk is a multiple, so chunks own whole words
static_assert(kChunk % kBlock == 0, "a chunk must own whole mask words");

inline int64_t mask_words(int64_t n) { return (n + kBlock - 1) / kBlock; }

template <int DT>
inline float upd(const void* p, int64_t i) {
  return load_as_float(p, DT, i);
}

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

// Hit mask of elements [i, i + len), len <= 64; sets *bad if any u is non-finite. The flag loop is plain
// element-wise code, so compilers vectorise it for every dtype; bits past len stay 0.
template <int DT>
inline uint64_t hit_bits_portable(const void* update, const float* residual, int64_t i, int64_t len, float tau,
                                  int32_t* bad) {
  uint8_t flags[kBlock];
  if (len < kBlock) std::memset(flags, 0, sizeof flags);
  int32_t b = 0;
  for (int64_t j = 0; j < len; ++j) {
    const float u = residual[i + j] + upd<DT>(update, i + j);
    flags[j] = static_cast<uint8_t>((u >= tau) | (u <= -tau));  // reaches(u, tau), without a branch
    b |= static_cast<int32_t>(!(u - u == 0.0f));                  // u - u is 0 unless u is NaN/Inf
  }
  *bad |= b;
  return pack_flags(flags);
}

template <int DT>
inline uint64_t hit_bits(const void* update, const float* residual, int64_t i, int64_t len, float tau,
                         int32_t* bad) {
#ifdef GS_SSE2
  if (DT == kFloat32 && len == kBlock) {  // movemask turns 4 compares into 4 bits in one instruction
    const float* g = static_cast<const float*>(update) + i;
    const float* r = residual + i;
    const __m128 vt = _mm_set1_ps(tau), vnt = _mm_set1_ps(-tau);
    __m128 vbad = _mm_setzero_ps();
    uint64_t bits = 0;
    for (int k = 0; k < kBlock; k += 4) {
      const __m128 u = _mm_add_ps(_mm_loadu_ps(r + k), _mm_loadu_ps(g + k));
      const __m128 hit = _mm_or_ps(_mm_cmpge_ps(u, vt), _mm_cmple_ps(u, vnt));
      const __m128 d = _mm_sub_ps(u, u);
      vbad = _mm_or_ps(vbad, _mm_cmpunord_ps(d, d));  // u - u is NaN iff u is NaN/Inf
      bits |= static_cast<uint64_t>(_mm_movemask_ps(hit)) << k;
    }
    *bad |= _mm_movemask_ps(vbad);
    return bits;
  }
#endif
  return hit_bits_portable<DT>(update, residual, i, len, tau, bad);
}

// Pass 1: per chunk, how many elements reach tau and the first non-finite u (or -1). Reads update and
// residual once; writes one count per chunk and, when `hits` is not null, the chunk's hit-mask words.
template <int DT>
void count_chunks(const void* update, const float* residual, int64_t n, float tau, int64_t* counts,
                  int64_t* first_bad, uint64_t* hits) {
  const int64_t nch = num_chunks(n);
  GS_PARALLEL_FOR(n >= kParallelMin)
  for (int64_t c = 0; c < nch; ++c) {
    const int64_t lo = c * kChunk, hi = std::min(n, lo + kChunk);
    int64_t cnt = 0;
    int32_t bad = 0;
    for (int64_t b = lo; b < hi; b += kBlock) {
      const uint64_t bits = hit_bits<DT>(update, residual, b, std::min(kBlock, hi - b), tau, &bad);
      if (hits) hits[b / kBlock] = bits;
      cnt += __builtin_popcountll(bits);
    }
    counts[c] = cnt;
    first_bad[c] = -1;
    if (bad) {  // rare: find the first offending element for the error message
      for (int64_t i = lo; i < hi; ++i)
        if (!is_finite(residual[i] + upd<DT>(update, i))) {
          first_bad[c] = i;
          break;
        }
    }
  }
}

// The residual threshold_step keeps for an element that does not reach tau: u, clipped exactly as it clips.
template <bool CLIP>
inline float kept_silent(float u, float clip) {
  if (!CLIP) return u;
  const float hi = u > clip ? clip : u;
  return hi < -clip ? -clip : hi;
}

// Block without hits: kept = u (clipped). A plain element-wise update, vectorised for every dtype.
// `kept` is the residual itself or a buffer that does not overlap it: element j is read before it is written.
template <int DT, bool CLIP>
inline void step_silent(const void* update, const float* residual, float* kept, int64_t b, int64_t len,
                        float clip) {
  for (int64_t j = 0; j < len; ++j)
    kept[b + j] = kept_silent<CLIP>(residual[b + j] + upd<DT>(update, b + j), clip);
}

// Block with hits: threshold_step on each element; returns the mask of elements that went negative.
template <int DT, bool CLIP>
inline uint64_t step_hits(const void* update, const float* residual, float* kept, int64_t b, int64_t len, float tau,
                          float clip) {
  const float c = CLIP ? clip : 0.0f;  // threshold_step clips only when clip > 0
#ifdef GS_SSE2
  if (DT == kFloat32 && len == kBlock) {  // threshold_step's selects as masks (pos and neg never both hold)
    const float* g = static_cast<const float*>(update) + b;
    const float* r = residual + b;
    float* o = kept + b;
    const __m128 vt = _mm_set1_ps(tau), vnt = _mm_set1_ps(-tau), vc = _mm_set1_ps(c), vnc = _mm_set1_ps(-c);
    uint64_t neg_bits = 0;
    for (int k = 0; k < kBlock; k += 4) {
      const __m128 u = _mm_add_ps(_mm_loadu_ps(r + k), _mm_loadu_ps(g + k));
      const __m128 pos = _mm_cmpge_ps(u, vt), neg = _mm_cmple_ps(u, vnt);
      __m128 kept = _mm_or_ps(_mm_or_ps(_mm_and_ps(pos, _mm_sub_ps(u, vt)), _mm_and_ps(neg, _mm_add_ps(u, vt))),
                              _mm_andnot_ps(_mm_or_ps(pos, neg), u));
      if (CLIP) kept = _mm_max_ps(_mm_min_ps(kept, vc), vnc);  // same order as threshold_step; u is finite
      _mm_storeu_ps(o + k, kept);
      neg_bits |= static_cast<uint64_t>(_mm_movemask_ps(neg)) << k;
    }
    return neg_bits;
  }
#endif
  uint8_t negative[kBlock];
  if (len < kBlock) std::memset(negative, 0, sizeof negative);
  for (int64_t j = 0; j < len; ++j) {
    float k;
    negative[j] = static_cast<uint8_t>(threshold_step(residual[b + j] + upd<DT>(update, b + j), tau, c, &k) < 0);
    kept[b + j] = k;
  }
  return pack_flags(negative);
}

// Pass 2: write the kept residual and the payload from the hit mask. Sparse: chunk c writes its signed
// 1-based indices, ascending, at offsets[c]. Bitmap: 16 elements per word, bit k present, bit k + 16 negative.
template <int DT, bool CLIP, bool BITMAP>
void write_chunks(const void* update, const float* residual, float* kept, int64_t n, float tau, float clip,
                  const uint64_t* hits, const int64_t* offsets, int32_t* payload) {
  const int64_t nch = num_chunks(n);
  GS_PARALLEL_FOR(n >= kParallelMin)
  for (int64_t c = 0; c < nch; ++c) {
    const int64_t lo = c * kChunk, hi = std::min(n, lo + kChunk);
    int32_t* p = BITMAP ? nullptr : payload + offsets[c];
    for (int64_t b = lo; b < hi; b += kBlock) {
      const int64_t len = std::min(kBlock, hi - b);
      uint64_t hit = hits[b / kBlock], neg = 0;
      if (hit == 0)
        step_silent<DT, CLIP>(update, residual, kept, b, len, clip);
      else
        neg = step_hits<DT, CLIP>(update, residual, kept, b, len, tau, clip);
      if (BITMAP) {
        // Both masks are 0 past n, so the last word's unused bits are 0 too.
        for (int64_t k = 0; 16 * k < len; ++k) {
          const uint32_t present = static_cast<uint32_t>(hit >> (16 * k)) & 0xFFFFu;
          const uint32_t negative = static_cast<uint32_t>(neg >> (16 * k)) & 0xFFFFu;
          payload[b / 16 + k] = static_cast<int32_t>(present | (negative << 16));
        }
      } else {
        for (; hit != 0; hit &= hit - 1) {  // lowest set bit first: ascending indices
          const int j = __builtin_ctzll(hit);
          const int32_t idx = static_cast<int32_t>(b + j + 1);
          *p++ = (neg >> j) & 1 ? -idx : idx;
        }
      }
    }
  }
}

template <int DT, bool BITMAP>
void write_payload(const void* update, const float* residual, float* kept, int64_t n, float tau, float clip,
                   const uint64_t* hits, const int64_t* offsets, int32_t* payload) {
  if (clip > 0.0f)
    write_chunks<DT, true, BITMAP>(update, residual, kept, n, tau, clip, hits, offsets, payload);
  else
    write_chunks<DT, false, BITMAP>(update, residual, kept, n, tau, clip, hits, offsets, payload);
}

template <int DT>
EncodeResult encode_t(const void* update, const float* residual, float* kept, int64_t n, float tau, float clip,
                      int32_t choice, int32_t* out, int64_t capacity) {
  const int64_t nch = num_chunks(n);
  std::vector<int64_t> counts(nch), first_bad(nch);
  // Scratch of n/8 bytes, left uninitialised: the count pass writes every word.
  const std::unique_ptr<uint64_t[]> hits(new uint64_t[static_cast<size_t>(mask_words(n))]);
  count_chunks<DT>(update, residual, n, tau, counts.data(), first_bad.data(), hits.get());
  EncodeResult r{0, 0, -1, kSparse};
  for (int64_t c = 0; c < nch; ++c) {
    if (r.nonfinite_index < 0 && first_bad[c] >= 0) r.nonfinite_index = first_bad[c];
    r.count += counts[c];
  }
  if (r.nonfinite_index >= 0) return r;  // nothing written: the residual (and kept) stay as they were

  r.format = choose_format(choice, r.count, n, capacity);
  const int64_t need = kHeaderWords + payload_words(r.format, n, r.count);
  write_header(out, r.format, n, r.count, tau);
  if (r.format == kSparse) {
    int64_t acc = 0;
    for (int64_t c = 0; c < nch; ++c) {  // exclusive scan: chunk c writes at counts[0..c)
      const int64_t k = counts[c];
      counts[c] = acc;
      acc += k;
    }
    write_payload<DT, false>(update, residual, kept, n, tau, clip, hits.get(), counts.data(), out + kHeaderWords);
  } else {
    write_payload<DT, true>(update, residual, kept, n, tau, clip, hits.get(), nullptr, out + kHeaderWords);
  }
  r.length = need;
  return r;
}

template <int DT>
CountResult count_t(const void* update, const float* residual, int64_t n, float tau) {
  const int64_t nch = num_chunks(n);
  std::vector<int64_t> counts(nch), first_bad(nch);
  count_chunks<DT>(update, residual, n, tau, counts.data(), first_bad.data(), nullptr);
  CountResult r{0, -1};
  for (int64_t c = 0; c < nch; ++c) {
    if (r.nonfinite_index < 0 && first_bad[c] >= 0) r.nonfinite_index = first_bad[c];
    r.count += counts[c];
  }
  return r;
}

}  // namespace

CountResult count_cpu(const void* update, int32_t dtype, const float* residual, int64_t n, float tau) {
  check_encode_args(dtype, n, tau, 0.0f, kChooseAuto, kHeaderWords);
  switch (dtype) {
    case kFloat16: return count_t<kFloat16>(update, residual, n, tau);
    case kBFloat16: return count_t<kBFloat16>(update, residual, n, tau);
    default: return count_t<kFloat32>(update, residual, n, tau);
  }
}

EncodeResult encode_cpu(const void* update, int32_t dtype, const float* residual, float* kept, int64_t n, float tau,
                        float clip, int32_t choice, int32_t* out, int64_t capacity) {
  check_encode_args(dtype, n, tau, clip, choice, capacity);
  switch (dtype) {
    case kFloat16: return encode_t<kFloat16>(update, residual, kept, n, tau, clip, choice, out, capacity);
    case kBFloat16: return encode_t<kBFloat16>(update, residual, kept, n, tau, clip, choice, out, capacity);
    default: return encode_t<kFloat32>(update, residual, kept, n, tau, clip, choice, out, capacity);
  }
}

}  // namespace gs
