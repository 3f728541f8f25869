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
from gradshare.message import BITMAP, HEADER_WORDS, NONFINITE, SPARSE, TERNARY, TOPK, TOPK8, TOPK_FORMATS, TOPKSIGN

BF16_MAX_BITS = 0x7F7F          # largest finite bfloat16
LANES = 32                      # a ternary chunk sum: 32 strided partial sums, then a fixed pairwise tree


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


def bf16_bits(u: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even bfloat16 bits (int64, 0..65535) of finite float32 values; a value that
    would round past the largest bfloat16 is clamped to it, so a finite input gives a finite output."""
    b = u.to(torch.bfloat16)
    big = torch.tensor(BF16_MAX_BITS, dtype=torch.int16).view(torch.bfloat16).float()
    b = torch.where(b.isinf(), torch.where(u < 0, -big, big).to(torch.bfloat16), b)
    return b.view(torch.int16).long() & 0xFFFF


def bf16_value(bits: torch.Tensor) -> torch.Tensor:
    return (bits.long() << 16).to(torch.int32).view(torch.float32)


def _first_bad(u: torch.Tensor) -> int:
    bad = (~torch.isfinite(u)).nonzero()
    return int(bad[0]) if bad.numel() else -1


def _chunk_rows(u: torch.Tensor, chunk: int):
    """Full chunks as rows of a 2-D view, and the shorter last chunk (or None)."""
    full = u.numel() // chunk
    return u[:full * chunk].view(full, chunk), (u[full * chunk:] if u.numel() % chunk else None)


def _topk_rows(x: torch.Tensor, kc: int, chunk: int):
    """Per row: the kc positions with the largest |x| (ties: the lower index), ascending."""
    ln = x.shape[1]
    # A unique integer key: |x| as float bits (monotonic for non-negative floats), then the lower index.
    key = (x.abs().view(torch.int32).long() << 31) + (chunk - 1 - torch.arange(ln, device=x.device))
    return torch.topk(key, kc, dim=1).indices.sort(dim=1).values


def _pack_halves(x: torch.Tensor, per_word: int, bits: int) -> torch.Tensor:
    """Rows of small unsigned ints -> rows of int32 words, `per_word` fields of `bits` bits, the first lowest."""
    r, m = x.shape
    words = (m + per_word - 1) // per_word
    pad = torch.zeros(r, words * per_word, dtype=torch.int64, device=x.device)
    pad[:, :m] = x
    shifts = torch.arange(per_word, device=x.device) * bits
    w = (pad.view(r, words, per_word) << shifts).sum(dim=2)
    return torch.where(w >= 2**31, w - 2**32, w)


def topk8_quantize(vals: torch.Tensor):
    """Per row: scale = largest |value| / 127 (float32) and q = value / scale rounded half to even, clamped to
    [-127, 127] (0 where the scale is 0)."""
    scale = vals.abs().amax(dim=1) / np.float32(127) if vals.shape[1] else vals.new_zeros(vals.shape[0])
    safe = torch.where(scale > 0, scale, 1.0).view(-1, 1)
    q = torch.where(scale.view(-1, 1) > 0, torch.round(vals / safe), 0.0).clamp(-127, 127)
    return scale, q.long().float()     # an integer, as the kernels hold it: no -0.0


def _topks_stream(idx: torch.Tensor, neg: torch.Tensor, ln: int, kc: int) -> torch.Tensor:
    """Rows of ascending local indices and their signs -> rows of a top-k signs chunk's stream words (int64
    holding int32 values): Elias-Fano low bits, high bits, sign bits, bit b in word b // 32 at bit b % 32."""
    r = idx.shape[0]
    if kc == 0:
        return torch.zeros(r, 0, dtype=torch.int64)
    l = msgfmt.ef_low_bits(ln, kc)
    words = (msgfmt.topks_chunk_bits(ln, kc) + 31) // 32
    bits = np.zeros((r, words * 32), dtype=np.uint8)
    p, i, rows = idx.cpu().numpy(), np.arange(kc), np.arange(r).reshape(-1, 1)
    for j in range(l):
        bits[:, i * l + j] = (p >> j) & 1
    bits[rows, kc * l + (p >> l) + i] = 1
    bits[:, kc * l + kc + ((ln - 1) >> l) + i] = neg.cpu().numpy()
    w = np.packbits(bits, axis=1, bitorder="little").view("<u4").astype(np.int64)
    return torch.from_numpy(np.where(w >= 2**31, w - 2**32, w))


def _topks_fields(p: torch.Tensor, ln: int, kc: int):
    """Rows of top-k signs chunks (words as non-negative int64) -> (scales, local indices, negative flags);
    raises ValueError when a stream does not hold exactly kc strictly ascending indices below ln with zero
    bits past its end."""
    p = p.cpu()
    sc = torch.where(p[:, 0] >= 2**31, p[:, 0] - 2**32, p[:, 0]).to(torch.int32).view(torch.float32)
    r = p.shape[0]
    if kc == 0:
        return sc, torch.zeros(r, 0, dtype=torch.int64), torch.zeros(r, 0, dtype=torch.bool)
    l = msgfmt.ef_low_bits(ln, kc)
    nbits = msgfmt.topks_chunk_bits(ln, kc)
    w = np.ascontiguousarray(p[:, 1:1 + (nbits + 31) // 32].numpy().astype("<u4"))
    bits = np.unpackbits(w.view(np.uint8), axis=1, bitorder="little").astype(np.int64)
    hs, hb = kc * l, kc + ((ln - 1) >> l)
    high = bits[:, hs:hs + hb]
    if (high.sum(axis=1) != kc).any() or bits[:, nbits:].any():
        raise ValueError("top-k signs chunk: its stream does not hold k_c entries, or has bits past its end")
    h = np.nonzero(high)[1].reshape(r, kc) - np.arange(kc)
    low = (bits[:, :hs].reshape(r, kc, l) << np.arange(l)).sum(axis=2) if l else np.zeros((r, kc), dtype=np.int64)
    local = (h << l) | low
    if (local >= ln).any() or (np.diff(local, axis=1) <= 0).any():
        raise ValueError("top-k signs entry index out of its chunk or not strictly ascending")
    neg = bits[:, hs + hb:hs + hb + kc].astype(bool)
    return sc, torch.from_numpy(local), torch.from_numpy(neg)


def encode_topk(update: torch.Tensor, residual: torch.Tensor, k: int, chunk: int, values: str = "bf16") -> torch.Tensor:
    """Top-k encode: in every chunk the k_c entries of u = residual + update with the largest |u| (ties: the
    lower index) are sent with their values (bfloat16; int8 times a scale per chunk with ``values="int8"``;
    +-scale, the mean |u| of the chunk's entries in the kernels' lane order, with ``values="sign"``); the
    residual keeps u minus what was sent."""
    fmt = {"bf16": TOPK, "int8": TOPK8, "sign": TOPKSIGN}[values]
    n = update.numel()
    u = residual + update.float()
    words = msgfmt.chunked_words(fmt, n, chunk, k)
    bad = _first_bad(u)
    if bad >= 0:
        return msgfmt.nonfinite_marker(n, 0.0, bad, device=update.device, words=words)
    kept = u.clone()
    payload = []
    full, last = _chunk_rows(u, chunk)
    for rows, lo, kc in ((full, 0, k), (None if last is None else last.view(1, -1), full.numel(),
                                       (k * (n % chunk) + chunk - 1) // chunk)):
        if rows is None or rows.shape[0] == 0:
            continue
        idx = _topk_rows(rows, kc, chunk) if kc else torch.zeros(rows.shape[0], 0, dtype=torch.int64)
        vals = torch.gather(rows, 1, idx)
        pos = lo + idx + torch.arange(rows.shape[0], device=u.device).view(-1, 1) * chunk
        if fmt == TOPK:
            b = bf16_bits(vals)
            sent = bf16_value(b)
            word = ((b << 16) | idx).view(-1)
            payload.append(torch.where(word >= 2**31, word - 2**32, word))
        elif fmt == TOPKSIGN:
            scale = chunk_abs_sums(vals) / np.float32(kc) if kc else vals.new_zeros(rows.shape[0])
            neg = vals < 0
            sent = torch.where(neg, -scale.view(-1, 1), scale.view(-1, 1))
            payload.append(torch.cat([scale.view(torch.int32).long().view(-1, 1),
                                      _topks_stream(idx, neg, rows.shape[1], kc)], dim=1).view(-1))
        else:
            scale, q = topk8_quantize(vals)
            sent = q * scale.view(-1, 1)
            payload.append(torch.cat([scale.view(torch.int32).long().view(-1, 1), _pack_halves(idx, 2, 16),
                                      _pack_halves(q.long() & 0xFF, 4, 8)], dim=1).view(-1))
        kept[pos.view(-1)] = (vals - sent).view(-1)
    residual.copy_(kept)
    head = torch.tensor(msgfmt.header(fmt, n, chunk, 0.0), dtype=torch.int64, device=update.device)
    head[4] = k
    return torch.cat([head] + payload).to(torch.int32)


def chunk_abs_sums(rows: torch.Tensor) -> torch.Tensor:
    """sum |x| of each row (a chunk) in the kernels' order: lane j adds elements j, j+32, j+64, ... in turn,
    then the 32 lane sums meet in a pairwise tree (16, 8, 4, 2, 1 apart). float32 throughout."""
    a = rows.abs()
    pad = (-a.shape[1]) % LANES
    a = torch.cat([a, a.new_zeros(a.shape[0], pad)], dim=1).view(a.shape[0], -1, LANES)
    acc = a.new_zeros(a.shape[0], LANES)
    for r in range(a.shape[1]):
        acc = acc + a[:, r]
    for step in (16, 8, 4, 2, 1):
        acc = torch.cat([acc[:, :step] + acc[:, step:2 * step], acc[:, 2 * step:]], dim=1)
    return acc[:, 0]


def _ternary_rows(x: torch.Tensor, frac: np.float32):
    """Per row (chunk): the selection, the scale and the kept residual."""
    ln = x.shape[1]
    mean = chunk_abs_sums(x) / np.float32(ln)
    th = (mean * frac).view(-1, 1)
    sel = (x.abs() >= th) & (x != 0)
    cnt = sel.sum(dim=1)
    s2 = chunk_abs_sums(torch.where(sel, x, 0.0))
    scale = torch.where(cnt > 0, s2 / cnt.clamp(min=1).float(), 0.0)
    sent = torch.where(sel, torch.where(x < 0, -scale.view(-1, 1), scale.view(-1, 1)), 0.0)
    return sel, scale, torch.where(sel, x - sent, x)


def _codes(sel: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
    """2-bit codes of each row, ceil(len/16) words per row (bit b present, bit b+16 negative)."""
    r, ln = sel.shape
    cw = (ln + 15) // 16
    present = torch.zeros(r, cw * 16, dtype=torch.int64, device=sel.device)
    negative = torch.zeros_like(present)
    present[:, :ln] = sel.long()
    negative[:, :ln] = (sel & neg).long()
    shifts = torch.arange(16, device=sel.device)
    codes = ((present.view(r, cw, 16) << shifts) | (negative.view(r, cw, 16) << (shifts + 16))).sum(dim=2)
    return torch.where(codes >= 2**31, codes - 2**32, codes)


def encode_ternary(update: torch.Tensor, residual: torch.Tensor, fraction: float, chunk: int) -> torch.Tensor:
    """Ternary encode: per chunk, entries with |u| >= fraction * mean|u| (and u != 0) are sent as +-scale, where
    scale is the mean |u| of those entries; the residual keeps u minus what was sent."""
    n = update.numel()
    u = residual + update.float()
    words = msgfmt.ternary_words(n, chunk)
    bad = _first_bad(u)
    if bad >= 0:
        return msgfmt.nonfinite_marker(n, 0.0, bad, device=update.device, words=words)
    frac = np.float32(fraction)
    kept, payload, entries = u.clone(), [], 0
    full, last = _chunk_rows(u, chunk)
    for rows, lo in ((full, 0), (None if last is None else last.view(1, -1), full.numel())):
        if rows is None or rows.shape[0] == 0:
            continue
        sel, scale, rest = _ternary_rows(rows, frac)
        kept[lo:lo + rows.numel()] = rest.view(-1)
        entries += int(sel.sum())
        scale_bits = scale.view(torch.int32).long().view(-1, 1)
        payload.append(torch.cat([scale_bits, _codes(sel, rows < 0)], dim=1).view(-1))
    residual.copy_(kept)
    head = torch.tensor(msgfmt.header(TERNARY, n, chunk, 0.0), dtype=torch.int64, device=update.device)
    head[4] = entries
    return torch.cat([head] + payload).to(torch.int32)


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
    if info.format in msgfmt.CHUNKED:
        _validate_chunked(row, info.format, n, scale)
        return info
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


def _chunked_parts(row: torch.Tensor, fmt: int, n: int):
    """Header fields and the payload split per chunk: [(first element, chunk length, payload rows)], each
    payload row one chunk (full chunks together, the shorter last one alone)."""
    head = row[:HEADER_WORDS].tolist()
    chunk, k = head[3], head[4]
    full, rest = divmod(n, chunk)
    per = {TOPK: lambda ln: (k * ln + chunk - 1) // chunk, TERNARY: lambda ln: 1 + (ln + 15) // 16,
           TOPK8: lambda ln: msgfmt.topk8_chunk_words((k * ln + chunk - 1) // chunk),
           TOPKSIGN: lambda ln: msgfmt.topks_chunk_words(ln, (k * ln + chunk - 1) // chunk)}[fmt]
    words = msgfmt.chunked_words(fmt, n, chunk, k)
    p = row[HEADER_WORDS:words].long() & 0xFFFFFFFF
    parts = []
    if full:
        parts.append((0, chunk, p[:full * per(chunk)].view(full, per(chunk))))
    if rest:
        parts.append((full * chunk, rest, p[full * per(chunk):].view(1, per(rest))))
    return chunk, k, words, parts


def _validate_chunked(row: torch.Tensor, fmt: int, n: int, scale: float) -> None:
    head = row[:HEADER_WORDS].tolist()
    if head[2] != n:
        raise ValueError("message length n does not match the destination buffer")
    chunk, k = head[3], head[4]
    if fmt in TOPK_FORMATS and (not 1 <= chunk <= msgfmt.max_topk_chunk(fmt) or not 0 <= k <= chunk):
        raise ValueError("top-k message: chunk must be in [1, 65536] (signs: [1, 2^31-1]) and k in [0, chunk]")
    if fmt == TERNARY and (not (16 <= chunk <= 2**30 and chunk % 16 == 0) or not 0 <= k <= n):
        raise ValueError("ternary message: chunk must be a multiple of 16 and the entry count in [0, n]")
    words = msgfmt.chunked_words(fmt, n, chunk, k)
    if words > row.numel():
        raise ValueError("message payload runs past the end of its row")
    total = 0
    for _, ln, p in _chunked_parts(row.cpu(), fmt, n)[3]:
        if p.shape[1] == 0:
            continue
        if fmt == TOPK8:
            kc = (k * ln + chunk - 1) // chunk
            sc, idx, q = _topk8_fields(p, kc)
            with np.errstate(over="ignore"):
                if not (torch.isfinite(sc).all() and (sc >= 0).all() and torch.isfinite(sc * 127 * np.float32(scale)).all()):
                    raise ValueError("8-bit top-k chunk scale is not finite and >= 0 (or overflows times scale)")
            if kc and ((idx >= ln).any() or (idx[:, 1:] <= idx[:, :-1]).any() or (q == -128).any()):
                raise ValueError("8-bit top-k entry index out of its chunk, not ascending, or value -128")
            iw = (kc + 1) // 2
            if (kc % 2 and (p[:, iw] >> 16).any()) or (kc % 4 and (p[:, 1 + iw + kc // 4] >> (8 * (kc % 4))).any()):
                raise ValueError("8-bit top-k padding is not zero")
            continue
        if fmt == TOPKSIGN:
            sc = torch.where(p[:, 0] >= 2**31, p[:, 0] - 2**32, p[:, 0]).to(torch.int32).view(torch.float32)
            with np.errstate(over="ignore"):
                if not (torch.isfinite(sc).all() and (sc >= 0).all() and torch.isfinite(sc * np.float32(scale)).all()):
                    raise ValueError("top-k signs chunk scale is not finite and >= 0 (or overflows times scale)")
            _topks_fields(p, ln, (k * ln + chunk - 1) // chunk)
            continue
        if fmt == TOPK:
            idx = p & 0xFFFF
            with np.errstate(over="ignore"):
                v = bf16_value(p >> 16) * np.float32(scale)
            if (idx >= ln).any() or (idx[:, 1:] <= idx[:, :-1]).any():
                raise ValueError("top-k entry index out of its chunk or not strictly ascending")
            if not torch.isfinite(v).all():
                raise ValueError("top-k entry value is not finite (or overflows times scale)")
            continue
        sc = p[:, 0].to(torch.int64)
        sc = torch.where(sc >= 2**31, sc - 2**32, sc).to(torch.int32).view(torch.float32)
        with np.errstate(over="ignore"):
            if not (torch.isfinite(sc).all() and (sc >= 0).all() and torch.isfinite(sc * np.float32(scale)).all()):
                raise ValueError("ternary chunk scale is not finite and >= 0 (or overflows times scale)")
        w = p[:, 1:]
        present, negative = w & 0xFFFF, w >> 16
        if (negative & ~present).any():
            raise ValueError("ternary code word has a sign bit without its present bit")
        valid = (ln - torch.arange(w.shape[1]) * 16).clamp(0, 16)
        if (present >> valid).any():
            raise ValueError("ternary bit past the end of its chunk")
        total += int(((present.view(-1, 1) >> torch.arange(16)) & 1).sum())
    if fmt == TERNARY and total != k:
        raise ValueError("ternary entry count does not match the header")


def _halves(words: torch.Tensor, shifts) -> torch.Tensor:
    """Rows of 32-bit words -> rows of their fields ``shifts`` bits up (16-bit halves or octets), low first, as
    non-negative integers of the words' dtype (the words' order within a row kept)."""
    width = 32 // len(shifts)
    fields = [(words >> s) & ((1 << width) - 1) for s in shifts]
    return torch.stack(fields, dim=2).view(words.shape[0], -1)


def _topk8_fields(p: torch.Tensor, kc: int):
    """Rows of 8-bit top-k chunks -> (scales, local indices, int8 values), each row one chunk."""
    sc = torch.where(p[:, 0] >= 2**31, p[:, 0] - 2**32, p[:, 0]).to(torch.int32).view(torch.float32)
    iw, vw = (kc + 1) // 2, (kc + 3) // 4
    halves = _halves(p[:, 1:1 + iw], (0, 16))[:, :kc]
    octets = _halves(p[:, 1 + iw:1 + iw + vw], (0, 8, 16, 24))[:, :kc]
    return sc, halves, octets.to(torch.uint8).view(torch.int8)     # the octets as two's complement


def _apply_chunked(flat: torch.Tensor, row: torch.Tensor, fmt: int, n: int, scale: float) -> None:
    head = row[:HEADER_WORDS].tolist()
    for lo, ln, p in _chunked_parts(row, fmt, n)[3]:
        if p.shape[1] == 0:
            continue
        p = p.to(flat.device)
        base = lo + torch.arange(p.shape[0], device=flat.device).view(-1, 1) * ln
        if fmt == TOPK8:
            kc = (head[4] * ln + head[3] - 1) // head[3]
            sc, idx, q = _topk8_fields(p.cpu(), kc)
            v = (q.float() * sc.view(-1, 1)) * np.float32(scale)
            i = (base.cpu() + idx).view(-1).to(flat.device)
            flat[i] = flat[i] + v.view(-1).to(flat.device)
            continue
        if fmt == TOPKSIGN:
            sc, idx, neg = _topks_fields(p, ln, (head[4] * ln + head[3] - 1) // head[3])
            v = torch.where(neg, -sc.view(-1, 1), sc.view(-1, 1)) * np.float32(scale)
            i = (base.cpu() + idx).view(-1).to(flat.device)
            flat[i] = flat[i] + v.view(-1).to(flat.device)
            continue
        if fmt == TOPK:
            idx = (base + (p & 0xFFFF)).view(-1)
            flat[idx] = flat[idx] + (bf16_value(p >> 16) * np.float32(scale)).view(-1)
            continue
        sc = torch.where(p[:, 0] >= 2**31, p[:, 0] - 2**32, p[:, 0]).to(torch.int32).view(torch.float32)
        v = (sc * np.float32(scale)).view(-1, 1)
        w = p[:, 1:].unsqueeze(2)
        shifts = torch.arange(16, device=flat.device)
        present = ((w >> shifts) & 1).view(p.shape[0], -1)[:, :ln].bool()
        negative = ((w >> (shifts + 16)) & 1).view(p.shape[0], -1)[:, :ln].bool()
        delta = torch.where(present, torch.where(negative, -v, v), 0.0)
        idx = (base + torch.arange(ln, device=flat.device)).view(-1)
        sel = present.view(-1)
        flat[idx[sel]] = flat[idx[sel]] + delta.view(-1)[sel]


def decode(dst: torch.Tensor, messages, scale: float = 1.0) -> None:
    """dst[i] += sign * (tau * scale) for every entry of every message, messages in order."""
    n = dst.numel()
    rows = _rows(messages)
    infos = [validate(r, n, scale) for r in rows]  # all first: a bad message changes nothing
    for row, info in zip(rows, infos):
        if info.format in msgfmt.CHUNKED:
            _apply_chunked(dst.view(-1), row.cpu(), info.format, n, scale)
            continue
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


def _topk_entries(row: torch.Tensor, fmt: int, n: int):
    """A top-k message's entries (``row``: its words on the CPU) as (element indices, int8 signs of their
    values: -1, 0 or 1), in message order (ascending). gradshare.momentum_masking reads its rank's sends
    with it at every compressed step: fields are cut with shifts and masks, no per-element branches."""
    chunk, k, _, parts = _chunked_parts(row, fmt, n)
    idx, sign = [torch.zeros(0, dtype=torch.long)], [torch.zeros(0, dtype=torch.int8)]
    for lo, ln, p in parts:
        if p.shape[1] == 0:
            continue
        if fmt == TOPK:
            local, v = p & 0xFFFF, p >> 16                  # index, bfloat16 bits
            s = ((v & 0x7FFF) != 0) * (1 - 2 * (v >> 15))   # 0 for +-0, else the sign bit's
        elif fmt == TOPKSIGN:
            sc, local, neg = _topks_fields(p, ln, (k * ln + chunk - 1) // chunk)
            s = (sc.view(-1, 1) != 0) * (1 - 2 * neg.long())  # 0 where the scale is 0, else the sign bit's
        else:
            _, local, q = _topk8_fields(p, (k * ln + chunk - 1) // chunk)
            s = q.sign()
        base = lo + torch.arange(p.shape[0]).view(-1, 1) * ln
        idx.append((base + local).view(-1))
        sign.append(s.to(torch.int8).view(-1))
    return torch.cat(idx), torch.cat(sign)


def sent_signs(row: torch.Tensor, n: int):
    """The elements a sound top-k message moves, as (indices, int8 signs of what it sends them), on the row's
    device; entries whose value is zero send nothing and are left out. None for a message of another format
    (gradshare.momentum_masking reads what its rank sent from its own message)."""
    cpu = row.cpu()
    fmt = int(cpu[1])
    if fmt not in TOPK_FORMATS:
        return None
    idx, sign = _topk_entries(cpu, fmt, n)
    if not bool(sign.all()):
        moved = sign.nonzero().view(-1)
        idx, sign = idx.index_select(0, moved), sign.index_select(0, moved)
    return idx.to(row.device), sign.to(row.device)


def sent_mask(row: torch.Tensor, n: int) -> torch.Tensor:
    """Which of n elements a sound message (not a marker) sends an entry for, as a bool tensor on the row's
    device: a top-k message's selected elements (whatever value they carry), a ternary or bitmap message's
    present bits, a sparse message's indices. A fused momentum zeroes the new velocity there."""
    cpu = row.cpu().long()
    fmt = int(cpu[1])
    mask = torch.zeros(n, dtype=torch.bool)
    if fmt in TOPK_FORMATS:
        mask[_topk_entries(row.cpu(), fmt, n)[0]] = True
    elif fmt in msgfmt.CHUNKED:
        chunk, k, _, parts = _chunked_parts(cpu, fmt, n)
        for lo, ln, p in parts:
            if p.shape[1] == 0:
                continue
            base = lo + torch.arange(p.shape[0]).view(-1, 1) * ln
            present = ((p[:, 1:].unsqueeze(2) >> torch.arange(16)) & 1).view(p.shape[0], -1)[:, :ln].bool()
            mask[(base + torch.arange(ln))[present]] = True
    elif fmt == SPARSE:
        count = int(cpu[3])
        mask[cpu[HEADER_WORDS:HEADER_WORDS + count].abs() - 1] = True
    elif fmt == BITMAP:
        w = (cpu[HEADER_WORDS:HEADER_WORDS + msgfmt.bitmap_words(n)] & 0xFFFF).view(-1, 1)
        mask = ((w >> torch.arange(16)) & 1).flatten()[:n].bool()
    return mask.to(row.device)


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


def scale_into(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], scale: float) -> torch.Tensor:
    """dst = src * scale (float32) for each pair; a 1-element float32 tensor on their device, 1 where any value
    written is NaN or Inf."""
    bad = []
    for d, s in zip(dsts, srcs):
        torch.mul(s.reshape(d.shape), _f32(scale), out=d)
        bad.append(~torch.isfinite(d).all())
    return torch.stack(bad).any().float().reshape(1) if bad else torch.zeros(1)


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """The float32 square root rounded to nearest, as IEEE and the kernels round it (torch's own CPU sqrt may
    be an ulp off: it takes the float64 root, exact before its one rounding to float32)."""
    return x.double().sqrt_().float()


FLOAT_MAX = float(torch.finfo(torch.float32).max)


def effective_world(world: float, noise: float = 0.0) -> float:
    """The divisor D of v_global = s + max(v - s, 0) / D for ``world`` ranks when the squared mean s holds the
    share ``noise`` of the gradient's variance (gradshare.second_moment: E[s] = mu^2 + noise * sigma^2, E[v] =
    mu^2 + sigma^2, and the global batch's mu^2 + sigma^2 / W is s + (v - s) * (1/W - noise) / (1 - noise)).
    ``world`` itself when ``noise`` is 0 (exactly); float32's largest value where noise >= 1/W, so that the
    global batch's second moment is s, never below it; as a Python float, rounded by the kernels' caller."""
    if noise == 0.0:
        return world
    keep = (1.0 / float(world) - noise) / (1.0 - noise) if noise < 1.0 else 0.0
    return min(1.0 / keep, FLOAT_MAX) if keep > 0.0 else FLOAT_MAX


def global_second_moment(s: torch.Tensor, v: torch.Tensor, world: float) -> torch.Tensor:
    """v_global = s + max(v - s, 0) / W, s the squared mean of the gradient (gradshare.second_moment; W: the
    :func:`effective_world`); ``v`` is left as it is."""
    return torch.sub(v, s).clamp_min_(0.0).div_(world).add_(s)


def global_batch_step(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, target: torch.Tensor, bias1: float,
                      bias2: float, world: float, eps: float, lr: float = 0.0, change: Optional[torch.Tensor] = None,
                      after: Optional[torch.Tensor] = None, decay: float = 0.0, sign: float = 1.0,
                      signal: Optional[torch.Tensor] = None, signal_weight: float = 0.0,
                      signal_bias: float = 1.0, noise: float = 0.0) -> None:
    """target +-= the excess of the global batch's step over a rank's own (csrc/gradshare/element.h:
    adam_excess without ``change``, change_excess with it), in float32 torch ops; ``signal`` (element.h:
    squared_mean) updated in place; ``noise``: the share of the variance the squared mean holds
    (:func:`effective_world`)."""
    world = effective_world(world, noise)
    m = exp_avg.float() / bias1
    v = exp_avg_sq.float() / bias2
    if signal is None:
        s = m * m
    else:
        s = ema_(signal.view(-1), (m * m).view(-1), signal_weight).view_as(m) / signal_bias
    wide = sqrt_rn(global_second_moment(s, v, world)).add_(eps)
    narrow = sqrt_rn(v).add_(eps)
    if change is None:
        excess = wide.reciprocal_().sub_(narrow.reciprocal_()).mul_(m).mul_(lr)
    else:
        divided = change.float()
        if decay != 0.0:
            divided = divided - torch.add(after.float(), divided).mul_(decay)
        infinite = torch.isinf(narrow)                  # v overflowed: no excess (element.h: change_excess)
        excess = divided * narrow.div_(wide).sub_(1.0).masked_fill_(infinite, 0.0)
    if sign > 0:
        target.add_(excess.view_as(target))
    else:
        target.sub_(excess.view_as(target).to(target.dtype))


# element.h's TrackedKind, in its order: the optimizers whose mean gradient gradshare keeps (second_moment.py)
TRACKED_KINDS = ("rmsprop", "adagrad", "adadelta", "adamax", "adafactor")
FLOAT_TINY = float(torch.finfo(torch.float32).tiny)


def ema_(avg: torch.Tensor, x: torch.Tensor, weight: float) -> torch.Tensor:
    """avg + (x - avg) * weight, in place (element.h: ema)."""
    return avg.add_(torch.sub(x, avg).mul_(weight))


def _capped(s: torch.Tensor, cap) -> torch.Tensor:
    """min(s, cap) as element.h's capped takes it: cap where cap < s (a NaN s stays NaN)."""
    return torch.where(cap < s, cap, s)


def _own_divisor(kind: str, x: torch.Tensor, grad_avg: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    if kind == "adadelta":
        return sqrt_rn(x + eps)
    if grad_avg is not None:
        d = x - grad_avg * grad_avg
        return sqrt_rn(torch.where(d < 0.0, 0.0, d)) + eps
    return sqrt_rn(x) + eps


def global_batch_step_tracked(grad: torch.Tensor, change: torch.Tensor, mean: torch.Tensor, target: torch.Tensor, *,
                              kind: str, world: float, after: Optional[torch.Tensor] = None,
                              second: Optional[torch.Tensor] = None, grad_avg: Optional[torch.Tensor] = None,
                              extra: Optional[torch.Tensor] = None, maximize: bool = False, weight_decay: float = 0.0,
                              decay: float = 0.0, mean_weight: float = 0.1, mean_bias: float = 1.0, offset: float = 0.0,
                              scale: float = 1.0, count: float = 1.0, eps: float = 0.0, momentum: float = 0.0,
                              lr: float = 0.0, square_weight: float = 0.0, square_bias: float = 1.0,
                              signal: Optional[torch.Tensor] = None, signal_weight: float = 1.0,
                              signal_bias: float = 1.0, sign: float = 1.0, noise: float = 0.0,
                              inv_world: Optional[float] = None) -> None:
    """target +-= the excess of the global batch's step over a rank's own for an optimizer whose mean gradient
    gradshare keeps, ``mean``, ``extra`` and ``signal`` (float32) updated in place (csrc/gradshare/element.h:
    tracked_inputs and tracked_excess), in float32 torch ops; the keywords of gradshare.ops.global_batch_step_tracked.
    ``inv_world``: Adamax's / Adafactor's floor of v_global / v, 1 / ``world`` unless given (by a caller whose
    ``world`` is the :func:`effective_world` already)."""
    flat = lambda t: None if t is None else t.float().reshape(-1).clone()
    ch, ga = flat(change), flat(grad_avg)
    g = flat(grad) * (-1.0 if maximize else 1.0)
    if inv_world is None:
        inv_world = 1.0 / float(world)
    world = effective_world(world, noise)
    divided = ch
    if (decay if kind == "adafactor" else weight_decay) != 0.0:
        before = flat(after) + ch
        if kind == "adafactor":
            divided = ch - before * decay
        else:
            g = g + before * weight_decay
    mean_f = mean.view(-1)
    m = ema_(mean_f, g, mean_weight) / mean_bias
    extra_f = None if extra is None else extra.view(-1)
    m2 = m * m if signal is None else ema_(signal.view(-1), m * m, signal_weight) / signal_bias
    if kind in ("adamax", "adafactor"):
        v = ema_(extra_f, g * g, square_weight) / square_bias
        s = _capped(m2, v)
        q = ((v - s) / world + s) / torch.where(v < FLOAT_TINY, FLOAT_TINY, v)
        r = sqrt_rn(torch.where(q < inv_world, inv_world, q))
        excess = divided * torch.reciprocal(r).sub_(1.0)
    else:
        if kind == "adagrad":
            s = extra_f.add_(m * m) / count
        elif ga is not None:
            s = ga / scale
            s = s * s
        else:
            s = m2
        sec = flat(second)
        v_hat = (sec - offset) / scale
        s = _capped(s, v_hat)
        v_global = ((v_hat - s) / world + s) * scale + offset
        narrow, wide = _own_divisor(kind, sec, ga, eps), _own_divisor(kind, v_global, ga, eps)
        if kind == "rmsprop" and momentum != 0.0:
            excess = extra_f.mul_(momentum).add_(torch.div(g, wide) - torch.div(g, narrow)) * lr
        else:
            excess = (narrow / wide - 1.0) * divided
    if sign > 0:
        target.add_(excess.view_as(target))
    else:
        target.sub_(excess.view_as(target).to(target.dtype))
