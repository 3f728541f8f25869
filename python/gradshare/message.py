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

Two formats carry magnitudes instead of +-tau. Both split the buffer into chunks of ``chunk`` elements
(the last may be shorter, ``len_c`` elements) and have a size fixed by (n, chunk, k): every rank's message
is as long as every other's, so one all-gather moves them with no lengths round first::

    top-k (format 3)  word 3 = chunk (1..65536), word 4 = k (entries per full chunk, 0..chunk)
                      payload: for each chunk, k_c = ceil(k * len_c / chunk) words in ascending local
                      index, each (bf16 bits of the value << 16) | local index; values finite
    ternary (format 4) word 3 = chunk (a multiple of 16), word 4 = entries (present bits in all chunks)
                      payload: for each chunk, 1 word (float32 bits of its scale, finite, >= 0), then
                      ceil(len_c/16) code words laid out like the bitmap: element present -> +-scale
    top-k, 8-bit values (format 5)  word 3 = chunk (1..65536), word 4 = k; per chunk: 1 word (float32 bits
                      of its scale s, finite, >= 0), ceil(k_c/2) words of 16-bit local indices (two per word,
                      the first in the low half, ascending), ceil(k_c/4) words of int8 values q in
                      [-127, 127] (four per word, the first in the low byte); an entry is q * s. Unused halves
                      and bytes are zero. 3 bytes an entry instead of 4.
    top-k signs (format 7)  word 3 = chunk (1..2**31-1: no 16-bit index), word 4 = k; per chunk: 1 word
                      (float32 bits of its scale s, finite, >= 0), then for k_c > 0 a bit stream (bit b in word
                      b // 32 at bit b % 32) of ceil(bits / 32) words: the local indices p_0 < p_1 < ...
                      Elias-Fano coded with l = floor(log2(len_c / k_c)) low bits (entry i's at bits
                      [i*l, i*l + l)), then k_c + ((len_c - 1) >> l) high bits (bit (p_i >> l) + i set per
                      entry), then k_c sign bits (set: the entry adds -s, else +s); bits past the stream are
                      zero. About 3 + log2(len_c / k_c) bits an entry (6.3 at 10%) where 8-bit top-k takes 24.

A rank whose update was not finite sends a non-finite marker of the same length (zero payload); a rank
that could not encode at all (an exception in its encoder) sends a failed marker (format 6) likewise, so
that every rank stops at the same exchange instead of waiting for it. Neither is ever decoded.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

MAGIC_VERSION = 0x47530001
HEADER_WORDS = 5
LENGTHS_WORDS = 4       # int64 per rank in the lengths all-gather before a varying-length payload: words, format, n, count
MAX_ELEMENTS = 2**31 - 1
SPARSE, BITMAP, NONFINITE, TOPK, TERNARY, TOPK8, FAILED, TOPKSIGN = 0, 1, 2, 3, 4, 5, 6, 7
FORMAT_NAMES = {SPARSE: "sparse", BITMAP: "bitmap", NONFINITE: "nonfinite", TOPK: "topk", TERNARY: "ternary",
                TOPK8: "topk8", FAILED: "failed", TOPKSIGN: "topk_sign"}
TOPK_FORMATS = (TOPK, TOPK8, TOPKSIGN)
CHUNKED = (TOPK, TERNARY, TOPK8, TOPKSIGN)
MAX_TOPK_CHUNK = 65536          # local indices are 16 bits
MAX_TOPK_SIGN_CHUNK = MAX_ELEMENTS   # the signs layout's are Elias-Fano coded: a chunk may be a whole buffer
# What encode() may be asked for; "auto" picks the smaller payload.
FORMAT_CHOICES = {"auto": -1, "sparse": SPARSE, "bitmap": BITMAP}


def max_topk_chunk(fmt: int) -> int:
    """The longest chunk a top-k format can address (message.h's twin)."""
    return MAX_TOPK_SIGN_CHUNK if fmt == TOPKSIGN else MAX_TOPK_CHUNK


def bitmap_words(n: int) -> int:
    return (n + 15) // 16


def prefer_sparse(count: int, n: int) -> bool:
    return count <= bitmap_words(n)


def chunk_lengths(n: int, chunk: int) -> list:
    """Lengths of the chunks a chunked format splits n elements into (the last may be shorter)."""
    return [min(chunk, n - o) for o in range(0, n, chunk)]


def topk_entries(n: int, chunk: int, k: int) -> int:
    """Entries of a top-k message: k per full chunk, ceil(k * len / chunk) for a shorter last one."""
    full, rest = n // chunk, n % chunk  # not divmod: the fake kernels pass SymInts under torch.compile
    return full * k + ((k * rest + chunk - 1) // chunk if rest else 0)


def topk_words(n: int, chunk: int, k: int) -> int:
    return HEADER_WORDS + topk_entries(n, chunk, k)


def topk8_chunk_words(kc: int) -> int:
    return 1 + (kc + 1) // 2 + (kc + 3) // 4


def topk8_words(n: int, chunk: int, k: int) -> int:
    full, rest = n // chunk, n % chunk  # not divmod: the fake kernels pass SymInts under torch.compile
    last = topk8_chunk_words((k * rest + chunk - 1) // chunk) if rest else 0
    return HEADER_WORDS + full * topk8_chunk_words(k) + last


def ef_low_bits(ln: int, kc: int) -> int:
    """Top-k signs: the low bits of each Elias-Fano coded index, floor(log2(ln / kc)) (0 when kc is 0)."""
    l = 0
    if kc > 0:
        while (kc << (l + 1)) <= ln:
            l += 1
    return l


def topks_chunk_bits(ln: int, kc: int) -> int:
    """Bits of a top-k signs chunk's stream: low bits, high bits, sign bits."""
    if kc <= 0:
        return 0
    l = ef_low_bits(ln, kc)
    return kc * l + kc + ((ln - 1) >> l) + kc


def topks_chunk_words(ln: int, kc: int) -> int:
    return 1 + (topks_chunk_bits(ln, kc) + 31) // 32


def topks_words(n: int, chunk: int, k: int) -> int:
    full, rest = n // chunk, n % chunk  # not divmod: the fake kernels pass SymInts under torch.compile
    last = topks_chunk_words(rest, (k * rest + chunk - 1) // chunk) if rest else 0
    return HEADER_WORDS + full * topks_chunk_words(chunk, k) + last


def chunked_words(fmt: int, n: int, chunk: int, k: int) -> int:
    """Length of a top-k, 8-bit top-k, top-k signs or ternary message (k is ignored for ternary)."""
    if fmt == TOPK:
        return topk_words(n, chunk, k)
    if fmt == TOPK8:
        return topk8_words(n, chunk, k)
    if fmt == TOPKSIGN:
        return topks_words(n, chunk, k)
    return ternary_words(n, chunk)


def ternary_words(n: int, chunk: int) -> int:
    full, rest = n // chunk, n % chunk  # not divmod: the fake kernels pass SymInts under torch.compile
    return HEADER_WORDS + full * (1 + chunk // 16) + ((1 + (rest + 15) // 16) if rest else 0)


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


def nonfinite_marker(n: int, tau: float, index: int, device=None, words: int = HEADER_WORDS) -> torch.Tensor:
    """The message a rank sends when its update was not finite: word 3 = first bad index, a zero payload
    up to ``words`` (the fixed length of a top-k or ternary exchange; just the header otherwise)."""
    out = torch.zeros(max(words, HEADER_WORDS), dtype=torch.int32, device=device)
    out[:HEADER_WORDS] = torch.tensor(header(NONFINITE, n, index, tau), dtype=torch.int32)
    return out


def failed_marker(n: int, device=None, words: int = HEADER_WORDS) -> torch.Tensor:
    """The message a rank sends when its encoder raised: header only, zero payload up to ``words``."""
    out = torch.zeros(max(words, HEADER_WORDS), dtype=torch.int32, device=device)
    out[:HEADER_WORDS] = torch.tensor(header(FAILED, n, 0, 0.0), dtype=torch.int32)
    return out
