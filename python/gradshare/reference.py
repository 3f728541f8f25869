"""Pure-torch reference of every native op, written for clarity, not speed.

The tests compare the native kernels against these bit for bit, and gradshare.ops falls back to them
(with a warning) where the native library is missing. They round exactly as the kernels do: float32
arithmetic, no fused multiply-add, one ±tau per element per step.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from gradshare import message as msgfmt
from gradshare.message import BITMAP, HEADER_WORDS, NONFINITE, SPARSE


def _f32(x: float) -> float:
    return float(np.float32(x))


def clip_value(tau: float, clip: Optional[float]) -> float:
    """The residual bound clip * tau, rounded once to float32 (0.0 = no clipping)."""
    return 0.0 if clip is None else float(np.float32(clip) * np.float32(tau))


def count(update: torch.Tensor, residual: torch.Tensor, tau: float) -> tuple:
    """(entries reaching tau, index of the first non-finite u or -1)."""
    u = residual + update.float()
    bad = (~torch.isfinite(u)).nonzero()
    first_bad = int(bad[0]) if bad.numel() else -1
    return int(((u >= tau) | (u <= -tau)).sum()), first_bad


def encode(update: torch.Tensor, residual: torch.Tensor, tau: float, clip: Optional[float] = None,
           format: str = "auto") -> torch.Tensor:
    """Threshold-encodes residual + update; updates residual in place. Returns one message."""
    tau = _f32(tau)
    n = update.numel()
    u = residual + update.float()
    bad = (~torch.isfinite(u)).nonzero()
    if bad.numel():
        return msgfmt.nonfinite_marker(n, tau, int(bad[0]), device=update.device)
    pos, neg = u >= tau, u <= -tau
    kept = torch.where(pos, u - tau, torch.where(neg, u + tau, u))
    c = clip_value(tau, clip)
    if c > 0:
        kept = kept.clamp(-c, c)
    residual.copy_(kept)
    count = int((pos | neg).sum())
    fmt = msgfmt.FORMAT_CHOICES[format]
    if fmt < 0:
        fmt = SPARSE if msgfmt.prefer_sparse(count, n) else BITMAP
    head = torch.tensor(msgfmt.header(fmt, n, count, tau), dtype=torch.int32, device=update.device)
    if fmt == SPARSE:
        idx = (pos | neg).nonzero().flatten() + 1
        payload = torch.where(neg[idx - 1], -idx, idx).to(torch.int32)
    else:
        words = msgfmt.bitmap_words(n)
        present = torch.zeros(words * 16, dtype=torch.int64, device=update.device)
        negative = torch.zeros_like(present)
        present[:n] = (pos | neg).long()
        negative[:n] = neg.long()
        shifts = torch.arange(16, device=update.device)
        bits = (present.view(words, 16) << shifts) | (negative.view(words, 16) << (shifts + 16))
        payload = bits.sum(dim=1).to(torch.int64)
        payload = torch.where(payload >= 2**31, payload - 2**32, payload).to(torch.int32)
    return torch.cat([head, payload])


def _rows(messages) -> list:
    if isinstance(messages, torch.Tensor):
        return [messages] if messages.dim() == 1 else list(messages)
    return list(messages)


def validate(row: torch.Tensor, n: int, scale: float = 1.0) -> msgfmt.MessageInfo:
    """Raises ValueError when the row is not a sound message for n elements."""
    row = row.cpu().long()
    if row.numel() < HEADER_WORDS:
        raise ValueError("message is shorter than its 5-word header")
    info = msgfmt.parse_header(row)
    if info.format == NONFINITE:
        raise ValueError("message is a non-finite marker: its sender saw NaN/Inf and sent no update")
    if info.format not in (SPARSE, BITMAP):
        raise ValueError("unknown message format")
    if info.n != n:
        raise ValueError("message length n does not match the destination buffer")
    if not 0 <= info.count <= n:
        raise ValueError("message count is negative or larger than n")
    if not (info.tau > 0 and np.isfinite(info.tau)):
        raise ValueError("message tau is not a positive finite float")
    with np.errstate(over="ignore"):
        entry = np.float32(info.tau) * np.float32(scale)
    if not np.isfinite(entry):
        raise ValueError("message tau * scale overflows float32")
    if info.words > row.numel():
        raise ValueError("message payload runs past the end of its row")
    payload = row[HEADER_WORDS:info.words]
    if info.format == SPARSE:
        a = payload.abs()
        if info.count and (a.min() < 1 or a.max() > n or (a[1:] <= a[:-1]).any()):
            raise ValueError("sparse entry out of bounds or not strictly ascending")
    else:
        w = payload & 0xFFFFFFFF
        present, negative = w & 0xFFFF, w >> 16
        if (negative & ~present).any():
            raise ValueError("bitmap word has a sign bit without its present bit")
        valid = (n - torch.arange(w.numel()) * 16).clamp(0, 16)
        if (present >> valid).any():
            raise ValueError("bitmap bit past n")
        total = sum(bin(int(x)).count("1") for x in present[present != 0])
        if total != info.count:
            raise ValueError("bitmap entry count does not match the header")
    return info


def decode(dst: torch.Tensor, messages, scale: float = 1.0) -> None:
    """dst[i] += sign * (tau * scale) for every entry of every message, messages in order."""
    n = dst.numel()
    rows = _rows(messages)
    infos = [validate(r, n, scale) for r in rows]  # all first: a bad message changes nothing
    for row, info in zip(rows, infos):
        v = float(np.float32(info.tau) * np.float32(scale))
        payload = row[HEADER_WORDS:info.words].long()
        if info.format == SPARSE:
            idx = payload.abs() - 1
            sign = torch.where(payload > 0, 1.0, -1.0)
        else:
            w = (payload & 0xFFFFFFFF).view(-1, 1)
            shifts = torch.arange(16, device=w.device)
            present = ((w >> shifts) & 1).flatten()[:n]
            negative = ((w >> (shifts + 16)) & 1).flatten()[:n]
            idx = present.nonzero().flatten()
            sign = torch.where(negative[idx] == 1, -1.0, 1.0)
        flat = dst.view(-1)
        vals = flat[idx.to(dst.device)] + (sign * v).to(dst.device, torch.float32)
        # sign * v is exactly +-v, so this rounds like the kernel's dst[i] += v / -= v
        flat[idx.to(dst.device)] = vals


def average(buffers: Sequence[torch.Tensor], weights: Optional[Sequence[float]] = None) -> torch.Tensor:
    """sum_j w_j * buffers[j] (or the mean), accumulated left to right in float32."""
    if weights is None:
        acc = buffers[0].clone()
        for b in buffers[1:]:
            acc = acc + b
        return acc / len(buffers)
    acc = buffers[0] * _f32(weights[0])
    for b, w in zip(buffers[1:], weights[1:]):
        acc = acc + b * _f32(w)
    return acc
