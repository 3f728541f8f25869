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
    moments), "change" (NAdam / RAdam) or "change_decay" (their decoupled weight decay)."""
    m, v = adam_moments(n, seed, edge, nonfinite)
    g = torch.Generator().manual_seed(seed + 1)
    kw = dict(bias1=0.271, bias2=0.00299, world=world, eps=1e-8)
    if form == "adam":
        kw["lr"] = 3e-3
    else:
        kw["change"] = torch.randn(n, generator=g) * 1e-3
        if form == "change_decay":
            kw.update(after=torch.randn(n, generator=g), decay=3e-4)
    return m, v, kw
