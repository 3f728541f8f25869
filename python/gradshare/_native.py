"""The one home of the native boundary: loads gradshare._C and passes it raw addresses.

Everything here assumes the arguments were already checked by gradshare.ops.
"""
from __future__ import annotations

import warnings

import torch

try:
    from gradshare import _C
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    _C = None
    _IMPORT_ERROR = exc
else:
    _IMPORT_ERROR = None

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

if _C is not None:
    MessageError = _C.MessageError
else:  # pragma: no cover
    class MessageError(ValueError):
        """A message failed validation (corrupt, hostile, or meant for another buffer)."""

_warned = False


def available() -> bool:
    global _warned
    if _C is None and not _warned:
        warnings.warn(f"gradshare: native library not loaded ({_IMPORT_ERROR}); using the slow pure-torch "
                      "reference ops", RuntimeWarning, stacklevel=3)
        _warned = True
    return _C is not None


def _stream(t: torch.Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0


def count(update: torch.Tensor, residual: torch.Tensor, tau: float) -> tuple:
    return _C.count(update.data_ptr(), DTYPE_CODES[update.dtype], residual.data_ptr(), update.numel(), tau,
                    update.is_cuda, _stream(update))


def _momentum(velocity) -> tuple:
    """(velocity, factor, velocity_out) addresses for a fused momentum, or none (0, 0.0, 0)."""
    if velocity is None:
        return 0, 0.0, 0
    v, m, out = velocity
    return v.data_ptr(), float(m), out.data_ptr()


def encode(update, residual, kept, tau, clip, choice, out, velocity=None) -> tuple:
    """What is not sent goes to ``kept`` (``residual`` itself for in place); ``velocity``: None or
    (velocity, momentum, velocity_out) for a fused momentum. Returns (length, count, nonfinite_index, format)."""
    return _C.encode(update.data_ptr(), DTYPE_CODES[update.dtype], residual.data_ptr(), kept.data_ptr(),
                     update.numel(), tau, clip, choice, out.data_ptr(), out.numel(), update.is_cuda, _stream(update),
                     *_momentum(velocity))


def encode_chunked(format: int, update, residual, kept, chunk: int, param: float, out, velocity=None) -> tuple:
    """Top-k / 8-bit top-k (param = k) or ternary (param = fraction) encode in message format ``format``,
    what is not sent to ``kept``, ``velocity`` as for :func:`encode`; returns (length, entries, nonfinite_index)."""
    return _C.encode_chunked(format, update.data_ptr(), DTYPE_CODES[update.dtype], residual.data_ptr(),
                             kept.data_ptr(), update.numel(), chunk, float(param), out.data_ptr(), out.numel(),
                             update.is_cuda, _stream(update), *_momentum(velocity))


def decode(dst: torch.Tensor, rows: torch.Tensor, scale: float) -> None:
    _C.decode(dst.data_ptr(), dst.numel(), rows.data_ptr(), rows.shape[0], rows.shape[1], scale, dst.is_cuda,
              _stream(dst))


def validate(rows: torch.Tensor, n: int, scale: float) -> None:
    """Checks the messages for a destination of n elements, writing nothing (decode without a destination)."""
    _C.decode(0, n, rows.data_ptr(), rows.shape[0], rows.shape[1], scale, rows.is_cuda, _stream(rows))


def average(out: torch.Tensor, buffers, weights) -> None:
    _C.average(out.data_ptr(), [b.data_ptr() for b in buffers], [] if weights is None else list(weights),
               out.numel(), out.is_cuda, _stream(out))


def rescale(exp_avg, exp_avg_sq, change, after, signal, target, bias1, bias2, world, eps, lr, decay, sign,
            signal_weight, signal_bias) -> None:
    """target +-= the global batch's excess (csrc/gradshare/element.h), signal updated; change / after / signal:
    None or a tensor."""
    addr = (lambda t: 0 if t is None else t.data_ptr())
    _C.rescale(exp_avg.data_ptr(), exp_avg_sq.data_ptr(), addr(change), addr(after), addr(signal), target.data_ptr(),
               target.numel(), bias1, bias2, world, eps, lr, decay, sign, signal_weight, signal_bias, target.is_cuda,
               _stream(target))


def rescale_many(steps) -> None:
    """:func:`rescale` for each step, one native call: a step is (exp_avg, exp_avg_sq, target, change, after,
    signal, bias1, bias2, world, eps, lr, decay, sign, signal_weight, signal_bias), tensors on one device."""
    addr = (lambda t: 0 if t is None else t.data_ptr())
    ptrs, ns, scalars = [], [], []
    for s in steps:
        ptrs += (s[0].data_ptr(), s[1].data_ptr(), addr(s[3]), addr(s[4]), addr(s[5]), s[2].data_ptr())
        ns.append(s[2].numel())
        scalars += (float(x) for x in s[6:15])
    if ns:
        t = steps[0][2]
        _C.rescale_many(ptrs, ns, scalars, t.is_cuda, _stream(t))


def scale_into(dsts, srcs, scale: float) -> bool:
    """dst = src * scale for each pair of contiguous float32 CPU tensors of equal size, one native call; whether
    any value written is NaN or Inf."""
    return _C.scale_into([d.data_ptr() for d in dsts], [s.data_ptr() for s in srcs], [d.numel() for d in dsts],
                         float(scale))


def rescale_tracked(kind, grad, change, after, second, grad_avg, mean, extra, signal, target, scalars) -> None:
    """target +-= the tracked step's excess, mean, extra and signal updated (csrc/gradshare/element.h: tracked_excess);
    tensors may be None (0), ``scalars`` the floats of gs::TrackedArgs in their order."""
    addr = (lambda t: 0 if t is None else t.data_ptr())
    _C.rescale_tracked(kind, grad.data_ptr(), change.data_ptr(), addr(after), addr(second), addr(grad_avg),
                       mean.data_ptr(), addr(extra), addr(signal), target.data_ptr(), target.numel(), *scalars, target.is_cuda,
                       _stream(target))


def build_info() -> dict:
    if _C is None:
        return {"version": None, "cuda": False, "cuda_archs": "", "openmp": False, "cpu_threads": 1,
                "native": False, "error": str(_IMPORT_ERROR)}
    return dict(_C.build_info(), native=True)


def set_num_threads(threads: int) -> None:
    """Threads the CPU kernels use (OpenMP). Results do not depend on it."""
    if _C is not None:
        _C.set_cpu_threads(int(threads))


def get_num_threads() -> int:
    return _C.cpu_threads() if _C is not None else 1
