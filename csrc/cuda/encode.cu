// Threshold encoding with fused residual accumulation (CUDA). Same two passes as csrc/cpu/encode.cpp,
// with the same per-element rule (gradshare/element.h), so messages and residuals are bit-identical:
//   pass 1  count kernel: per tile of kTile elements, how many reach tau, plus the first non-finite u
//           (atomicMin) and the grand total; the host reads the total (one stream sync: the caller
//           needs the message length) and picks the format like encode_cpu.
//   scan    exclusive sum of the tile counts (CUB), sparse only.
//   pass 2  sparse: each tile writes the kept residual and its signed 1-based indices at its scanned
//           offset, ascending (a block scan per row of kThreads elements, rows in order);
//           bitmap: one thread per element, two warp ballots build two 16-element words per warp.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_scan.cuh>
#include <string>

#include "cuda/common.cuh"
#include "gradshare/kernels.h"

namespace gs {
namespace {

using cuda::kThreads;
constexpr int kItems = 16;                              // elements per thread per tile
constexpr int64_t kTile = int64_t(kThreads) * kItems;  // elements per block in the count and sparse passes

// Pass-1 results that cross to the host (one copy).
struct Pass1 {
  unsigned long long total;      // elements that reach tau
  unsigned long long first_bad;  // smallest i with non-finite u, or cuda::kNone
};

int64_t num_tiles(int64_t n) { return (n + kTile - 1) / kTile; }

// kernels.h's input_at with the momentum decided at run time (the branch is the same for every thread).
template <int DT>
__device__ __forceinline__ float input_any(const void* update, const Momentum& mo, int64_t i) {
  return mo.velocity ? input_at<DT, true>(update, mo, i) : input_at<DT, false>(update, mo, i);
}

// Pass 1. Rows of kThreads consecutive elements, so loads are coalesced. tile_counts may be null
// (count only).
template <int DT>
__global__ void __launch_bounds__(kThreads)
    count_kernel(const void* update, const Momentum mo, const float* residual, int64_t n, float tau,
                 long long* tile_counts, Pass1* p1) {
  using Reduce = cub::BlockReduce<int, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  const int64_t base = int64_t(blockIdx.x) * kTile;
  int cnt = 0;
  unsigned long long bad = cuda::kNone;
#pragma unroll 4
  for (int k = 0; k < kItems; ++k) {
    const int64_t i = base + int64_t(k) * kThreads + threadIdx.x;
    if (i < n) {
      const float u = residual[i] + input_any<DT>(update, mo, i);
      cnt += reaches(u, tau) ? 1 : 0;
      if (!is_finite(u) && bad == cuda::kNone) bad = static_cast<unsigned long long>(i);
    }
  }
  if (bad != cuda::kNone) atomicMin(&p1->first_bad, bad);  // rare
  const int block_count = Reduce(tmp).Sum(cnt);
  if (threadIdx.x == 0) {
    if (tile_counts) tile_counts[blockIdx.x] = block_count;
    atomicAdd(&p1->total, static_cast<unsigned long long>(block_count));
  }
}

__global__ void header_kernel(int32_t* out, int32_t format, int64_t n, int64_t count, float tau) {
  write_header(out, format, n, count, tau);
}

// Pass 2 (sparse). Tile layout as in count_kernel; offsets[b] is the exclusive scan of the tile
// counts. `limit` (the pass-1 total) bounds every write even if the inputs changed in between. With a
// fused momentum the new velocity goes to mo.out, 0 where sent (also in the bitmap kernel).
template <int DT>
__global__ void __launch_bounds__(kThreads)
    write_sparse_kernel(const void* update, const Momentum mo, const float* residual, float* kept, int64_t n,
                        float tau, float clip, const long long* offsets, int32_t* payload, int64_t limit) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage tmp;
  const int64_t base = int64_t(blockIdx.x) * kTile;
  int64_t off = offsets[blockIdx.x];
  for (int k = 0; k < kItems; ++k) {
    const int64_t row = base + int64_t(k) * kThreads;
    if (row >= n) break;  // uniform across the block
    const int64_t i = row + threadIdx.x;
    int s = 0;
    if (i < n) {
      float k;
      const float w = input_any<DT>(update, mo, i);
      s = threshold_step(residual[i] + w, tau, clip, &k);
      kept[i] = k;
      if (mo.velocity) mo.out[i] = s != 0 ? 0.0f : w;
    }
    int pos, row_count;
    Scan(tmp).ExclusiveSum(s != 0 ? 1 : 0, pos, row_count);
    if (s != 0 && off + pos < limit)
      payload[off + pos] = s > 0 ? static_cast<int32_t>(i + 1) : -static_cast<int32_t>(i + 1);
    off += row_count;
    __syncthreads();  // tmp is reused by the next row
  }
}

// Pass 2 (bitmap). One thread per element; a warp covers 32 consecutive elements = two whole words
// (blocks start at multiples of kThreads), written by lanes 0 and 16.
template <int DT>
__global__ void __launch_bounds__(kThreads)
    write_bitmap_kernel(const void* update, const Momentum mo, const float* residual, float* kept, int64_t n,
                        float tau, float clip, int32_t* payload) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  int s = 0;
  if (i < n) {
    float k;
    const float w = input_any<DT>(update, mo, i);
    s = threshold_step(residual[i] + w, tau, clip, &k);
    kept[i] = k;
    if (mo.velocity) mo.out[i] = s != 0 ? 0.0f : w;
  }
  // Every lane takes part in the ballots (no early return above); lanes past n contribute zeros,
  // so bits past n stay clear.
  const unsigned present = __ballot_sync(0xffffffffu, s != 0);
  const unsigned negative = __ballot_sync(0xffffffffu, s < 0);
  const unsigned lane = threadIdx.x & 31u;
  if ((lane & 15u) == 0 && i < n) {  // first element of a word that exists
    const uint32_t word = ((present >> lane) & 0xffffu) | (((negative >> lane) & 0xffffu) << 16);
    payload[i / 16] = static_cast<int32_t>(word);
  }
}

// Runs pass 1 and waits for it. tile_counts (num_tiles(n) slots) may be null.
template <int DT>
Pass1 run_count(const void* update, const Momentum& mo, const float* residual, int64_t n, float tau,
                long long* tile_counts, Pass1* p1, cudaStream_t stream) {
  cuda::check(cudaMemsetAsync(&p1->total, 0, sizeof p1->total, stream), "cudaMemsetAsync");
  cuda::check(cudaMemsetAsync(&p1->first_bad, 0xff, sizeof p1->first_bad, stream), "cudaMemsetAsync");
  count_kernel<DT><<<cuda::blocks_for(n, kTile), kThreads, 0, stream>>>(update, mo, residual, n, tau, tile_counts,
                                                                         p1);
  cuda::check_launch("count_kernel");
  Pass1 h{};
  cuda::check(cudaMemcpyAsync(&h, p1, sizeof h, cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync(count)");
  cuda::check(cudaStreamSynchronize(stream), "cudaStreamSynchronize(count)");
  return h;
}

int64_t nonfinite_index(const Pass1& p) {
  return p.first_bad == cuda::kNone ? -1 : static_cast<int64_t>(p.first_bad);
}

template <int DT>
CountResult count_t(const void* update, const float* residual, int64_t n, float tau, cudaStream_t stream) {
  cuda::Scratch scratch(sizeof(Pass1), stream);
  const Pass1 p = run_count<DT>(update, Momentum{}, residual, n, tau, nullptr, scratch.at<Pass1>(0), stream);
  return CountResult{static_cast<int64_t>(p.total), nonfinite_index(p)};
}

template <int DT>
EncodeResult encode_t(const void* update, const Momentum& mo, const float* residual, float* kept, int64_t n, float tau,
                      float clip, int32_t choice, int32_t* out, int64_t capacity, cudaStream_t stream) {
  // Scratch: [Pass1][tile counts][tile offsets][CUB scan temp], each region 256-byte aligned.
  const int64_t tiles = num_tiles(n);
  size_t scan_bytes = 0;
  if (tiles > 0)
    cuda::check(cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, static_cast<const long long*>(nullptr),
                                              static_cast<long long*>(nullptr), static_cast<int>(tiles), stream),
                "cub::DeviceScan::ExclusiveSum (size)");
  const size_t at_counts = cuda::align_up(sizeof(Pass1));
  const size_t at_offsets = at_counts + cuda::align_up(size_t(tiles) * sizeof(long long));
  const size_t at_scan = at_offsets + cuda::align_up(size_t(tiles) * sizeof(long long));
  cuda::Scratch scratch(n > 0 ? at_scan + scan_bytes : 0, stream);

  EncodeResult r{0, 0, -1, kSparse};
  if (n > 0) {
    const Pass1 p = run_count<DT>(update, mo, residual, n, tau, scratch.at<long long>(at_counts),
                                  scratch.at<Pass1>(0), stream);
    r.count = static_cast<int64_t>(p.total);
    r.nonfinite_index = nonfinite_index(p);
  }
  if (r.nonfinite_index >= 0) return r;  // nothing written: the residual (and kept) stay as they were

  r.format = choose_format(choice, r.count, n, capacity);
  const int64_t need = kHeaderWords + payload_words(r.format, n, r.count);
  header_kernel<<<1, 1, 0, stream>>>(out, r.format, n, r.count, tau);
  cuda::check_launch("header_kernel");
  if (n > 0) {  // even with no entries kept takes residual + update (and the clipping)
    if (r.format == kSparse) {
      long long* counts = scratch.at<long long>(at_counts);
      long long* offsets = scratch.at<long long>(at_offsets);
      cuda::check(cub::DeviceScan::ExclusiveSum(scratch.at<void>(at_scan), scan_bytes, counts, offsets,
                                                static_cast<int>(tiles), stream),
                  "cub::DeviceScan::ExclusiveSum");
      write_sparse_kernel<DT><<<cuda::blocks_for(n, kTile), kThreads, 0, stream>>>(
          update, mo, residual, kept, n, tau, clip, offsets, out + kHeaderWords, r.count);
      cuda::check_launch("write_sparse_kernel");
    } else {
      write_bitmap_kernel<DT><<<cuda::blocks_for(n, kThreads), kThreads, 0, stream>>>(
          update, mo, residual, kept, n, tau, clip, out + kHeaderWords);
      cuda::check_launch("write_bitmap_kernel");
    }
  }
  r.length = need;
  return r;
}

}  // namespace

CountResult count_cuda(const void* update, int32_t dtype, const float* residual, int64_t n, float tau,
                       void* stream) {
  check_encode_args(dtype, n, tau, 0.0f, kChooseAuto, kHeaderWords);
  if (n == 0) return CountResult{0, -1};
  cuda::DeviceGuard guard(residual, "residual");
  cuda::device_of(update, "update");
  const cudaStream_t s = cuda::as_stream(stream);
  return dispatch(dtype, Momentum{}, [&](auto kind) {
    return count_t<decltype(kind)::dt>(update, residual, n, tau, s);
  });
}

EncodeResult encode_cuda(const void* update, int32_t dtype, const float* residual, float* kept, int64_t n, float tau,
                         float clip, int32_t choice, int32_t* out, int64_t capacity, void* stream,
                         const Momentum& mo) {
  check_encode_args(dtype, n, tau, clip, choice, capacity);
  check_momentum(mo);
  cuda::DeviceGuard guard(out, "out");
  if (n > 0) {
    cuda::device_of(update, "update");
    cuda::device_of(residual, "residual");
    cuda::device_of(kept, "kept");
    if (mo.velocity) {
      cuda::device_of(mo.velocity, "velocity");
      cuda::device_of(mo.out, "velocity_out");
    }
  }
  const cudaStream_t s = cuda::as_stream(stream);
  // The kernels take the momentum at run time: only the dtype is a template argument here.
  return dispatch(dtype, Momentum{}, [&](auto kind) {
    return encode_t<decltype(kind)::dt>(update, mo, residual, kept, n, tau, clip, choice, out, capacity, s);
  });
}

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {  // no driver or no device: not an error here
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}

}  // namespace gs
