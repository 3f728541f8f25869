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
