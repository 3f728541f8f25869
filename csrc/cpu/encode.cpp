// Threshold encoding with fused residual accumulation (CPU). See csrc/gradshare/message.h for the
// format and csrc/gradshare/element.h for the per-element rule shared with the CUDA kernels.
//
// The payload's offsets are known only once every chunk is counted, and in place the residual may change only
// once every element is known to be finite, so there:
//   two passes over the data. The count pass reads update + residual, counts per chunk, checks finiteness and
//   stores a hit mask: one bit per element (one uint64_t per 64-element block) telling whether u reaches tau.
//   The write pass then works in 64-element blocks: a block whose mask word is 0 (almost all of them at the
//   usual densities) only stores kept = u (clipped), and the signed indices / bitmap words are built from the
//   hit mask and a negative-sign mask of the block instead of being searched for element by element.
// With `kept` apart from the residual (the sharing core's case: the residual is only read, and a non-finite
// step drops `kept`), one pass over the data: each block stores kept at once and keeps its hit and negative
// masks, and the payload is then built from the masks alone (n/32 bytes read, not the data again).
//
// With a fused momentum (kernels.h's Momentum) the update's place is taken by m * velocity + update, and the
// pass that stores kept also stores it, 0 where sent, as the new velocity.
#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>
#include "cpu/code_word.h"
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

#ifdef GS_SSE2
// Four inputs at g + k (float32): the update or m * v + update, rounded as velocity_step rounds it.
template <bool MOM>
inline __m128 input4(const float* g, const Momentum& mo, int64_t i, __m128 vm) {
  const __m128 x = _mm_loadu_ps(g + i);
  return MOM ? _mm_add_ps(_mm_mul_ps(vm, _mm_loadu_ps(mo.velocity + i)), x) : x;
}
#endif

// Hit mask of elements [i, i + len), len <= 64; sets *bad if any u is non-finite. The flag loop is plain
// element-wise code, so compilers vectorise it for every dtype; bits past len stay 0.
template <int DT, bool MOM>
inline uint64_t hit_bits_portable(const void* update, const Momentum& mo, const float* residual, int64_t i,
                                  int64_t len, float tau, int32_t* bad) {
  uint8_t flags[kBlock];
  if (len < kBlock) std::memset(flags, 0, sizeof flags);
  int32_t b = 0;
  for (int64_t j = 0; j < len; ++j) {
    const float u = residual[i + j] + input_at<DT, MOM>(update, mo, i + j);
    flags[j] = static_cast<uint8_t>((u >= tau) | (u <= -tau));  // reaches(u, tau), without a branch
    b |= static_cast<int32_t>(!(u - u == 0.0f));                  // u - u is 0 unless u is NaN/Inf
  }
  *bad |= b;
  return pack_flags(flags);
}

template <int DT, bool MOM>
inline uint64_t hit_bits(const void* update, const Momentum& mo, const float* residual, int64_t i, int64_t len,
                         float tau, int32_t* bad) {
#ifdef GS_SSE2
  if (DT == kFloat32 && len == kBlock) {  // movemask turns 4 compares into 4 bits in one instruction
    const float* g = static_cast<const float*>(update);
    const float* r = residual + i;
    const __m128 vt = _mm_set1_ps(tau), vnt = _mm_set1_ps(-tau), vm = _mm_set1_ps(mo.factor);
    __m128 vbad = _mm_setzero_ps();
    uint64_t bits = 0;
    for (int k = 0; k < kBlock; k += 4) {
      const __m128 u = _mm_add_ps(_mm_loadu_ps(r + k), input4<MOM>(g, mo, i + k, vm));
      const __m128 hit = _mm_or_ps(_mm_cmpge_ps(u, vt), _mm_cmple_ps(u, vnt));
      const __m128 d = _mm_sub_ps(u, u);
      vbad = _mm_or_ps(vbad, _mm_cmpunord_ps(d, d));  // u - u is NaN iff u is NaN/Inf
      bits |= static_cast<uint64_t>(_mm_movemask_ps(hit)) << k;
    }
    *bad |= _mm_movemask_ps(vbad);
    return bits;
  }
#endif
  return hit_bits_portable<DT, MOM>(update, mo, residual, i, len, tau, bad);
}

// Per chunk, in parallel: `block(b, len, &bad)` handles a block of up to 64 elements and returns its hit mask
// (setting bad when some u is not finite); the chunk's count of hits and its first non-finite element (or -1,
// searched for only in a chunk that had one) go to counts[c] and first_bad[c].
template <class Block, class Input>
void for_chunks(int64_t n, const float* residual, int64_t* counts, int64_t* first_bad, Block block, Input input) {
  const int64_t nch = num_chunks(n);
  GS_PARALLEL_FOR(n >= kParallelMin)
  for (int64_t c = 0; c < nch; ++c) {
    const int64_t lo = c * kChunk, hi = std::min(n, lo + kChunk);
    int64_t cnt = 0;
    int32_t bad = 0;
    for (int64_t b = lo; b < hi; b += kBlock) cnt += __builtin_popcountll(block(b, std::min(kBlock, hi - b), &bad));
    counts[c] = cnt;
    first_bad[c] = -1;
    if (bad) {  // rare: find the first offending element for the error message
      for (int64_t i = lo; i < hi; ++i)
        if (!is_finite(residual[i] + input(i))) {
          first_bad[c] = i;
          break;
        }
    }
  }
}

// Pass 1: per chunk, how many elements reach tau and the first non-finite u (or -1). Reads update and
// residual once; writes one count per chunk and, when `hits` is not null, the chunk's hit-mask words.
template <int DT, bool MOM>
void count_chunks(const void* update, const Momentum& mo, const float* residual, int64_t n, float tau,
                  int64_t* counts, int64_t* first_bad, uint64_t* hits) {
  for_chunks(
      n, residual, counts, first_bad,
      [&](int64_t b, int64_t len, int32_t* bad) {
        const uint64_t bits = hit_bits<DT, MOM>(update, mo, residual, b, len, tau, bad);
        if (hits) hits[b / kBlock] = bits;
        return bits;
      },
      [&](int64_t i) { return input_at<DT, MOM>(update, mo, i); });
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
// With momentum the block's new velocity goes to mo.out as well (nothing in the block was sent).
template <int DT, bool CLIP, bool MOM>
inline void step_silent(const void* update, const Momentum& mo, const float* residual, float* kept, int64_t b,
                        int64_t len, float clip) {
  for (int64_t j = 0; j < len; ++j) {
    const float w = input_at<DT, MOM>(update, mo, b + j);
    if (MOM) mo.out[b + j] = w;
    kept[b + j] = kept_silent<CLIP>(residual[b + j] + w, clip);
  }
}

// Block with hits: threshold_step on each element; returns the mask of elements that went negative.
// With momentum mo.out gets the new velocity, 0 where the element was sent (factor masking).
template <int DT, bool CLIP, bool MOM>
inline uint64_t step_hits(const void* update, const Momentum& mo, const float* residual, float* kept, int64_t b,
                          int64_t len, float tau, float clip) {
  const float c = CLIP ? clip : 0.0f;  // threshold_step clips only when clip > 0
#ifdef GS_SSE2
  if (DT == kFloat32 && len == kBlock) {  // threshold_step's selects as masks (pos and neg never both hold)
    const float* g = static_cast<const float*>(update);
    const float* r = residual + b;
    float* o = kept + b;
    const __m128 vt = _mm_set1_ps(tau), vnt = _mm_set1_ps(-tau), vc = _mm_set1_ps(c), vnc = _mm_set1_ps(-c);
    const __m128 vm = _mm_set1_ps(mo.factor);
    uint64_t neg_bits = 0;
    for (int k = 0; k < kBlock; k += 4) {
      const __m128 w = input4<MOM>(g, mo, b + k, vm);
      const __m128 u = _mm_add_ps(_mm_loadu_ps(r + k), w);
      const __m128 pos = _mm_cmpge_ps(u, vt), neg = _mm_cmple_ps(u, vnt);
      if (MOM) _mm_storeu_ps(mo.out + b + k, _mm_andnot_ps(_mm_or_ps(pos, neg), w));
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
    const float w = input_at<DT, MOM>(update, mo, b + j);
    const int s = threshold_step(residual[b + j] + w, tau, c, &k);
    negative[j] = static_cast<uint8_t>(s < 0);
    kept[b + j] = k;
    if (MOM) mo.out[b + j] = s != 0 ? 0.0f : w;
  }
  return pack_flags(negative);
}

// A block's part of the payload from its hit and negative masks. Sparse: its signed 1-based indices,
// ascending, at *p (advanced). Bitmap: 16 elements per word, bit k present, bit k + 16 negative.
template <bool BITMAP>
inline void emit_block(int64_t b, int64_t len, uint64_t hit, uint64_t neg, int32_t*& p, int32_t* payload) {
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

// The payload, chunk by chunk in parallel (sparse: chunk c at offsets[c]): `masks(b, len, &neg)` returns a block's
// hit mask and sets its negative mask, doing whatever else the block needs first.
template <bool BITMAP, class Masks>
void emit_chunks(int64_t n, const int64_t* offsets, int32_t* payload, Masks masks) {
  const int64_t nch = num_chunks(n);
  GS_PARALLEL_FOR(n >= kParallelMin)
  for (int64_t c = 0; c < nch; ++c) {
    const int64_t lo = c * kChunk, hi = std::min(n, lo + kChunk);
    int32_t* p = BITMAP ? nullptr : payload + offsets[c];
    for (int64_t b = lo; b < hi; b += kBlock) {
      const int64_t len = std::min(kBlock, hi - b);
      uint64_t neg = 0;
      const uint64_t hit = masks(b, len, &neg);
      emit_block<BITMAP>(b, len, hit, neg, p, payload);
    }
  }
}

// Pass 2 (in place): the kept residual of each block, then its part of the payload from the hit mask.
template <int DT, bool CLIP, bool BITMAP, bool MOM>
void write_chunks(const void* update, const Momentum& mo, const float* residual, float* kept, int64_t n, float tau,
                  float clip, const uint64_t* hits, const int64_t* offsets, int32_t* payload) {
  emit_chunks<BITMAP>(n, offsets, payload, [&](int64_t b, int64_t len, uint64_t* neg) {
    const uint64_t hit = hits[b / kBlock];
    if (hit == 0)
      step_silent<DT, CLIP, MOM>(update, mo, residual, kept, b, len, clip);
    else
      *neg = step_hits<DT, CLIP, MOM>(update, mo, residual, kept, b, len, tau, clip);
    return hit;
  });
}

// ---- direct: `kept` is not the residual, so it may be written before finiteness is known: one pass over the
// data. Each block's threshold_step for every element, kept (and the new velocity) stored at once, and its
// hit and negative masks kept; the payload is then built from the masks alone.

// One block: stores kept (and, with momentum, the new velocity, 0 where sent); returns the hit mask, the
// negative mask in *neg_bits; sets *bad if some u is not finite (what was stored is then dropped by the caller).
template <int DT, bool CLIP, bool MOM>
inline uint64_t step_block(const void* update, const Momentum& mo, const float* residual, float* kept, int64_t b,
                           int64_t len, float tau, float clip, uint64_t* neg_bits, int32_t* bad) {
  const float c = CLIP ? clip : 0.0f;
#ifdef GS_SSE2
  if (DT == kFloat32 && len == kBlock) {  // step_hits' selects, plus the hit mask and the finiteness test
    const float* g = static_cast<const float*>(update);
    const float* r = residual + b;
    float* o = kept + b;
    const __m128 vt = _mm_set1_ps(tau), vnt = _mm_set1_ps(-tau), vc = _mm_set1_ps(c), vnc = _mm_set1_ps(-c);
    const __m128 vm = _mm_set1_ps(mo.factor);
    __m128 vbad = _mm_setzero_ps();
    uint64_t hit_bits = 0, neg_out = 0;
    for (int k = 0; k < kBlock; k += 4) {
      const __m128 w = input4<MOM>(g, mo, b + k, vm);
      const __m128 u = _mm_add_ps(_mm_loadu_ps(r + k), w);
      const __m128 pos = _mm_cmpge_ps(u, vt), neg = _mm_cmple_ps(u, vnt), hit = _mm_or_ps(pos, neg);
      if (MOM) _mm_storeu_ps(mo.out + b + k, _mm_andnot_ps(hit, w));
      __m128 kv = _mm_or_ps(_mm_or_ps(_mm_and_ps(pos, _mm_sub_ps(u, vt)), _mm_and_ps(neg, _mm_add_ps(u, vt))),
                            _mm_andnot_ps(hit, u));
      if (CLIP) kv = _mm_max_ps(_mm_min_ps(kv, vc), vnc);  // same order as threshold_step (u finite)
      _mm_storeu_ps(o + k, kv);
      const __m128 d = _mm_sub_ps(u, u);
      vbad = _mm_or_ps(vbad, _mm_cmpunord_ps(d, d));
      hit_bits |= static_cast<uint64_t>(_mm_movemask_ps(hit)) << k;
      neg_out |= static_cast<uint64_t>(_mm_movemask_ps(neg)) << k;
    }
    *bad |= _mm_movemask_ps(vbad);
    *neg_bits = neg_out;
    return hit_bits;
  }
#endif
  uint8_t present[kBlock], negative[kBlock];
  if (len < kBlock) {
    std::memset(present, 0, sizeof present);
    std::memset(negative, 0, sizeof negative);
  }
  int32_t bd = 0;
  for (int64_t j = 0; j < len; ++j) {
    float k;
    const float w = input_at<DT, MOM>(update, mo, b + j);
    const float u = residual[b + j] + w;
    const int s = threshold_step(u, tau, c, &k);
    present[j] = static_cast<uint8_t>(s != 0);
    negative[j] = static_cast<uint8_t>(s < 0);
    bd |= static_cast<int32_t>(!(u - u == 0.0f));
    kept[b + j] = k;
    if (MOM) mo.out[b + j] = s != 0 ? 0.0f : w;
  }
  *bad |= bd;
  *neg_bits = pack_flags(negative);
  return pack_flags(present);
}

// The one pass: per chunk its count, first non-finite element (or -1), and the hit / negative masks.
template <int DT, bool CLIP, bool MOM>
void step_chunks(const void* update, const Momentum& mo, const float* residual, float* kept, int64_t n, float tau,
                 float clip, int64_t* counts, int64_t* first_bad, uint64_t* hits, uint64_t* negs) {
  for_chunks(
      n, residual, counts, first_bad,
      [&](int64_t b, int64_t len, int32_t* bad) {
        return hits[b / kBlock] =
                   step_block<DT, CLIP, MOM>(update, mo, residual, kept, b, len, tau, clip, &negs[b / kBlock], bad);
      },
      [&](int64_t i) { return input_at<DT, MOM>(update, mo, i); });
}

template <int DT, bool BITMAP, bool MOM>
void write_payload(const void* update, const Momentum& mo, const float* residual, float* kept, int64_t n, float tau,
                   float clip, const uint64_t* hits, const int64_t* offsets, int32_t* payload) {
  if (clip > 0.0f)
    write_chunks<DT, true, BITMAP, MOM>(update, mo, residual, kept, n, tau, clip, hits, offsets, payload);
  else
    write_chunks<DT, false, BITMAP, MOM>(update, mo, residual, kept, n, tau, clip, hits, offsets, payload);
}

template <int DT, bool MOM>
EncodeResult encode_t(const void* update, const Momentum& mo, const float* residual, float* kept, int64_t n,
                      float tau, float clip, int32_t choice, int32_t* out, int64_t capacity) {
  const int64_t nch = num_chunks(n);
  const bool direct = kept != residual;
  std::vector<int64_t> counts(nch), first_bad(nch);
  // Scratch of n/8 bytes (direct: twice that), left uninitialised: the first pass writes every word.
  const std::unique_ptr<uint64_t[]> hits(new uint64_t[static_cast<size_t>(mask_words(n))]);
  std::unique_ptr<uint64_t[]> negs;
  if (direct) {
    negs.reset(new uint64_t[static_cast<size_t>(mask_words(n))]);
    if (clip > 0.0f)
      step_chunks<DT, true, MOM>(update, mo, residual, kept, n, tau, clip, counts.data(), first_bad.data(),
                                 hits.get(), negs.get());
    else
      step_chunks<DT, false, MOM>(update, mo, residual, kept, n, tau, clip, counts.data(), first_bad.data(),
                                  hits.get(), negs.get());
  } else {
    count_chunks<DT, MOM>(update, mo, residual, n, tau, counts.data(), first_bad.data(), hits.get());
  }
  EncodeResult r{0, 0, -1, kSparse};
  for (int64_t c = 0; c < nch; ++c) {
    if (r.nonfinite_index < 0 && first_bad[c] >= 0) r.nonfinite_index = first_bad[c];
    r.count += counts[c];
  }
  if (r.nonfinite_index >= 0) return r;  // the residual is unchanged (a separate kept holds nothing of use)

  r.format = choose_format(choice, r.count, n, capacity);
  const int64_t need = kHeaderWords + payload_words(r.format, n, r.count);
  write_header(out, r.format, n, r.count, tau);
  int32_t* payload = out + kHeaderWords;
  const auto from_masks = [&](int64_t b, int64_t, uint64_t* neg) {  // direct: the first pass kept the masks
    *neg = negs[b / kBlock];
    return hits[b / kBlock];
  };
  if (r.format == kSparse) {
    int64_t acc = 0;
    for (int64_t c = 0; c < nch; ++c) {  // exclusive scan: chunk c writes at counts[0..c)
      const int64_t k = counts[c];
      counts[c] = acc;
      acc += k;
    }
    if (direct)
      emit_chunks<false>(n, counts.data(), payload, from_masks);
    else
      write_payload<DT, false, MOM>(update, mo, residual, kept, n, tau, clip, hits.get(), counts.data(), payload);
  } else {
    if (direct)
      emit_chunks<true>(n, nullptr, payload, from_masks);
    else
      write_payload<DT, true, MOM>(update, mo, residual, kept, n, tau, clip, hits.get(), nullptr, payload);
  }
  r.length = need;
  return r;
}

template <int DT>
CountResult count_t(const void* update, const float* residual, int64_t n, float tau) {
  const int64_t nch = num_chunks(n);
  std::vector<int64_t> counts(nch), first_bad(nch);
  count_chunks<DT, false>(update, Momentum{}, residual, n, tau, counts.data(), first_bad.data(), nullptr);
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
  return dispatch(dtype, Momentum{}, [&](auto kind) { return count_t<decltype(kind)::dt>(update, residual, n, tau); });
}

EncodeResult encode_cpu(const void* update, int32_t dtype, const float* residual, float* kept, int64_t n, float tau,
                        float clip, int32_t choice, int32_t* out, int64_t capacity, const Momentum& mo) {
  check_encode_args(dtype, n, tau, clip, choice, capacity);
  check_momentum(mo);
  return dispatch(dtype, mo, [&](auto kind) {
    return encode_t<decltype(kind)::dt, decltype(kind)::mom>(update, mo, residual, kept, n, tau, clip, choice, out,
                                                             capacity);
  });
}

}  // namespace gs
