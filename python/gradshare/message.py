"""The gradshare message format (one int32 array per rank and step).

Layout (csrc/gradshare/message.h is the native twin of this file)::

    word 0  magic + version   0x47530001
    word 1  format            0 = sparse, 1 = bitmap, 2 = non-finite marker (no payload)
    word 2  n                 elements of the dense buffer (0 <= n < 2**31)
    word 3  count             +-tau entries in the payload (marker: index of the first non-finite element)
    word 4  tau               float32 bits of the threshold
    word 5.. payload          sparse: `count` signed 1-based indices, strictly ascending in |index|
                              bitmap: ceil(n/16) words, bit b = element present, bit b+16 = negative

A message may sit in a longer, zero-padded row (the all-gather pads to the longest message); its header
says how many words it uses. Sparse is chosen whenever its payload is no larger than the bitmap's.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

MAGIC_VERSION = 0x47530001
HEADER_WORDS = 5
MAX_ELEMENTS = 2**31 - 1
SPARSE, BITMAP, NONFINITE = 0, 1, 2
FORMAT_NAMES = {SPARSE: "sparse", BITMAP: "bitmap", NONFINITE: "nonfinite"}
# What encode() may be asked for; "auto" picks the smaller payload.
FORMAT_CHOICES = {"auto": -1, "sparse": SPARSE, "bitmap": BITMAP}


def bitmap_words(n: int) -> int:
    return (n + 15) // 16


def prefer_sparse(count: int, n: int) -> bool:
    return count <= bitmap_words(n)


def message_words(fmt: int, n: int, count: int) -> int:
    """Total words (header + payload) of a message."""
    payload = count if fmt == SPARSE else bitmap_words(n) if fmt == BITMAP else 0
    return HEADER_WORDS + payload


def float_bits(x: float) -> int:
    return int(np.array(x, dtype=np.float32).view(np.int32))


def bits_float(b: int) -> float:
    return float(np.array(b, dtype=np.int32).view(np.float32))


@dataclass(frozen=True)
class MessageInfo:
    format: int
    n: int
    count: int
    tau: float

    @property
    def format_name(self) -> str:
        return FORMAT_NAMES.get(self.format, f"unknown({self.format})")

    @property
    def words(self) -> int:
        return message_words(self.format, self.n, self.count)


def parse_header(message) -> MessageInfo:
    """Reads (without validating the payload) the header of one message row."""
    head = message[:HEADER_WORDS]
    head = head.tolist() if isinstance(head, (torch.Tensor, np.ndarray)) else list(head)
    if len(head) < HEADER_WORDS or head[0] != MAGIC_VERSION:
        raise ValueError("message: not a gradshare v1 message (short or bad magic word)")
    return MessageInfo(format=head[1], n=head[2], count=head[3], tau=bits_float(head[4]))


def header(fmt: int, n: int, count: int, tau: float) -> list:
    return [MAGIC_VERSION, fmt, n, count, float_bits(tau)]


def nonfinite_marker(n: int, tau: float, index: int, device=None) -> torch.Tensor:
    """The message a rank sends when its update was not finite: no payload, word 3 = first bad index."""
    return torch.tensor(header(NONFINITE, n, index, tau), dtype=torch.int32, device=device)
