// Top-k and ternary encoding with fused residual accumulation (CPU). The formats are described in
// csrc/gradshare/message.h; per-element rules (bf16 rounding, the selection key, the ternary test and
// the order of chunk sums) are in csrc/gradshare/element.h, shared with csrc/cuda/chunked.cu; the pure-torch
// twin is gradshare/reference.py. One chunk is one unit of work for one thread, so nothing depends on
// the number of threads.
//
// Two phases. Phase 1 (parallel over chunks) computes u = residual + update (with a fused momentum:
// residual + m * velocity + update, the new velocity going to its own buffer and then zeroed where sent) into
// a per-thread scratch chunk, checks it is finite and writes the chunk's part of the message. When `kept` is
// a separate buffer (the residual is only read), phase 1 also writes the chunk's kept residual (u, minus what
// was sent): top-k builds u in `kept` itself and subtracts in place, ternary writes it from the scratch chunk
// while it is in cache; a non-finite chunk then leaves `kept` partly written, which the caller discards with
// the step. In place (kept == residual) the residual may only change once every chunk
// is known to be finite: phase 2 then recomputes u and writes it. A non-finite u anywhere leaves the
// residual unchanged and turns the message into a marker of the same length.
#include <algorithm>
#include <cstring>
#include <functional>
#include <vector>

#include "cpu/clones.h"
#include "cpu/code_word.h"
#include "cpu/parallel.h"
#include "gradshare/kernels.h"

// SSE2 (every x86-64 CPU) for the top-k candidate masks; other targets, and builds with -DGS_NO_SIMD, use the
// portable loop, which gives the same masks.
#if defined(__SSE2__) && !defined(GS_NO_SIMD)
#include <emmintrin.h>
#define GS_SSE2 1
#endif

namespace gs {
namespace {

struct Collector;
void collect(Collector& col, const float* u, int64_t b, int64_t m);

// u = residual + input for one chunk into `u` (with momentum the input, the new velocity, into mo.out too);
// returns the first non-finite local index or -1. The encoder's own work rides on this one pass over memory:
// each(lane, x) sees every element as it is made (lane = its index % 32: ternary adds |x| into its lane sums in
// element.h's order), side(b, m) every 64-element block u[b, b + m) once it is written, in L1 (top-k collects its
// candidates there). Full blocks run in rows of 32 with a constant trip count, which the compiler vectorizes.
template <int DT, bool MOM, typename Each, typename Side>
inline int64_t load_chunk(const void* update, const Momentum& mo, const float* residual, int64_t lo, int64_t len,
                          float* u, Each&& each, Side&& side) {
  int32_t bad = 0;
  auto one = [&](int64_t j, int lane) {
    const float w = input_at<DT, MOM>(update, mo, lo + j);
    if (MOM) mo.out[lo + j] = w;
    const float x = residual[lo + j] + w;
    u[j] = x;
    bad |= static_cast<int32_t>(!(x - x == 0.0f));  // x - x is 0 unless x is NaN/Inf
    each(lane, x);
  };
  const int64_t full = len / 64 * 64;
  for (int64_t b = 0; b < full; b += 64) {
    for (int64_t r = b; r < b + 64; r += kLanes)
      for (int l = 0; l < kLanes; ++l) one(r + l, l);
    side(b, int64_t{64});
  }
  if (full < len) {
    for (int64_t j = full; j < len; ++j) one(j, static_cast<int>((j - full) % kLanes));
    side(full, len - full);
  }
  if (!bad) return -1;
  for (int64_t j = 0; j < len; ++j)
    if (!is_finite(u[j])) return j;
  return -1;
}

// Top-k's load: with a collector, the candidates of each block (which spares the selection a pass over the chunk).
int64_t load_topk(const void* update, int32_t dtype, const Momentum& mo, const float* residual, int64_t lo,
                  int64_t len, float* u, Collector* col) {
  return dispatch(dtype, mo, [&](auto kind) {
    return load_chunk<decltype(kind)::dt, decltype(kind)::mom>(update, mo, residual, lo, len, u,
                                                               [](int, float) {}, [&](int64_t b, int64_t m) {
                                                                 if (col) collect(*col, u, b, m);
                                                               });
  });
}

// kept[lo, lo + len) = residual + input (phase 2 in place: the chunk's u again).
void add_input(const void* update, int32_t dtype, const Momentum& mo, const float* residual, float* kept, int64_t lo,
               int64_t len) {
  dispatch(dtype, mo, [&](auto kind) {
    for (int64_t j = 0; j < len; ++j)
      kept[lo + j] = residual[lo + j] + input_at<decltype(kind)::dt, decltype(kind)::mom>(update, mo, lo + j);
  });
}

// Writes the non-finite marker (header + zeros up to `words`).
void write_marker(int32_t* out, int64_t words, int64_t n, int64_t index) {
  write_header(out, kNonFinite, n, index, 0.0f);
  std::fill(out + kHeaderWords, out + words, 0);
}

// The first non-finite element over all chunks (chunk order), or -1.
int64_t first_bad(const std::vector<int64_t>& bad, int64_t chunk) {
  for (size_t c = 0; c < bad.size(); ++c)
    if (bad[c] >= 0) return static_cast<int64_t>(c) * chunk + bad[c];
  return -1;
}

// The kc largest keys of u[0, len) (element.h's topk_key), as ascending local indices into `sel`.
// Radix selection on the magnitude's bits, which order the keys. A histogram of the top 11 bits finds the
// bin B holding the kc-th largest key; one pass then splits the chunk into the elements above B (all
// selected) and those in B (the candidates); a histogram of the next 11 bits among the candidates narrows
// them, and nth_element among what is left gives the kc-th largest key T exactly (keys are distinct: they
// end in the index). The candidates with a key >= T, merged with the elements above B, are the selection.
// A heap of kc keys paid a logarithmic update for each element that beat its root, thousands per chunk.
constexpr int kRadixBins = 2048;

inline uint32_t magnitude(float x) { return static_cast<uint32_t>(float_to_bits(x)) & 0x7fffffffu; }

struct TopkScratch {
  std::vector<int32_t> cand, picked, merged;
  std::vector<uint64_t> keys;
  std::vector<uint32_t> mags;
  // The candidates' floor for the next chunk this thread loads (0: none): the magnitude that about as many of the
  // last selected chunk's elements reached as a floor aims for. Neighbouring chunks are mostly one tensor's, so
  // most chunks collect their candidates while they load; where the floor misleads, the chunk is sampled. The
  // selection is exact from any floor, so what a thread selected before changes no bit.
  uint32_t guess = 0;
};

// The bin holding the kc-th largest of the counted elements, given `above` of them in higher bins already;
// `above` becomes the count in the bins above the returned one.
inline uint32_t bin_of_kth(const uint32_t* hist, int64_t kc, int64_t& above) {
  uint32_t b = kRadixBins - 1;
  while (above + hist[b] < kc) above += hist[b--];
  return b;
}

// The second radix step, shared by both selections: among candidates cand[0, nc) (magnitudes mag[i]), of which
// those in 11-bit bin b1 compete for the kc largest keys after `above` of them in higher bins, the kc-th largest
// key: a histogram of the next 11 bits within b1, then nth_element among the candidates in that finer bin.
template <class Mag>
uint64_t kth_key_in_bin(const int32_t* cand, int64_t nc, Mag mag, uint32_t b1, int64_t kc, int64_t above,
                        std::vector<uint64_t>& keys) {
  uint32_t hist[kRadixBins] = {};
  for (int64_t i = 0; i < nc; ++i) hist[(mag(i) >> 9) & (kRadixBins - 1)] += (mag(i) >> 20) == b1;
  const uint32_t b2 = bin_of_kth(hist, kc, above);
  // The candidates in both bins (magnitudes below 2^31: their top 22 bits are the two bins), without branches:
  // every key is written, and the count moves only where it belongs.
  const uint32_t both = (b1 << 11) | b2;
  keys.resize(static_cast<size_t>(nc));
  uint64_t* k = keys.data();
  int64_t nk = 0;
  for (int64_t i = 0; i < nc; ++i) {
    k[nk] = topk_key_of_magnitude(mag(i), cand[i]);
    nk += (mag(i) >> 9) == both;
  }
  const int64_t need = kc - above;  // >= 1: the largest `need` of the nk keys complete the selection
  std::nth_element(k, k + (need - 1), k + nk, std::greater<uint64_t>());
  return k[need - 1];
}

void select_topk_radix(const float* u, int64_t len, int64_t kc, TopkScratch& s, int32_t* sel) {
  // Four interleaved histograms: neighbours often share a bin, and one counter would chain their increments.
  uint32_t part[4][kRadixBins] = {};
  int64_t j4 = 0;
  for (; j4 + 4 <= len; j4 += 4)
    for (int q = 0; q < 4; ++q) ++part[q][magnitude(u[j4 + q]) >> 20];
  for (; j4 < len; ++j4) ++part[0][magnitude(u[j4]) >> 20];
  uint32_t hist[kRadixBins];
  for (int b = 0; b < kRadixBins; ++b) hist[b] = part[0][b] + part[1][b] + part[2][b] + part[3][b];
  int64_t above = 0;
  const uint32_t b1 = bin_of_kth(hist, kc, above);
  // Split without branches: every index is written, and the count moves only where it belongs. Runs of 16
  // with nothing in bin B or above (most of them at small densities) are passed over after one vector test.
  s.cand.resize(static_cast<size_t>(len));
  int32_t* cand = s.cand.data();
  int64_t na = 0, nc = 0;
  const int32_t floor_b1 = static_cast<int32_t>(b1 << 20);  // bin >= B  <=>  magnitude >= floor_b1
  for (int64_t r = 0; r < len; r += 16) {
    const int64_t m = std::min<int64_t>(16, len - r);
    int32_t hit = 0;
    if (m == 16) {
      for (int q = 0; q < 16; ++q) hit |= static_cast<int32_t>(static_cast<int32_t>(magnitude(u[r + q])) >= floor_b1);
    } else {
      hit = 1;
    }
    if (!hit) continue;
    for (int64_t j = r; j < r + m; ++j) {
      const uint32_t bin = magnitude(u[j]) >> 20;
      sel[na] = static_cast<int32_t>(j);  // sel holds kc + 1 entries and na < kc
      na += bin > b1;
      cand[nc] = static_cast<int32_t>(j);
      nc += bin == b1;
    }
  }
  const uint64_t t = kth_key_in_bin(cand, nc, [&](int64_t i) { return magnitude(u[cand[i]]); }, b1, kc, above,
                                     s.keys);
  s.picked.clear();
  for (int64_t i = 0; i < nc; ++i)
    if (topk_key(u[cand[i]], cand[i]) >= t) s.picked.push_back(cand[i]);
  s.merged.resize(static_cast<size_t>(kc));
  std::merge(sel, sel + na, s.picked.begin(), s.picked.end(), s.merged.begin());
  std::copy(s.merged.begin(), s.merged.end(), sel);
}

// Bit q of the result: magnitude(u[q]) >= low, for the 64 elements at u (len == 64) or the first len.
inline uint64_t at_least_bits(const float* u, int64_t len, uint32_t low) {
  uint64_t bits = 0;
#ifdef GS_SSE2
  if (len == 64) {
    const __m128i abs_mask = _mm_set1_epi32(0x7fffffff), below = _mm_set1_epi32(static_cast<int32_t>(low - 1));
    for (int q = 0; q < 64; q += 4) {
      const __m128i m = _mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u + q)), abs_mask);
      // magnitudes are below 2^31, so the signed compare orders them; low >= 1 (the caller's)
      bits |= static_cast<uint64_t>(_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpgt_epi32(m, below)))) << q;
    }
    return bits;
  }
#endif
  for (int64_t q = 0; q < len; ++q) bits |= static_cast<uint64_t>(magnitude(u[q]) >= low) << q;
  return bits;
}

// The same selection as select_topk_radix, found from candidates: every element at or above a floor, collected
// 64 at a time with vector compares (a few percent of the chunk at the densities used), on which alone the radix
// steps find the kc-th largest key T. Every element outside the candidates is below all of them, so when there
// are at least kc candidates the kc largest keys are among them, and the selection, the candidates with a key >=
// T, is exactly the radix one. The floor is the thread's guess from its last chunk, collected while the chunk
// loads (encode_topk_cpu), or else the magnitude that about twice kc of the chunk's elements reach, read off
// kSample elements spread over it and collected in a pass over the chunk. Where neither gives between kc
// candidates and a quarter of the chunk (or the sample's floor is 0: many zeros), the radix selection runs. The
// histograms of the radix selection cost a counter update per element, and its split a scalar pass over every 16
// elements that hold a large one (a third of them at 2%): this reads each element once, four to a compare.
constexpr int64_t kSample = 1024;

// Whether a chunk's selection starts from candidates: densities up to 1/16 (above, the candidates are too many)
// in chunks of 8 * kSample elements or more.
inline bool selects_candidates(int64_t len, int64_t kc) {
  return kc > 0 && kc < len && len >= 8 * kSample && 16 * kc <= len;
}

// The candidates a chunk may hold: beyond a quarter of it, the radix selection is as fast.
inline int64_t candidate_cap(int64_t len) { return len / 4; }

// The elements of u[b, b + m) (m <= 64) at or above col.low, appended to the candidates (cand and mags hold
// cap + 64: a block adds at most 64 past the cap, after which nothing more is collected).
struct Collector {
  uint32_t low;  // >= 1
  int64_t cap;
  int32_t* cand;
  uint32_t* mags;  // the candidates' magnitudes, read in order by the selection's passes
  int64_t nc;
};

void collect(Collector& col, const float* u, int64_t b, int64_t m) {
  if (col.nc > col.cap) return;
  uint64_t bits = at_least_bits(u + b, m, col.low);
  while (bits) {
    const int64_t j = b + __builtin_ctzll(bits);
    col.cand[col.nc] = static_cast<int32_t>(j);
    col.mags[col.nc++] = magnitude(u[j]);
    bits &= bits - 1;
  }
}

// The magnitude that about `aim` of the counted elements reach, interpolated within its 11-bit bin (a magnitude's
// bits grow about linearly with it within one); 0 when fewer than `aim` were counted.
inline uint32_t magnitude_reached_by(const uint32_t* hist, int64_t aim) {
  int64_t above = 0;
  for (int64_t b = kRadixBins - 1; b >= 0; --b) {
    if (above + hist[b] >= aim) {  // then hist[b] >= aim - above >= 1
      const uint64_t within = (static_cast<uint64_t>(aim - above) << 20) / hist[b];
      return static_cast<uint32_t>((static_cast<uint64_t>(b + 1) << 20) - within);
    }
    above += hist[b];
  }
  return 0;
}

// The selection among nc candidates, kc <= nc: the 11-bit bin of the kc-th largest, then the next 11 bits within
// that bin, then nth_element among the few left (one or two at 2%). The thread's next floor is read off the same
// histogram, aiming at `aim` candidates; where fewer were collected, the floor `low` they came from is kept.
void select_candidates(const Collector& col, int64_t kc, int64_t aim, TopkScratch& s, int32_t* sel) {
  const int32_t* cand = col.cand;
  const uint32_t* mags = col.mags;
  const int64_t nc = col.nc;
  uint32_t hist[kRadixBins] = {};
  for (int64_t i = 0; i < nc; ++i) ++hist[mags[i] >> 20];
  const uint32_t next = magnitude_reached_by(hist, aim);
  s.guess = next ? next : col.low;
  int64_t above = 0;
  const uint32_t b1 = bin_of_kth(hist, kc, above);
  const uint64_t t = kth_key_in_bin(cand, nc, [&](int64_t i) { return mags[i]; }, b1, kc, above, s.keys);
  int64_t m = 0;
  for (int64_t i = 0; i < nc; ++i) {
    sel[m] = cand[i];  // branch-free: sel holds kc + 1 entries and m < kc until the last pick
    m += topk_key_of_magnitude(mags[i], cand[i]) >= t;
  }
}

// The kc largest keys of u[0, len) as ascending local indices into `sel`. `loaded`: the candidates collected while
// the chunk loaded, from the thread's guess (or null).
void select_topk(const float* u, int64_t len, int64_t kc, TopkScratch& s, int32_t* sel, const Collector* loaded) {
  if (kc >= len) {
    for (int64_t j = 0; j < len; ++j) sel[j] = static_cast<int32_t>(j);
    return;
  }
  if (!selects_candidates(len, kc)) {  // short chunks, and densities above 1/16
    select_topk_radix(u, len, kc, s, sel);
    return;
  }
  // Sample i at i * stride plus a shift that varies with i: no period of the layout (a matrix's rows) lines up.
  const int64_t stride = len / kSample, cap = candidate_cap(len);
  const int64_t r = std::min<int64_t>(kSample, std::max<int64_t>(8, (2 * kc * kSample + len - 1) / len));
  const int64_t aim = r * stride;  // about as many as the sample's floor collects
  if (loaded && loaded->nc >= kc && loaded->nc <= cap) {
    select_candidates(*loaded, kc, aim, s, sel);
    return;
  }
  uint32_t sample[kSample];
  for (int64_t i = 0; i < kSample; ++i) sample[i] = magnitude(u[i * stride + (i * 7919) % stride]);
  std::nth_element(sample, sample + (r - 1), sample + kSample, std::greater<uint32_t>());
  const uint32_t low = sample[r - 1];
  s.guess = 0;
  if (low == 0) {
    select_topk_radix(u, len, kc, s, sel);
    return;
  }
  s.cand.resize(static_cast<size_t>(cap) + 64);
  s.mags.resize(static_cast<size_t>(cap) + 64);
  Collector col{low, cap, s.cand.data(), s.mags.data(), 0};
  for (int64_t b = 0; b < len && col.nc <= cap; b += 64) collect(col, u, b, std::min<int64_t>(64, len - b));
  if (col.nc < kc || col.nc > cap) {
    select_topk_radix(u, len, kc, s, sel);
    return;
  }
  select_candidates(col, kc, aim, s, sel);
}

}  // namespace

namespace {

// Sets bits [off, off + nbits) of a zeroed bit stream to `value` (nbits in [0, 32]).
inline void stream_put(int32_t* s, int64_t off, int nbits, uint32_t value) {
  if (nbits <= 0) return;
  const int64_t q = off >> 5;
  const int b = static_cast<int>(off & 31);
  s[q] = static_cast<int32_t>(static_cast<uint32_t>(s[q]) | (value << b));
  if (b + nbits > 32) s[q + 1] = static_cast<int32_t>(static_cast<uint32_t>(s[q + 1]) | (value >> (32 - b)));
}

// Writes the kc selected entries (ascending local indices in sel[0..kc)) of a chunk of len elements in
// `format`: top-k words (bf16 value | index) in place of sel, the 8-bit layout (scale, index pairs, int8
// values), or the signs layout (scale, Elias-Fano indices, sign bits). With `kept` (u itself, phase 1), each
// entry's sent value is subtracted from it as the entry is written, the value subtract_topk would read back.
void pack_topk(int32_t format, float* u, const int32_t* sel, int64_t kc, int64_t len, int32_t* w, bool kept) {
  if (format == kTopKSign) {
    float acc[kLanes] = {0.0f};  // element.h's order over the entries: lane i % 32 adds entry i
    for (int64_t i = 0; i < kc; ++i) {
      const float x = u[sel[i]];
      acc[i % kLanes] += x < 0.0f ? -x : x;
    }
    const float s = kc ? lane_tree(acc) / static_cast<float>(kc) : 0.0f;
    w[0] = float_to_bits(s);
    const int64_t bits = topks_chunk_bits(len, kc);
    std::fill(w + 1, w + 1 + (bits + 31) / 32, 0);
    const int l = ef_low_bits(len, kc);
    const int64_t hs = kc * l, ss = hs + (kc ? ef_high_bits(len, kc, l) : 0);
    for (int64_t i = 0; i < kc; ++i) {
      const uint32_t p = static_cast<uint32_t>(sel[i]);
      const bool negative = u[p] < 0.0f;
      stream_put(w + 1, i * l, l, l ? (p & ((1u << l) - 1u)) : 0u);
      stream_put(w + 1, hs + (p >> l) + i, 1, 1u);
      stream_put(w + 1, ss + i, 1, negative ? 1u : 0u);
      if (kept) u[p] -= sign_entry(s, negative);
    }
    return;
  }
  if (format == kTopK) {
    for (int64_t i = 0; i < kc; ++i) {
      const int32_t p = sel[i];
      const uint16_t v = bf16_bits(u[p]);
      w[i] = topk_word(v, p);
      if (kept) u[p] -= bf16_bits_to_float(v);
    }
    return;
  }
  uint32_t big = 0;  // the largest |u| sent, as bits (they order non-negative floats)
  for (int64_t i = 0; i < kc; ++i) big = std::max(big, magnitude(u[sel[i]]));
  const float s = topk8_scale(bits_to_float(static_cast<int32_t>(big)));
  const int64_t iw = (kc + 1) / 2, vw = (kc + 3) / 4;
  std::fill(w + 1, w + 1 + iw + vw, 0);
  w[0] = float_to_bits(s);
  for (int64_t i = 0; i < kc; ++i) {
    const int v = topk8_quantize(u[sel[i]], s);
    const uint32_t q = static_cast<uint8_t>(static_cast<int8_t>(v));
    w[1 + i / 2] = static_cast<int32_t>(static_cast<uint32_t>(w[1 + i / 2]) | (static_cast<uint32_t>(sel[i]) << (16 * (i % 2))));
    w[1 + iw + i / 4] = static_cast<int32_t>(static_cast<uint32_t>(w[1 + iw + i / 4]) | (q << (8 * (i % 4))));
    if (kept) u[sel[i]] -= topk8_entry(v, s);
  }
}

// kept[0, kc entries of chunk words w) -= the value each entry sent (exact in float32 for bf16 values), read back
// from the message: phase 2 (in place) has no selection at hand.
void subtract_topk(int32_t format, const int32_t* w, int64_t kc, int64_t len, float* kept) {
  if (format == kTopKSign) {
    const float s = bits_to_float(w[0]);
    topks_for_each(w + 1, len, kc, [&](int64_t, int64_t pos, bool negative) {
      kept[pos] -= sign_entry(s, negative);
      return true;
    });
    return;
  }
  if (format == kTopK) {
    for (int64_t i = 0; i < kc; ++i) {
      const uint32_t e = static_cast<uint32_t>(w[i]);
      kept[e & 0xffffu] -= bf16_bits_to_float(static_cast<uint16_t>(e >> 16));
    }
  } else {
    const float s = bits_to_float(w[0]);
    for (int64_t i = 0; i < kc; ++i) kept[topk8_index(w, i)] -= topk8_entry(topk8_value(w, kc, i), s);
  }
}

}  // namespace

// Top-k (format kTopK: bfloat16 values) or 8-bit top-k (kTopK8): the same selection, two layouts.
ChunkedResult encode_topk_cpu(const void* update, int32_t dtype, const float* residual, float* kept, int64_t n,
                              int64_t chunk, int64_t k, int32_t format, int32_t* out, int64_t capacity,
                              const Momentum& mo) {
  const int64_t words = check_chunked_args(format, dtype, n, chunk, k, 0.0f, capacity);
  check_momentum(mo);
  const int64_t nch = (n + chunk - 1) / chunk, stride = chunk_stride(format, chunk, k);
  const bool direct = kept != residual;  // kept written in phase 1 (see the top of this file)
  std::vector<int64_t> bad(static_cast<size_t>(nch), -1);
  int32_t* payload = out + kHeaderWords;
  // Phase 1: select and write the message.
#ifdef GS_HAVE_OPENMP
#pragma omp parallel if (n >= kParallelMin)
#endif
  {
    std::vector<float> u(direct ? 0 : static_cast<size_t>(std::min(chunk, n)));
    std::vector<int32_t> sel(static_cast<size_t>(std::min(k, n)) + 1);
    TopkScratch scratch;
#ifdef GS_HAVE_OPENMP
#pragma omp for schedule(static)
#endif
    for (int64_t c = 0; c < nch; ++c) {
      const int64_t lo = c * chunk, len = chunk_len(n, chunk, c), kc = topk_k(k, len, chunk);
      int32_t* w = payload + c * stride;  // every earlier chunk is full
      // With a kept buffer apart from the residual, u is built in place there (the spare: nothing reads it
      // until a completed step commits it), so no copy of the chunk follows.
      float* uc = direct ? kept + lo : u.data();
      Collector col{scratch.guess, candidate_cap(len), nullptr, nullptr, 0};
      const bool guessed = scratch.guess && selects_candidates(len, kc);
      if (guessed) {
        scratch.cand.resize(static_cast<size_t>(col.cap) + 64);
        scratch.mags.resize(static_cast<size_t>(col.cap) + 64);
        col.cand = scratch.cand.data();
        col.mags = scratch.mags.data();
      }
      bad[c] = load_topk(update, dtype, mo, residual, lo, len, uc, guessed ? &col : nullptr);
      if (bad[c] >= 0) continue;
      if (kc > 0) select_topk(uc, len, kc, scratch, sel.data(), guessed ? &col : nullptr);
      pack_topk(format, uc, sel.data(), kc, len, w, direct);
      if (mo.velocity)
        for (int64_t i = 0; i < kc; ++i) mo.out[lo + sel[i]] = 0.0f;  // momentum factor masking
    }
  }
  const int64_t b = first_bad(bad, chunk);
  if (b >= 0) {
    write_marker(out, words, n, b);
    return {words, 0, b};
  }
  // Phase 2 (in place): kept = u, minus the value sent for each entry.
  if (!direct) {
    GS_PARALLEL_FOR(n >= kParallelMin)
    for (int64_t c = 0; c < nch; ++c) {
      const int64_t lo = c * chunk, len = chunk_len(n, chunk, c), kc = topk_k(k, len, chunk);
      add_input(update, dtype, mo, residual, kept, lo, len);
      subtract_topk(format, payload + c * stride, kc, len, kept + lo);
    }
  }
  write_header(out, format, n, chunk, 0.0f);
  out[4] = static_cast<int32_t>(k);
  return {words, topk_entries(n, chunk, k), -1};
}

namespace {

// Ternary's chunk sums in element.h's order: 32 lanes, lane l adding elements l, l + 32, ... in turn (rows of 32,
// then the tail's elements in their lanes). Each rides on a pass the chunk needs anyway, so a chunk is read
// from memory once: the load sums |u|, then the flags' pass over the chunk in cache sums the sent |u| and counts
// them.

// Ternary's load (load_chunk), with *sum = the chunk's sum of |u| (meaningless when a u is not finite).
template <int DT, bool MOM>
GS_AVX2_CLONES int64_t load_abs_sum_t(const void* update, const Momentum& mo, const float* residual, int64_t lo,
                                      int64_t len, float* u, float* sum) {
  float acc[kLanes] = {0.0f};
  const int64_t bad = load_chunk<DT, MOM>(update, mo, residual, lo, len, u,
                                          [&](int lane, float x) { acc[lane] += x < 0.0f ? -x : x; },
                                          [](int64_t, int64_t) {});
  *sum = lane_tree(acc);
  return bad;
}

int64_t load_abs_sum(const void* update, int32_t dtype, const Momentum& mo, const float* residual, int64_t lo,
                     int64_t len, float* u, float* sum) {
  return dispatch(dtype, mo, [&](auto kind) {
    return load_abs_sum_t<decltype(kind)::dt, decltype(kind)::mom>(update, mo, residual, lo, len, u, sum);
  });
}

// Which elements of u[0, len) are sent at threshold th (sent[j], and negative[j] where sent and u < 0); returns
// their count, *sent_sum = the sum of their |u| (an element not sent adds +0.0, which leaves a lane unchanged).
GS_AVX2_CLONES int64_t ternary_flags(const float* u, int64_t len, float th, uint8_t* sent, uint8_t* negative,
                                     float* sent_sum) {
  float acc[kLanes] = {0.0f};
  int64_t cnt = 0;
  auto one = [&](int64_t j, int l) {
    const uint8_t s = static_cast<uint8_t>(ternary_sent(u[j], th));
    sent[j] = s;
    negative[j] = s & static_cast<uint8_t>(u[j] < 0.0f);
    acc[l] += keep_or_zero(u[j] < 0.0f ? -u[j] : u[j], s);
    cnt += s;
  };
  const int64_t rows = len / kLanes;
  for (int64_t r = 0; r < rows; ++r)
    for (int l = 0; l < kLanes; ++l) one(r * kLanes + l, l);
  for (int64_t j = rows * kLanes; j < len; ++j) one(j, static_cast<int>(j - rows * kLanes));
  *sent_sum = lane_tree(acc);
  return cnt;
}

// What a ternary element keeps: u minus +-scale where it was sent (x - 0.0f is x, so no branch on unsent).
inline float ternary_kept(float u, bool sent, bool negative, float scale) {
  return u - keep_or_zero(negated_if(scale, negative), sent);
}

// One chunk's end (phase 1): kept = u minus +-scale where sent (`kept` null: in place, phase 2 does it), and
// with momentum the new velocity zeroed where sent (factor masking; `velocity` null: none).
GS_AVX2_CLONES void ternary_keep(const float* u, const uint8_t* sent, int64_t len, float scale, float* kept,
                                 float* velocity) {
  if (kept && velocity) {
    for (int64_t j = 0; j < len; ++j) {
      kept[j] = ternary_kept(u[j], sent[j], u[j] < 0.0f, scale);
      velocity[j] = keep_or_zero(velocity[j], !sent[j]);
    }
  } else if (kept) {
    for (int64_t j = 0; j < len; ++j) kept[j] = ternary_kept(u[j], sent[j], u[j] < 0.0f, scale);
  } else if (velocity) {
    for (int64_t j = 0; j < len; ++j) velocity[j] = keep_or_zero(velocity[j], !sent[j]);
  }
}

template <int DT, bool MOM>
GS_AVX2_CLONES void ternary_residual(const void* update, const Momentum& mo, const float* residual, float* kept,
                                    int64_t lo, int64_t len, const int32_t* w) {
  const float scale = bits_to_float(w[0]);
  const int64_t words = (len + 15) / 16;
  for (int64_t q = 0; q < words; ++q) {
    const uint32_t code = static_cast<uint32_t>(w[1 + q]);
    const uint32_t present = code & 0xffffu, negative = code >> 16;
    const int64_t base = lo + q * 16, m = std::min<int64_t>(16, len - q * 16);
    if (m == 16) {
      for (int b = 0; b < 16; ++b) {
        const float x = residual[base + b] + input_at<DT, MOM>(update, mo, base + b);
        kept[base + b] = ternary_kept(x, present & kBit[b], negative & kBit[b], scale);
      }
    } else {
      for (int64_t b = 0; b < m; ++b) {
        const float x = residual[base + b] + input_at<DT, MOM>(update, mo, base + b);
        kept[base + b] = ternary_kept(x, present & kBit[b], negative & kBit[b], scale);
      }
    }
  }
}

}  // namespace

ChunkedResult encode_ternary_cpu(const void* update, int32_t dtype, const float* residual, float* kept, int64_t n,
                                 int64_t chunk, float fraction, int32_t* out, int64_t capacity, const Momentum& mo) {
  const int64_t words = check_chunked_args(kTernary, dtype, n, chunk, 0, fraction, capacity);
  check_momentum(mo);
  const int64_t nch = (n + chunk - 1) / chunk, per_full = ternary_chunk_words(chunk);
  const bool direct = kept != residual;  // kept written in phase 1 (see the top of this file)
  std::vector<int64_t> bad(static_cast<size_t>(nch), -1), entries(static_cast<size_t>(nch), 0);
  int32_t* payload = out + kHeaderWords;
  // Phase 1: per chunk the scale and the codes.
#ifdef GS_HAVE_OPENMP
#pragma omp parallel if (n >= kParallelMin)
#endif
  {
    const size_t cap = static_cast<size_t>(std::min(chunk, n));
    std::vector<float> u(cap);
    std::vector<uint8_t> sent(cap), negative(cap);
#ifdef GS_HAVE_OPENMP
#pragma omp for schedule(static)
#endif
    for (int64_t c = 0; c < nch; ++c) {
      const int64_t lo = c * chunk, len = chunk_len(n, chunk, c);
      float sum = 0.0f, sent_sum = 0.0f;
      bad[c] = load_abs_sum(update, dtype, mo, residual, lo, len, u.data(), &sum);
      if (bad[c] >= 0) continue;
      const float th = fraction * (sum / static_cast<float>(len));
      const int64_t cnt = ternary_flags(u.data(), len, th, sent.data(), negative.data(), &sent_sum);
      // The code words, 64 elements at a time from their packed masks (a chunk's last block zero-padded).
      int32_t* w = payload + c * per_full;
      for (int64_t b = 0; b < len; b += 64) {
        const int64_t m = std::min<int64_t>(64, len - b);
        if (m == 64) {
          write_code_words(w + 1 + b / 16, pack_flags(sent.data() + b), pack_flags(negative.data() + b), 4);
        } else {
          uint8_t ps[64] = {0}, ns[64] = {0};
          std::memcpy(ps, sent.data() + b, static_cast<size_t>(m));
          std::memcpy(ns, negative.data() + b, static_cast<size_t>(m));
          write_code_words(w + 1 + b / 16, pack_flags(ps), pack_flags(ns), (m + 15) / 16);
        }
      }
      w[0] = float_to_bits(cnt ? sent_sum / static_cast<float>(cnt) : 0.0f);
      entries[c] = cnt;
      ternary_keep(u.data(), sent.data(), len, bits_to_float(w[0]), direct ? kept + lo : nullptr,
                   mo.velocity ? mo.out + lo : nullptr);
    }
  }
  const int64_t b = first_bad(bad, chunk);
  if (b >= 0) {
    write_marker(out, words, n, b);
    return {words, 0, b};
  }
  // Phase 2 (in place): kept = u, minus +-scale where sent.
  if (!direct) {
    GS_PARALLEL_FOR(n >= kParallelMin)
    for (int64_t c = 0; c < nch; ++c) {
      const int64_t lo = c * chunk, len = chunk_len(n, chunk, c);
      const int32_t* w = payload + c * per_full;
      dispatch(dtype, mo, [&](auto kind) {
        ternary_residual<decltype(kind)::dt, decltype(kind)::mom>(update, mo, residual, kept, lo, len, w);
      });
    }
  }
  int64_t total = 0;
  for (int64_t e : entries) total += e;
  write_header(out, kTernary, n, chunk, 0.0f);
  out[4] = static_cast<int32_t>(total);
  return {words, total, -1};
}

}  // namespace gs
