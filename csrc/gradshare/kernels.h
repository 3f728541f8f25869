// The native API: plain C++ over raw pointers. No Python and no libtorch here; csrc/bindings.cpp is
// the only file that knows pybind11. Argument errors throw std::invalid_argument; a malformed message
// throws gs::MessageError. CPU functions run with OpenMP; CUDA functions launch on `stream`.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include "gradshare/element.h"
#include "gradshare/message.h"

namespace gs {

struct MessageError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

struct CountResult {
  int64_t count;            // elements with |residual + update| >= tau
  int64_t nonfinite_index;  // first i whose residual + update is NaN/Inf, or -1
};

struct EncodeResult {
  int64_t length;           // words written to out (header + payload); 0 when nothing was written
  int64_t count;
  int64_t nonfinite_index;  // >= 0: nothing was written and the residual is unchanged
  int32_t format;
};

struct ChunkedResult {
  int64_t length;           // words written to out (the fixed length of the format)
  int64_t entries;          // entries sent (top-k: k_c summed; ternary: present bits)
  int64_t nonfinite_index;  // >= 0: out holds a non-finite marker and the residual is unchanged
};
// The CUDA encoders do not wait for the device (the length is fixed): their nonfinite_index is -1 and a ternary
// message's entries -1; the header in `out` says both (a non-finite marker, or the entry count in word 4).

// Momentum correction fused into an encode (Deep Gradient Compression). With `velocity` set, the encoder's
// input is w = factor * velocity + update (element.h's velocity_step) instead of the update, and `out`
// receives w with the entries just sent set to 0 (momentum factor masking): one kernel where a velocity
// update, the encode and a mask from the message would each pass over memory. `out` is n floats overlapping
// no other buffer, so the velocity is only read; on a non-finite result `out` holds nothing of use (the
// caller keeps the velocity, as it keeps the residual). velocity == nullptr: no momentum, `out` unused.
struct Momentum {
  const float* velocity = nullptr;
  float factor = 0.0f;
  float* out = nullptr;
};

// The encoders' input at element i, in every CPU and CUDA encoder: the update (dtype DT), or with a fused
// momentum (MOM) the new velocity m * velocity + update.
template <int DT, bool MOM>
GS_HD float input_at(const void* update, const Momentum& mo, int64_t i) {
  const float g = load_as_float(update, DT, i);
  return MOM ? velocity_step(mo.velocity[i], mo.factor, g) : g;
}

// The one place where an encoder's input kind becomes template arguments: dispatch(dtype, mo, f) calls
// f(InputKind<DT, MOM>{}) for the update's dtype and whether a momentum is fused (mo.velocity set), and
// returns what f returns. f reads decltype(kind)::dt and ::mom.
template <int DT, bool MOM>
struct InputKind {
  static constexpr int dt = DT;
  static constexpr bool mom = MOM;
};
template <typename F>
auto dispatch(int32_t dtype, const Momentum& mo, F&& f) -> decltype(f(InputKind<kFloat32, false>{})) {
  const bool m = mo.velocity != nullptr;
  switch (dtype) {
    case kFloat16: return m ? f(InputKind<kFloat16, true>{}) : f(InputKind<kFloat16, false>{});
    case kBFloat16: return m ? f(InputKind<kBFloat16, true>{}) : f(InputKind<kBFloat16, false>{});
    default: return m ? f(InputKind<kFloat32, true>{}) : f(InputKind<kFloat32, false>{});
  }
}

// Words an encode may need: enough for either format when the choice is kChooseAuto or kChooseBitmap.
inline int64_t encode_capacity(int64_t n) { return kHeaderWords + bitmap_words(n); }

// ---- CPU ----
CountResult count_cpu(const void* update, int32_t dtype, const float* residual, int64_t n, float tau);
// Every encoder reads residual + update and writes what it does not send into `kept`: the residual itself
// (in place) or a buffer of n floats that overlaps neither it nor the update, so that the residual is only
// read. A non-finite residual + update leaves the residual unchanged (a separate `kept` then holds nothing
// of use: the caller drops it with the step).
// Two passes: count (and finiteness) per chunk, then write kept and payload at scanned offsets, so
// the indices come out ascending whatever the thread count. clip <= 0 disables residual clipping.
EncodeResult encode_cpu(const void* update, int32_t dtype, const float* residual, float* kept, int64_t n, float tau,
                        float clip, int32_t choice, int32_t* out, int64_t capacity, const Momentum& mo = {});
// Validates every message first (nothing is written if any is bad), then adds them in order:
// dst[i] += sign * (tau * scale). Messages are rows of `row_words` words. dst == nullptr: validate only.
void decode_cpu(float* dst, int64_t n, const int32_t* msgs, int64_t num_msgs, int64_t row_words, float scale);
// Top-k (format 3) and ternary (format 4) encodes of residual + update, what is kept into `kept` (see
// csrc/cpu/chunked.cpp). `capacity` must hold topk_words / ternary_words.
// `format`: kTopK (bfloat16 values), kTopK8 (8-bit values and a scale per chunk) or kTopKSign (signs and a
// scale per chunk, Elias-Fano coded indices).
ChunkedResult encode_topk_cpu(const void* update, int32_t dtype, const float* residual, float* kept, int64_t n,
                              int64_t chunk, int64_t k, int32_t format, int32_t* out, int64_t capacity,
                              const Momentum& mo = {});
ChunkedResult encode_ternary_cpu(const void* update, int32_t dtype, const float* residual, float* kept, int64_t n,
                                 int64_t chunk, float fraction, int32_t* out, int64_t capacity,
                                 const Momentum& mo = {});
// dst = sum_j weights[j] * srcs[j] (weights == nullptr: the mean). dst may be one of srcs.
void average_cpu(float* dst, const float* const* srcs, int64_t k, const float* weights, int64_t n);
// target[i] +-= the excess of element i (element.h): adam_excess from the optimizer's moments (change ==
// nullptr), or change_excess of the step's change (after: the parameters after the step, read only when
// a.decay != 0). signal: nullptr, or gradshare's average of m^2, updated (element.h: squared_mean). n floats
// each; target may be `change` itself (in place), and overlaps nothing else.
void rescale_cpu(const float* exp_avg, const float* exp_avg_sq, const float* change, const float* after,
                 float* signal, float* target, int64_t n, const RescaleArgs& a);
// The tensors of a step of an optimizer whose mean gradient gradshare keeps (element.h: tracked_excess), n
// floats each. change and after may be target itself; nothing else overlaps.
struct TrackedTensors {
  const float* grad = nullptr;      // the parameter's gradient, as the optimizer read it
  const float* change = nullptr;    // the step's change, before - after
  const float* after = nullptr;     // the parameters after the step (read only with a weight decay)
  const float* second = nullptr;    // RMSprop / Adagrad / Adadelta: the optimizer's second moment
  const float* grad_avg = nullptr;  // centered RMSprop: its mean gradient
  float* mean = nullptr;            // gradshare's mean gradient (updated)
  float* extra = nullptr;           // Adagrad's sum of m^2, Adamax's / Adafactor's mean square, RMSprop's momentum
  float* signal = nullptr;          // nullptr, or the average of m^2 over the second moment's window (updated)
  float* target = nullptr;          // += (sign -1: -=) the excess
};
// target[i] +-= tracked_excess of element i, updating mean, extra and signal.
void rescale_tracked_cpu(const TrackedTensors& t, int64_t n, const TrackedArgs& a);

// dsts[j][i] = srcs[j][i] * scale for each of the k pairs (ns[j] floats each; a dst may be its own src, and
// overlaps nothing else); returns whether any value written is NaN or Inf (element.h: scale_element).
bool scale_into_cpu(float* const* dsts, const float* const* srcs, const int64_t* ns, int64_t k, float scale);

int cpu_threads();
void set_cpu_threads(int threads);
bool have_openmp();

// ---- CUDA (defined only when built with GS_HAVE_CUDA) ----
#ifdef GS_HAVE_CUDA
CountResult count_cuda(const void* update, int32_t dtype, const float* residual, int64_t n, float tau,
                       void* stream);
EncodeResult encode_cuda(const void* update, int32_t dtype, const float* residual, float* kept, int64_t n, float tau,
                         float clip, int32_t choice, int32_t* out, int64_t capacity, void* stream,
                         const Momentum& mo = {});
void decode_cuda(float* dst, int64_t n, const int32_t* msgs, int64_t num_msgs, int64_t row_words, float scale,
                 void* stream);
ChunkedResult encode_topk_cuda(const void* update, int32_t dtype, const float* residual, float* kept, int64_t n,
                               int64_t chunk, int64_t k, int32_t format, int32_t* out, int64_t capacity, void* stream,
                               const Momentum& mo = {});
ChunkedResult encode_ternary_cuda(const void* update, int32_t dtype, const float* residual, float* kept, int64_t n,
                                  int64_t chunk, float fraction, int32_t* out, int64_t capacity, void* stream,
                                  const Momentum& mo = {});
// srcs and weights are host arrays of device pointers / host floats.
void average_cuda(float* dst, const float* const* srcs, int64_t k, const float* weights, int64_t n, void* stream);
void rescale_cuda(const float* exp_avg, const float* exp_avg_sq, const float* change, const float* after,
                  float* signal, float* target, int64_t n, const RescaleArgs& a, void* stream);
void rescale_tracked_cuda(const TrackedTensors& t, int64_t n, const TrackedArgs& a, void* stream);
int cuda_device_count();
#endif

// Shared argument checks (throw std::invalid_argument naming the argument).
inline void check_encode_args(int32_t dtype, int64_t n, float tau, float clip, int32_t choice, int64_t capacity) {
  if (dtype != kFloat32 && dtype != kFloat16 && dtype != kBFloat16)
    throw std::invalid_argument("update: dtype must be float32, float16 or bfloat16");
  if (n < 0 || n > kMaxElements)
    throw std::invalid_argument("update: " + std::to_string(n) +
                                " elements; a message can encode at most 2^31-1 (split the buffer)");
  if (!(tau > 0.0f) || !is_finite(tau)) throw std::invalid_argument("tau must be a positive finite float");
  if (!is_finite(clip)) throw std::invalid_argument("clip must be finite (<= 0 disables clipping)");
  if (choice != kChooseAuto && choice != kChooseSparse && choice != kChooseBitmap)
    throw std::invalid_argument("format must be auto, sparse or bitmap");
  if (capacity < kHeaderWords) throw std::invalid_argument("out: capacity is smaller than the message header");
}

// A fused momentum (see Momentum): an output for the new velocity and a finite factor.
inline void check_momentum(const Momentum& mo) {
  if (mo.velocity == nullptr) return;
  if (mo.out == nullptr) throw std::invalid_argument("velocity_out: needed with a velocity");
  if (!is_finite(mo.factor)) throw std::invalid_argument("momentum must be a finite float");
}

// Arguments of the top-k / ternary encoders (CPU and CUDA); returns the message length in words.
inline int64_t check_chunked_args(int32_t format, int32_t dtype, int64_t n, int64_t chunk, int64_t k, float fraction,
                                  int64_t capacity) {
  const bool topk = is_topk(format);
  if (!topk && format != kTernary)
    throw std::invalid_argument("format must be top-k, 8-bit top-k, top-k signs or ternary");
  if (dtype != kFloat32 && dtype != kFloat16 && dtype != kBFloat16)
    throw std::invalid_argument("update: dtype must be float32, float16 or bfloat16");
  if (n < 0 || n > kMaxElements)
    throw std::invalid_argument("update: " + std::to_string(n) +
                                " elements; a message can encode at most 2^31-1 (split the buffer)");
  if (topk) {
    if (chunk < 1 || chunk > max_topk_chunk(format))
      throw std::invalid_argument(format == kTopKSign ? "chunk: must be in [1, 2^31-1] for top-k signs"
                                                      : "chunk: must be in [1, 65536] for top-k");
    if (k < 0 || k > chunk) throw std::invalid_argument("k must be in [0, chunk]");
  } else {
    if (chunk < 16 || chunk % 16 != 0 || chunk > kMaxTernaryChunk)
      throw std::invalid_argument("chunk: must be a multiple of 16 (and at most 2^30) for ternary");
    if (!(fraction >= 0.0f) || !is_finite(fraction)) throw std::invalid_argument("fraction must be finite and >= 0");
  }
  const int64_t words = chunked_words(format, n, chunk, k);
  if (capacity < words)
    throw std::invalid_argument("out: message needs " + std::to_string(words) + " words, capacity is " +
                                std::to_string(capacity));
  return words;
}

// The format an encode writes (kChooseAuto: the smaller payload) once the count is known; throws when
// the message would not fit in `capacity` words. Shared by the CPU and CUDA encoders.
inline int32_t choose_format(int32_t choice, int64_t count, int64_t n, int64_t capacity) {
  const int32_t format = choice == kChooseAuto ? (prefer_sparse(count, n) ? kSparse : kBitmap) : choice;
  const int64_t need = kHeaderWords + payload_words(format, n, count);
  if (need > capacity)
    throw std::invalid_argument("out: message needs " + std::to_string(need) + " words, capacity is " +
                                std::to_string(capacity));
  return format;
}

inline void check_rescale_args(const float* exp_avg, const float* exp_avg_sq, const float* change, const float* after,
                               const float* signal, const float* target, int64_t n, const RescaleArgs& a) {
  if (n < 0) throw std::invalid_argument("n must be >= 0");
  if (n > 0 && (exp_avg == nullptr || exp_avg_sq == nullptr || target == nullptr))
    throw std::invalid_argument("exp_avg, exp_avg_sq and target are required");
  if (n > 0 && change != nullptr && a.decay != 0.0f && after == nullptr)
    throw std::invalid_argument("after: required with a decoupled weight decay");
  if (!(a.bias1 > 0.0f) || !(a.bias2 > 0.0f) || !is_finite(a.bias1) || !is_finite(a.bias2))
    throw std::invalid_argument("bias corrections must be positive and finite");
  if (!(a.world >= 1.0f) || !is_finite(a.world)) throw std::invalid_argument("world must be >= 1");
  if (!(a.eps >= 0.0f) || !is_finite(a.eps)) throw std::invalid_argument("eps must be >= 0 and finite");
  if (!is_finite(a.lr) || !is_finite(a.decay)) throw std::invalid_argument("lr and decay must be finite");
  if (a.sign != 1.0f && a.sign != -1.0f) throw std::invalid_argument("sign must be +1 or -1");
  if (signal != nullptr && (!(a.signal_weight > 0.0f && a.signal_weight <= 1.0f) ||
                            !(a.signal_bias > 0.0f && a.signal_bias <= 1.0f)))
    throw std::invalid_argument("signal_weight and signal_bias must lie in (0, 1]");
}

// Whether a tracked step reads the parameters before it (a weight decay: coupled into the gradient, or
// Adafactor's decoupled one) and keeps RMSprop's momentum.
inline bool tracked_decay(const TrackedArgs& a) { return a.kind == kAdafactor ? a.decay != 0.0f : a.weight_decay != 0.0f; }
inline bool tracked_momentum(const TrackedArgs& a) { return a.kind == kRmsprop && a.momentum != 0.0f; }

inline void check_tracked_args(const TrackedTensors& t, int64_t n, const TrackedArgs& a) {
  if (a.kind < 0 || a.kind >= kTrackedKinds) throw std::invalid_argument("kind must be 0 to 4 (gs::TrackedKind)");
  if (n < 0) throw std::invalid_argument("n must be >= 0");
  const bool own = a.kind == kRmsprop || a.kind == kAdagrad || a.kind == kAdadelta;
  if (n > 0) {
    if (t.grad == nullptr || t.change == nullptr || t.mean == nullptr || t.target == nullptr)
      throw std::invalid_argument("grad, change, mean and target are required");
    if (own && t.second == nullptr) throw std::invalid_argument("second: required for RMSprop, Adagrad, Adadelta");
    if (t.extra == nullptr && (a.kind != kRmsprop || tracked_momentum(a)) && a.kind != kAdadelta)
      throw std::invalid_argument("extra: required for Adagrad, Adamax, Adafactor and RMSprop with momentum");
    if (tracked_decay(a) && t.after == nullptr) throw std::invalid_argument("after: required with a weight decay");
    const void* rw[] = {t.mean, t.extra, t.signal, t.target};
    const void* ro[] = {t.grad, t.second, t.grad_avg};
    for (int i = 0; i < 4; ++i) {
      for (int j = 0; j < 3; ++j)
        if (rw[i] != nullptr && rw[i] == ro[j])
          throw std::invalid_argument("mean, extra, signal and target: written, so they cannot be grad, second or "
                                      "grad_avg");
      for (int j = i + 1; j < 4; ++j)
        if (rw[i] != nullptr && rw[i] == rw[j])
          throw std::invalid_argument("mean, extra, signal and target must be distinct");
    }
    for (int i = 0; i < 3; ++i)
      if (rw[i] != nullptr && (rw[i] == t.change || rw[i] == t.after))
        throw std::invalid_argument("mean, extra and signal cannot be change or after");
  }
  if (t.signal != nullptr && (a.kind == kAdagrad || t.grad_avg != nullptr))
    throw std::invalid_argument("signal: not for Adagrad (its sum of m^2 spans its window) or centered RMSprop "
                                "(it subtracts its own mean)");
  if (t.signal != nullptr && (!(a.signal_weight > 0.0f && a.signal_weight <= 1.0f) ||
                              !(a.signal_bias > 0.0f && a.signal_bias <= 1.0f)))
    throw std::invalid_argument("signal_weight and signal_bias must lie in (0, 1]");
  if (t.grad_avg != nullptr && a.kind != kRmsprop) throw std::invalid_argument("grad_avg: only for RMSprop");
  if (a.momentum != 0.0f && a.kind != kRmsprop) throw std::invalid_argument("momentum: only for RMSprop");
  if (a.kind == kAdafactor ? a.weight_decay != 0.0f : a.decay != 0.0f)
    throw std::invalid_argument("weight_decay is coupled (not Adafactor), decay decoupled (Adafactor only)");
  const float finite[] = {a.weight_decay, a.decay, a.offset, a.eps, a.momentum, a.lr};
  for (float x : finite)
    if (!is_finite(x)) throw std::invalid_argument("weight_decay, decay, offset, eps, momentum and lr must be finite");
  if (!(a.world >= 1.0f) || !is_finite(a.world)) throw std::invalid_argument("world must be >= 1");
  if (!(a.inv_world > 0.0f && a.inv_world <= 1.0f)) throw std::invalid_argument("inv_world must be in (0, 1]");
  if (a.grad_sign != 1.0f && a.grad_sign != -1.0f) throw std::invalid_argument("grad_sign must be +1 or -1");
  if (!(a.mean_weight > 0.0f && a.mean_weight <= 1.0f) || !(a.mean_bias > 0.0f && a.mean_bias <= 1.0f))
    throw std::invalid_argument("mean_weight and mean_bias must be in (0, 1]");
  if (!(a.square_weight >= 0.0f && a.square_weight <= 1.0f) || !(a.square_bias > 0.0f && a.square_bias <= 1.0f))
    throw std::invalid_argument("square_weight must be in [0, 1], square_bias in (0, 1]");
  if (!(a.scale > 0.0f) || !is_finite(a.scale)) throw std::invalid_argument("scale must be positive and finite");
  if (!(a.count >= 1.0f) || !is_finite(a.count)) throw std::invalid_argument("count must be >= 1");
  if (!(a.eps >= 0.0f)) throw std::invalid_argument("eps must be >= 0");
  if (a.sign != 1.0f && a.sign != -1.0f) throw std::invalid_argument("sign must be +1 or -1");
}

}  // namespace gs
