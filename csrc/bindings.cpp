// The only file that knows Python. Tensors cross as raw addresses (data_ptr) plus sizes, so the
// native library never links libtorch and works with any torch (and numpy) without a rebuild.
// gradshare/_native.py is its one caller; argument checks with friendly messages live there.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <vector>
#include "gradshare/kernels.h"

namespace py = pybind11;
using gs::CountResult;
using gs::EncodeResult;

namespace {

template <typename T>
T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

[[noreturn, maybe_unused]] void no_cuda() { throw std::runtime_error("gradshare was built without CUDA kernels"); }

py::tuple count(uintptr_t update, int32_t dtype, uintptr_t residual, int64_t n, float tau, bool cuda,
                uintptr_t stream) {
  CountResult r;
  {
    py::gil_scoped_release nogil;
    if (cuda) {
#ifdef GS_HAVE_CUDA
      r = gs::count_cuda(ptr<const void>(update), dtype, ptr<const float>(residual), n, tau, ptr<void>(stream));
#else
      (void)stream;
      no_cuda();
#endif
    } else {
      r = gs::count_cpu(ptr<const void>(update), dtype, ptr<const float>(residual), n, tau);
    }
  }
  return py::make_tuple(r.count, r.nonfinite_index);
}

// A fused momentum (gs::Momentum): velocity 0 means none.
gs::Momentum momentum_of(uintptr_t velocity, float factor, uintptr_t velocity_out) {
  return gs::Momentum{ptr<const float>(velocity), factor, ptr<float>(velocity_out)};
}

py::tuple encode(uintptr_t update, int32_t dtype, uintptr_t residual, uintptr_t kept, int64_t n, float tau, float clip,
                 int32_t choice, uintptr_t out, int64_t capacity, bool cuda, uintptr_t stream, uintptr_t velocity,
                 float momentum, uintptr_t velocity_out) {
  const gs::Momentum mo = momentum_of(velocity, momentum, velocity_out);
  EncodeResult r;
  {
    py::gil_scoped_release nogil;
    if (cuda) {
#ifdef GS_HAVE_CUDA
      r = gs::encode_cuda(ptr<const void>(update), dtype, ptr<const float>(residual), ptr<float>(kept), n, tau, clip,
                          choice, ptr<int32_t>(out), capacity, ptr<void>(stream), mo);
#else
      (void)stream;
      no_cuda();
#endif
    } else {
      r = gs::encode_cpu(ptr<const void>(update), dtype, ptr<const float>(residual), ptr<float>(kept), n, tau, clip,
                         choice, ptr<int32_t>(out), capacity, mo);
    }
  }
  return py::make_tuple(r.length, r.count, r.nonfinite_index, r.format);
}

// Top-k / 8-bit top-k (param = k) or ternary (param = fraction) encode, `format` the message format code;
// returns (length, entries, first bad); on CUDA -1 where not read back (kernels.h).
py::tuple encode_chunked(int32_t format, uintptr_t update, int32_t dtype, uintptr_t residual, uintptr_t kept, int64_t n,
                         int64_t chunk, double param, uintptr_t out, int64_t capacity, bool cuda, uintptr_t stream,
                         uintptr_t velocity, float momentum, uintptr_t velocity_out) {
  const gs::Momentum mo = momentum_of(velocity, momentum, velocity_out);
  gs::ChunkedResult r;
  {
    py::gil_scoped_release nogil;
    if (cuda) {
#ifdef GS_HAVE_CUDA
      r = format != gs::kTernary
              ? gs::encode_topk_cuda(ptr<const void>(update), dtype, ptr<const float>(residual), ptr<float>(kept), n,
                                     chunk, static_cast<int64_t>(param), format, ptr<int32_t>(out), capacity,
                                     ptr<void>(stream), mo)
               : gs::encode_ternary_cuda(ptr<const void>(update), dtype, ptr<const float>(residual), ptr<float>(kept),
                                         n, chunk, static_cast<float>(param), ptr<int32_t>(out), capacity,
                                         ptr<void>(stream), mo);
#else
      (void)stream;
      no_cuda();
#endif
    } else {
      r = format != gs::kTernary
              ? gs::encode_topk_cpu(ptr<const void>(update), dtype, ptr<const float>(residual), ptr<float>(kept), n,
                                    chunk, static_cast<int64_t>(param), format, ptr<int32_t>(out), capacity, mo)
               : gs::encode_ternary_cpu(ptr<const void>(update), dtype, ptr<const float>(residual), ptr<float>(kept),
                                        n, chunk, static_cast<float>(param), ptr<int32_t>(out), capacity, mo);
    }
  }
  return py::make_tuple(r.length, r.entries, r.nonfinite_index);
}

void decode(uintptr_t dst, int64_t n, uintptr_t msgs, int64_t num_msgs, int64_t row_words, float scale, bool cuda,
            uintptr_t stream) {
  py::gil_scoped_release nogil;
  if (cuda) {
#ifdef GS_HAVE_CUDA
    gs::decode_cuda(ptr<float>(dst), n, ptr<const int32_t>(msgs), num_msgs, row_words, scale, ptr<void>(stream));
#else
    (void)stream;
    no_cuda();
#endif
  } else {
    gs::decode_cpu(ptr<float>(dst), n, ptr<const int32_t>(msgs), num_msgs, row_words, scale);
  }
}

void average(uintptr_t dst, const std::vector<uintptr_t>& srcs, const std::vector<float>& weights, int64_t n,
             bool cuda, uintptr_t stream) {
  if (!weights.empty() && weights.size() != srcs.size())
    throw std::invalid_argument("weights: need one weight per buffer");
  std::vector<const float*> p(srcs.size());
  for (size_t i = 0; i < srcs.size(); ++i) p[i] = ptr<const float>(srcs[i]);
  const float* w = weights.empty() ? nullptr : weights.data();
  py::gil_scoped_release nogil;
  if (cuda) {
#ifdef GS_HAVE_CUDA
    gs::average_cuda(ptr<float>(dst), p.data(), (int64_t)p.size(), w, n, ptr<void>(stream));
#else
    (void)stream;
    no_cuda();
#endif
  } else {
    gs::average_cpu(ptr<float>(dst), p.data(), (int64_t)p.size(), w, n);
  }
}

void rescale(uintptr_t exp_avg, uintptr_t exp_avg_sq, uintptr_t change, uintptr_t after, uintptr_t signal,
             uintptr_t target, int64_t n, float bias1, float bias2, float world, float eps, float lr, float decay,
             float sign, float signal_weight, float signal_bias, bool cuda, uintptr_t stream) {
  gs::RescaleArgs a;
  a.signal_weight = signal_weight;
  a.signal_bias = signal_bias;
  a.bias1 = bias1;
  a.bias2 = bias2;
  a.world = world;
  a.eps = eps;
  a.lr = lr;
  a.decay = decay;
  a.sign = sign;
  py::gil_scoped_release nogil;
  if (cuda) {
#ifdef GS_HAVE_CUDA
    gs::rescale_cuda(ptr<const float>(exp_avg), ptr<const float>(exp_avg_sq), ptr<const float>(change),
                     ptr<const float>(after), ptr<float>(signal), ptr<float>(target), n, a, ptr<void>(stream));
#else
    (void)stream;
    no_cuda();
#endif
  } else {
    gs::rescale_cpu(ptr<const float>(exp_avg), ptr<const float>(exp_avg_sq), ptr<const float>(change),
                    ptr<const float>(after), ptr<float>(signal), ptr<float>(target), n, a);
  }
}

// Several rescale calls under one GIL release: an Adam-family model of many small tensors paid more for the
// Python call per parameter than for its pass over memory. ptrs: 6 addresses per item (exp_avg, exp_avg_sq,
// change, after, signal, target; 0 where absent), scalars: 9 per item in rescale's order (bias1 .. signal_bias).
void rescale_many(const std::vector<uintptr_t>& ptrs, const std::vector<int64_t>& ns, const std::vector<float>& scalars,
                  bool cuda, uintptr_t stream) {
  const size_t k = ns.size();
  if (ptrs.size() != 6 * k || scalars.size() != 9 * k) {
    throw std::invalid_argument("rescale_many: 6 addresses and 9 scalars per item");
  }
  py::gil_scoped_release nogil;
  for (size_t i = 0; i < k; ++i) {
    const uintptr_t* p = &ptrs[6 * i];
    const float* s = &scalars[9 * i];
    gs::RescaleArgs a;
    a.bias1 = s[0];
    a.bias2 = s[1];
    a.world = s[2];
    a.eps = s[3];
    a.lr = s[4];
    a.decay = s[5];
    a.sign = s[6];
    a.signal_weight = s[7];
    a.signal_bias = s[8];
    if (cuda) {
#ifdef GS_HAVE_CUDA
      gs::rescale_cuda(ptr<const float>(p[0]), ptr<const float>(p[1]), ptr<const float>(p[2]), ptr<const float>(p[3]),
                       ptr<float>(p[4]), ptr<float>(p[5]), ns[i], a, ptr<void>(stream));
#else
      (void)stream;
      no_cuda();
#endif
    } else {
      gs::rescale_cpu(ptr<const float>(p[0]), ptr<const float>(p[1]), ptr<const float>(p[2]), ptr<const float>(p[3]),
                      ptr<float>(p[4]), ptr<float>(p[5]), ns[i], a);
    }
  }
}

bool scale_into(const std::vector<uintptr_t>& dsts, const std::vector<uintptr_t>& srcs, const std::vector<int64_t>& ns,
                float scale) {
  if (dsts.size() != ns.size() || srcs.size() != ns.size()) {
    throw std::invalid_argument("scale_into: one destination, one source and one size per tensor");
  }
  std::vector<float*> d(dsts.size());
  std::vector<const float*> s(srcs.size());
  for (size_t i = 0; i < ns.size(); ++i) {
    d[i] = ptr<float>(dsts[i]);
    s[i] = ptr<const float>(srcs[i]);
  }
  py::gil_scoped_release nogil;
  return gs::scale_into_cpu(d.data(), s.data(), ns.data(), (int64_t)ns.size(), scale);
}

void rescale_tracked(int32_t kind, uintptr_t grad, uintptr_t change, uintptr_t after, uintptr_t second,
                     uintptr_t grad_avg, uintptr_t mean, uintptr_t extra, uintptr_t signal, uintptr_t target,
                     int64_t n, float world, float inv_world, float grad_sign, float weight_decay, float decay,
                     float mean_weight, float mean_bias, float offset, float scale, float count, float eps,
                     float momentum, float lr, float square_weight, float square_bias, float sign, float signal_weight,
                     float signal_bias, bool cuda, uintptr_t stream) {
  gs::TrackedTensors t;
  t.grad = ptr<const float>(grad);
  t.change = ptr<const float>(change);
  t.after = ptr<const float>(after);
  t.second = ptr<const float>(second);
  t.grad_avg = ptr<const float>(grad_avg);
  t.mean = ptr<float>(mean);
  t.extra = ptr<float>(extra);
  t.signal = ptr<float>(signal);
  t.target = ptr<float>(target);
  gs::TrackedArgs a;
  a.kind = kind;
  a.world = world;
  a.inv_world = inv_world;
  a.grad_sign = grad_sign;
  a.weight_decay = weight_decay;
  a.decay = decay;
  a.mean_weight = mean_weight;
  a.mean_bias = mean_bias;
  a.offset = offset;
  a.scale = scale;
  a.count = count;
  a.eps = eps;
  a.momentum = momentum;
  a.lr = lr;
  a.square_weight = square_weight;
  a.square_bias = square_bias;
  a.sign = sign;
  a.signal_weight = signal_weight;
  a.signal_bias = signal_bias;
  py::gil_scoped_release nogil;
  if (cuda) {
#ifdef GS_HAVE_CUDA
    gs::rescale_tracked_cuda(t, n, a, ptr<void>(stream));
#else
    (void)stream;
    no_cuda();
#endif
  } else {
    gs::rescale_tracked_cpu(t, n, a);
  }
}

py::dict build_info() {
  py::dict d;
  d["version"] = GS_VERSION;
#ifdef GS_HAVE_CUDA
  d["cuda"] = true;
  d["cuda_archs"] = std::string(GS_CUDA_ARCHS);
#else
  d["cuda"] = false;
  d["cuda_archs"] = std::string();
#endif
  d["openmp"] = gs::have_openmp();
  d["cpu_threads"] = gs::cpu_threads();
  d["message_version"] = gs::kMagicVersion & 0xff;
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "gradshare native kernels (raw-pointer API; use gradshare.ops)";
  py::register_exception<gs::MessageError>(m, "MessageError", PyExc_ValueError);
  // Argument names match python/gradshare/_C.pyi.
  m.def("count", &count, py::arg("update"), py::arg("dtype"), py::arg("residual"), py::arg("n"), py::arg("tau"),
        py::arg("cuda"), py::arg("stream"));
  m.def("encode", &encode, py::arg("update"), py::arg("dtype"), py::arg("residual"), py::arg("kept"), py::arg("n"),
        py::arg("tau"), py::arg("clip"), py::arg("choice"), py::arg("out"), py::arg("capacity"), py::arg("cuda"),
        py::arg("stream"), py::arg("velocity") = 0, py::arg("momentum") = 0.0f, py::arg("velocity_out") = 0);
  m.def("encode_chunked", &encode_chunked, py::arg("format"), py::arg("update"), py::arg("dtype"),
        py::arg("residual"), py::arg("kept"), py::arg("n"), py::arg("chunk"), py::arg("param"), py::arg("out"),
        py::arg("capacity"), py::arg("cuda"), py::arg("stream"), py::arg("velocity") = 0, py::arg("momentum") = 0.0f,
        py::arg("velocity_out") = 0);
  m.def("decode", &decode, py::arg("dst"), py::arg("n"), py::arg("msgs"), py::arg("num_msgs"), py::arg("row_words"),
        py::arg("scale"), py::arg("cuda"), py::arg("stream"));
  m.def("average", &average, py::arg("dst"), py::arg("srcs"), py::arg("weights"), py::arg("n"), py::arg("cuda"),
        py::arg("stream"));
  m.def("rescale", &rescale, py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("change"), py::arg("after"),
        py::arg("signal"), py::arg("target"), py::arg("n"), py::arg("bias1"), py::arg("bias2"), py::arg("world"),
        py::arg("eps"), py::arg("lr"), py::arg("decay"), py::arg("sign"), py::arg("signal_weight"),
        py::arg("signal_bias"), py::arg("cuda"), py::arg("stream"));
  m.def("rescale_many", &rescale_many, py::arg("ptrs"), py::arg("ns"), py::arg("scalars"), py::arg("cuda"),
        py::arg("stream"));
  m.def("scale_into", &scale_into, py::arg("dsts"), py::arg("srcs"), py::arg("ns"), py::arg("scale"));
  m.def("rescale_tracked", &rescale_tracked, py::arg("kind"), py::arg("grad"), py::arg("change"), py::arg("after"),
        py::arg("second"), py::arg("grad_avg"), py::arg("mean"), py::arg("extra"), py::arg("signal"), py::arg("target"),
        py::arg("n"), py::arg("world"), py::arg("inv_world"), py::arg("grad_sign"), py::arg("weight_decay"),
        py::arg("decay"), py::arg("mean_weight"), py::arg("mean_bias"), py::arg("offset"), py::arg("scale"),
        py::arg("count"), py::arg("eps"), py::arg("momentum"), py::arg("lr"), py::arg("square_weight"),
        py::arg("square_bias"), py::arg("sign"), py::arg("signal_weight"), py::arg("signal_bias"), py::arg("cuda"),
        py::arg("stream"));
  m.def("build_info", &build_info);
  m.def("cpu_threads", &gs::cpu_threads);
  m.def("set_cpu_threads", &gs::set_cpu_threads, py::arg("threads"));
  m.attr("HEADER_WORDS") = gs::kHeaderWords;
  m.attr("MAGIC_VERSION") = gs::kMagicVersion;
}
