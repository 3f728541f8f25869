"""Inputs and bit-exact comparison shared by the CPU and CUDA op tests."""
import torch


def bits(t: torch.Tensor) -> torch.Tensor:
    """float32 -> its int32 bit pattern (tells -0.0 from 0.0 and compares NaNs)."""
    return t.contiguous().view(torch.int32)


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    """Same dtype, shape and bit pattern, wherever the tensors live."""
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    if a.dtype == torch.float32:
        a, b = bits(a), bits(b)
    diff = (a != b).nonzero()
    assert diff.numel() == 0, f"{diff.numel()} elements differ, first at {diff[0].tolist()}"


def make_state(n, density, dtype=torch.float32, seed=0, tau=1.0):
    """(update, residual) on the CPU where roughly `density` of residual + update reaches tau."""
    g = torch.Generator().manual_seed(seed)
    residual = (torch.rand(n, generator=g) * 2 - 1) * (0.9 * tau)
    update = torch.randn(n, generator=g) * (0.01 * tau)
    hot = torch.rand(n, generator=g) < density
    update[hot] += torch.where(torch.rand(int(hot.sum()), generator=g) < 0.5, -2.5, 2.5) * tau
    return update.to(dtype), residual


def adam_moments(n: int, seed: int, edge: bool = False, nonfinite: bool = False):
    """An Adam state's (exp_avg, exp_avg_sq): v mostly above m^2, some below (the variance clamps to 0); with
    ``edge``, zeros, a v of 0, huge and tiny values; with ``nonfinite`` also a NaN and an inf."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(n, generator=g) * 1e-2
    v = m * m * (torch.rand(n, generator=g) * 3) + torch.rand(n, generator=g) * 1e-5
    if edge and n >= 4:
        m[0], v[0] = 0.0, 0.0
        m[1], v[1] = 1e-3, 0.0
        m[2], v[2] = 3e18, 1e37
        m[3], v[3] = -1e-30, 1e-44
    if nonfinite and n >= 6:
        m[4] = float("nan")
        v[5] = float("inf")
    return m, v


def global_batch_step_case(form: str, n: int, seed: int, world: int = 2, edge: bool = False, nonfinite: bool = False):
    """(exp_avg, exp_avg_sq, keyword arguments) for gradshare.ops.global_batch_step: form "adam" (from the
    moments), "change" (NAdam / RAdam) or "change_decay" (their decoupled weight decay); "..._signal": with
    gradshare's average of m^2 (``signal``, written by the op: clone it per call)."""
    form, with_signal, _ = form.partition("_signal")
    m, v = adam_moments(n, seed, edge, nonfinite)
    g = torch.Generator().manual_seed(seed + 1)
    kw = dict(bias1=0.271, bias2=0.00299, world=world, eps=1e-8)
    if with_signal:      # an average of m^2 (bias-corrected by signal_bias) within a factor 2 of this step's m^2
        kw.update(signal=(m / 0.271) ** 2 * 0.00299 * (0.5 + torch.rand(n, generator=g)), signal_weight=1e-3,
                  signal_bias=0.00299)
    if form == "adam":
        kw["lr"] = 3e-3
    else:
        kw["change"] = torch.randn(n, generator=g) * 1e-3
        if form == "change_decay":
            kw.update(after=torch.randn(n, generator=g), decay=3e-4)
    return m, v, kw


# (kind, variant) of gradshare.ops.global_batch_step_tracked: every form its kernels specialise
TRACKED_FORMS = [("rmsprop", "plain"), ("rmsprop", "centered"), ("rmsprop", "momentum"),
                 ("rmsprop", "centered_momentum"), ("rmsprop", "decay"), ("adagrad", "plain"), ("adagrad", "decay"),
                 ("adadelta", "plain"), ("adadelta", "decay"), ("adamax", "plain"), ("adamax", "decay"),
                 ("adafactor", "plain"), ("adafactor", "decay"),
                 # with gradshare's average of m^2 over the second moment's window (signal)
                 ("rmsprop", "signal"), ("rmsprop", "momentum_signal"), ("rmsprop", "decay_signal"),
                 ("adadelta", "signal"), ("adamax", "signal"), ("adamax", "decay_signal"), ("adafactor", "signal"),
                 ("adafactor", "decay_signal")]


def tracked_step_case(kind: str, variant: str, n: int, seed: int, world: int = 2, edge: bool = False,
                      nonfinite: bool = False, maximize: bool = False):
    """(grad, change, mean, keyword arguments) for gradshare.ops.global_batch_step_tracked: a mid-training
    state of ``kind`` ("rmsprop", ..., "adafactor") in ``variant`` ("plain", "centered", "momentum",
    "centered_momentum", "decay": a weight decay, which reads ``after``; "..._signal" or "signal": with
    gradshare's average of m^2, ``signal``, written by the op); with ``edge``, zeros, a second moment
    of 0 and huge and tiny values; with ``nonfinite`` also a NaN and an inf."""
    g = torch.Generator().manual_seed(seed)
    grad = torch.randn(n, generator=g) * 1e-2
    mean = torch.randn(n, generator=g) * 5e-3
    change = torch.randn(n, generator=g) * 1e-3
    kw = dict(kind=kind, world=world, maximize=maximize, mean_weight=0.1, mean_bias=0.651)
    if kind in ("rmsprop", "adagrad", "adadelta"):
        second = grad * grad * (torch.rand(n, generator=g) * 3) + torch.rand(n, generator=g) * 1e-5
        kw.update(second=second, eps=1e-8 if kind != "adadelta" else 1e-6)
        if kind == "adagrad":
            kw.update(offset=0.1, scale=7.0, count=7.0, extra=second * 0.5)
            second.mul_(7.0).add_(0.1)
        else:
            kw.update(scale=0.0679)
        if "centered" in variant:
            kw["grad_avg"] = mean * 0.0679
        if "momentum" in variant:
            kw.update(momentum=0.9, lr=1e-3, extra=torch.randn(n, generator=g) * 1e-4)
    else:
        kw.update(extra=grad * grad * (torch.rand(n, generator=g) * 3) + torch.rand(n, generator=g) * 1e-6,
                  square_weight=1e-3 if kind == "adamax" else 0.2, square_bias=0.00699 if kind == "adamax" else 1.0)
    if "signal" in variant:   # an average of m^2 (bias-corrected by signal_bias) within a factor 2 of this m^2
        weight, bias = (0.2, 1.0) if kind == "adafactor" else (1e-2, 0.0679)
        kw.update(signal=(mean / 0.651) ** 2 * bias * (0.5 + torch.rand(n, generator=g)), signal_weight=weight,
                  signal_bias=bias)
    if "decay" in variant:
        kw["after"] = torch.randn(n, generator=g)
        kw["decay" if kind == "adafactor" else "weight_decay"] = 3e-4 if kind == "adafactor" else 1e-2
    if edge and n >= 4:
        grad[0], mean[0] = 0.0, 0.0
        grad[1] = 1e-3
        grad[2], mean[2] = 3e18, 1e18
        grad[3], mean[3] = -1e-30, 1e-40
        for key in ("second", "extra", "signal"):
            if key in kw:
                kw[key][0], kw[key][1], kw[key][3] = 0.0, 0.0, 1e-44
    if nonfinite and n >= 6:
        grad[4] = float("nan")
        mean[5] = float("inf")
    return grad, change, mean, kw
