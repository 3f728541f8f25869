// Bounds-checked decoding (CPU): every message is validated in full before any element of dst is
// touched, so a corrupt or hostile message raises and leaves dst exactly as it was.
#include <algorithm>
#include <string>
#include "cpu/clones.h"
#include "cpu/code_word.h"
#include "cpu/parallel.h"
#include "gradshare/kernels.h"

namespace gs {
namespace {

[[noreturn]] void fail(int64_t m, const std::string& what) {
  throw MessageError("message " + std::to_string(m) + ": " + what);
}

// Index of the first invalid payload word, or -1.
int64_t first_bad_sparse(const int32_t* p, int64_t count, int64_t n) {
  int bad = 0;
#ifdef GS_HAVE_OPENMP
#pragma omp parallel for schedule(static) reduction(| : bad) if (count >= kParallelMin)
#endif
  for (int64_t j = 0; j < count; ++j) {
    const int64_t prev = j == 0 ? 0 : (p[j - 1] < 0 ? -(int64_t)p[j - 1] : (int64_t)p[j - 1]);
    bad |= sparse_entry_ok(p[j], prev, n) ? 0 : 1;
  }
  if (!bad) return -1;
  for (int64_t j = 0; j < count; ++j) {
    const int64_t prev = j == 0 ? 0 : (p[j - 1] < 0 ? -(int64_t)p[j - 1] : (int64_t)p[j - 1]);
    if (!sparse_entry_ok(p[j], prev, n)) return j;
  }
  return -1;
}

// Top-k / ternary payloads, chunk by chunk (parallel over chunks): the first bad chunk's complaint.
void validate_chunked(const int32_t* msg, int64_t m, int64_t n, float scale) {
  const int64_t chunk = msg[3], k = msg[4], nch = (n + chunk - 1) / chunk;
  const int32_t* p = msg + kHeaderWords;
  const int32_t format = msg[1];
  const int64_t per_full = chunk_stride(format, chunk, k);
  int64_t first = nch, total = 0;
  int reason = 0;
#ifdef GS_HAVE_OPENMP
#pragma omp parallel for schedule(static) reduction(+ : total) if (n >= kParallelMin)
#endif
  for (int64_t c = 0; c < nch; ++c) {
    int64_t entries = 0;
    const int why = check_chunk(p + c * per_full, format, k, chunk_len(n, chunk, c), chunk, scale, &entries);
    total += entries;
    if (why) {
#ifdef GS_HAVE_OPENMP
#pragma omp critical
#endif
      if (c < first) {
        first = c;
        reason = why;
      }
    }
  }
  if (first < nch) fail(m, "chunk " + std::to_string(first) + " " + chunk_complaint(reason));
  if (format == kTernary && total != k)
    fail(m, "ternary codes hold " + std::to_string(total) + " entries but the header says " + std::to_string(k));
}

// d[0, len) += the ternary code words w (16 elements each, the last one's first len % 16), each present
// element +-v: one chunk of a ternary message.
GS_AVX2_CLONES void add_code_words(float* d, const int32_t* w, float v, int64_t len) {
  for (int64_t q = 0; q < (len + 15) / 16; ++q)
    add_code_word(d + q * 16, static_cast<uint32_t>(w[q]), v, std::min<int64_t>(16, len - q * 16));
}

// d[0, len) += chunk c's entries (words w) of a chunked message of `format`, k and `chunk` (len: the chunk's).
void apply_chunk(float* d, const int32_t* w, int32_t format, int64_t k, int64_t chunk, int64_t len, float scale) {
  if (format == kTopK8) {
    const int64_t kc = topk_k(k, len, chunk);
    const float s = bits_to_float(w[0]);
    for (int64_t i = 0; i < kc; ++i) d[topk8_index(w, i)] += topk8_entry(topk8_value(w, kc, i), s) * scale;
    return;
  }
  if (format == kTopKSign) {
    const int64_t kc = topk_k(k, len, chunk);
    const float s = bits_to_float(w[0]);
    topks_for_each(w + 1, len, kc, [&](int64_t, int64_t pos, bool negative) {
      d[pos] += sign_entry(s, negative) * scale;
      return true;
    });
    return;
  }
  if (format == kTopK) {
    for (int64_t i = 0; i < topk_k(k, len, chunk); ++i) {
      const uint32_t e = static_cast<uint32_t>(w[i]);
      d[e & 0xffffu] += bf16_bits_to_float(static_cast<uint16_t>(e >> 16)) * scale;
    }
    return;
  }
  add_code_words(d, w + 1, bits_to_float(w[0]) * scale, len);
}

// Chunked messages msgs[0, count) (rows of row_words), all with the same chunk size, applied chunk by chunk: chunk
// c of every message in message order, then chunk c + 1. Each element still receives the messages' entries in
// message order (the same sums as one message after another), and a chunk of dst is read and written once for
// all of them while it is in cache, where message after message would pass over all of dst once each.
void apply_chunked(float* dst, const int32_t* msgs, int64_t count, int64_t row_words, int64_t n, float scale) {
  const int64_t chunk = msgs[3], nch = (n + chunk - 1) / chunk;
  GS_PARALLEL_FOR(n >= kParallelMin)
  for (int64_t c = 0; c < nch; ++c) {
    const int64_t len = chunk_len(n, chunk, c);
    for (int64_t m = 0; m < count; ++m) {
      const int32_t* msg = msgs + m * row_words;
      const int32_t format = msg[1];
      const int64_t k = msg[4];
      apply_chunk(dst + c * chunk, msg + kHeaderWords + c * chunk_stride(format, chunk, k), format, k, chunk, len,
                  scale);
    }
  }
}

void validate(const int32_t* msg, int64_t m, int64_t row_words, int64_t n, float scale) {
  if (const char* err = check_header(msg, row_words, n, scale)) fail(m, err);
  if (is_chunked(msg[1])) {
    validate_chunked(msg, m, n, scale);
    return;
  }
  const int32_t* p = msg + kHeaderWords;
  const int64_t count = msg[3];
  if (msg[1] == kSparse) {
    const int64_t j = first_bad_sparse(p, count, n);
    if (j >= 0)
      fail(m, "sparse entry " + std::to_string(j) + " (" + std::to_string(p[j]) +
                  ") is out of bounds for n=" + std::to_string(n) + " or not strictly ascending");
    return;
  }
  const int64_t words = bitmap_words(n);
  int64_t bad_word = -1, total = 0;
  for (int64_t w = 0; w < words; ++w) {  // small (n/16 words): one thread is fine
    const uint32_t x = static_cast<uint32_t>(p[w]);
    if (!bitmap_word_ok(x, w, n)) {
      bad_word = w;
      break;
    }
    total += popcount16(x);
  }
  if (bad_word >= 0)
    fail(m, "bitmap word " + std::to_string(bad_word) + " has a sign bit without its present bit or a bit past n");
  if (total != count)
    fail(m, "bitmap holds " + std::to_string(total) + " entries but the header says " + std::to_string(count));
}

void apply(float* dst, const int32_t* msg, int64_t n, float scale) {
  const float v = entry_value(bits_to_float(msg[4]), scale);
  const int32_t* p = msg + kHeaderWords;
  if (msg[1] == kSparse) {
    const int64_t count = msg[3];
    // Entries are distinct (validated ascending), so threads never touch the same element.
    // Signs are random: select +-v instead of branching (x + (-v) rounds exactly like x - v).
    GS_PARALLEL_FOR(count >= kParallelMin)
    for (int64_t j = 0; j < count; ++j) {
      const int32_t e = p[j];
      const int64_t i = (e > 0 ? (int64_t)e : -(int64_t)e) - 1;
      dst[i] += e > 0 ? v : -v;
    }
    return;
  }
  const int64_t words = bitmap_words(n);
  GS_PARALLEL_FOR(words >= kParallelMin / 16)
  for (int64_t w = 0; w < words; ++w)
    add_code_word(dst + w * 16, static_cast<uint32_t>(p[w]), v, std::min<int64_t>(16, n - w * 16));
}

}  // namespace

void decode_cpu(float* dst, int64_t n, const int32_t* msgs, int64_t num_msgs, int64_t row_words, float scale) {
  if (n < 0 || n > kMaxElements) throw std::invalid_argument("dst: size must be in [0, 2^31-1]");
  if (num_msgs < 0) throw std::invalid_argument("messages: negative count");
  if (!is_finite(scale)) throw std::invalid_argument("scale must be finite");
  for (int64_t m = 0; m < num_msgs; ++m) validate(msgs + m * row_words, m, row_words, n, scale);
  if (dst == nullptr) return;  // validation only
  // Runs of chunked messages with one chunk size (an all-gather's rows: every rank encodes alike) go together.
  for (int64_t m = 0; m < num_msgs;) {
    const int32_t* msg = msgs + m * row_words;
    if (!is_chunked(msg[1])) {
      apply(dst, msg, n, scale);
      ++m;
      continue;
    }
    int64_t e = m + 1;
    while (e < num_msgs && is_chunked(msgs[e * row_words + 1]) && msgs[e * row_words + 3] == msg[3]) ++e;
    apply_chunked(dst, msg, e - m, row_words, n, scale);
    m = e;
  }
}

}  // namespace gs
