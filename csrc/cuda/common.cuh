// Plumbing shared by the CUDA kernels: error checks, the device of a pointer, stream-ordered scratch
// memory and launch geometry. Per-element logic does not live here: it is in gradshare/element.h and
// gradshare/message.h, shared with the CPU kernels.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace gs {
namespace cuda {

constexpr int kThreads = 256;  // threads per block in every kernel

// Throws std::runtime_error naming the failed call and the CUDA error.
inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // clear a non-sticky error so the next call starts clean
    throw std::runtime_error(std::string("gradshare CUDA: ") + what + ": " + cudaGetErrorString(e));
  }
}

// Call right after a launch: reports a bad configuration (or an earlier asynchronous failure).
inline void check_launch(const char* kernel) { check(cudaGetLastError(), kernel); }

inline cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

// Blocks of `per_block` items that cover `items` (items <= 2^31-1, so this always fits a grid's x).
inline unsigned int blocks_for(int64_t items, int64_t per_block) {
  const int64_t b = (items + per_block - 1) / per_block;
  if (b > 2147483647) throw std::invalid_argument("gradshare CUDA: too many elements for one launch");
  return static_cast<unsigned int>(b);
}

// Refuses memory the device cannot reach (plain host memory on a system without HMM/ATS): a kernel
// reading it would fault and poison the context. Returns the device that owns `p`, or -1 when it is
// not tied to one device (pinned or system-allocated host memory the device can address).
inline int device_of(const void* p, const char* name) {
  cudaPointerAttributes a{};
  check(cudaPointerGetAttributes(&a, p), name);
  if (a.type == cudaMemoryTypeUnregistered && a.devicePointer == nullptr)
    throw std::invalid_argument(std::string(name) + ": not CUDA memory (a host pointer was passed to a CUDA kernel)");
  return (a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged) ? a.device : -1;
}

// Makes the device that owns `p` current for the lifetime of the guard (and checks `p` is CUDA memory),
// so launches and scratch allocations land on the same device as the caller's tensors and stream.
class DeviceGuard {
 public:
  DeviceGuard(const void* p, const char* name) {
    const int dev = device_of(p, name);
    check(cudaGetDevice(&prev_), "cudaGetDevice");
    if (dev >= 0 && dev != prev_) {
      check(cudaSetDevice(dev), "cudaSetDevice");
      switched_ = true;
    }
  }
  ~DeviceGuard() {
    if (switched_) (void)cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
  bool switched_ = false;
};

// gradshare's own memory pool on the current device (created once, kept for the process), or null where the
// device has no memory pools. Not the device's default pool: that one returns its memory to the system at every
// synchronization (release threshold 0), so an encode that waits for its message length would map its scratch
// anew on every call, which costs more than the kernels on small buffers; and its threshold is not ours to change.
// This pool keeps up to kPoolKeep bytes between calls.
constexpr uint64_t kPoolKeep = uint64_t(256) << 20;
inline cudaMemPool_t scratch_pool() {
  static std::mutex mu;
  static std::vector<cudaMemPool_t> pools;  // per device; null: no pools
  static std::vector<bool> made;
  int dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  std::lock_guard<std::mutex> lock(mu);
  if (static_cast<size_t>(dev) >= made.size()) {
    pools.resize(dev + 1, nullptr);
    made.resize(dev + 1, false);
  }
  if (!made[dev]) {
    int supported = 0;
    check(cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, dev), "cudaDeviceGetAttribute");
    if (supported) {
      cudaMemPoolProps props{};
      props.allocType = cudaMemAllocationTypePinned;
      props.location.type = cudaMemLocationTypeDevice;
      props.location.id = dev;
      check(cudaMemPoolCreate(&pools[dev], &props), "cudaMemPoolCreate");
      uint64_t keep = kPoolKeep;
      check(cudaMemPoolSetAttribute(pools[dev], cudaMemPoolAttrReleaseThreshold, &keep), "cudaMemPoolSetAttribute");
    }
    made[dev] = true;
  }
  return pools[dev];
}

// Stream-ordered scratch memory from scratch_pool(), released on the same stream when it goes out of scope,
// after every kernel already queued on the stream that uses it. Devices without memory pools fall back to
// cudaMalloc, freed after the stream drains.
class Scratch {
 public:
  Scratch(size_t bytes, cudaStream_t stream) : stream_(stream) {
    if (!bytes) return;
    const cudaMemPool_t pool = scratch_pool();
    if (pool) {
      check(cudaMallocFromPoolAsync(&p_, bytes, pool, stream), "cudaMallocFromPoolAsync");
    } else {
      pooled_ = false;
      check(cudaMalloc(&p_, bytes), "cudaMalloc");
    }
  }
  ~Scratch() {
    if (!p_) return;
    if (pooled_) {
      (void)cudaFreeAsync(p_, stream_);
    } else {
      (void)cudaStreamSynchronize(stream_);
      (void)cudaFree(p_);
    }
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  template <typename T>
  T* at(size_t byte_offset) const {
    return reinterpret_cast<T*>(static_cast<char*>(p_) + byte_offset);
  }

 private:
  void* p_ = nullptr;
  cudaStream_t stream_;
  bool pooled_ = true;
};

// Byte offsets of consecutive scratch regions, each aligned to 256 bytes.
inline size_t align_up(size_t bytes) { return (bytes + 255) & ~size_t(255); }

constexpr unsigned long long kNone = ~0ull;  // "no index" for atomicMin slots (memset to 0xff)

}  // namespace cuda
}  // namespace gs
