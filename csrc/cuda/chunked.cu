// Top-k and ternary encoding with fused residual accumulation (CUDA). Same selections and the same
// per-element rules as csrc/cpu/chunked.cpp (gradshare/element.h), so messages and residuals are bit-identical:
//   phase 1  top-k: one block per chunk. A radix select over the 31 magnitude bits of u finds the magnitude T
//            of the k_c-th largest |u| (three passes of 11, 10 and 10 bits); elements above T are taken, and of those
//            equal to T the lowest indices (the selection key of element.h breaks ties that way), listed in
//            ascending index order by block scans. A second kernel packs the entries, one block per chunk.
//            ternary: one block per chunk. Lane j of 32 sums elements j, j+32, ... in turn (the block's warps
//            load tiles of rows into shared memory, one warp adds them in order) and warp shuffles form the
//            same pairwise tree as the CPU's lane_tree; ballots build the code words.
//            Both record the first non-finite u (atomicMin) instead of writing the residual.
//   phase 2  kept = u minus what was sent, one thread per element or entry (`kept`: the residual itself, or a
//            buffer apart from it), and with a fused momentum the new velocity, 0 where sent. Every phase-2
//            kernel reads the non-finite flag first and writes nothing when it is set; the last kernel then
//            writes the header, or the non-finite marker over the whole message.
// The host never waits: the message length is fixed by (n, chunk, k), and a non-finite u is reported by the
// marker in the message (ChunkedResult's nonfinite_index and a ternary message's entry count are not read
// back on this path). A fused momentum (kernels.h) replaces the update by m * velocity + update wherever u is
// computed.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <algorithm>
#include <string>

#include "cuda/common.cuh"
#include "gradshare/kernels.h"

namespace gs {
namespace {

using cuda::kThreads;

struct Flags {
  unsigned long long first_bad;  // smallest i with non-finite u, or cuda::kNone
  unsigned long long entries;    // ternary: present bits summed over the chunks
};

__device__ __forceinline__ bool flagged(const Flags* f) { return f->first_bad != cuda::kNone; }

// u = residual + input_at (kernels.h). The kernels are instantiated per update dtype and with / without momentum,
// so that these loads carry no branch and an unrolled loop issues all of its loads before it uses the first.
template <int DT, bool MOM>
__device__ __forceinline__ float u_at(const void* update, const Momentum& mo, const float* residual, int64_t i) {
  return residual[i] + input_at<DT, MOM>(update, mo, i);
}

// u at local index j of a chunk of len elements starting at lo, or 0 past its end (a load from inside the chunk
// whose value is dropped, so that the load needs no branch).
template <int DT, bool MOM>
__device__ __forceinline__ float u_or_zero(const void* update, const Momentum& mo, const float* residual, int64_t lo,
                                           int64_t j, int64_t len) {
  const float u = u_at<DT, MOM>(update, mo, residual, lo + (j < len ? j : len - 1));
  return j < len ? u : 0.0f;
}

__device__ __forceinline__ uint32_t mag_of(float u) { return static_cast<uint32_t>(float_to_bits(u)) & 0x7fffffffu; }

__device__ __forceinline__ float warp_tree(float v) {
  // Lane j < step adds lane j + step, for step = 16, 8, 4, 2, 1: lane 0 ends with element.h's lane_tree.
  for (int step = 16; step >= 1; step /= 2) v += __shfl_down_sync(0xffffffffu, v, step);
  return v;
}

// Sets bits [off, off + nbits) of a zeroed bit stream to `value` (nbits in [0, 32]); threads share words.
__device__ __forceinline__ void stream_put(int32_t* s, int64_t off, int nbits, uint32_t value) {
  if (nbits <= 0 || value == 0u) return;
  unsigned int* u = reinterpret_cast<unsigned int*>(s);
  const int64_t q = off >> 5;
  const int b = static_cast<int>(off & 31);
  atomicOr(u + q, value << b);
  if (b + nbits > 32) atomicOr(u + q + 1, value >> (32 - b));
}

// ---------------------------------------------------------------------------------------------- top-k
constexpr int kHistBins = 2048;
constexpr int kSelectThreads = 512;  // threads per chunk in the select kernel
constexpr int kUnroll = 8;           // loads in flight per thread in the histogram passes
constexpr int kTileItems = 8;        // consecutive elements per thread in the selection walk

// Top-k selection of one chunk (one block): three radix passes over the chunk (11, 10 and 10 bits of the
// magnitude, shared-memory histograms; the first also checks finiteness) find T, the kc-th largest magnitude;
// then an ordered walk lists the elements above T and the lowest-indexed ones equal to it.
template <int DT, bool MOM>
__global__ void __launch_bounds__(kSelectThreads)
    topk_select_kernel(const void* update, const Momentum mo, const float* residual, int64_t n,
                       int64_t chunk, int64_t k, int32_t* pairs, Flags* flags) {
  using Scan = cub::BlockScan<int, kSelectThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ unsigned int hist[kHistBins];
  __shared__ unsigned int s_prefix, s_need;
  __shared__ int s_bad;
  const int64_t c = blockIdx.x, lo = c * chunk, len = chunk_len(n, chunk, c), kc = topk_k(k, len, chunk);
  if (threadIdx.x == 0) s_bad = 0;
  __syncthreads();
  uint32_t prefix = 0, mask = 0;
  int64_t need = kc;
  const int shifts[3] = {20, 10, 0}, widths[3] = {11, 10, 10};
  for (int pass = 0; pass < 3; ++pass) {
    const int shift = shifts[pass], bins = 1 << widths[pass];
    for (int b = threadIdx.x; b < bins; b += kSelectThreads) hist[b] = 0;
    __syncthreads();
    for (int64_t base = 0; base < len; base += int64_t(kSelectThreads) * kUnroll) {
      float u[kUnroll];
#pragma unroll
      for (int q = 0; q < kUnroll; ++q)
        u[q] = u_or_zero<DT, MOM>(update, mo, residual, lo, base + int64_t(q) * kSelectThreads + threadIdx.x, len);
#pragma unroll
      for (int q = 0; q < kUnroll; ++q) {
        const int64_t j = base + int64_t(q) * kSelectThreads + threadIdx.x;
        if (pass == 0 && !is_finite(u[q])) {  // never past len (u = 0 there)
          atomicMin(&flags->first_bad, static_cast<unsigned long long>(lo + j));
          s_bad = 1;
        }
        const uint32_t m = mag_of(u[q]);
        if (j < len && (m & mask) == prefix) atomicAdd(&hist[(m >> shift) & (bins - 1)], 1u);
      }
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
  // indices first. Walk the chunk in tiles; thread t holds kTileItems consecutive elements of a tile, so block
  // scans of per-thread counts order the entries by index.
  const uint32_t T = prefix;
  int32_t* w = pairs + 2 * c * k;  // (local index, u bits) per selected entry, ascending
  int running_eq = 0, running_sel = 0;
  constexpr int64_t kTile = int64_t(kSelectThreads) * kTileItems;
  for (int64_t tile = 0; tile < len; tile += kTile) {
    const int64_t j0 = tile + int64_t(threadIdx.x) * kTileItems;
    float u[kTileItems];
    int eq_count = 0;
#pragma unroll
    for (int q = 0; q < kTileItems; ++q) u[q] = u_or_zero<DT, MOM>(update, mo, residual, lo, j0 + q, len);
#pragma unroll
    for (int q = 0; q < kTileItems; ++q) eq_count += (j0 + q < len && mag_of(u[q]) == T) ? 1 : 0;
    int eq_before, eq_total;
    Scan(scan_tmp).ExclusiveSum(eq_count, eq_before, eq_total);
    __syncthreads();
    int eq_rank = running_eq + eq_before;
    unsigned sel_bits = 0;
#pragma unroll
    for (int q = 0; q < kTileItems; ++q) {
      const uint32_t m = mag_of(u[q]);
      const bool in = j0 + q < len;
      const bool eq = in && m == T;
      if (in && (m > T || (eq && eq_rank < static_cast<int>(need)))) sel_bits |= 1u << q;
      eq_rank += eq ? 1 : 0;
    }
    int slot, sel_total;
    Scan(scan_tmp).ExclusiveSum(__popc(sel_bits), slot, sel_total);
    __syncthreads();
    slot += running_sel;
#pragma unroll
    for (int q = 0; q < kTileItems; ++q) {
      if (sel_bits & (1u << q)) {
        w[2 * slot] = static_cast<int32_t>(j0 + q);
        w[2 * slot + 1] = float_to_bits(u[q]);
        ++slot;
      }
    }
    running_eq += eq_total;
    running_sel += sel_total;
  }
}

// One block per chunk: the selected (index, u) pairs into the message layout (element.h's rules). An 8-bit
// chunk's scale comes from its largest selected |u|; its index and value words are each built by one thread.
__global__ void __launch_bounds__(kThreads)
    topk_pack_kernel(const int32_t* pairs, int64_t n, int64_t chunk, int64_t k, int32_t format, int32_t* payload,
                     const Flags* flags) {
  using Reduce = cub::BlockReduce<float, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  __shared__ float s_scale;
  if (flagged(flags)) return;  // the pairs of a non-finite chunk were never written; the marker follows
  const int64_t c = blockIdx.x;
  const int64_t kc = topk_k(k, chunk_len(n, chunk, c), chunk);
  const int32_t* p = pairs + 2 * c * k;
  int32_t* w = payload + c * chunk_stride(format, chunk, k);
  if (format == kTopK) {
    for (int64_t i = threadIdx.x; i < kc; i += kThreads) w[i] = topk_word(bf16_bits(bits_to_float(p[2 * i + 1])), p[2 * i]);
    return;
  }
  if (format == kTopKSign) {  // the scale by warp 0 in element.h's lane order; the stream's bits by atomicOr
    const int64_t len = chunk_len(n, chunk, c);
    const int l = ef_low_bits(len, kc);
    const int64_t hs = kc * l, ss = hs + (kc ? ef_high_bits(len, kc, l) : 0);
    for (int64_t t = threadIdx.x; t < (topks_chunk_bits(len, kc) + 31) / 32; t += kThreads) w[1 + t] = 0;
    if (threadIdx.x < 32) {
      float acc = 0.0f;
      for (int64_t i = threadIdx.x; i < kc; i += 32) {
        const float x = bits_to_float(p[2 * i + 1]);
        acc += x < 0.0f ? -x : x;
      }
      const float total = warp_tree(acc);
      if (threadIdx.x == 0) w[0] = float_to_bits(kc ? total / static_cast<float>(kc) : 0.0f);
    }
    __syncthreads();
    for (int64_t i = threadIdx.x; i < kc; i += kThreads) {
      const uint32_t pos = static_cast<uint32_t>(p[2 * i]);
      stream_put(w + 1, i * l, l, l ? (pos & ((1u << l) - 1u)) : 0u);
      stream_put(w + 1, hs + (pos >> l) + i, 1, 1u);
      stream_put(w + 1, ss + i, 1, bits_to_float(p[2 * i + 1]) < 0.0f ? 1u : 0u);
    }
    return;
  }
  float big = 0.0f;
  for (int64_t i = threadIdx.x; i < kc; i += kThreads) big = fmaxf(big, fabsf(bits_to_float(p[2 * i + 1])));
  big = Reduce(tmp).Reduce(big, [](float a, float b) { return fmaxf(a, b); });
  if (threadIdx.x == 0) s_scale = topk8_scale(big);
  __syncthreads();
  const float s = s_scale;
  const int64_t iw = (kc + 1) / 2, vw = (kc + 3) / 4;
  if (threadIdx.x == 0) w[0] = float_to_bits(s);
  for (int64_t t = threadIdx.x; t < iw + vw; t += kThreads) {
    uint32_t word = 0;
    if (t < iw) {  // two 16-bit local indices
      for (int64_t i = 2 * t; i < 2 * t + 2 && i < kc; ++i) word |= static_cast<uint32_t>(p[2 * i]) << (16 * (i % 2));
    } else {  // four int8 values
      for (int64_t i = 4 * (t - iw); i < 4 * (t - iw) + 4 && i < kc; ++i) {
        const uint32_t q = static_cast<uint8_t>(static_cast<int8_t>(topk8_quantize(bits_to_float(p[2 * i + 1]), s)));
        word |= q << (8 * (i % 4));
      }
    }
    w[1 + t] = static_cast<int32_t>(word);
  }
}

// kept = u; with a fused momentum the new velocity to mo.out (topk_subtract_kernel then zeroes what was sent).
template <int DT, bool MOM>
__global__ void __launch_bounds__(kThreads)
    add_update_kernel(const void* update, const Momentum mo, const float* residual, float* kept, int64_t n,
                      const Flags* flags) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= n || flagged(flags)) return;
  const float w = input_at<DT, MOM>(update, mo, i);
  if (MOM) mo.out[i] = w;
  kept[i] = residual[i] + w;
}

// One block per chunk, a thread per entry (a chunk's entries are distinct elements): kept gives up what was
// sent, and a fused momentum's new velocity (velocity_out, or null) is zeroed there.
__global__ void __launch_bounds__(kThreads)
    topk_subtract_kernel(float* kept, float* velocity_out, const int32_t* payload, const int32_t* pairs, int64_t n,
                         int64_t chunk, int64_t k, int32_t format, const Flags* flags) {
  if (flagged(flags)) return;
  const int64_t c = blockIdx.x;
  const int64_t kc = topk_k(k, chunk_len(n, chunk, c), chunk);
  const int32_t* w = payload + c * chunk_stride(format, chunk, k);
  float* r = kept + c * chunk;
  float* v = velocity_out ? velocity_out + c * chunk : nullptr;
  if (format == kTopKSign) {  // the entries from the selection, in the message's order
    const int32_t* p = pairs + 2 * c * k;
    const float s = bits_to_float(w[0]);
    for (int64_t i = threadIdx.x; i < kc; i += kThreads) {
      r[p[2 * i]] -= sign_entry(s, bits_to_float(p[2 * i + 1]) < 0.0f);
      if (v) v[p[2 * i]] = 0.0f;
    }
    return;
  }
  if (format == kTopK) {
    for (int64_t i = threadIdx.x; i < kc; i += kThreads) {
      const uint32_t e = static_cast<uint32_t>(w[i]);
      r[e & 0xffffu] -= bf16_bits_to_float(static_cast<uint16_t>(e >> 16));
      if (v) v[e & 0xffffu] = 0.0f;
    }
    return;
  }
  const float s = bits_to_float(w[0]);
  for (int64_t i = threadIdx.x; i < kc; i += kThreads) {
    r[topk8_index(w, i)] -= topk8_entry(topk8_value(w, kc, i), s);
    if (v) v[topk8_index(w, i)] = 0.0f;
  }
}

// ---------------------------------------------------------------------------------------------- ternary
// One block per chunk. The chunk's sums must run in element.h's order (lane j of 32 adding elements j, j+32, ...
// in turn), a chain of len / 32 additions per lane: too short to matter, but one warp alone cannot keep enough
// loads in flight. So the block's warps load a tile of rows (computing u, checking it) into shared memory, and
// warp 0 adds the tile's rows in order; the tree over the 32 lane sums is done with warp shuffles.
constexpr int kTernaryThreads = 512;
constexpr int kTernaryWarps = kTernaryThreads / 32;
constexpr int kRowsPerWarp = 16;  // rows of 32 elements each warp loads per tile
static_assert(kRowsPerWarp % 16 == 0, "code words are written 32 (16 rows) at a time");
constexpr int kTileRows = kTernaryWarps * kRowsPerWarp;  // 256 rows = 8192 elements (32 KiB) per tile

template <int DT, bool MOM>
__global__ void __launch_bounds__(kTernaryThreads)
    ternary_chunk_kernel(const void* update, const Momentum mo, const float* residual, int64_t n,
                         int64_t chunk, float fraction, int32_t* payload, Flags* flags) {
  __shared__ float tile[kTileRows][32];
  __shared__ int s_bad;
  __shared__ float s_th;
  __shared__ int s_cnt;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t c = blockIdx.x, lo = c * chunk, len = chunk_len(n, chunk, c);
  const int64_t rows = (len + 31) / 32, cw = (len + 15) / 16;
  if (threadIdx.x == 0) {
    s_bad = 0;
    s_cnt = 0;
  }
  __syncthreads();
  // Pass 1: the mean |u| of the chunk. Elements past len add +0.0 to their lane, which leaves a sum unchanged.
  float acc = 0.0f;
  for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
    float u[kRowsPerWarp];
#pragma unroll
    for (int q = 0; q < kRowsPerWarp; ++q)
      u[q] = u_or_zero<DT, MOM>(update, mo, residual, lo, (r0 + warp * kRowsPerWarp + q) * 32 + lane, len);
#pragma unroll
    for (int q = 0; q < kRowsPerWarp; ++q) {
      if (!is_finite(u[q])) {
        atomicMin(&flags->first_bad, static_cast<unsigned long long>(lo + (r0 + warp * kRowsPerWarp + q) * 32 + lane));
        s_bad = 1;
      }
      tile[warp * kRowsPerWarp + q][lane] = u[q] < 0.0f ? -u[q] : u[q];
    }
    __syncthreads();
    if (warp == 0 && !s_bad) {
      const int64_t last = rows - r0 < kTileRows ? rows - r0 : kTileRows;
      for (int64_t q = 0; q < last; ++q) acc += tile[q][lane];
    }
    __syncthreads();
    if (s_bad) return;  // the same for every thread after the barrier
  }
  if (warp == 0) {
    const float mean = __shfl_sync(0xffffffffu, warp_tree(acc), 0) / static_cast<float>(len);
    if (lane == 0) s_th = fraction * mean;
  }
  __syncthreads();
  const float th = s_th;
  // Pass 2: the code words (each warp its own rows) and the scale, the mean |u| of what is sent, summed in the
  // same order (an unsent element adds +0.0).
  int32_t* w = payload + c * ternary_chunk_words(chunk);
  float acc2 = 0.0f;
  int cnt = 0;
  for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
    float u[kRowsPerWarp];
#pragma unroll
    for (int q = 0; q < kRowsPerWarp; ++q)
      u[q] = u_or_zero<DT, MOM>(update, mo, residual, lo, (r0 + warp * kRowsPerWarp + q) * 32 + lane, len);
    uint32_t present[kRowsPerWarp], negative[kRowsPerWarp];
#pragma unroll
    for (int q = 0; q < kRowsPerWarp; ++q) {
      const bool sent = ternary_sent(u[q], th);  // false past len (u = 0)
      present[q] = __ballot_sync(0xffffffffu, sent);
      negative[q] = __ballot_sync(0xffffffffu, sent && u[q] < 0.0f);
      tile[warp * kRowsPerWarp + q][lane] = sent ? (u[q] < 0.0f ? -u[q] : u[q]) : 0.0f;
      cnt += __popc(present[q]);
    }
    // The warp's 2 * kRowsPerWarp code words, 32 at a time, one per lane: word `lane` of a group of 16 rows is
    // half lane % 2 of its row lane / 2.
#pragma unroll
    for (int grp = 0; grp < kRowsPerWarp / 16; ++grp) {
      uint32_t p = 0, g = 0;
#pragma unroll
      for (int q = 0; q < 16; ++q)
        if (lane / 2 == q) {
          p = present[grp * 16 + q];
          g = negative[grp * 16 + q];
        }
      const int h = 16 * (lane % 2);
      const int64_t word = (r0 + warp * kRowsPerWarp + grp * 16) * 2 + lane;
      if (word < cw) w[1 + word] = static_cast<int32_t>(((p >> h) & 0xffffu) | (((g >> h) & 0xffffu) << 16));
    }
    __syncthreads();
    if (warp == 0) {
      const int64_t last = rows - r0 < kTileRows ? rows - r0 : kTileRows;
      for (int64_t q = 0; q < last; ++q) acc2 += tile[q][lane];
    }
    __syncthreads();
  }
  if (lane == 0) atomicAdd(&s_cnt, cnt);  // every lane of a warp counted the same ballots: lane 0 speaks for it
  __syncthreads();
  if (warp == 0) {
    const float total2 = warp_tree(acc2);
    if (lane == 0) {
      w[0] = float_to_bits(s_cnt ? total2 / static_cast<float>(s_cnt) : 0.0f);
      atomicAdd(&flags->entries, static_cast<unsigned long long>(s_cnt));
    }
  }
}

template <int DT, bool MOM>
__global__ void __launch_bounds__(kThreads)
    ternary_residual_kernel(const void* update, const Momentum mo, const float* residual, float* kept, int64_t n,
                            int64_t chunk, const int32_t* payload, const Flags* flags) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= n || flagged(flags)) return;
  const int64_t c = i / chunk, j = i % chunk;
  const int32_t* w = payload + c * ternary_chunk_words(chunk);
  const float in = input_at<DT, MOM>(update, mo, i);
  const float x = residual[i] + in;
  const uint32_t code = static_cast<uint32_t>(w[1 + j / 16]) >> (j % 16);
  const float scale = bits_to_float(w[0]);
  const float sent = (code >> 16) & 1u ? -scale : scale;
  kept[i] = (code & 1u) ? x - sent : x;
  if (MOM) mo.out[i] = (code & 1u) ? 0.0f : in;
}

// ---------------------------------------------------------------------------------------------- plumbing
// The header (w4: `w4`, or the ternary entry count when `w4_entries`), or, after a non-finite u, the marker:
// every word zero but the marker's header. Grid-stride over the message, since only the device knows which.
constexpr unsigned int kHeaderBlocks = 64;
__global__ void __launch_bounds__(kThreads)
    header_kernel(int32_t* out, int64_t words, int32_t format, int64_t n, int64_t w3, int64_t w4, bool w4_entries,
                  const Flags* flags) {
  const bool bad = flagged(flags);
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < (bad ? words : kHeaderWords); i += stride) {
    int64_t v = 0;
    switch (i) {
      case 0: v = kMagicVersion; break;
      case 1: v = bad ? kNonFinite : format; break;
      case 2: v = n; break;
      case 3: v = bad ? static_cast<int64_t>(flags->first_bad) : w3; break;
      case 4: v = bad ? 0 : (w4_entries ? static_cast<int64_t>(flags->entries) : w4); break;
      default: break;
    }
    out[i] = static_cast<int32_t>(v);
  }
}

Flags* init_flags(cuda::Scratch& scratch, cudaStream_t s) {
  Flags* f = scratch.at<Flags>(0);
  cuda::check(cudaMemsetAsync(&f->first_bad, 0xff, sizeof(unsigned long long), s), "cudaMemsetAsync");
  cuda::check(cudaMemsetAsync(&f->entries, 0, sizeof(unsigned long long), s), "cudaMemsetAsync");
  return f;
}

void launch_header(int32_t* out, int64_t words, int32_t format, int64_t n, int64_t w3, int64_t w4, bool w4_entries,
                   const Flags* flags, cudaStream_t s) {
  const unsigned int blocks = std::min<unsigned int>(kHeaderBlocks, cuda::blocks_for(words, kThreads));
  header_kernel<<<blocks, kThreads, 0, s>>>(out, words, format, n, w3, w4, w4_entries, flags);
  cuda::check_launch("header_kernel");
}

}  // namespace

ChunkedResult encode_topk_cuda(const void* update, int32_t dtype, const float* residual, float* kept, int64_t n,
                               int64_t chunk, int64_t k, int32_t format, int32_t* out, int64_t capacity, void* stream,
                               const Momentum& mo) {
  const int64_t words = check_chunked_args(format, dtype, n, chunk, k, 0.0f, capacity);
  check_momentum(mo);
  cuda::DeviceGuard guard(out, "out");
  const cudaStream_t s = cuda::as_stream(stream);
  const int64_t nch = (n + chunk - 1) / chunk;
  const size_t at_pairs = cuda::align_up(sizeof(Flags));
  // A chunk's k slots; a single chunk longer than the buffer (top-k signs) selects at most n.
  cuda::Scratch scratch(at_pairs + size_t(2 * nch * (nch == 1 ? std::min(k, n) : k) + 1) * sizeof(int32_t), s);
  int32_t* pairs = scratch.at<int32_t>(at_pairs);
  Flags* flags = init_flags(scratch, s);
  if (n > 0) {
    const unsigned int chunks = static_cast<unsigned int>(nch);
    dispatch(dtype, mo, [&](auto kind) {
      constexpr int DT = decltype(kind)::dt;
      constexpr bool MOM = decltype(kind)::mom;
      topk_select_kernel<DT, MOM><<<chunks, kSelectThreads, 0, s>>>(update, mo, residual, n, chunk, k, pairs, flags);
      cuda::check_launch("topk_select_kernel");
      topk_pack_kernel<<<chunks, kThreads, 0, s>>>(pairs, n, chunk, k, format, out + kHeaderWords, flags);
      cuda::check_launch("topk_pack_kernel");
      add_update_kernel<DT, MOM><<<cuda::blocks_for(n, kThreads), kThreads, 0, s>>>(update, mo, residual, kept, n,
                                                                                    flags);
      cuda::check_launch("add_update_kernel");
    });
    topk_subtract_kernel<<<chunks, kThreads, 0, s>>>(kept, mo.velocity ? mo.out : nullptr, out + kHeaderWords,
                                                      pairs, n, chunk, k, format, flags);
    cuda::check_launch("topk_subtract_kernel");
  }
  launch_header(out, words, format, n, chunk, k, false, flags, s);
  return {words, topk_entries(n, chunk, k), -1};
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
  Flags* flags = init_flags(scratch, s);
  if (n > 0) {
    dispatch(dtype, mo, [&](auto kind) {
      constexpr int DT = decltype(kind)::dt;
      constexpr bool MOM = decltype(kind)::mom;
      ternary_chunk_kernel<DT, MOM><<<static_cast<unsigned int>(nch), kTernaryThreads, 0, s>>>(
          update, mo, residual, n, chunk, fraction, out + kHeaderWords, flags);
      cuda::check_launch("ternary_chunk_kernel");
      ternary_residual_kernel<DT, MOM><<<cuda::blocks_for(n, kThreads), kThreads, 0, s>>>(
          update, mo, residual, kept, n, chunk, out + kHeaderWords, flags);
      cuda::check_launch("ternary_residual_kernel");
    });
  }
  launch_header(out, words, kTernary, n, chunk, 0, true, flags, s);
  return {words, -1, -1};
}

}  // namespace gs
