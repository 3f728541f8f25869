// Threshold encoding with fused residual accumulation (CPU). See csrc/gradshare/message.h for the
// format and csrc/gradshare/element.h for the per-element rule shared with the CUDA kernels.
#include <algorithm>
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
    int64_t cnt = 0;
    int bad = 0;
    for (int64_t i = lo; i < hi; ++i) {
      const float u = residual[i] + upd<DT>(update, i);
      cnt += reaches(u, tau) ? 1 : 0;
      bad |= is_finite(u) ? 0 : 1;
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

// Pass 2 (sparse): write the kept residual and the signed 1-based indices at each chunk's offset.
template <int DT>
void write_sparse(const void* update, float* residual, int64_t n, float tau, float clip, const int64_t* offsets,
                  int32_t* payload) {
  const int64_t nch = num_chunks(n);
  GS_PARALLEL_FOR(n >= kParallelMin)
  for (int64_t c = 0; c < nch; ++c) {
    const int64_t lo = c * kChunk, hi = std::min(n, lo + kChunk);
    int32_t* p = payload + offsets[c];
    for (int64_t i = lo; i < hi; ++i) {
      float kept;
      const int s = threshold_step(residual[i] + upd<DT>(update, i), tau, clip, &kept);
      residual[i] = kept;
      if (s != 0) *p++ = s > 0 ? static_cast<int32_t>(i + 1) : -static_cast<int32_t>(i + 1);
    }
  }
}

// Pass 2 (bitmap): 16 elements per word; a chunk owns whole words.
template <int DT>
void write_bitmap(const void* update, float* residual, int64_t n, float tau, float clip, int32_t* payload) {
  const int64_t nch = num_chunks(n);
  GS_PARALLEL_FOR(n >= kParallelMin)
  for (int64_t c = 0; c < nch; ++c) {
    const int64_t lo = c * kChunk, hi = std::min(n, lo + kChunk);
    for (int64_t w0 = lo; w0 < hi; w0 += 16) {
      uint32_t word = 0;
      const int64_t end = std::min(hi, w0 + 16);
      for (int64_t i = w0; i < end; ++i) {
        float kept;
        const int s = threshold_step(residual[i] + upd<DT>(update, i), tau, clip, &kept);
        residual[i] = kept;
        const uint32_t b = static_cast<uint32_t>(i - w0);
        if (s != 0) word |= (1u << b) | (s < 0 ? (1u << (b + 16)) : 0u);
      }
      payload[w0 / 16] = static_cast<int32_t>(word);
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
