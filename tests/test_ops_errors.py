"""Every argument check of gradshare.ops raises its documented error and names the bad argument."""
import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import gradshare
from gradshare import message as msgfmt
from gradshare import ops

N = 64


def state(n=N):
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.3


def good_message(n=N, fmt="sparse"):
    u, r = state(n)
    return ops.encode(u, r, 0.5, format=fmt)


def test_error_types():
    assert issubclass(gradshare.MessageError, ValueError)
    assert issubclass(gradshare.NonFiniteError, FloatingPointError)


# ---------------------------------------------------------------------------------------------------
# encode and count share the update / residual / tau checks
# ---------------------------------------------------------------------------------------------------

def _encode(u, r, tau=0.5, **kw):
    return ops.encode(u, r, tau, **kw)


def _count(u, r, tau=0.5, **kw):
    assert not kw
    return ops.count(u, r, tau)


ENCODERS = [pytest.param(_encode, id="encode"), pytest.param(_count, id="count")]


def _bad_inputs():
    u, r = state()
    return {
        "update_dtype_f64": (u.double(), r, TypeError, r"update: dtype float64"),
        "update_dtype_int": (u.int(), r, TypeError, r"update: dtype int32"),
        "update_dtype_bool": (u > 0, r, TypeError, r"update: dtype bool"),
        "residual_dtype_f16": (u, r.half(), TypeError, r"residual: dtype float16"),
        "residual_dtype_bf16": (u.bfloat16(), r.bfloat16(), TypeError, r"residual: dtype bfloat16"),
        "update_not_contiguous": (torch.randn(N, 2)[:, 0], r, ValueError, r"update: must be contiguous"),
        "residual_not_contiguous": (u, torch.randn(2 * N)[::2], ValueError, r"residual: must be contiguous"),
        "update_list": (u.tolist(), r, TypeError, r"update: expected a torch.Tensor or numpy.ndarray"),
        "residual_list": (u, r.tolist(), TypeError, r"residual: expected a torch.Tensor or numpy.ndarray"),
        "update_numpy_strided": (np.zeros((N, 2), np.float32)[:, 0], r.numpy(), ValueError,
                                 r"update: numpy array must be C-contiguous"),
        "residual_numpy_strided": (u.numpy(), np.zeros(2 * N, np.float32)[::2], ValueError,
                                   r"residual: numpy array must be C-contiguous"),
        "size_mismatch": (u, torch.zeros(N + 1), ValueError, rf"residual: {N + 1} elements but update has {N}"),
        "size_mismatch_empty": (u, torch.zeros(0), ValueError, r"residual: 0 elements"),
        "update_meta": (u.to("meta"), r, ValueError, r"update: device meta not supported"),
        "residual_meta": (u, r.to("meta"), ValueError, r"residual: device meta not supported"),
    }


@pytest.mark.parametrize("fn", ENCODERS)
@pytest.mark.parametrize("case", sorted(_bad_inputs()))
def test_update_residual_checks(fn, case):
    u, r, exc, pattern = _bad_inputs()[case]
    before = torch.as_tensor(r).clone() if not isinstance(r, list) else None
    with pytest.raises(exc, match=pattern):
        fn(u, r)
    if before is not None and before.device.type == "cpu":
        assert torch.equal(torch.as_tensor(r), before)


BAD_TAUS = [(0.0, ValueError), (-0.5, ValueError), (-0.0, ValueError), (float("nan"), ValueError),
            (float("inf"), ValueError), (float("-inf"), ValueError),
            (1e-46, ValueError),  # positive, but 0 as float32
            (1e39, ValueError),  # finite, but inf as float32
            ("abc", TypeError), (None, TypeError), ([1.0], TypeError)]


@pytest.mark.parametrize("fn", ENCODERS)
@pytest.mark.parametrize("tau,exc", BAD_TAUS, ids=[repr(t) for t, _ in BAD_TAUS])
def test_tau_checks(fn, tau, exc):
    u, r = state()
    before = r.clone()
    with pytest.raises(exc, match=r"^tau: "):
        fn(u, r, tau)
    assert torch.equal(r, before)


@pytest.mark.parametrize("clip", [0.0, -1.0, float("nan"), float("inf"), float("-inf")])
def test_clip_checks(clip):
    u, r = state()
    before = r.clone()
    with pytest.raises(ValueError, match=r"^clip: "):
        ops.encode(u, r, 0.5, clip=clip)
    assert torch.equal(r, before)


def test_clip_times_tau_overflow_is_refused():
    u, r = state()
    before = r.clone()
    with pytest.raises(ValueError, match=r"clip"):
        ops.encode(u, r, 1e30, clip=1e30)  # clip * tau is inf in float32
    assert torch.equal(r, before)


def test_clip_times_tau_underflow_is_refused():
    u, r = state()
    with pytest.raises(ValueError, match=r"clip"):
        ops.encode(u, r * 1e-30, 1e-30, clip=1e-20)


def test_clip_not_a_number_names_clip():
    u, r = state()
    with pytest.raises((TypeError, ValueError), match=r"^clip: "):
        ops.encode(u, r, 0.5, clip="big")


@pytest.mark.parametrize("fmt", ["dense", "Sparse", "", None, 0])
def test_format_checks(fmt):
    u, r = state()
    before = r.clone()
    with pytest.raises(ValueError, match=r"^format: "):
        ops.encode(u, r, 0.5, format=fmt)
    assert torch.equal(r, before)


@pytest.mark.parametrize("mode", ["skip", "RAISE", None])
def test_on_nonfinite_checks(mode):
    u, r = state()
    before = r.clone()
    with pytest.raises(ValueError, match=r"^on_nonfinite: "):
        ops.encode(u, r, 0.5, on_nonfinite=mode)
    assert torch.equal(r, before)


# ---------------------------------------------------------------------------------------------------
# sizes past 2**31 - 1 and device mixes, with fake tensors (no memory is allocated)
# ---------------------------------------------------------------------------------------------------

BIG = 2**31


@pytest.fixture
def fake():
    with FakeTensorMode() as mode:
        yield mode


def test_encode_count_refuse_more_than_2_31_elements(fake):
    u, r = torch.empty(BIG), torch.empty(BIG)
    with pytest.raises(ValueError, match=rf"^update: {BIG} elements.*2\*\*31-1"):
        ops.encode(u, r, 0.5)
    with pytest.raises(ValueError, match=rf"^update: {BIG} elements"):
        ops.count(u, r, 0.5)
    with pytest.raises(ValueError, match=rf"^update: {BIG} elements"):
        ops.encode(torch.empty(BIG, dtype=torch.bfloat16), r, 0.5)


def test_residual_size_checked_against_limit_too(fake):
    with pytest.raises(ValueError, match=rf"^residual: {BIG} elements"):
        ops.encode(torch.empty(BIG - 1), torch.empty(BIG), 0.5)


def test_decode_refuses_more_than_2_31_elements(fake):
    with pytest.raises(ValueError, match=rf"^dst: {BIG} elements"):
        ops.decode(torch.empty(BIG), torch.zeros(5, dtype=torch.int32))


def test_average_refuses_more_than_2_31_elements(fake):
    with pytest.raises(ValueError, match=rf"^buffers\[0\]: {BIG} elements"):
        ops.average([torch.empty(BIG), torch.empty(BIG)])


def test_largest_allowed_size_passes_the_checks(fake):
    u = torch.empty(2**31 - 1)
    ops._check_update_residual(u, torch.empty(2**31 - 1))  # no error


def test_device_mix_encode_count(fake):
    u, r = torch.empty(N), torch.empty(N, device="cuda")
    with pytest.raises(ValueError, match=r"^residual: on cuda:0 but update is on cpu"):
        ops.encode(u, r, 0.5)
    with pytest.raises(ValueError, match=r"^residual: on cpu but update is on cuda:0"):
        ops.count(r, u, 0.5)


def test_device_mix_average(fake):
    a, b = torch.empty(N), torch.empty(N, device="cuda")
    with pytest.raises(ValueError, match=r"^buffers\[1\]: on cuda:0 but buffers\[0\] is on cpu"):
        ops.average([a, b])
    with pytest.raises(ValueError, match=r"^out: on cuda:0 but buffers\[0\] is on cpu"):
        ops.average([a, a], out=b)


# ---------------------------------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dst,exc,pattern", [
    (torch.zeros(N, dtype=torch.float64), TypeError, r"^dst: dtype float64"),
    (torch.zeros(N, dtype=torch.float16), TypeError, r"^dst: dtype float16"),
    (torch.zeros(N, 2)[:, 0], ValueError, r"^dst: must be contiguous"),
    (np.zeros((N, 2), np.float32)[:, 1], ValueError, r"^dst: numpy array must be C-contiguous"),
    ([0.0] * N, TypeError, r"^dst: expected a torch.Tensor"),
    (torch.zeros(N, device="meta"), ValueError, r"^dst: device meta"),
], ids=["f64", "f16", "strided", "numpy_strided", "list", "meta"])
def test_decode_dst_checks(dst, exc, pattern):
    with pytest.raises(exc, match=pattern):
        ops.decode(dst, good_message())


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), float("-inf")])
def test_decode_scale_checks(scale):
    dst = torch.zeros(N)
    with pytest.raises(ValueError, match=r"^scale: "):
        ops.decode(dst, good_message(), scale=scale)
    assert not dst.any()


@pytest.mark.parametrize("messages,exc,pattern", [
    (lambda m: m.long(), TypeError, r"^messages: dtype must be int32, got int64"),
    (lambda m: m.float(), TypeError, r"^messages: dtype must be int32, got float32"),
    (lambda m: m.numpy().astype(np.int64), TypeError, r"^messages: dtype must be int32"),
    (lambda m: m.view(1, 1, -1), ValueError, r"^messages: expected a 1-D message or 2-D rows, got 3 dims"),
    (lambda m: m[0], ValueError, r"^messages: expected a 1-D message or 2-D rows, got 0 dims"),
    (lambda m: [m, m.long()], TypeError, r"^messages\[1\]: must be a 1-D int32 message"),
    (lambda m: [m, m, m.view(1, -1)], TypeError, r"^messages\[2\]: must be a 1-D int32 message"),
    (lambda m: [m.tolist()], TypeError, r"^messages: expected a torch.Tensor or numpy.ndarray"),
], ids=["int64", "float32", "numpy_int64", "3d", "0d", "list_int64", "list_2d", "list_of_lists"])
def test_decode_message_type_checks(messages, exc, pattern):
    dst = torch.zeros(N)
    with pytest.raises(exc, match=pattern):
        ops.decode(dst, messages(good_message()))
    assert not dst.any()


@pytest.mark.parametrize("fmt", ["sparse", "bitmap"])
@pytest.mark.parametrize("n", [0, N - 1, N + 1, 2 * N, 16 * 4 + 16])
def test_decode_message_for_another_n(fmt, n):
    dst = torch.zeros(n)
    with pytest.raises(gradshare.MessageError, match=r"^message 0: message length n does not match"):
        ops.decode(dst, good_message(N, fmt))
    assert not dst.any()


def test_decode_names_the_bad_message_and_writes_nothing():
    good = good_message()
    bad = good.clone()
    bad[0] = 0
    dst = torch.zeros(N)
    with pytest.raises(gradshare.MessageError, match=r"^message 2: bad magic"):
        ops.decode(dst, [good, good, bad, good])
    assert not dst.any()
    rows = torch.stack([good, good, bad])
    with pytest.raises(ValueError, match=r"^message 2: "):
        ops.decode(dst, rows)
    assert not dst.any()


def test_decode_row_shorter_than_header():
    dst = torch.zeros(N)
    with pytest.raises(gradshare.MessageError, match="shorter than its 5-word header"):
        ops.decode(dst, good_message()[:4])
    with pytest.raises(gradshare.MessageError, match="shorter than its 5-word header"):
        ops.decode(dst, torch.zeros(2, 3, dtype=torch.int32))
    assert not dst.any()


def test_decode_nonfinite_marker():
    dst = torch.zeros(N)
    with pytest.raises(gradshare.MessageError, match="non-finite marker"):
        ops.decode(dst, [good_message(), msgfmt.nonfinite_marker(N, 0.5, 3)])
    assert not dst.any()


# ---------------------------------------------------------------------------------------------------
# average
# ---------------------------------------------------------------------------------------------------

def _bufs(k=3, n=N):
    return [torch.randn(n) for _ in range(k)]


@pytest.mark.parametrize("call,exc,pattern", [
    (lambda b: ops.average([]), ValueError, r"^buffers: need at least one"),
    (lambda b: ops.average([b[0], b[1].double()]), TypeError, r"^buffers\[1\]: dtype float64"),
    (lambda b: ops.average([b[0], b[1].half()]), TypeError, r"^buffers\[1\]: dtype float16"),
    (lambda b: ops.average([b[0], b[1], torch.randn(N + 1)]), ValueError,
     rf"^buffers\[2\]: {N + 1} elements but buffers\[0\] has {N}"),
    (lambda b: ops.average([b[0], torch.randn(N, 2)[:, 0]]), ValueError, r"^buffers\[1\]: must be contiguous"),
    (lambda b: ops.average([b[0], b[1].tolist()]), TypeError, r"^buffers\[1\]: expected a torch.Tensor"),
    (lambda b: ops.average(b, weights=[1.0, 2.0]), ValueError, r"^weights: 2 weights for 3 buffers"),
    (lambda b: ops.average(b, weights=[1.0, 2.0, 3.0, 4.0]), ValueError, r"^weights: 4 weights for 3 buffers"),
    (lambda b: ops.average(b, weights=[]), ValueError, r"^weights: 0 weights for 3 buffers"),
    (lambda b: ops.average(b, weights=[1.0, float("nan"), 1.0]), ValueError, r"^weights: must be finite"),
    (lambda b: ops.average(b, weights=[1.0, float("inf"), 1.0]), ValueError, r"^weights: must be finite"),
    (lambda b: ops.average(b, out=torch.zeros(N, dtype=torch.float64)), TypeError, r"^out: dtype float64"),
    (lambda b: ops.average(b, out=torch.zeros(N + 1)), ValueError, rf"^out: {N + 1} elements but the buffers have"),
    (lambda b: ops.average(b, out=torch.zeros(N, 2)[:, 0]), ValueError, r"^out: must be contiguous"),
    (lambda b: ops.average(b, out=torch.zeros(N, device="meta")), ValueError, r"^out: device meta"),
], ids=["empty", "f64", "f16", "size", "strided", "list", "weights_short", "weights_long", "weights_empty",
        "weights_nan", "weights_inf", "out_f64", "out_size", "out_strided", "out_meta"])
def test_average_checks(call, exc, pattern):
    b = _bufs()
    before = [x.clone() for x in b]
    with pytest.raises(exc, match=pattern):
        call(b)
    for x, y in zip(b, before):
        assert torch.equal(x, y)


def _gbs(target=None, **kw):
    g = torch.Generator().manual_seed(5)
    m, v = torch.randn(N, generator=g), torch.rand(N, generator=g)
    args = dict(bias1=0.1, bias2=0.01, world=2, eps=1e-8, lr=1e-3)
    args.update(kw)
    return m, v, (torch.zeros(N) if target is None else target), args


@pytest.mark.parametrize("kw,exc,pattern", [
    (dict(target=torch.zeros(N, dtype=torch.float64)), TypeError, r"^target: dtype float64"),
    (dict(target=torch.zeros(N + 1)), ValueError, rf"^target: {N + 1} elements but target|^exp_avg: {N} elements"),
    (dict(target=torch.zeros(N, 2)[:, 0]), ValueError, r"^target: must be contiguous"),
    (dict(change=torch.zeros(N, dtype=torch.bfloat16)), TypeError, r"^change: dtype bfloat16"),
    (dict(change=torch.zeros(N - 1)), ValueError, rf"^change: {N - 1} elements but target has {N}"),
    (dict(after=torch.zeros(N)), ValueError, r"^after / decay: only with change"),
    (dict(change=torch.zeros(N), decay=0.1), ValueError, r"^after: required with a decoupled weight decay"),
    (dict(bias1=0.0), ValueError, r"^bias1, bias2: 1 - beta\^t lies in \(0, 1\]"),
    (dict(bias2=1.5), ValueError, r"^bias1, bias2: "),
    (dict(bias1=float("nan")), ValueError, r"^bias1: must be finite"),
    (dict(world=0), ValueError, r"^world: a number of ranks >= 1, got 0"),
    (dict(world=2.5), ValueError, r"^world: a number of ranks >= 1, got 2.5"),
    (dict(eps=-1.0), ValueError, r"^eps: must be >= 0"),
    (dict(lr=float("inf")), ValueError, r"^lr: must be finite"),
    (dict(sign=0.5), ValueError, r"^sign: \+1 \(add\) or -1 \(subtract\), got 0.5"),
], ids=["target_f64", "target_size", "target_strided", "change_bf16", "change_size", "after_alone", "decay_alone",
        "bias1_zero", "bias2_above_1", "bias1_nan", "world_zero", "world_float", "eps_negative", "lr_inf", "sign"])
def test_global_batch_step_checks(kw, exc, pattern):
    m, v, target, args = _gbs(kw.pop("target", None), **kw)
    before = target.clone()
    with pytest.raises(exc, match=pattern):
        ops.global_batch_step(m, v, target, **args)
    assert torch.equal(target, before)


def test_global_batch_step_refuses_a_target_over_the_moments():
    m, v, _, args = _gbs()
    with pytest.raises(ValueError, match=r"^target: overlaps exp_avg_sq; the moments are only read"):
        ops.global_batch_step(m, v, v, **args)
    base = torch.zeros(N + 1)
    with pytest.raises(ValueError, match=r"^target: overlaps change at an offset"):
        ops.global_batch_step(m, v, base[1:], change=base[:N], bias1=0.1, bias2=0.1, world=2, eps=1e-8)


def test_global_batch_step_checks_its_signal():
    m, v, target, args = _gbs()
    signal = torch.rand(N)
    before = (target.clone(), signal.clone())
    for bad, pattern in ((dict(signal_weight=0.0, signal_bias=0.5), r"^signal_weight, signal_bias: .*got 0.0, 0.5"),
                         (dict(signal_weight=0.1, signal_bias=1.5), r"^signal_weight, signal_bias: .*got 0.1, 1.5"),
                         (dict(signal_weight=float("nan"), signal_bias=0.5), r"^signal_weight, signal_bias")):
        with pytest.raises(ValueError, match=pattern):
            ops.global_batch_step(m, v, target, signal=signal, **bad, **args)
    with pytest.raises(ValueError, match=r"^signal: overlaps exp_avg"):
        ops.global_batch_step(m, v, target, signal=m, signal_weight=0.1, signal_bias=0.5, **args)
    with pytest.raises(ValueError, match=r"^signal: overlaps target"):
        ops.global_batch_step(m, v, target, signal=target, signal_weight=0.1, signal_bias=0.5, **args)
    with pytest.raises(TypeError, match=r"signal"):
        ops.global_batch_step(m, v, target, signal=signal.double(), signal_weight=0.1, signal_bias=0.5, **args)
    assert torch.equal(target, before[0]) and torch.equal(signal, before[1])


def _tracked(base="rmsprop", **kw):
    """(grad, change, mean, target, keyword arguments) of a valid global_batch_step_tracked call for optimizer
    ``base``, changed by ``kw`` (None: the argument left out)."""
    g = torch.Generator().manual_seed(6)
    t = dict(zip(("grad", "change", "mean", "target"), (torch.randn(N, generator=g) for _ in range(4))))
    args = dict(kind=base, world=2, mean_bias=0.5)
    if base in ("rmsprop", "adagrad", "adadelta"):
        args["second"] = torch.rand(N, generator=g)
    if base in ("adagrad", "adamax", "adafactor"):
        args["extra"] = torch.rand(N, generator=g)
    for k, v in kw.items():
        (t if k in t else args)[k] = v
    return t["grad"], t["change"], t["mean"], t["target"], {k: v for k, v in args.items() if v is not None}


@pytest.mark.parametrize("kind,kw,exc,pattern", [
    ("rmsprop", dict(kind="sgd"), ValueError, r"^kind: one of rmsprop, adagrad, adadelta, adamax, adafactor, got 'sgd'"),
    ("rmsprop", dict(target=torch.zeros(N, dtype=torch.float64)), TypeError, r"^target: dtype float64"),
    ("rmsprop", dict(grad=torch.zeros(N, dtype=torch.bfloat16)), TypeError, r"^grad: dtype bfloat16"),
    ("rmsprop", dict(mean=torch.zeros(N + 1)), ValueError, rf"^mean: {N + 1} elements but target has {N}"),
    ("rmsprop", dict(change=torch.zeros(N, 2)[:, 0]), ValueError, r"^change: must be contiguous"),
    ("rmsprop", dict(second=None), ValueError, r"^second: rmsprop divides by its own second moment"),
    ("adamax", dict(second=torch.zeros(N)), ValueError, r"^second: not read for adamax"),
    ("adagrad", dict(grad_avg=torch.zeros(N)), ValueError, r"^grad_avg: only for centered RMSprop"),
    ("adadelta", dict(momentum=0.9), ValueError, r"^momentum: only for RMSprop"),
    ("rmsprop", dict(momentum=0.9), ValueError, r"^extra: required for rmsprop with momentum"),
    ("adamax", dict(extra=None), ValueError, r"^extra: required for adamax"),
    ("adadelta", dict(extra=torch.zeros(N)), ValueError, r"^extra: not read for adadelta"),
    ("adafactor", dict(weight_decay=0.1), ValueError, r"^weight_decay: Adafactor's is decoupled"),
    ("adamax", dict(decay=0.1), ValueError, r"^decay: only Adafactor's weight decay is decoupled"),
    ("rmsprop", dict(weight_decay=0.1), ValueError, r"^after: required with a weight decay"),
    ("rmsprop", dict(world=0), ValueError, r"^world: a number of ranks >= 1, got 0"),
    ("rmsprop", dict(eps=float("nan")), ValueError, r"^eps: must be finite"),
    ("rmsprop", dict(eps=-1.0), ValueError, r"^eps: must be >= 0"),
    ("rmsprop", dict(mean_bias=0.0), ValueError, r"^mean_bias: must lie in \(0, 1\]"),
    ("adamax", dict(square_bias=1.5), ValueError, r"^square_bias: must lie in \(0, 1\]"),
    ("adamax", dict(square_weight=-0.1), ValueError, r"^square_weight: must lie in \[0, 1\]"),
    ("rmsprop", dict(scale=0.0), ValueError, r"^scale: must be > 0"),
    ("adagrad", dict(count=0.5), ValueError, r"^count: Adagrad's steps, >= 1"),
    ("rmsprop", dict(sign=0.5), ValueError, r"^sign: \+1 \(add\) or -1 \(subtract\), got 0.5"),
    ("adagrad", dict(signal=torch.zeros(N), signal_weight=0.1), ValueError, r"^signal: not for Adagrad"),
    ("rmsprop", dict(signal=torch.zeros(N), signal_weight=0.1, grad_avg=torch.zeros(N)), ValueError,
     r"^signal: not for centered RMSprop"),
    ("adamax", dict(signal=torch.zeros(N)), ValueError, r"^signal_weight: must lie in \(0, 1\] with a signal, got 0.0"),
    ("rmsprop", dict(signal=torch.zeros(N), signal_weight=0.1, signal_bias=1.5), ValueError,
     r"^signal_bias: must lie in \(0, 1\] with a signal"),
    ("adafactor", dict(signal=torch.zeros(N, dtype=torch.float64), signal_weight=0.1), TypeError,
     r"^signal: dtype float64"),
], ids=["kind", "target_f64", "grad_bf16", "mean_size", "change_strided", "second_missing", "second_extra",
        "grad_avg", "momentum", "momentum_extra", "extra_missing", "extra_extra", "adafactor_wd", "adamax_decay",
        "after_missing", "world_zero", "eps_nan", "eps_negative", "mean_bias", "square_bias", "square_weight",
        "scale", "count", "sign", "signal_adagrad", "signal_centered", "signal_weight", "signal_bias", "signal_f64"])
def test_global_batch_step_tracked_checks(kind, kw, exc, pattern):
    grad, change, mean, target, args = _tracked(kind, **kw)
    state = (mean, target, args.get("extra", mean), args.get("signal", mean))
    written = [t.clone() for t in state]
    with pytest.raises(exc, match=pattern):
        ops.global_batch_step_tracked(grad, change, mean, target, **args)
    for t, was in zip(state, written):
        assert torch.equal(t, was)                                     # nothing written


def test_global_batch_step_tracked_refuses_overlaps():
    grad, change, mean, target, args = _tracked("adagrad")
    with pytest.raises(ValueError, match=r"^target: overlaps grad; it is only read"):
        ops.global_batch_step_tracked(grad, change, mean, grad, **args)
    with pytest.raises(ValueError, match=r"^extra: overlaps mean"):
        ops.global_batch_step_tracked(grad, change, mean, target, **dict(args, extra=mean))
    with pytest.raises(ValueError, match=r"^mean: overlaps change"):
        ops.global_batch_step_tracked(grad, change, change, target, **args)
    base = torch.zeros(N + 1)
    with pytest.raises(ValueError, match=r"^target: overlaps change at an offset"):
        ops.global_batch_step_tracked(grad, base[:N], mean, base[1:], **args)
    with pytest.raises(ValueError, match=r"^after: the parameters after the step cannot be the change"):
        ops.global_batch_step_tracked(grad, change, mean, target, **dict(args, weight_decay=0.1, after=change))
    grad, change, mean, target, args = _tracked("adamax", signal_weight=0.1)
    with pytest.raises(ValueError, match=r"^signal: overlaps mean"):
        ops.global_batch_step_tracked(grad, change, mean, target, **dict(args, signal=mean))
    with pytest.raises(ValueError, match=r"^signal: overlaps extra"):
        ops.global_batch_step_tracked(grad, change, mean, target, **dict(args, signal=args["extra"]))
    with pytest.raises(ValueError, match=r"^signal: overlaps grad; it is only read"):
        ops.global_batch_step_tracked(grad, change, mean, target, **dict(args, signal=grad))
    with pytest.raises(ValueError, match=r"^signal: overlaps change"):
        ops.global_batch_step_tracked(grad, change, mean, target, **dict(args, signal=change))


# ---------------------------------------------------------------------------------------------------
# outputs the ops must refuse to write
# ---------------------------------------------------------------------------------------------------

def test_average_out_partially_overlapping_a_buffer_is_refused():
    base = torch.randn(N + 1)
    with pytest.raises(ValueError, match=r"^out: "):
        ops.average([base[:N], torch.randn(N)], out=base[1:])


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
def test_read_only_numpy_outputs_are_refused():
    dst = np.zeros(N, np.float32)
    dst.setflags(write=False)
    with pytest.raises(ValueError, match=r"^dst: "):
        ops.decode(dst, good_message())


@pytest.mark.parametrize("change,pattern", [
    (dict(kind=7), r"kind must be 0 to 4"),
    (dict(inv_world=0.0), r"inv_world must be in \(0, 1\]"),
    (dict(mean="target"), r"mean, extra, signal and target must be distinct"),
    (dict(target="grad"), r"written, so they cannot be grad, second or grad_avg"),
    (dict(signal="mean", signal_weight=0.1), r"mean, extra, signal and target must be distinct"),
    (dict(signal="change", signal_weight=0.1), r"mean, extra and signal cannot be change or after"),
    (dict(signal="signal", signal_weight=0.0), r"signal_weight and signal_bias must lie in \(0, 1\]"),
    (dict(kind=1, extra="extra", signal="signal", signal_weight=0.1), r"signal: not for Adagrad"),
    (dict(second=0), r"second: required for RMSprop, Adagrad, Adadelta"),
    (dict(weight_decay=0.1), r"after: required with a weight decay"),
    (dict(n=-1), r"n must be >= 0"),
], ids=["kind", "inv_world", "mean_is_target", "target_is_grad", "signal_is_mean", "signal_is_change",
        "signal_weight", "signal_adagrad", "second", "after", "n"])
def test_native_tracked_step_checks_its_arguments(change, pattern):
    """The native entry point checks what gradshare.ops checks before it, for callers that reach it directly."""
    from gradshare import _native
    if _native._C is None:
        pytest.skip("no native library")
    t = {k: torch.rand(N) for k in ("grad", "change", "second", "mean", "target", "extra", "signal")}
    args = dict(kind=0, grad=t["grad"].data_ptr(), change=t["change"].data_ptr(), after=0,
                second=t["second"].data_ptr(), grad_avg=0, mean=t["mean"].data_ptr(), extra=0, signal=0,
                target=t["target"].data_ptr(), n=N, world=2.0, inv_world=0.5, grad_sign=1.0, weight_decay=0.0,
                decay=0.0, mean_weight=0.1, mean_bias=0.5, offset=0.0, scale=1.0, count=1.0, eps=1e-8, momentum=0.0,
                lr=0.0, square_weight=0.0, square_bias=1.0, sign=1.0, signal_weight=0.0, signal_bias=1.0, cuda=False,
                stream=0)
    for k, v in change.items():
        args[k] = (args[v] or t[v].data_ptr()) if isinstance(v, str) else v
    before = {k: x.clone() for k, x in t.items()}
    with pytest.raises(ValueError, match=pattern):
        _native._C.rescale_tracked(**args)
    for k, x in t.items():
        assert torch.equal(x, before[k])
