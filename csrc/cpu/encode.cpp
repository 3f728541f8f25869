// Threshold encoding with fused residual accumulation (CPU). See csrc/gradshare/message.h for the
// format and csrc/gradshare/element.h for the per-element rule shared with the CUDA kernels.
#include <algorithm>
#include <cstring>
#include <vector>
#include "cpu/parallel.h"
#include "gradshare/kernels.h"

namespace gs {
namespace {

template <int DT>
inline float upd(const void* p, int64_t i) {
  return load_as_float(p, DT, i);
}

// Pass 1: per chunk, how many elements reach tau and whether any u is non-finite. Reads update and
// residual once; writes nothing but one count per chunk.
template <int DT>
void count_chunks(const void* update, const float* residual, int64_t n, float tau, int64_t* counts,
                  int64_t* first_bad) {
  const int64_t nch = num_chunks(n);
  GS_PARALLEL_FOR(n >= kParallelMin)
  for (int64_t c = 0; c < nch; ++c) {
    const int64_t lo = c * kChunk, hi = std::min(n, lo + kChunk);
    // int32 lanes and a float test for finiteness (u - u is 0 unless u is NaN/Inf) keep this loop
    // vectorised: it is half of the memory traffic of an encode.
    int32_t cnt = 0, bad = 0;
    for (int64_t i = lo; i < hi; ++i) {
      const float u = residual[i] + upd<DT>(update, i);
      cnt += static_cast<int32_t>(u >= tau) | static_cast<int32_t>(u <= -tau);
      bad |= static_cast<int32_t>(!(u - u == 0.0f));
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

// Residual update and signs for elements [b, b+len) of one block. A select-only loop, so it vectorises;
// the data-dependent work (emitting indices / packing bits) then reads the cache-resident signs.
constexpr int64_t kSignBlock = 512;  // a multiple of 16: blocks hold whole bitmap words

template <int DT>
inline void step_block(const void* update, float* residual, int64_t b, int64_t len, float tau, float clip,
                       int8_t* sign) {
  for (int64_t j = 0; j < len; ++j) {
    float kept;
    sign[j] = static_cast<int8_t>(threshold_step(residual[b + j] + upd<DT>(update, b + j), tau, clip, &kept));
    residual[b + j] = kept;
  }
}

// Pass 2 (sparse): write the kept residual and the signed 1-based indices at each chunk's offset.
template <int DT>
void write_sparse(const void* update, float* residual, int64_t n, float tau, float clip, const int64_t* offsets,
                  int32_t* payload) {
  const int64_t nch = num_chunks(n);
  GS_PARALLEL_FOR(n >= kParallelMin)
  for (int64_t c = 0; c < nch; ++c) {
    const int64_t lo = c * kChunk, hi = std::min(n, lo + kChunk);
    int32_t* p = payload + offsets[c];
    int8_t sign[kSignBlock];
    for (int64_t b = lo; b < hi; b += kSignBlock) {
      const int64_t len = std::min(kSignBlock, hi - b);
      step_block<DT>(update, residual, b, len, tau, clip, sign);
      for (int64_t j0 = 0; j0 < len; j0 += 8) {  // skip 8 silent elements per test (len % 8 == 0 but the tail)
        uint64_t eight = 0;
        const int64_t m = std::min<int64_t>(8, len - j0);
        std::memcpy(&eight, sign + j0, static_cast<size_t>(m));
        if (eight == 0) continue;
        for (int64_t j = j0; j < j0 + m; ++j)
          if (sign[j] != 0) *p++ = static_cast<int32_t>(sign[j] > 0 ? (b + j + 1) : -(b + j + 1));
      }
    }
  }
}

// Pass 2 (bitmap): 16 elements per word.
template <int DT>
void write_bitmap(const void* update, float* residual, int64_t n, float tau, float clip, int32_t* payload) {
  const int64_t nch = num_chunks(n);
  GS_PARALLEL_FOR(n >= kParallelMin)
  for (int64_t c = 0; c < nch; ++c) {
    const int64_t lo = c * kChunk, hi = std::min(n, lo + kChunk);
    int8_t sign[kSignBlock];
    for (int64_t b = lo; b < hi; b += kSignBlock) {
      const int64_t len = std::min(kSignBlock, hi - b);
      step_block<DT>(update, residual, b, len, tau, clip, sign);
      for (int64_t w = 0; w < len; w += 16) {
        uint32_t word = 0;
        const int64_t end = std::min<int64_t>(16, len - w);
        for (int64_t k = 0; k < end; ++k) {
          const int8_t sg = sign[w + k];
          word |= (static_cast<uint32_t>(sg != 0) << k) | (static_cast<uint32_t>(sg < 0) << (k + 16));
        }
        payload[(b + w) / 16] = static_cast<int32_t>(word);
      }
    }
  }
}

template <int DT>
EncodeResult encode_t(const void* update, float* residual, int64_t n, float tau, float clip, int32_t choice,
                      int32_t* out, int64_t capacity) {
  const int64_t nch = num_chunks(n);
  std::vector<int64_t> counts(nch), first_bad(nch);
  count_chunks<DT>(update, residual, n, tau, counts.data(), first_bad.data());
  EncodeResult r{0, 0, -1, kSparse};
  for (int64_t c = 0; c < nch; ++c) {
    if (r.nonfinite_index < 0 && first_bad[c] >= 0) r.nonfinite_index = first_bad[c];
    r.count += counts[c];
  }
  if (r.nonfinite_index >= 0) return r;  // nothing written: the residual stays as it was

  r.format = choice == kChooseAuto ? (prefer_sparse(r.count, n) ? kSparse : kBitmap) : choice;
  const int64_t need = kHeaderWords + payload_words(r.format, n, r.count);
  if (need > capacity)
    throw std::invalid_argument("out: message needs " + std::to_string(need) + " words, capacity is " +
                                std::to_string(capacity));
  write_header(out, r.format, n, r.count, tau);
  if (r.format == kSparse) {
    int64_t acc = 0;
    for (int64_t c = 0; c < nch; ++c) {  // exclusive scan: chunk c writes at counts[0..c)
      const int64_t k = counts[c];
      counts[c] = acc;
      acc += k;
    }
    write_sparse<DT>(update, residual, n, tau, clip, counts.data(), out + kHeaderWords);
  } else {
    write_bitmap<DT>(update, residual, n, tau, clip, out + kHeaderWords);
  }
  r.length = need;
  return r;
}

template <int DT>
CountResult count_t(const void* update, const float* residual, int64_t n, float tau) {
  const int64_t nch = num_chunks(n);
  std::vector<int64_t> counts(nch), first_bad(nch);
  count_chunks<DT>(update, residual, n, tau, counts.data(), first_bad.data());
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

EncodeResult encode_cpu(const void* update, int32_t dtype, float* residual, int64_t n, float tau, float clip,
                        int32_t choice, int32_t* out, int64_t capacity) {
  check_encode_args(dtype, n, tau, clip, choice, capacity);
  switch (dtype) {
    case kFloat16: return encode_t<kFloat16>(update, residual, n, tau, clip, choice, out, capacity);
    case kBFloat16: return encode_t<kBFloat16>(update, residual, n, tau, clip, choice, out, capacity);
    default: return encode_t<kFloat32>(update, residual, n, tau, clip, choice, out, capacity);
  }
}

}  // namespace gs
