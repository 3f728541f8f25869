// Top-k and ternary encoding with fused residual accumulation (CUDA). Same two phases and the same
// per-element rules as csrc/cpu/chunked.cpp (gradshare/element.h), so messages and residuals are bit-identical:
//   phase 1  top-k: one block per chunk. A radix select over the 31 magnitude bits of u (three passes of
//            11, 10 and 10 bits, shared-memory histograms) finds the magnitude T of the k_c-th largest |u|;
//            elements above T are taken, and of those equal to T the lowest indices (the selection key of
//            element.h breaks ties that way), by block scans over the chunk in order, which also give each
//            entry its slot in ascending index order.
//            ternary: one warp per chunk. Lane j sums elements j, j+32, ... in turn and the warp shuffles
//            form the same pairwise tree as the CPU's lane_tree; ballots build the code words.
//            Both record the first non-finite u (atomicMin) instead of writing the residual.
//   phase 2  after one stream sync (the host must know whether to send a marker): kept = u minus what
//            was sent, one thread per element (`kept`: the residual itself, or a buffer apart from it), and
//            with a fused momentum the new velocity, 0 where sent.
// A fused momentum (kernels.h) replaces the update by m * velocity + update wherever u is computed.
#include <cub/block/block_scan.cuh>
#include <string>

#include "cuda/common.cuh"
#include "gradshare/kernels.h"

namespace gs {
namespace {

using cuda::kThreads;

// The encoder's input at element i: the update or, with a fused momentum, the new velocity m * v + update.
__device__ __forceinline__ float input_at(const void* update, int32_t dtype, const Momentum& mo, int64_t i) {
  const float g = load_as_float(update, dtype, i);
  return mo.velocity ? velocity_step(mo.velocity[i], mo.factor, g) : g;
}

__device__ __forceinline__ float u_at(const void* update, int32_t dtype, const Momentum& mo, const float* residual,
                                      int64_t i) {
  return residual[i] + input_at(update, dtype, mo, i);
}

__device__ __forceinline__ uint32_t mag_of(float u) { return static_cast<uint32_t>(float_to_bits(u)) & 0x7fffffffu; }

// ---------------------------------------------------------------------------------------------- top-k
constexpr int kHistBins = 2048;

__global__ void __launch_bounds__(kThreads)
    topk_select_kernel(const void* update, int32_t dtype, const Momentum mo, const float* residual, int64_t n,
                       int64_t chunk, int64_t k, int32_t* pairs, unsigned long long* first_bad) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ unsigned int hist[kHistBins];
  __shared__ unsigned int s_prefix, s_need;
  __shared__ int s_bad;
  __shared__ int s_running_eq, s_running_sel;
  const int64_t c = blockIdx.x, lo = c * chunk, len = chunk_len(n, chunk, c), kc = topk_k(k, len, chunk);
  if (threadIdx.x == 0) s_bad = 0;
  __syncthreads();
  // Pass 1 also checks finiteness.
  uint32_t prefix = 0, mask = 0;
  int64_t need = kc;
  const int shifts[3] = {20, 10, 0}, widths[3] = {11, 10, 10};
  for (int pass = 0; pass < 3; ++pass) {
    const int shift = shifts[pass], bins = 1 << widths[pass];
    for (int b = threadIdx.x; b < bins; b += kThreads) hist[b] = 0;
    __syncthreads();
    for (int64_t j = threadIdx.x; j < len; j += kThreads) {
      const float u = u_at(update, dtype, mo, residual, lo + j);
      if (pass == 0 && !is_finite(u)) {
        atomicMin(first_bad, static_cast<unsigned long long>(lo + j));
        s_bad = 1;
      }
      const uint32_t m = mag_of(u);
      if ((m & mask) == prefix) atomicAdd(&hist[(m >> shift) & (bins - 1)], 1u);
    }
    __syncthreads();
    if (s_bad || kc == 0) return;  // every thread reads the same flag after the barrier
    if (threadIdx.x == 0) {        // from the top bin down: the bin that holds the need-th largest
      int64_t left = need;
      int b = bins - 1;
      for (; b > 0 && static_cast<int64_t>(hist[b]) < left; --b) left -= hist[b];
      s_prefix = prefix | (static_cast<uint32_t>(b) << shift);
      s_need = static_cast<unsigned int>(left);
    }
    __syncthreads();
    prefix = s_prefix;
    need = s_need;
    mask |= static_cast<uint32_t>(bins - 1) << shift;
    __syncthreads();
  }
  // prefix is now the magnitude T of the kc-th largest; `need` of the elements equal to T are taken, lowest
  // indices first. Walk the chunk in rows of kThreads, in order, with two block scans per row.
  const uint32_t T = prefix;
  if (threadIdx.x == 0) {
    s_running_eq = 0;
    s_running_sel = 0;
  }
  __syncthreads();
  int32_t* w = pairs + 2 * c * k;   // (local index, u bits) per selected entry, ascending
  for (int64_t row = 0; row < len; row += kThreads) {
    const int64_t j = row + threadIdx.x;
    float u = 0.0f;
    uint32_t m = 0;
    if (j < len) {
      u = u_at(update, dtype, mo, residual, lo + j);
      m = mag_of(u);
    }
    const int eq = (j < len && m == T) ? 1 : 0;
    int eq_before, eq_total;
    Scan(scan_tmp).ExclusiveSum(eq, eq_before, eq_total);
    __syncthreads();
    const int taken_eq = s_running_eq;
    const int sel = (j < len && (m > T || (eq && taken_eq + eq_before < static_cast<int>(need)))) ? 1 : 0;
    int slot, sel_total;
    Scan(scan_tmp).ExclusiveSum(sel, slot, sel_total);
    __syncthreads();
    if (sel) {
      w[2 * (s_running_sel + slot)] = static_cast<int32_t>(j);
      w[2 * (s_running_sel + slot) + 1] = float_to_bits(u);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      s_running_eq += eq_total;
      s_running_sel += sel_total;
    }
    __syncthreads();
  }
}

// One thread per chunk: the selected (index, u) pairs into the message layout (element.h's rules).
__global__ void __launch_bounds__(kThreads)
    topk_pack_kernel(const int32_t* pairs, int64_t n, int64_t chunk, int64_t k, int32_t format, int32_t* payload) {
  const int64_t c = int64_t(blockIdx.x) * kThreads + threadIdx.x, nch = (n + chunk - 1) / chunk;
  if (c >= nch) return;
  const int64_t kc = topk_k(k, chunk_len(n, chunk, c), chunk);
  const int32_t* p = pairs + 2 * c * k;
  int32_t* w = payload + c * chunk_stride(format, chunk, k);
  if (format == kTopK) {
    for (int64_t i = 0; i < kc; ++i) w[i] = topk_word(bf16_bits(bits_to_float(p[2 * i + 1])), p[2 * i]);
    return;
  }
  float big = 0.0f;
  for (int64_t i = 0; i < kc; ++i) big = fmaxf(big, fabsf(bits_to_float(p[2 * i + 1])));
  const float s = topk8_scale(big);
  const int64_t iw = (kc + 1) / 2, vw = (kc + 3) / 4;
  w[0] = float_to_bits(s);
  for (int64_t i = 0; i < iw + vw; ++i) w[1 + i] = 0;
  for (int64_t i = 0; i < kc; ++i) {
    const uint32_t q = static_cast<uint8_t>(static_cast<int8_t>(topk8_quantize(bits_to_float(p[2 * i + 1]), s)));
    w[1 + i / 2] = static_cast<int32_t>(static_cast<uint32_t>(w[1 + i / 2]) | (static_cast<uint32_t>(p[2 * i]) << (16 * (i % 2))));
    w[1 + iw + i / 4] = static_cast<int32_t>(static_cast<uint32_t>(w[1 + iw + i / 4]) | (q << (8 * (i % 4))));
  }
}

// kept = u; with a fused momentum the new velocity to mo.out (topk_subtract_kernel then zeroes what was sent).
__global__ void __launch_bounds__(kThreads)
    add_update_kernel(const void* update, int32_t dtype, const Momentum mo, const float* residual, float* kept,
                      int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= n) return;
  const float w = input_at(update, dtype, mo, i);
  if (mo.velocity) mo.out[i] = w;
  kept[i] = residual[i] + w;
}

// One thread per chunk (a chunk's entries are distinct elements): kept gives up what was sent, and a fused
// momentum's new velocity (velocity_out, or null) is zeroed there.
__global__ void __launch_bounds__(kThreads)
    topk_subtract_kernel(float* kept, float* velocity_out, const int32_t* payload, int64_t n, int64_t chunk,
                         int64_t k, int32_t format) {
  const int64_t c = int64_t(blockIdx.x) * kThreads + threadIdx.x, nch = (n + chunk - 1) / chunk;
  if (c >= nch) return;
  const int64_t kc = topk_k(k, chunk_len(n, chunk, c), chunk);
  const int32_t* w = payload + c * chunk_stride(format, chunk, k);
  float* r = kept + c * chunk;
  float* v = velocity_out ? velocity_out + c * chunk : nullptr;
  if (format == kTopK) {
    for (int64_t i = 0; i < kc; ++i) {
      const uint32_t e = static_cast<uint32_t>(w[i]);
      r[e & 0xffffu] -= bf16_bits_to_float(static_cast<uint16_t>(e >> 16));
      if (v) v[e & 0xffffu] = 0.0f;
    }
    return;
  }
  const float s = bits_to_float(w[0]);
  for (int64_t i = 0; i < kc; ++i) {
    r[topk8_index(w, i)] -= topk8_entry(topk8_value(w, kc, i), s);
    if (v) v[topk8_index(w, i)] = 0.0f;
  }
}

// ---------------------------------------------------------------------------------------------- ternary
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ float warp_tree(float v) {
  // Lane j < step adds lane j + step, for step = 16, 8, 4, 2, 1: lane 0 ends with element.h's lane_tree.
  for (int step = 16; step >= 1; step /= 2) v += __shfl_down_sync(0xffffffffu, v, step);
  return v;
}

__global__ void __launch_bounds__(kThreads)
    ternary_chunk_kernel(const void* update, int32_t dtype, const Momentum mo, const float* residual, int64_t n,
                         int64_t chunk, float fraction, int32_t* payload, unsigned long long* first_bad,
                         unsigned long long* entries) {
  const int lane = threadIdx.x % 32;
  const int64_t c = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int64_t nch = (n + chunk - 1) / chunk;
  if (c >= nch) return;  // whole warps leave together
  const int64_t lo = c * chunk, len = chunk_len(n, chunk, c);
  float acc = 0.0f;
  int bad = 0;
  for (int64_t j = lane; j < len; j += 32) {
    const float u = u_at(update, dtype, mo, residual, lo + j);
    if (!is_finite(u)) {
      atomicMin(first_bad, static_cast<unsigned long long>(lo + j));
      bad = 1;
    }
    acc += u < 0.0f ? -u : u;
  }
  if (__any_sync(0xffffffffu, bad)) return;
  const float mean = __shfl_sync(0xffffffffu, warp_tree(acc), 0) / static_cast<float>(len);
  const float th = fraction * mean;
  int32_t* w = payload + c * ternary_chunk_words(chunk);
  const int64_t cw = (len + 15) / 16;
  float acc2 = 0.0f;
  int cnt = 0;
  for (int64_t row = 0; row < len; row += 32) {
    const int64_t j = row + lane;
    float u = 0.0f;
    bool sent = false;
    if (j < len) {
      u = u_at(update, dtype, mo, residual, lo + j);
      sent = ternary_sent(u, th);
    }
    const uint32_t present = __ballot_sync(0xffffffffu, sent);
    const uint32_t negative = __ballot_sync(0xffffffffu, sent && u < 0.0f);
    if (sent) acc2 += u < 0.0f ? -u : u;
    if (lane == 0) {
      const int64_t q = row / 16;
      w[1 + q] = static_cast<int32_t>((present & 0xffffu) | ((negative & 0xffffu) << 16));
      if (q + 1 < cw) w[2 + q] = static_cast<int32_t>((present >> 16) | ((negative >> 16) << 16));
      cnt += __popc(present);
    }
  }
  const float total2 = warp_tree(acc2);
  if (lane == 0) {
    w[0] = float_to_bits(cnt ? total2 / static_cast<float>(cnt) : 0.0f);
    atomicAdd(entries, static_cast<unsigned long long>(cnt));
  }
}

__global__ void __launch_bounds__(kThreads)
    ternary_residual_kernel(const void* update, int32_t dtype, const Momentum mo, const float* residual, float* kept,
                            int64_t n, int64_t chunk, const int32_t* payload) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= n) return;
  const int64_t c = i / chunk, j = i % chunk;
  const int32_t* w = payload + c * ternary_chunk_words(chunk);
  const float in = input_at(update, dtype, mo, i);
  const float x = residual[i] + in;
  const uint32_t code = static_cast<uint32_t>(w[1 + j / 16]) >> (j % 16);
  const float scale = bits_to_float(w[0]);
  const float sent = (code >> 16) & 1u ? -scale : scale;
  kept[i] = (code & 1u) ? x - sent : x;
  if (mo.velocity) mo.out[i] = (code & 1u) ? 0.0f : in;
}

// ---------------------------------------------------------------------------------------------- plumbing
__global__ void write_header_kernel(int32_t* out, int32_t format, int64_t n, int64_t w3, int64_t w4) {
  out[0] = kMagicVersion;
  out[1] = format;
  out[2] = static_cast<int32_t>(n);
  out[3] = static_cast<int32_t>(w3);
  out[4] = static_cast<int32_t>(w4);
}

struct Flags {
  unsigned long long first_bad;
  unsigned long long entries;
};

// Reads the phase-1 flags (one sync); on a non-finite u writes the marker and returns true.
bool marker_if_bad(Flags* dev, Flags* host, int32_t* out, int64_t words, int64_t n, cudaStream_t s) {
  cuda::check(cudaMemcpyAsync(host, dev, sizeof(Flags), cudaMemcpyDeviceToHost, s), "cudaMemcpyAsync(flags)");
  cuda::check(cudaStreamSynchronize(s), "cudaStreamSynchronize(flags)");
  if (host->first_bad == cuda::kNone) return false;
  cuda::check(cudaMemsetAsync(out, 0, size_t(words) * sizeof(int32_t), s), "cudaMemsetAsync(marker)");
  write_header_kernel<<<1, 1, 0, s>>>(out, kNonFinite, n, static_cast<int64_t>(host->first_bad), 0);
  cuda::check_launch("write_header_kernel");
  return true;
}

Flags* init_flags(cuda::Scratch& scratch, cudaStream_t s) {
  Flags* f = scratch.at<Flags>(0);
  cuda::check(cudaMemsetAsync(&f->first_bad, 0xff, sizeof(unsigned long long), s), "cudaMemsetAsync");
  cuda::check(cudaMemsetAsync(&f->entries, 0, sizeof(unsigned long long), s), "cudaMemsetAsync");
  return f;
}

}  // namespace

// Phase 1 (`select` launches it), then either the marker or phase 2 (`finish`) and the header.
template <typename Select, typename Finish>
ChunkedResult encode_chunked(int32_t format, int64_t n, int64_t chunk, int64_t k, int64_t words, int32_t* out,
                             cudaStream_t s, cuda::Scratch& scratch, Select select, Finish finish) {
  Flags* flags = init_flags(scratch, s);
  if (n > 0) select(flags);
  Flags host{};
  if (marker_if_bad(flags, &host, out, words, n, s)) return {words, 0, static_cast<int64_t>(host.first_bad)};
  if (n > 0) finish();
  const bool topk = format != kTernary;
  const int64_t entries = topk ? topk_entries(n, chunk, k) : static_cast<int64_t>(host.entries);
  write_header_kernel<<<1, 1, 0, s>>>(out, format, n, chunk, topk ? k : entries);
  cuda::check_launch("write_header_kernel");
  return {words, entries, -1};
}

ChunkedResult encode_topk_cuda(const void* update, int32_t dtype, const float* residual, float* kept, int64_t n,
                               int64_t chunk, int64_t k, int32_t format, int32_t* out, int64_t capacity, void* stream,
                               const Momentum& mo) {
  const int64_t words = check_chunked_args(format, dtype, n, chunk, k, 0.0f, capacity);
  check_momentum(mo);
  cuda::DeviceGuard guard(out, "out");
  const cudaStream_t s = cuda::as_stream(stream);
  const int64_t nch = (n + chunk - 1) / chunk;
  const size_t at_pairs = cuda::align_up(sizeof(Flags));
  cuda::Scratch scratch(at_pairs + size_t(2 * nch * k + 1) * sizeof(int32_t), s);
  int32_t* pairs = scratch.at<int32_t>(at_pairs);
  return encode_chunked(
      format, n, chunk, k, words, out, s, scratch,
      [&](Flags* flags) {
        topk_select_kernel<<<static_cast<unsigned int>(nch), kThreads, 0, s>>>(update, dtype, mo, residual, n, chunk,
                                                                               k, pairs, &flags->first_bad);
        cuda::check_launch("topk_select_kernel");
        topk_pack_kernel<<<cuda::blocks_for(nch, kThreads), kThreads, 0, s>>>(pairs, n, chunk, k, format,
                                                                             out + kHeaderWords);
        cuda::check_launch("topk_pack_kernel");
      },
      [&]() {
        add_update_kernel<<<cuda::blocks_for(n, kThreads), kThreads, 0, s>>>(update, dtype, mo, residual, kept, n);
        cuda::check_launch("add_update_kernel");
        topk_subtract_kernel<<<cuda::blocks_for(nch, kThreads), kThreads, 0, s>>>(
            kept, mo.velocity ? mo.out : nullptr, out + kHeaderWords, n, chunk, k, format);
        cuda::check_launch("topk_subtract_kernel");
      });
}

ChunkedResult encode_ternary_cuda(const void* update, int32_t dtype, const float* residual, float* kept, int64_t n,
                                  int64_t chunk, float fraction, int32_t* out, int64_t capacity, void* stream,
                                  const Momentum& mo) {
  const int64_t words = check_chunked_args(kTernary, dtype, n, chunk, 0, fraction, capacity);
  check_momentum(mo);
  cuda::DeviceGuard guard(out, "out");
  const cudaStream_t s = cuda::as_stream(stream);
  const int64_t nch = (n + chunk - 1) / chunk;
  cuda::Scratch scratch(sizeof(Flags), s);
  return encode_chunked(
      kTernary, n, chunk, 0, words, out, s, scratch,
      [&](Flags* flags) {
        ternary_chunk_kernel<<<cuda::blocks_for(nch, kWarps), kThreads, 0, s>>>(
            update, dtype, mo, residual, n, chunk, fraction, out + kHeaderWords, &flags->first_bad, &flags->entries);
        cuda::check_launch("ternary_chunk_kernel");
      },
      [&]() {
        ternary_residual_kernel<<<cuda::blocks_for(n, kThreads), kThreads, 0, s>>>(update, dtype, mo, residual, kept,
                                                                                  n, chunk, out + kHeaderWords);
        cuda::check_launch("ternary_residual_kernel");
      });
}

}  // namespace gs
