"""The thin ops API: threshold encode, count, decode and averaging.

Each function checks its arguments (a bad one raises naming it), then runs the native kernel through a
torch custom op (``torch.ops.gradshare.*``, usable under torch.compile). CPU tensors, CUDA tensors (the
kernel runs on the current stream) and numpy arrays (CPU) are accepted. Without the native library the
pure-torch reference in gradshare.reference is used, with a warning.
"""
from __future__ import annotations

import math
import warnings
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from gradshare import _native, reference
from gradshare import message as msgfmt
from gradshare.message import HEADER_WORDS, NONFINITE

MessageError = _native.MessageError
ArrayLike = Union[torch.Tensor, np.ndarray]


class NonFiniteError(FloatingPointError):
    """residual + update held NaN or Inf; nothing was written and the residual is unchanged."""

    def __init__(self, index: int, what: str = "update"):
        super().__init__(f"{what}: residual + update is not finite at element {index} (NaN or Inf); "
                         "nothing was encoded and the residual is unchanged")
        self.index = index


# ---------------------------------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------------------------------

def _as_tensor(x, name: str, written: bool = False) -> torch.Tensor:
    """A torch view of ``x`` (numpy arrays share memory). ``written``: the op writes into it."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        if not x.flags.c_contiguous:
            raise ValueError(f"{name}: numpy array must be C-contiguous")
        if not x.flags.writeable:
            if written:
                raise ValueError(f"{name}: numpy array is read-only but this op writes into it")
            with warnings.catch_warnings():  # torch warns about read-only arrays; we only read this one
                warnings.simplefilter("ignore", UserWarning)
                return torch.from_numpy(x)
        return torch.from_numpy(x)
    raise TypeError(f"{name}: expected a torch.Tensor or numpy.ndarray, got {type(x).__name__}")


def _check_flat(t: torch.Tensor, name: str, dtypes) -> None:
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name}: dtype {str(t.dtype).replace('torch.', '')} not supported (expected {allowed})")
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (call .contiguous() first)")
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: device {t.device} not supported (cpu or cuda)")
    if t.numel() > msgfmt.MAX_ELEMENTS:
        raise ValueError(f"{name}: {t.numel()} elements; a message encodes at most 2**31-1 (split the buffer)")


def _check_same_device(a: torch.Tensor, b: torch.Tensor, na: str, nb: str) -> None:
    if a.device != b.device:
        raise ValueError(f"{nb}: on {b.device} but {na} is on {a.device}")


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when the memory of a and b intersects (same device)."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    if type(a) is not torch.Tensor or type(b) is not torch.Tensor:  # fake / subclass tensors: no real memory
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    if a0 == 0 or b0 == 0:  # no real storage (meta tensors)
        return False
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _check_tau(tau) -> float:
    try:
        t = float(tau)
    except (TypeError, ValueError):
        raise TypeError(f"tau: expected a float, got {type(tau).__name__}") from None
    with np.errstate(over="ignore", under="ignore"):
        t32 = np.float32(t)
    if not (t > 0 and math.isfinite(t)) or not (t32 > 0 and np.isfinite(t32)):
        raise ValueError(f"tau: must be a positive finite float32, got {tau}")
    return float(t32)


def _check_clip(clip, tau: float) -> float:
    """The clipping factor c (0.0 = none); c * tau must be a positive finite float32."""
    if clip is None:
        return 0.0
    try:
        c = float(clip)
    except (TypeError, ValueError):
        raise TypeError(f"clip: expected a float factor or None, got {type(clip).__name__}") from None
    if not (c > 0 and math.isfinite(c)):
        raise ValueError(f"clip: must be a positive finite factor or None, got {clip}")
    with np.errstate(over="ignore", under="ignore"):
        bound = reference.clip_value(tau, c)
    if not (bound > 0 and math.isfinite(bound)):
        raise ValueError(f"clip: clip * tau = {c} * {tau} is not a positive finite float32 (clipping would be "
                         "disabled or unbounded)")
    return c


def _check_update_residual(update, residual, residual_written: bool = True):
    update, residual = _as_tensor(update, "update"), _as_tensor(residual, "residual", residual_written)
    _check_flat(update, "update", (torch.float32, torch.float16, torch.bfloat16))
    _check_flat(residual, "residual", (torch.float32,))
    _check_same_device(update, residual, "update", "residual")
    if residual.numel() != update.numel():
        raise ValueError(f"residual: {residual.numel()} elements but update has {update.numel()}")
    if residual_written and _overlap(update, residual):
        raise ValueError("residual: shares memory with update; pass separate buffers")
    return update, residual


def _check_kept(kept, update: torch.Tensor, residual: torch.Tensor) -> Optional[torch.Tensor]:
    """``kept`` for an encode: None or the residual itself (in place), or a float32 buffer of the same size on
    the same device that overlaps neither the update nor the residual."""
    if kept is None:
        return None
    kept = _as_tensor(kept, "kept", written=True)
    _check_flat(kept, "kept", (torch.float32,))
    _check_same_device(residual, kept, "residual", "kept")
    if kept.numel() != residual.numel():
        raise ValueError(f"kept: {kept.numel()} elements but residual has {residual.numel()}")
    if kept.data_ptr() == residual.data_ptr() and type(kept) is torch.Tensor:
        return None
    if _overlap(kept, update):
        raise ValueError("kept: shares memory with update; pass separate buffers")
    if _overlap(kept, residual):
        raise ValueError("kept: overlaps residual without being it; pass the residual itself or a separate buffer")
    return kept


# ---------------------------------------------------------------------------------------------------
# Custom ops (what torch.compile sees). Inputs here are already checked. Each encoder's *_into function
# takes a separate `kept` buffer (the residual is then only read); the registered ops update the residual
# in place (kept = residual), which is what tracing sees.
# ---------------------------------------------------------------------------------------------------

def _encode_into(update: torch.Tensor, residual: torch.Tensor, kept: torch.Tensor, tau: float, clip: float,
                 choice: int, velocity=None) -> torch.Tensor:
    # clip: the clipping factor c (<= 0: none); the kernels take the bound c * tau rounded to float32.
    n = update.numel()
    cap = msgfmt.HEADER_WORDS + (n if choice == msgfmt.SPARSE else msgfmt.bitmap_words(n))
    out = torch.empty(cap, dtype=torch.int32, device=update.device)
    bound = reference.clip_value(tau, clip if clip > 0 else None)
    length, count, bad, fmt = _native.encode(update, residual, kept, tau, bound, choice, out, velocity)
    if bad >= 0:
        return msgfmt.nonfinite_marker(n, tau, bad, device=update.device)
    # Keep a short message in its own small allocation rather than a view of the worst-case buffer.
    return out[:length].clone() if 4 * length < cap else out[:length]


def _encode_impl(update: torch.Tensor, residual: torch.Tensor, tau: float, clip: float, choice: int) -> torch.Tensor:
    if not _native.available():
        fmt = {v: k for k, v in msgfmt.FORMAT_CHOICES.items()}[choice]
        return reference.encode(update.view(-1), residual.view(-1), tau, clip if clip > 0 else None, fmt)
    return _encode_into(update, residual, residual, tau, clip, choice)


_encode_op = torch.library.custom_op("gradshare::encode", _encode_impl, mutates_args=("residual",))


@_encode_op.register_fake
def _(update, residual, tau, clip, choice):
    ctx = torch.library.get_ctx()
    return update.new_empty(ctx.new_dynamic_size(), dtype=torch.int32)


TOPK_VALUES = {"bf16": msgfmt.TOPK, "int8": msgfmt.TOPK8, "sign": msgfmt.TOPKSIGN}   # encode_topk's values=


def _encode_topk_into(update: torch.Tensor, residual: torch.Tensor, kept: torch.Tensor, k: int, chunk: int,
                      fmt: int, velocity=None) -> torch.Tensor:
    out = torch.empty(msgfmt.chunked_words(fmt, update.numel(), chunk, k), dtype=torch.int32, device=update.device)
    _native.encode_chunked(fmt, update, residual, kept, chunk, k, out, velocity)
    return out


def _encode_topk_impl(update: torch.Tensor, residual: torch.Tensor, k: int, chunk: int, fmt: int) -> torch.Tensor:
    if not _native.available():
        values = {v: name for name, v in TOPK_VALUES.items()}[fmt]
        return reference.encode_topk(update.view(-1), residual.view(-1), k, chunk, values)
    return _encode_topk_into(update, residual, residual, k, chunk, fmt)


_encode_topk_op = torch.library.custom_op("gradshare::encode_topk", _encode_topk_impl, mutates_args=("residual",))


@_encode_topk_op.register_fake
def _(update, residual, k, chunk, fmt):
    return update.new_empty(msgfmt.chunked_words(fmt, update.numel(), chunk, k), dtype=torch.int32)


def _encode_ternary_into(update: torch.Tensor, residual: torch.Tensor, kept: torch.Tensor, fraction: float,
                         chunk: int, velocity=None) -> torch.Tensor:
    out = torch.empty(msgfmt.ternary_words(update.numel(), chunk), dtype=torch.int32, device=update.device)
    _native.encode_chunked(msgfmt.TERNARY, update, residual, kept, chunk, fraction, out, velocity)
    return out


def _encode_ternary_impl(update: torch.Tensor, residual: torch.Tensor, fraction: float, chunk: int) -> torch.Tensor:
    if not _native.available():
        return reference.encode_ternary(update.view(-1), residual.view(-1), fraction, chunk)
    return _encode_ternary_into(update, residual, residual, fraction, chunk)


_encode_ternary_op = torch.library.custom_op("gradshare::encode_ternary", _encode_ternary_impl,
                                             mutates_args=("residual",))


@_encode_ternary_op.register_fake
def _(update, residual, fraction, chunk):
    return update.new_empty(msgfmt.ternary_words(update.numel(), chunk), dtype=torch.int32)


def _sent_impl(row: torch.Tensor, n: int) -> torch.Tensor:
    return reference.sent_mask(row, n)


_sent_op = torch.library.custom_op("gradshare::sent_mask", _sent_impl, mutates_args=())


@_sent_op.register_fake
def _(row, n):
    return row.new_empty(n, dtype=torch.bool)


def _count_impl(update: torch.Tensor, residual: torch.Tensor, tau: float) -> torch.Tensor:
    if _native.available():
        c, bad = _native.count(update, residual, tau)
    else:
        c, bad = reference.count(update.view(-1), residual.view(-1), tau)
    return torch.tensor([c, bad], dtype=torch.int64)


_count_op = torch.library.custom_op("gradshare::count", _count_impl, mutates_args=())


@_count_op.register_fake
def _(update, residual, tau):
    return torch.empty(2, dtype=torch.int64)


def _decode_impl(dst: torch.Tensor, rows: torch.Tensor, scale: float) -> None:
    if _native.available():
        _native.decode(dst, rows if rows.device == dst.device else rows.to(dst.device), scale)
    else:
        reference.decode(dst.view(-1), rows, scale)


_decode_op = torch.library.custom_op("gradshare::decode", _decode_impl, mutates_args=("dst",))


@_decode_op.register_fake
def _(dst, rows, scale):
    return None


def _average_impl(out: torch.Tensor, buffers: List[torch.Tensor], weights: Optional[List[float]]) -> None:
    if _native.available():
        _native.average(out, buffers, weights)
    else:
        out.copy_(reference.average([b.view(-1) for b in buffers], weights).view_as(out))


_average_op = torch.library.custom_op("gradshare::average", _average_impl, mutates_args=("out",))


@_average_op.register_fake
def _(out, buffers, weights):
    return None


def _global_batch_step_impl(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, target: torch.Tensor,
                            change: Optional[torch.Tensor], after: Optional[torch.Tensor],
                            signal: Optional[torch.Tensor], bias1: float, bias2: float, world: float, eps: float,
                            lr: float, decay: float, sign: float, signal_weight: float, signal_bias: float) -> None:
    if _native.available():
        _native.rescale(exp_avg, exp_avg_sq, change, after, signal, target, bias1, bias2, world, eps, lr, decay, sign,
                        signal_weight, signal_bias)
    else:
        reference.global_batch_step(exp_avg, exp_avg_sq, target, bias1, bias2, world, eps, lr, change, after, decay,
                                    sign, signal=signal, signal_weight=signal_weight, signal_bias=signal_bias)


_global_batch_step_op = torch.library.custom_op("gradshare::global_batch_step", _global_batch_step_impl,
                                                mutates_args=("target", "signal"))


@_global_batch_step_op.register_fake
def _(exp_avg, exp_avg_sq, target, change, after, signal, bias1, bias2, world, eps, lr, decay, sign, signal_weight,
      signal_bias):
    return None


# gs::TrackedArgs's floats in the order the native call takes them (after the kind)
TRACKED_SCALARS = ("world", "inv_world", "grad_sign", "weight_decay", "decay", "mean_weight", "mean_bias", "offset",
                   "scale", "count", "eps", "momentum", "lr", "square_weight", "square_bias", "sign", "signal_weight",
                   "signal_bias")


def _global_batch_step_tracked_impl(grad: torch.Tensor, change: torch.Tensor, after: Optional[torch.Tensor],
                                    second: Optional[torch.Tensor], grad_avg: Optional[torch.Tensor],
                                    mean: torch.Tensor, extra: Optional[torch.Tensor], signal: Optional[torch.Tensor],
                                    target: torch.Tensor, kind: int, scalars: List[float]) -> None:
    if _native.available():
        _native.rescale_tracked(kind, grad, change, after, second, grad_avg, mean, extra, signal, target, scalars)
    else:
        kw = dict(zip(TRACKED_SCALARS, scalars))       # world: the effective divisor, inv_world: 1 / W
        reference.global_batch_step_tracked(grad, change, mean, target, kind=reference.TRACKED_KINDS[kind],
                                            after=after, second=second, grad_avg=grad_avg, extra=extra,
                                            signal=signal, maximize=kw.pop("grad_sign") < 0, **kw)


_global_batch_step_tracked_op = torch.library.custom_op(
    "gradshare::global_batch_step_tracked", _global_batch_step_tracked_impl,
    mutates_args=("mean", "extra", "signal", "target"))


@_global_batch_step_tracked_op.register_fake
def _(grad, change, after, second, grad_avg, mean, extra, signal, target, kind, scalars):
    return None


def _run(op, impl, *args):
    """Eager calls on plain tensors go straight to the implementation: the custom-op dispatcher costs
    tens of microseconds a call, which small DDP buckets feel. Tracing (torch.compile, fake tensors,
    dispatch modes) goes through the registered op."""
    plain = all(type(a) is torch.Tensor for a in args if isinstance(a, torch.Tensor))
    if plain and not torch.compiler.is_compiling() and not torch._C._is_torch_function_mode_enabled():
        return impl(*args)
    return op(*args)


def _run_encode(op, impl, into, update: torch.Tensor, residual: torch.Tensor, kept: Optional[torch.Tensor], *args,
                velocity=None):
    """An encode whose kept residual goes to ``kept`` (None: the residual, in place), with a fused momentum when
    ``velocity`` is (velocity, m, velocity_out). Eager calls on plain tensors with the native library run the
    kernel once (reading the residual only when ``kept`` is given); otherwise (tracing, the pure-torch
    reference) the same result is composed: velocity_out = m * velocity + update, the in-place op on it (and on
    a copy of the residual in ``kept``), then velocity_out zeroed where the message sent."""
    if kept is None and velocity is None:
        return _run(op, impl, update, residual, *args)
    tensors = (update, residual) + (() if kept is None else (kept,)) + (() if velocity is None else
                                                                       (velocity[0], velocity[2]))
    plain = all(type(t) is torch.Tensor for t in tensors)
    if (plain and not torch.compiler.is_compiling() and not torch._C._is_torch_function_mode_enabled()
            and _native.available()):
        return into(update, residual, residual if kept is None else kept, *args, velocity=velocity)
    if velocity is not None:
        v, m, new_v = velocity
        update = torch.mul(v, m, out=new_v).add_(update)
    if kept is not None:
        kept.copy_(residual)
        residual = kept
    msg = _run(op, impl, update, residual, *args)
    if velocity is not None:
        new_v.masked_fill_(_run(_sent_op, _sent_impl, msg, new_v.numel()), 0.0)
    return msg


def momentum_kwargs(velocity) -> dict:
    """The keywords of a fused momentum given as one (velocity, m, velocity_out) tuple (None: none), for the
    encoders below; the exchange and the compression policies pass it on this way."""
    if velocity is None:
        return {}
    v, m, out = velocity
    return {"velocity": v, "momentum": m, "velocity_out": out}


def _check_velocity(velocity, momentum, velocity_out, update: torch.Tensor, residual: torch.Tensor,
                    kept: Optional[torch.Tensor]):
    """A fused momentum's (velocity, m, velocity_out), flat, or None when neither buffer is given."""
    if velocity is None and velocity_out is None:
        return None
    if velocity is None or velocity_out is None:
        raise ValueError("velocity and velocity_out: pass both (a fused momentum) or neither")
    v = _as_tensor(velocity, "velocity")
    out = _as_tensor(velocity_out, "velocity_out", written=True)
    for t, name in ((v, "velocity"), (out, "velocity_out")):
        _check_flat(t, name, (torch.float32,))
        _check_same_device(residual, t, "residual", name)
        if t.numel() != residual.numel():
            raise ValueError(f"{name}: {t.numel()} elements but residual has {residual.numel()}")
    try:
        m = float(momentum)
    except (TypeError, ValueError):
        raise TypeError(f"momentum: expected a float, got {type(momentum).__name__}") from None
    with np.errstate(over="ignore"):
        if not np.isfinite(np.float32(m)):
            raise ValueError(f"momentum: must be a finite float32, got {momentum}")
    written = [(residual, "residual")] + ([] if kept is None else [(kept, "kept")])
    for other, name in [(update, "update"), (v, "velocity")] + written:
        if _overlap(out, other):
            raise ValueError(f"velocity_out: shares memory with {name}; pass a separate buffer")
    for other, name in written:
        if _overlap(v, other):
            raise ValueError(f"velocity: shares memory with {name}, which the encode writes; pass separate buffers")
    return v.view(-1), float(np.float32(m)), out.view(-1)


# ---------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------

def encode(update: ArrayLike, residual: ArrayLike, tau: float, *, clip: Optional[float] = None,
           format: str = "auto", on_nonfinite: str = "raise", kept: Optional[ArrayLike] = None,
           velocity: Optional[ArrayLike] = None, momentum: float = 0.0,
           velocity_out: Optional[ArrayLike] = None) -> ArrayLike:
    """Threshold-encode ``residual + update`` and keep what was not sent in ``residual`` (in place), or in
    ``kept``.

    Per element u = residual + update: u >= tau sends +tau and keeps u - tau; u <= -tau sends -tau and
    keeps u + tau; otherwise keeps u. ``clip=c`` then limits the kept residual to [-c*tau, c*tau].

    Args:
        update: flat float32 / float16 / bfloat16 buffer (a gradient or an optimizer update).
        residual: float32 buffer of the same size, updated in place.
        tau: the threshold (> 0, finite).
        clip: optional residual clipping factor c (> 0).
        format: "auto" (sparse while no larger than the bitmap, else bitmap), "sparse" or "bitmap".
        on_nonfinite: "raise" (NonFiniteError) or "flag" (return a non-finite marker message that
            decode refuses; lets every rank of an exchange learn of it). Either way the residual is not
            written (and ``kept`` holds nothing meaningful).
        kept: optional float32 buffer of the residual's size that receives what was not sent; the residual
            is then only read (so a step that fails later can keep it). It must not overlap the update or
            the residual.
        velocity, momentum, velocity_out: Deep Gradient Compression's momentum correction in the same kernel.
            With float32 buffers ``velocity`` and ``velocity_out`` (the residual's size; velocity_out overlapping
            nothing else) the encoded value is u = residual + (momentum * velocity + update), and
            ``velocity_out`` receives momentum * velocity + update with the sent entries set to 0 (momentum
            factor masking); ``velocity`` is only read. Rounds as ``velocity * momentum + update`` in torch.
            On a non-finite u ``velocity_out`` holds nothing of use.

    Returns:
        One int32 message (see gradshare.message), indices ascending whatever the thread count.
    """
    as_numpy = isinstance(update, np.ndarray)
    update, residual = _check_update_residual(update, residual, residual_written=True)
    tau = _check_tau(tau)
    clip = _check_clip(clip, tau)
    if not isinstance(format, str) or format not in msgfmt.FORMAT_CHOICES:
        raise ValueError(f"format: expected one of {sorted(msgfmt.FORMAT_CHOICES)}, got {format!r}")
    if on_nonfinite not in ("raise", "flag"):
        raise ValueError(f"on_nonfinite: expected 'raise' or 'flag', got {on_nonfinite!r}")
    kept = _check_kept(kept, update, residual)
    vel = _check_velocity(velocity, momentum, velocity_out, update, residual, kept)
    out = _run_encode(_encode_op, _encode_impl, _encode_into, update.view(-1), residual.view(-1),
                      None if kept is None else kept.view(-1), tau, clip, msgfmt.FORMAT_CHOICES[format], velocity=vel)
    # A marker is a bare header (so is a message that sends nothing): only then is the header read, which on a
    # GPU is a device-to-host copy.
    if on_nonfinite == "raise" and out.numel() == HEADER_WORDS and int(out[1]) == NONFINITE:
        raise NonFiniteError(int(out[3]))
    return out.cpu().numpy() if as_numpy else out


def _check_chunk(chunk, low: int, high: int, multiple: int = 1) -> int:
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)):
        raise TypeError(f"chunk: expected an int, got {type(chunk).__name__}")
    c = int(chunk)
    if not (low <= c <= high and c % multiple == 0):
        extra = f" and a multiple of {multiple}" if multiple > 1 else ""
        raise ValueError(f"chunk: must be in [{low}, {high}]{extra}, got {chunk}")
    return c


def encode_topk(update: ArrayLike, residual: ArrayLike, k: int, *, chunk: int = 4096,
                values: str = "bf16", kept: Optional[ArrayLike] = None, velocity: Optional[ArrayLike] = None,
                momentum: float = 0.0, velocity_out: Optional[ArrayLike] = None) -> torch.Tensor:
    """Top-k encode ``residual + update`` per chunk, keeping what was not sent in ``residual`` (in place), or
    in ``kept`` (as for :func:`encode`: the residual is then only read).

    In every chunk of ``chunk`` elements, the ``k`` entries with the largest |u| (u = residual + update; ties
    go to the lower index; a shorter last chunk sends ceil(k * len / chunk)) are sent with their values, and
    the residual keeps u minus the value sent: the rounding error too stays in it. ``values``: "bf16" (each
    value rounded to bfloat16; 4 bytes an entry, format 3), "int8" (one float scale per chunk, the largest
    |value| / 127, and each value as a rounded multiple of it; 3 bytes an entry, format 5) or "sign" (one float
    scale per chunk, the mean |value| of its entries, each entry sent as +-scale, its index Elias-Fano coded:
    about 3 + log2(chunk / k) bits an entry, format 7; its chunk may be up to 2**31 - 1 elements, so the whole
    buffer one chunk).
    The message length depends only on (n, chunk, k), so every rank's message has the same size.
    Non-finite u: a non-finite marker of the same length is returned and the residual is left unchanged.
    ``velocity``, ``momentum``, ``velocity_out``: a fused momentum, as for :func:`encode` (an element is sent
    when it is selected).
    """
    update, residual = _check_update_residual(update, residual, residual_written=True)
    if values not in TOPK_VALUES:
        raise ValueError(f"values: expected 'bf16', 'int8' or 'sign', got {values!r}")
    chunk = _check_chunk(chunk, 1, msgfmt.max_topk_chunk(TOPK_VALUES[values]))
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= int(k) <= chunk:
        raise ValueError(f"k: must be an int in [0, chunk={chunk}], got {k!r}")
    kept = _check_kept(kept, update, residual)
    vel = _check_velocity(velocity, momentum, velocity_out, update, residual, kept)
    return _run_encode(_encode_topk_op, _encode_topk_impl, _encode_topk_into, update.view(-1), residual.view(-1),
                       None if kept is None else kept.view(-1), int(k), chunk, TOPK_VALUES[values], velocity=vel)


def encode_ternary(update: ArrayLike, residual: ArrayLike, fraction: float = 0.5, *,
                   chunk: int = 4096, kept: Optional[ArrayLike] = None, velocity: Optional[ArrayLike] = None,
                   momentum: float = 0.0, velocity_out: Optional[ArrayLike] = None) -> torch.Tensor:
    """Ternary encode ``residual + update`` per chunk, keeping what was not sent in ``residual`` (in place),
    or in ``kept`` (as for :func:`encode`: the residual is then only read).

    In every chunk, the entries with |u| >= fraction * mean|u| (and u != 0) are sent as +-scale, where scale
    is the mean |u| of those entries (one float per chunk, 2 bits per element: 16x smaller than float32).
    Sums run in a fixed order, so the result does not depend on threads or device. Non-finite u: a
    non-finite marker of the same length, residual unchanged. ``velocity``, ``momentum``, ``velocity_out``: a
    fused momentum, as for :func:`encode`.
    """
    update, residual = _check_update_residual(update, residual, residual_written=True)
    chunk = _check_chunk(chunk, 16, 2**30, multiple=16)
    try:
        f = float(fraction)
    except (TypeError, ValueError):
        raise TypeError(f"fraction: expected a float, got {type(fraction).__name__}") from None
    if not (f >= 0 and math.isfinite(f)):
        raise ValueError(f"fraction: must be a finite number >= 0, got {fraction}")
    kept = _check_kept(kept, update, residual)
    vel = _check_velocity(velocity, momentum, velocity_out, update, residual, kept)
    return _run_encode(_encode_ternary_op, _encode_ternary_impl, _encode_ternary_into, update.view(-1),
                       residual.view(-1), None if kept is None else kept.view(-1), f, chunk, velocity=vel)


def count(update: ArrayLike, residual: ArrayLike, tau: float) -> int:
    """How many elements of ``residual + update`` reach ``tau`` (a read-only pass; for density).

    Raises NonFiniteError when residual + update holds NaN or Inf.
    """
    update, residual = _check_update_residual(update, residual, residual_written=False)
    c, bad = _run(_count_op, _count_impl, update.view(-1), residual.view(-1), _check_tau(tau)).tolist()
    if bad >= 0:
        raise NonFiniteError(bad)
    return c


def _message_rows(messages, device) -> torch.Tensor:
    """One message, a list of messages, or a 2-D [k, row] tensor of padded rows -> int32 rows."""
    if isinstance(messages, (torch.Tensor, np.ndarray)):
        m = _as_tensor(messages, "messages")
        if m.dtype != torch.int32:
            raise TypeError(f"messages: dtype must be int32, got {str(m.dtype).replace('torch.', '')}")
        if m.dim() not in (1, 2):
            raise ValueError(f"messages: expected a 1-D message or 2-D rows, got {m.dim()} dims")
        return (m.view(1, -1) if m.dim() == 1 else m).contiguous()
    rows = [_as_tensor(m, "messages") for m in messages]
    for i, r in enumerate(rows):
        if r.dtype != torch.int32 or r.dim() != 1:
            raise TypeError(f"messages[{i}]: must be a 1-D int32 message")
    width = max((r.numel() for r in rows), default=HEADER_WORDS)
    out = torch.zeros(len(rows), width, dtype=torch.int32, device=device)
    for i, r in enumerate(rows):
        out[i, :r.numel()] = r
    return out


def decode(dst: ArrayLike, messages, *, scale: float = 1.0) -> None:
    """Add every message into ``dst`` in order: dst[i] += sign * tau * scale.

    ``messages`` is one message, a sequence of them, or a 2-D int32 tensor of zero-padded rows (what an
    all-gather returns). Every message is validated before anything is written: a malformed one raises
    MessageError naming it and its fault, and leaves ``dst`` unchanged.
    """
    dst = _as_tensor(dst, "dst", written=True)
    _check_flat(dst, "dst", (torch.float32,))
    s = float(scale)
    if not math.isfinite(s):
        raise ValueError(f"scale: must be finite, got {scale}")
    rows = _message_rows(messages, dst.device)
    if _overlap(dst, rows) or any(_overlap(dst, _as_tensor(m, "messages")) for m in _sources(messages)):
        raise ValueError("messages: share memory with dst; decode into a separate buffer")
    _run(_decode_op, _decode_impl, dst.view(-1), rows, s)


def _sources(messages) -> list:
    """The tensors/arrays a decode call reads its messages from."""
    if isinstance(messages, (torch.Tensor, np.ndarray)):
        return [messages]
    return [m for m in messages if isinstance(m, (torch.Tensor, np.ndarray))]


def validate(messages, n: int, *, scale: float = 1.0) -> None:
    """Checks that ``messages`` (as for :func:`decode`) are sound for a destination of ``n`` elements decoded with
    ``scale``, writing nothing; raises MessageError naming the first bad message and its fault."""
    s = float(scale)
    if not math.isfinite(s):
        raise ValueError(f"scale: must be finite, got {scale}")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= int(n) <= msgfmt.MAX_ELEMENTS:
        raise ValueError(f"n: expected an element count in [0, 2**31-1], got {n!r}")
    first = messages if isinstance(messages, (torch.Tensor, np.ndarray)) else next(iter(messages), None)
    device = _as_tensor(first, "messages").device if first is not None else torch.device("cpu")
    rows = _message_rows(messages, device)
    if _native.available():
        _native.validate(rows, int(n), s)
    else:
        for i, r in enumerate(rows):
            try:
                reference.validate(r, int(n), s)
            except ValueError as exc:
                raise MessageError(f"message {i}: {exc}") from None


def average(buffers: Sequence[ArrayLike], *, weights: Optional[Sequence[float]] = None,
            out: Optional[ArrayLike] = None) -> ArrayLike:
    """Mean (or ``sum_j weights[j] * buffers[j]``) of k float32 buffers in one pass over memory.

    ``out`` may be one of ``buffers`` (in place). Returns ``out`` (a new buffer when not given).
    """
    if len(buffers) == 0:
        raise ValueError("buffers: need at least one buffer to average")
    as_numpy = isinstance(buffers[0], np.ndarray)
    ts = [_as_tensor(b, f"buffers[{i}]") for i, b in enumerate(buffers)]
    for i, t in enumerate(ts):
        _check_flat(t, f"buffers[{i}]", (torch.float32,))
        _check_same_device(ts[0], t, "buffers[0]", f"buffers[{i}]")
        if t.numel() != ts[0].numel():
            raise ValueError(f"buffers[{i}]: {t.numel()} elements but buffers[0] has {ts[0].numel()}")
    if weights is not None:
        weights = [float(w) for w in weights]
        if len(weights) != len(ts):
            raise ValueError(f"weights: {len(weights)} weights for {len(ts)} buffers")
        if not all(math.isfinite(w) for w in weights):
            raise ValueError("weights: must be finite")
    o = torch.empty_like(ts[0]) if out is None else _as_tensor(out, "out", written=True)
    _check_flat(o, "out", (torch.float32,))
    _check_same_device(ts[0], o, "buffers[0]", "out")
    if o.numel() != ts[0].numel():
        raise ValueError(f"out: {o.numel()} elements but the buffers have {ts[0].numel()}")
    for i, t in enumerate(ts):  # the kernel reads each element before writing it: only exact aliasing is safe
        if _overlap(o, t) and o.data_ptr() != t.data_ptr():
            raise ValueError(f"out: overlaps buffers[{i}] at an offset; pass that very buffer or separate memory")
    _run(_average_op, _average_impl, o.view(-1), [t.view(-1) for t in ts], weights)
    if out is not None:
        return out
    return o.numpy() if as_numpy else o


def _float32_operands(given: dict, written: Sequence[str]) -> dict:
    """name -> tensor for the operands given (not None) of an op over float32 tensors of one size and device,
    all checked (``written``: the op writes them); "target" sets the size and device."""
    ts = {n: _as_tensor(t, n, written=(n in written)) for n, t in given.items() if t is not None}
    tgt = ts["target"]
    for n, t in ts.items():
        _check_flat(t, n, (torch.float32,))
        _check_same_device(tgt, t, "target", n)
        if t.numel() != tgt.numel():
            raise ValueError(f"{n}: {t.numel()} elements but target has {tgt.numel()}")
    return ts


def global_batch_step(exp_avg: ArrayLike, exp_avg_sq: ArrayLike, target: ArrayLike, *, bias1: float, bias2: float,
                      world: int, eps: float, lr: float = 0.0, change: Optional[ArrayLike] = None,
                      after: Optional[ArrayLike] = None, decay: float = 0.0, sign: float = 1.0,
                      signal: Optional[ArrayLike] = None, signal_weight: float = 0.0, signal_bias: float = 1.0,
                      noise: float = 0.0) -> None:
    """Adds to ``target`` (``sign`` -1: subtracts) how far a rank's Adam-family step falls short of the step
    on the global batch of ``world`` ranks (gradshare.second_moment), in one pass over memory.

    ``exp_avg`` / ``exp_avg_sq``: the optimizer's moments (amsgrad: its running maximum), divided by ``bias1``
    / ``bias2`` (1 - beta^t) into m and v; v_global = s + max(v - s, 0) / D with s the squared mean: m^2, or
    with ``signal`` (gradshare's average of m^2 over v's window, updated here: signal += (m^2 - signal) *
    ``signal_weight``) signal / ``signal_bias``; D = W where s holds none of the gradient's noise, and
    gradshare.reference.effective_world(W, ``noise``) where it holds the share ``noise`` (in [0, 1]) of its
    variance. Without ``change`` (Adam,
    AdamW) the excess is lr * m * (1 / (sqrt(v_global) + eps) - 1 / (sqrt(v) + eps)); with it (NAdam, RAdam:
    the step's change, before - after) it is the change less ``decay`` (lr * weight decay, when decoupled)
    times the parameters before the step (``after`` + change), times (sqrt(v) + eps) / (sqrt(v_global) + eps)
    - 1. All float32, contiguous, of one size and device; ``target`` may be ``change`` or ``after`` itself,
    and overlaps nothing else. Bit for bit as gradshare.reference.global_batch_step.
    """
    ts = _float32_operands(dict(exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, target=target, change=change, after=after,
                                signal=signal), written=("target", "signal"))
    tgt = ts["target"]
    decay, sign = float(decay), float(sign)
    signal_weight, signal_bias = float(signal_weight), float(signal_bias)
    if signal is not None:
        if not (0.0 < signal_weight <= 1.0 and 0.0 < signal_bias <= 1.0):
            raise ValueError(f"signal_weight, signal_bias: 1 - beta2 and 1 - beta2^k lie in (0, 1], got "
                             f"{signal_weight}, {signal_bias}")
        for n in ("exp_avg", "exp_avg_sq", "target", "change", "after"):
            if n in ts and _overlap(ts["signal"], ts[n]):
                raise ValueError(f"signal: overlaps {n}")
    if change is None and (after is not None or decay != 0.0):
        raise ValueError("after / decay: only with change (the NAdam / RAdam form)")
    if decay != 0.0 and after is None:
        raise ValueError("after: required with a decoupled weight decay (decay != 0)")
    for n in ("exp_avg", "exp_avg_sq"):
        if _overlap(tgt, ts[n]):
            raise ValueError(f"target: overlaps {n}; the moments are only read")
    for n in ("change", "after"):
        if n in ts and _overlap(tgt, ts[n]) and tgt.data_ptr() != ts[n].data_ptr():
            raise ValueError(f"target: overlaps {n} at an offset; pass that very buffer or separate memory")
    scalars = {"bias1": bias1, "bias2": bias2, "world": world, "eps": eps, "lr": lr, "decay": decay}
    for n, x in scalars.items():
        if not math.isfinite(float(x)):
            raise ValueError(f"{n}: must be finite, got {x}")
    if not (0.0 < float(bias1) <= 1.0 and 0.0 < float(bias2) <= 1.0):
        raise ValueError(f"bias1, bias2: 1 - beta^t lies in (0, 1], got {bias1}, {bias2}")
    _check_world(world, noise)
    if float(eps) < 0.0:
        raise ValueError(f"eps: must be >= 0, got {eps}")
    if sign not in (1.0, -1.0):
        raise ValueError(f"sign: +1 (add) or -1 (subtract), got {sign}")
    flat = {n: t.view(-1) for n, t in ts.items()}
    _run(_global_batch_step_op, _global_batch_step_impl, flat["exp_avg"], flat["exp_avg_sq"], flat["target"],
         flat.get("change"), flat.get("after"), flat.get("signal"), float(bias1), float(bias2),
         float(reference.effective_world(world, float(noise))), float(eps), float(lr), decay, sign, signal_weight,
         signal_bias)


def _check_world(world: int, noise: float) -> None:
    if isinstance(world, bool) or not isinstance(world, (int, np.integer)) or world < 1:
        raise ValueError(f"world: a number of ranks >= 1, got {world!r}")
    if not 0.0 <= float(noise) <= 1.0:
        raise ValueError(f"noise: the share of the gradient's variance in the squared mean, in [0, 1]; got {noise}")


def global_batch_steps(steps: Sequence[Tuple]) -> None:
    """:func:`global_batch_step` for each of several parameters, in one native call: a model of many small tensors (a
    transformer's norms and biases) spent more per parameter on the call than on its pass over memory. For
    gradshare.second_moment, which builds the operands from an optimizer's state: each step is the implementation's
    positional arguments (exp_avg, exp_avg_sq, target, change, after, signal, bias1, bias2, world, eps, lr, decay,
    sign, signal_weight, signal_bias), ``world`` the effective divisor (gradshare.reference.effective_world). What
    memory safety needs is checked here (float32, contiguous, one device, equal sizes); the ranges and aliasing that
    :func:`global_batch_step` checks for a user's operands hold by the caller's construction. Bit for bit as one
    :func:`global_batch_step` per step."""
    if not steps:
        return
    device = steps[0][2].device
    plain = True
    for s in steps:
        if len(s) != 15:
            raise ValueError(f"global_batch_steps: a step is 15 arguments, got {len(s)}")
        n = s[2].numel()
        for t in s[:6]:
            if t is None:
                continue
            if t.dtype != torch.float32 or not t.is_contiguous() or t.device != device or t.numel() != n:
                raise ValueError("global_batch_steps: every operand float32, contiguous, on one device, of its "
                                 f"target's size; got {t.dtype}, {t.numel()} elements on {t.device} for a target of "
                                 f"{n} on {device}")
            plain = plain and type(t) is torch.Tensor
    if plain and device.type in ("cpu", "cuda") and _native.available() and not torch.compiler.is_compiling() \
            and not torch._C._is_torch_function_mode_enabled():
        _native.rescale_many(steps)          # addresses and sizes: contiguous, so the shapes do not matter
        return
    for s in steps:
        _run(_global_batch_step_op, _global_batch_step_impl, *(None if t is None else t.view(-1) for t in s[:6]),
             *(float(x) for x in s[6:]))


def scale_into(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], scale: float) -> torch.Tensor:
    """``dst = src * scale`` for each pair, and whether any value written is NaN or Inf: a 1-element float32
    tensor on their device, 1.0 if so. For the sharing core, which scales an all-reduced sum to the mean straight
    into the gradients: one pass over memory where scaling the sum in place and copying it out took two. Every
    tensor float32, on one device, each pair of one size (shapes may differ); a dst may be its own src, and
    overlaps no other operand by the caller's construction (aliasing decides values, never where a write
    lands). One native call on the CPU where every tensor is contiguous; otherwise torch's multi-tensor kernels
    (GPUs: a fused copy, then GradScaler's fused check-and-scale) or the reference, with the same bits."""
    if len(dsts) != len(srcs):
        raise ValueError(f"scale_into: {len(dsts)} destinations for {len(srcs)} sources")
    if not dsts:
        return torch.zeros(1)
    s = float(scale)
    if not math.isfinite(s):
        raise ValueError(f"scale: must be finite, got {scale}")
    device = dsts[0].device
    plain = True
    for d, src in zip(dsts, srcs):
        for t in (d, src):
            if t.dtype != torch.float32 or t.device != device:
                raise ValueError("scale_into: every tensor float32 and on one device; got "
                                 f"{t.dtype} on {t.device} with the first on {device}")
            plain = plain and type(t) is torch.Tensor and t.is_contiguous()
        if d.numel() != src.numel():
            raise ValueError(f"scale_into: a destination of {d.numel()} elements for a source of {src.numel()}")
    if plain and device.type == "cpu" and _native.available() and not torch.compiler.is_compiling() \
            and not torch._C._is_torch_function_mode_enabled():
        return torch.full((1,), float(_native.scale_into(dsts, srcs, s)))
    if abs(s) <= 1.0 and all(type(t) is torch.Tensor for t in dsts) and \
            all(type(t) is torch.Tensor and t.is_contiguous() for t in srcs):
        # GradScaler's kernel checks each value before scaling it: with |scale| <= 1 that is the check of the result
        torch._foreach_copy_(list(dsts), [x.view(d.shape) for x, d in zip(srcs, dsts)])
        found = torch.zeros(1, dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(list(dsts), found,
                                                         torch.full((1,), s, dtype=torch.float32, device=device))
        return found
    return reference.scale_into(dsts, srcs, s)


def global_batch_step_tracked(grad: ArrayLike, change: ArrayLike, mean: ArrayLike, target: ArrayLike, *, kind: str,
                              world: int, second: Optional[ArrayLike] = None, grad_avg: Optional[ArrayLike] = None,
                              extra: Optional[ArrayLike] = None, after: Optional[ArrayLike] = None,
                              maximize: bool = False, weight_decay: float = 0.0, decay: float = 0.0,
                              mean_weight: float = 0.1, mean_bias: float = 1.0, offset: float = 0.0,
                              scale: float = 1.0, count: float = 1.0, eps: float = 0.0, momentum: float = 0.0,
                              lr: float = 0.0, square_weight: float = 0.0, square_bias: float = 1.0,
                              signal: Optional[ArrayLike] = None, signal_weight: float = 0.0, signal_bias: float = 1.0,
                              sign: float = 1.0, noise: float = 0.0) -> None:
    """Adds to ``target`` (``sign`` -1: subtracts) how far a rank's step of an optimizer whose mean gradient
    gradshare keeps falls short of the step on the global batch of ``world`` ranks (gradshare.second_moment),
    in one pass over memory; ``mean``, ``extra`` and ``signal`` (gradshare's state) are updated.

    ``kind``: "rmsprop", "adagrad", "adadelta" (divided by their own second moment ``second``, which reads
    offset + scale * v_hat; centered RMSprop also by ``grad_avg``), "adamax", "adafactor" (divided by r =
    sqrt(v_global / v) of gradshare's mean square in ``extra``, averaged with ``square_weight`` and divided by
    ``square_bias``). g = -grad with ``maximize``, plus ``weight_decay`` times the parameters before the step
    (``after`` + change; Adafactor's ``decay``, lr * its weight decay, is the change's undivided part instead);
    ``mean`` += (g - mean) * ``mean_weight``, m = mean / ``mean_bias``. ``extra``: Adagrad's running sum of m^2
    (its mean over ``count`` steps), RMSprop's momentum of the step's difference (with ``momentum`` and
    ``lr``), Adamax's and Adafactor's mean square. ``signal``: None (the squared mean of v_global is this
    step's m^2) or the average of m^2 over the second moment's window, ``signal`` += (m^2 - ``signal``) *
    ``signal_weight``, read divided by ``signal_bias`` (not for Adagrad, whose running sum of m^2 is that
    already, nor centered RMSprop, which subtracts its own mean). ``noise``: the share of the gradient's variance
    that the squared mean holds (:func:`global_batch_step`). All float32, contiguous, of one size and device;
    ``target`` may be ``change`` or ``after`` itself, and overlaps nothing else. Bit for bit as
    gradshare.reference.global_batch_step_tracked.
    """
    if kind not in reference.TRACKED_KINDS:
        raise ValueError(f"kind: one of {', '.join(reference.TRACKED_KINDS)}, got {kind!r}")
    written = ("mean", "target", "extra", "signal")
    ts = _float32_operands(dict(grad=grad, change=change, mean=mean, target=target, second=second, grad_avg=grad_avg,
                                extra=extra, after=after, signal=signal), written)
    tgt = ts["target"]
    own = kind in ("rmsprop", "adagrad", "adadelta")
    if own and second is None:
        raise ValueError(f"second: {kind} divides by its own second moment; pass it")
    if not own and second is not None:
        raise ValueError(f"second: not read for {kind} (its mean square is gradshare's, in extra)")
    if grad_avg is not None and kind != "rmsprop":
        raise ValueError("grad_avg: only for centered RMSprop")
    if momentum != 0.0 and kind != "rmsprop":
        raise ValueError("momentum: only for RMSprop")
    needs_extra = kind in ("adagrad", "adamax", "adafactor") or momentum != 0.0
    if needs_extra != (extra is not None):
        raise ValueError(f"extra: {'required' if needs_extra else 'not read'} for {kind}"
                         + (" with momentum" if kind == "rmsprop" and needs_extra else ""))
    if signal is not None and (kind == "adagrad" or grad_avg is not None):
        raise ValueError("signal: not for " + ("Adagrad (its running sum of m^2 spans its window)" if kind == "adagrad"
                                               else "centered RMSprop (it subtracts its own mean, grad_avg)"))
    if kind == "adafactor" and weight_decay != 0.0:
        raise ValueError("weight_decay: Adafactor's is decoupled; pass lr * weight_decay as decay")
    if kind != "adafactor" and decay != 0.0:
        raise ValueError(f"decay: only Adafactor's weight decay is decoupled; {kind}'s is weight_decay")
    if (decay if kind == "adafactor" else weight_decay) != 0.0 and after is None:
        raise ValueError("after: required with a weight decay (the parameters before the step are after + change)")
    for n in ("grad", "second", "grad_avg", "mean", "extra", "signal"):
        for w in written:
            if n != w and n in ts and w in ts and _overlap(ts[n], ts[w]):
                raise ValueError(f"{w}: overlaps {n}" + ("; it is only read" if n not in written else ""))
    for n in ("change", "after"):
        if n in ts:
            for w in ("mean", "extra", "signal"):
                if w in ts and _overlap(ts[n], ts[w]):
                    raise ValueError(f"{w}: overlaps {n}")
            if _overlap(tgt, ts[n]) and tgt.data_ptr() != ts[n].data_ptr():
                raise ValueError(f"target: overlaps {n} at an offset; pass that very buffer or separate memory")
    if "after" in ts and ts["after"].data_ptr() == ts["change"].data_ptr() and tgt.numel():
        raise ValueError("after: the parameters after the step cannot be the change")
    _check_world(world, noise)
    values = dict(world=float(reference.effective_world(world, float(noise))), inv_world=1.0 / float(world),
                  grad_sign=-1.0 if maximize else 1.0,
                  weight_decay=weight_decay, decay=decay, mean_weight=mean_weight, mean_bias=mean_bias, offset=offset,
                  scale=scale, count=count, eps=eps, momentum=momentum, lr=lr, square_weight=square_weight,
                  square_bias=square_bias, sign=sign, signal_weight=signal_weight, signal_bias=signal_bias)
    for n, x in values.items():
        if not math.isfinite(float(x)):
            raise ValueError(f"{n}: must be finite, got {x}")
    for n in ("mean_weight", "mean_bias", "square_bias"):
        if not 0.0 < float(values[n]) <= 1.0:
            raise ValueError(f"{n}: must lie in (0, 1], got {values[n]}")
    if signal is not None:
        for n in ("signal_weight", "signal_bias"):
            if not 0.0 < float(values[n]) <= 1.0:
                raise ValueError(f"{n}: must lie in (0, 1] with a signal, got {values[n]}")
    if not 0.0 <= float(square_weight) <= 1.0:
        raise ValueError(f"square_weight: must lie in [0, 1], got {square_weight}")
    if float(scale) <= 0.0:
        raise ValueError(f"scale: must be > 0, got {scale}")
    if float(count) < 1.0:
        raise ValueError(f"count: Adagrad's steps, >= 1, got {count}")
    if float(eps) < 0.0:
        raise ValueError(f"eps: must be >= 0, got {eps}")
    if float(sign) not in (1.0, -1.0):
        raise ValueError(f"sign: +1 (add) or -1 (subtract), got {sign}")
    flat = {n: t.view(-1) for n, t in ts.items()}
    _run(_global_batch_step_tracked_op, _global_batch_step_tracked_impl, flat["grad"], flat["change"],
         flat.get("after"), flat.get("second"), flat.get("grad_avg"), flat["mean"], flat.get("extra"), flat.get("signal"),
         flat["target"],
         reference.TRACKED_KINDS.index(kind), [float(values[n]) for n in TRACKED_SCALARS])
