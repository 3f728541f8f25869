// Bounds-checked decoding (CUDA). Like csrc/cpu/decode.cpp, every message is validated in full before
// any element of dst is touched, so a corrupt or hostile message raises gs::MessageError (with the
// CPU's wording) and leaves dst exactly as it was:
//   1. the headers are gathered and copied to the host and checked there (check_header);
//   2. the payloads of the messages before the first bad header are checked on the device (one thread
//      per sparse entry or bitmap word; first bad word by atomicMin, bitmap entries summed), one sync;
//   3. the messages are applied in order on the stream: dst[i] += / -= tau * scale.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <string>
#include <vector>

#include "cuda/common.cuh"
#include "gradshare/kernels.h"

namespace gs {
namespace {

using cuda::kThreads;

[[noreturn]] void fail(int64_t m, const std::string& what) {
  throw MessageError("message " + std::to_string(m) + ": " + what);
}

__device__ __forceinline__ int64_t thread_index() { return int64_t(blockIdx.x) * kThreads + threadIdx.x; }

__device__ __forceinline__ int64_t abs_entry(int32_t e) { return e < 0 ? -(int64_t)e : (int64_t)e; }

__global__ void __launch_bounds__(kThreads)
    gather_headers_kernel(const int32_t* msgs, int64_t num_msgs, int64_t row_words, int32_t* heads) {
  const int64_t t = thread_index();
  if (t >= num_msgs * kHeaderWords) return;
  heads[t] = msgs[(t / kHeaderWords) * row_words + t % kHeaderWords];
}

// One thread per entry: the first entry that is out of bounds or not ascending (atomicMin).
__global__ void __launch_bounds__(kThreads)
    check_sparse_kernel(const int32_t* p, int64_t count, int64_t n, unsigned long long* first_bad) {
  const int64_t j = thread_index();
  if (j >= count) return;
  const int64_t prev = j == 0 ? 0 : abs_entry(p[j - 1]);
  if (!sparse_entry_ok(p[j], prev, n)) atomicMin(first_bad, static_cast<unsigned long long>(j));
}

// One thread per word: the first malformed word (atomicMin) and the number of entries.
__global__ void __launch_bounds__(kThreads)
    check_bitmap_kernel(const int32_t* p, int64_t words, int64_t n, unsigned long long* first_bad,
                        unsigned long long* entries) {
  using Reduce = cub::BlockReduce<int, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  const int64_t w = thread_index();
  int c = 0;
  if (w < words) {  // no early return: every thread joins the reduction
    const uint32_t x = static_cast<uint32_t>(p[w]);
    if (!bitmap_word_ok(x, w, n)) atomicMin(first_bad, static_cast<unsigned long long>(w));
    c = popcount16(x);
  }
  const int block_entries = Reduce(tmp).Sum(c);
  if (threadIdx.x == 0 && block_entries != 0) atomicAdd(entries, static_cast<unsigned long long>(block_entries));
}

// One thread per entry; entries are distinct (validated ascending), so no two threads share an element.
// The bounds test repeats the validation so that no write can leave dst whatever the payload holds.
__global__ void __launch_bounds__(kThreads)
    apply_sparse_kernel(float* dst, const int32_t* p, int64_t count, int64_t n, float v) {
  const int64_t j = thread_index();
  if (j >= count) return;
  const int32_t e = p[j];
  const int64_t a = abs_entry(e);
  if (a < 1 || a > n) return;
  if (e > 0) dst[a - 1] += v;
  else dst[a - 1] -= v;
}

// One thread per element (coalesced); the 16 threads of a word read the same payload word.
__global__ void __launch_bounds__(kThreads) apply_bitmap_kernel(float* dst, const int32_t* p, int64_t n, float v) {
  const int64_t i = thread_index();
  if (i >= n) return;
  const uint32_t x = static_cast<uint32_t>(p[i / 16]);
  const uint32_t b = static_cast<uint32_t>(i % 16);
  if (x & (1u << b)) {
    if (x & (1u << (b + 16))) dst[i] -= v;
    else dst[i] += v;
  }
}

// Top-k / ternary payloads: one thread per item of a chunk (message.h's check_chunk_item: the scale, each entry
// or code word, the padding), thread t = chunk * per_chunk + item. The first failing item of the message, as
// atomicMin(t << 3 | why), so that the host reports the CPU's chunk and reason; and the ternary entry count.
__global__ void __launch_bounds__(kThreads)
    check_chunked_kernel(const int32_t* p, int64_t n, int64_t chunk, int64_t k, int32_t format, float scale,
                         int64_t per_chunk, unsigned long long* first_bad, unsigned long long* entries) {
  using Reduce = cub::BlockReduce<int, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  const int64_t t = thread_index(), nch = (n + chunk - 1) / chunk;
  int cnt = 0;
  if (t < nch * per_chunk) {  // no early return: every thread joins the reduction
    const int64_t c = t / per_chunk, item = t % per_chunk, len = chunk_len(n, chunk, c);
    if (item < chunk_items(format, k, len, chunk)) {
      const int32_t* w = p + c * chunk_stride(format, chunk, k);
      const int why = check_chunk_item(w, format, k, len, chunk, scale, item);
      if (why) atomicMin(first_bad, static_cast<unsigned long long>(t) << 3 | static_cast<unsigned long long>(why));
      else if (format == kTernary && item > 0)
        cnt = popcount16(static_cast<uint32_t>(w[item]));
    }
  }
  const int block_entries = Reduce(tmp).Sum(cnt);
  if (threadIdx.x == 0 && block_entries != 0) atomicAdd(entries, static_cast<unsigned long long>(block_entries));
}

// One thread per entry (entries of a message are distinct elements).
__global__ void __launch_bounds__(kThreads)
    apply_topk_kernel(float* dst, const int32_t* p, int64_t n, int64_t chunk, int64_t k, int64_t entries, float scale) {
  const int64_t e = thread_index();
  if (e >= entries) return;
  const int64_t full = n / chunk, c = k > 0 && e < full * k ? e / k : full;
  const uint32_t w = static_cast<uint32_t>(p[e]);
  const int64_t i = c * chunk + (w & 0xffffu);
  if (i < n) dst[i] += bf16_bits_to_float(static_cast<uint16_t>(w >> 16)) * scale;
}

// One thread per entry slot of the full-chunk layout (entries of a message are distinct elements).
__global__ void __launch_bounds__(kThreads)
    apply_topk8_kernel(float* dst, const int32_t* p, int64_t n, int64_t chunk, int64_t k, float scale) {
  const int64_t t = thread_index(), nch = (n + chunk - 1) / chunk;
  if (k == 0 || t >= nch * k) return;
  const int64_t c = t / k, i = t % k, len = chunk_len(n, chunk, c), kc = topk_k(k, len, chunk);
  if (i >= kc) return;
  const int32_t* w = p + c * topk8_chunk_words(k);
  const int64_t local = topk8_index(w, i);
  if (local < len) dst[c * chunk + local] += topk8_entry(topk8_value(w, kc, i), bits_to_float(w[0])) * scale;
}

// What a top-k signs entry adds, bounds-checked like every apply kernel.
struct AddSign {
  float* d;
  float s, scale;
  int64_t len;
  __device__ bool operator()(int64_t, int64_t p, bool negative) const {
    if (p >= 0 && p < len) d[p] += sign_entry(s, negative) * scale;
    return true;
  }
};

// One block per chunk: each thread takes a run of the high bits' 32-bit windows, a block scan of their set bits
// gives the index of its first entry, and it walks its run (message.h's topks_walk).
__global__ void __launch_bounds__(kThreads)
    apply_topks_kernel(float* dst, const int32_t* p, int64_t n, int64_t chunk, int64_t k, float scale) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage tmp;
  const int64_t c = blockIdx.x, len = chunk_len(n, chunk, c), kc = topk_k(k, len, chunk);
  if (kc == 0) return;  // the same for the whole block
  const int32_t* w = p + c * topks_chunk_words(chunk, k);
  const int l = ef_low_bits(len, kc);
  const int64_t hs = kc * l, hbits = ef_high_bits(len, kc, l), windows = topks_windows(len, kc);
  const int64_t per = (windows + kThreads - 1) / kThreads;
  const int64_t q0 = min(windows, int64_t(threadIdx.x) * per), q1 = min(windows, q0 + per);
  int cnt = 0;
  for (int64_t q = q0; q < q1; ++q)
    cnt += popcount32(stream_bits(w + 1, hs + q * 32, hbits - q * 32 < 32 ? static_cast<int>(hbits - q * 32) : 32));
  int before = 0;
  Scan(tmp).ExclusiveSum(cnt, before);
  topks_walk(w + 1, len, kc, q0, q1, before, AddSign{dst + c * chunk, bits_to_float(w[0]), scale, len});
}

// One thread per element.
__global__ void __launch_bounds__(kThreads)
    apply_ternary_kernel(float* dst, const int32_t* p, int64_t n, int64_t chunk, float scale) {
  const int64_t i = thread_index();
  if (i >= n) return;
  const int64_t c = i / chunk, j = i % chunk;
  const int32_t* w = p + c * ternary_chunk_words(chunk);
  const uint32_t x = static_cast<uint32_t>(w[1 + j / 16]);
  const uint32_t b = static_cast<uint32_t>(j % 16);
  if (x & (1u << b)) {
    const float v = bits_to_float(w[0]) * scale;
    if (x & (1u << (b + 16))) dst[i] -= v;
    else dst[i] += v;
  }
}

}  // namespace

void decode_cuda(float* dst, int64_t n, const int32_t* msgs, int64_t num_msgs, int64_t row_words, float scale,
                 void* stream) {
  if (n < 0 || n > kMaxElements) throw std::invalid_argument("dst: size must be in [0, 2^31-1]");
  if (num_msgs < 0) throw std::invalid_argument("messages: negative count");
  if (!is_finite(scale)) throw std::invalid_argument("scale must be finite");
  if (num_msgs == 0) return;
  if (row_words < kHeaderWords) {
    const int32_t none[kHeaderWords] = {0, 0, 0, 0, 0};
    fail(0, check_header(none, row_words, n, scale));
  }
  cuda::DeviceGuard guard(msgs, "messages");
  if (n > 0 && dst != nullptr) cuda::device_of(dst, "dst");
  const cudaStream_t s = cuda::as_stream(stream);

  // 1. Headers, checked on the host in message order.
  const int64_t head_words = num_msgs * kHeaderWords;
  std::vector<int32_t> heads(static_cast<size_t>(head_words));
  {
    cuda::Scratch dev_heads(size_t(head_words) * sizeof(int32_t), s);
    gather_headers_kernel<<<cuda::blocks_for(head_words, kThreads), kThreads, 0, s>>>(msgs, num_msgs, row_words,
                                                                                      dev_heads.at<int32_t>(0));
    cuda::check_launch("gather_headers_kernel");
    cuda::check(cudaMemcpyAsync(heads.data(), dev_heads.at<int32_t>(0), size_t(head_words) * sizeof(int32_t),
                                cudaMemcpyDeviceToHost, s),
                "cudaMemcpyAsync(headers)");
    cuda::check(cudaStreamSynchronize(s), "cudaStreamSynchronize(headers)");
  }
  auto head = [&](int64_t m) { return heads.data() + m * kHeaderWords; };
  auto payload = [&](int64_t m) { return msgs + m * row_words + kHeaderWords; };
  int64_t bad_header = -1;
  const char* header_error = nullptr;
  for (int64_t m = 0; m < num_msgs && bad_header < 0; ++m)
    if ((header_error = check_header(head(m), row_words, n, scale)) != nullptr) bad_header = m;

  // 2. Payloads of the messages before the first bad header (the CPU validates message by message, so
  //    a bad payload in an earlier message is the error it reports).
  const int64_t checked = bad_header >= 0 ? bad_header : num_msgs;
  if (checked > 0) {
    const size_t at_entries = cuda::align_up(size_t(checked) * sizeof(unsigned long long));
    cuda::Scratch dev(at_entries + size_t(checked) * sizeof(unsigned long long), s);
    unsigned long long* first_bad = dev.at<unsigned long long>(0);
    unsigned long long* entries = dev.at<unsigned long long>(at_entries);
    cuda::check(cudaMemsetAsync(first_bad, 0xff, size_t(checked) * sizeof(unsigned long long), s), "cudaMemsetAsync");
    cuda::check(cudaMemsetAsync(entries, 0, size_t(checked) * sizeof(unsigned long long), s), "cudaMemsetAsync");
    for (int64_t m = 0; m < checked; ++m) {
      if (is_chunked(head(m)[1])) {
        const int64_t chunk = head(m)[3], nch = (n + chunk - 1) / chunk;
        const int64_t per_chunk = chunk_items(head(m)[1], head(m)[4], chunk, chunk);  // a full chunk's: the most
        if (nch * per_chunk == 0) continue;
        check_chunked_kernel<<<cuda::blocks_for(nch * per_chunk, kThreads), kThreads, 0, s>>>(
            payload(m), n, chunk, head(m)[4], head(m)[1], scale, per_chunk, first_bad + m, entries + m);
        cuda::check_launch("check_chunked_kernel");
      } else if (head(m)[1] == kSparse) {
        const int64_t count = head(m)[3];
        if (count == 0) continue;
        check_sparse_kernel<<<cuda::blocks_for(count, kThreads), kThreads, 0, s>>>(payload(m), count, n, first_bad + m);
        cuda::check_launch("check_sparse_kernel");
      } else {
        const int64_t words = bitmap_words(n);
        if (words == 0) continue;
        check_bitmap_kernel<<<cuda::blocks_for(words, kThreads), kThreads, 0, s>>>(payload(m), words, n,
                                                                                 first_bad + m, entries + m);
        cuda::check_launch("check_bitmap_kernel");
      }
    }
    std::vector<unsigned long long> h_bad(static_cast<size_t>(checked)), h_entries(static_cast<size_t>(checked));
    cuda::check(cudaMemcpyAsync(h_bad.data(), first_bad, size_t(checked) * sizeof(unsigned long long),
                                cudaMemcpyDeviceToHost, s),
                "cudaMemcpyAsync(validation)");
    cuda::check(cudaMemcpyAsync(h_entries.data(), entries, size_t(checked) * sizeof(unsigned long long),
                                cudaMemcpyDeviceToHost, s),
                "cudaMemcpyAsync(validation)");
    cuda::check(cudaStreamSynchronize(s), "cudaStreamSynchronize(validation)");
    for (int64_t m = 0; m < checked; ++m) {
      const int64_t count = head(m)[3];
      if (is_chunked(head(m)[1])) {
        if (h_bad[m] != cuda::kNone)
          fail(m, "chunk " + std::to_string(static_cast<int64_t>(h_bad[m] >> 3) /
                                            chunk_items(head(m)[1], head(m)[4], head(m)[3], head(m)[3])) +
                      " " + chunk_complaint(static_cast<int>(h_bad[m] & 7u)));
        if (head(m)[1] == kTernary && static_cast<int64_t>(h_entries[m]) != head(m)[4])
          fail(m, "ternary codes hold " + std::to_string(h_entries[m]) + " entries but the header says " +
                      std::to_string(head(m)[4]));
      } else if (head(m)[1] == kSparse) {
        if (h_bad[m] != cuda::kNone) {
          const int64_t j = static_cast<int64_t>(h_bad[m]);
          int32_t e = 0;
          cuda::check(cudaMemcpyAsync(&e, payload(m) + j, sizeof e, cudaMemcpyDeviceToHost, s),
                      "cudaMemcpyAsync(entry)");
          cuda::check(cudaStreamSynchronize(s), "cudaStreamSynchronize(entry)");
          fail(m, "sparse entry " + std::to_string(j) + " (" + std::to_string(e) + ") is out of bounds for n=" +
                      std::to_string(n) + " or not strictly ascending");
        }
      } else {
        if (h_bad[m] != cuda::kNone)
          fail(m, "bitmap word " + std::to_string(h_bad[m]) +
                      " has a sign bit without its present bit or a bit past n");
        if (static_cast<int64_t>(h_entries[m]) != count)
          fail(m, "bitmap holds " + std::to_string(h_entries[m]) + " entries but the header says " +
                      std::to_string(count));
      }
    }
  }
  if (bad_header >= 0) fail(bad_header, header_error);
  if (dst == nullptr) return;  // validation only

  // 3. Apply in message order (kernels on one stream run in order).
  for (int64_t m = 0; m < num_msgs; ++m) {
    if (head(m)[1] == kTopK) {
      const int64_t entries = topk_entries(n, head(m)[3], head(m)[4]);
      if (entries == 0) continue;
      apply_topk_kernel<<<cuda::blocks_for(entries, kThreads), kThreads, 0, s>>>(dst, payload(m), n, head(m)[3],
                                                                                head(m)[4], entries, scale);
      cuda::check_launch("apply_topk_kernel");
      continue;
    }
    if (head(m)[1] == kTopK8) {
      const int64_t slots = ((n + head(m)[3] - 1) / head(m)[3]) * head(m)[4];
      if (slots == 0) continue;
      apply_topk8_kernel<<<cuda::blocks_for(slots, kThreads), kThreads, 0, s>>>(dst, payload(m), n, head(m)[3],
                                                                                head(m)[4], scale);
      cuda::check_launch("apply_topk8_kernel");
      continue;
    }
    if (head(m)[1] == kTopKSign) {
      const int64_t nch = (n + head(m)[3] - 1) / head(m)[3];
      if (nch == 0 || head(m)[4] == 0) continue;
      apply_topks_kernel<<<static_cast<unsigned int>(nch), kThreads, 0, s>>>(dst, payload(m), n, head(m)[3],
                                                                             head(m)[4], scale);
      cuda::check_launch("apply_topks_kernel");
      continue;
    }
    if (head(m)[1] == kTernary) {
      if (n == 0) continue;
      apply_ternary_kernel<<<cuda::blocks_for(n, kThreads), kThreads, 0, s>>>(dst, payload(m), n, head(m)[3], scale);
      cuda::check_launch("apply_ternary_kernel");
      continue;
    }
    const float v = entry_value(bits_to_float(head(m)[4]), scale);
    if (head(m)[1] == kSparse) {
      const int64_t count = head(m)[3];
      if (count == 0) continue;
      apply_sparse_kernel<<<cuda::blocks_for(count, kThreads), kThreads, 0, s>>>(dst, payload(m), count, n, v);
      cuda::check_launch("apply_sparse_kernel");
    } else {
      if (n == 0) continue;
      apply_bitmap_kernel<<<cuda::blocks_for(n, kThreads), kThreads, 0, s>>>(dst, payload(m), n, v);
      cuda::check_launch("apply_bitmap_kernel");
    }
  }
}

}  // namespace gs
