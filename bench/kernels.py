"""Kernel benchmark: fused gradshare ops against a naive torch-ops version and a memory-bound reference.

For each n (float32) and density, times through the public gradshare.ops API:

    encode     fused threshold encode (format "auto": sparse at these densities; residual updated in place)
    encode_kept  the same with what is kept written to a spare buffer (kept=, the residual only read: what the
               sharing core does; one pass over the data where in place takes two)
    bitmap     fused threshold encode, bitmap format
    count      count-only pass
    momentum   the threshold encode with Deep Gradient Compression's momentum correction fused in (velocity=):
               u = residual + (0.9 * velocity + update), the new velocity (0 where sent) and the kept residual
               into spare buffers; "naive" is the same result in three steps (velocity update in torch, the
               encode, the velocity zeroed at the message's indices), as gradshare did it before
    decode     one sparse message added into a dense buffer
    topk       TopK's encode (the default for SGD): per 65536-element chunk the density fraction of largest
               |residual + update|, 8-bit values, what is kept written into a spare buffer (kept=)
    topk_sign  the same selection sent as +-scale with Elias-Fano coded indices (local steps' pseudo-gradient), at
               10% and 2% per 65536-element chunk; topk_sign_whole: at 2% with the whole buffer one chunk
               (TopK(values="sign", chunk=None): one selection, so one thread)
    ternary    Ternary's encode (the default for Adam): -s, 0 or +s per element, kept= a spare buffer
               (independent of density: once per n)
    topk_momentum, ternary_momentum  the same with the momentum correction fused in (velocity=; TopK at its
               default density 2%); "naive" is gradshare's earlier three steps: the velocity update in torch,
               the encode, and the velocity zeroed where the decoded message is not 0
    ternary_decode4  four Ternary messages (a 4-worker exchange) decoded into one buffer; "naive" unpacks
               each message's codes in torch and adds them (8n + n/4 bytes a message)
    topk_sign_decode2  two messages of the defaults' per-step layout (the top 5% of each 65536-element chunk as
               signs: a 2-worker exchange) decoded into one buffer; "naive" is gradshare.reference.decode (torch
               ops); membound: the buffer read and written once (8n bytes)
    average4   mean of 4 buffers into a preallocated output (independent of density: once per n)
    global_batch_step  an AdamW step made the global batch's (gradshare.second_moment: 2 ranks, the Adam
               form): read exp_avg and exp_avg_sq, add the excess into the step's change (16n bytes; once
               per n); "naive" is gradshare.reference's torch ops, checked bit for bit against it first
    global_batch_step_tracked  the same for RMSprop with momentum (global_batch_step_tracked): read the
               gradient, its second moment, the change, gradshare's mean gradient and momentum buffer, write
               the last three (32n bytes; once per n)

Each op is compared, in the same run and interleaved repeat by repeat, with
  * naive: the same result from several plain torch passes (add, abs, compare, nonzero, index, sub, ...),
    as gradient-compression libraries written in plain torch do it (topk: torch.topk per chunk, values
    sent unrounded; ternary: per-chunk threshold, mask and scale in torch);
  * membound: torch.add(a, b, out=c) over m float32 elements with 12*m = the op's minimum bytes moved
    (encode: read update + residual, write residual = 12n, so m = n; average4: 4 reads + 1 write = 20n, so
    m = 5n/3; momentum: read update, velocity, residual, write velocity and kept = 20n; count: 8n;
    global_batch_step: read the two moments, read and write the change = 16n; global_batch_step_tracked:
    32n; decode:
    message + read-modify-write of the touched elements = 12*count).

Reported: median time of the repeats after warm-up, GB/s of the fused op (minimum bytes / time), the speedup
over naive (naive / fused) and the ratio to the memory-bound reference (fused / membound). Torch and the
gradshare kernels use the same thread count (--threads, default 2). With --device cuda, times come from CUDA
events on the current stream.

    python bench/kernels.py                      # n = 2^16, 2^20, 2^24; densities 1e-4, 1e-3, 1e-2
    python bench/kernels.py --quick              # n = 2^16, 2^20, fewer repeats
    python bench/kernels.py --json out.json      # also write every measurement as JSON
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time

import torch

import gradshare
from gradshare import message as msgfmt
from gradshare import ops, reference

TAU = 1e-3
TARGETS = {  # at n = 2^24, density 1e-3 (issue 2)
    "encode": {"membound_max": 1.5, "naive_speedup_min": 5.0},
    "average4": {"membound_max": 1.3},
}


# ---------------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------------

def make_state(n: int, density: float, device, seed: int = 0):
    """(update, residual) so that a `density` fraction of residual + update reaches TAU (exactly so)."""
    g = torch.Generator().manual_seed(seed)
    residual = (torch.rand(n, generator=g) - 0.5) * TAU  # |r| <= tau/2
    update = (torch.rand(n, generator=g) - 0.5) * (0.2 * TAU)  # |r + g| <= 0.6 tau: never reaches tau
    k = int(round(density * n))
    hot = torch.randperm(n, generator=g)[:k]
    update[hot] = torch.where(torch.rand(k, generator=g) < 0.5, -1.6, 1.6) * TAU  # |r + g| >= 1.1 tau
    return update.to(device), residual.to(device)


# ---------------------------------------------------------------------------------------------------
# naive torch-ops versions
# ---------------------------------------------------------------------------------------------------

def naive_encode(update, residual, tau):
    residual.add_(update)
    idx = (residual.abs() >= tau).nonzero().flatten()
    sel = residual[idx]
    sign = torch.sign(sel)
    residual[idx] = sel - sign * tau
    return torch.where(sign > 0, idx + 1, -(idx + 1)).to(torch.int32)


def naive_bitmap(update, residual, tau):
    residual.add_(update)
    pos, neg = residual >= tau, residual <= -tau
    residual.sub_(pos.float() * tau).add_(neg.float() * tau)
    n = residual.numel()
    pad = (-n) % 16
    bits = torch.nn.functional.pad((pos | neg).int(), (0, pad)) | (torch.nn.functional.pad(neg.int(), (0, pad)) << 16)
    shifts = torch.arange(16, device=residual.device, dtype=torch.int32)
    return (bits.view(-1, 16) << shifts).sum(dim=1, dtype=torch.int32)


def unfused_momentum(update, velocity, residual, tau, kept, spare):
    w = torch.mul(velocity, 0.9, out=spare).add_(update)
    msg = ops.encode(w, residual, tau, kept=kept)
    w.index_fill_(0, msg[msgfmt.HEADER_WORDS:].abs().long() - 1, 0.0)   # sparse at these densities
    return msg


def unfused_chunked_momentum(encode, update, velocity, spare, kept):
    w = torch.mul(velocity, 0.9, out=spare).add_(update)
    msg = encode(w, kept=kept)
    sent = torch.zeros_like(w)
    ops.decode(sent, msg)
    w.masked_fill_(sent != 0, 0.0)
    return msg


def naive_count(update, residual, tau):
    return int(((residual + update).abs() >= tau).sum())


def naive_decode(dst, msg):
    info = msgfmt.parse_header(msg)
    e = msg[msgfmt.HEADER_WORDS:msgfmt.HEADER_WORDS + info.count].long()
    dst[e.abs() - 1] += torch.sign(e).float() * info.tau


def naive_topk(update, residual, k, chunk, kept):
    u = torch.add(residual, update, out=kept).view(-1, chunk)
    idx = u.abs().topk(k, dim=1, sorted=False).indices.sort(dim=1).values
    vals = u.gather(1, idx)
    u.scatter_(1, idx, 0.0)
    return idx, vals


def naive_ternary(update, residual, fraction, chunk, kept):
    u = torch.add(residual, update, out=kept).view(-1, chunk)
    a = u.abs()
    sent = a >= fraction * a.mean(dim=1, keepdim=True)
    scale = (a * sent).sum(dim=1, keepdim=True) / sent.sum(dim=1, keepdim=True).clamp(min=1)
    u.sub_(torch.sign(u) * scale * sent)
    return sent, scale


def naive_ternary_decode(dst, rows, chunk):
    """Every row's ternary codes unpacked in torch and added, row by row (n a multiple of ``chunk``)."""
    shifts = torch.arange(16, device=rows.device, dtype=torch.int32)
    for row in rows:
        w = row[msgfmt.HEADER_WORDS:].view(-1, 1 + chunk // 16)
        scale = w[:, :1].view(torch.float32).unsqueeze(-1)
        codes = w[:, 1:].unsqueeze(-1)
        present = ((codes >> shifts) & 1).bool()
        negative = ((codes >> (shifts + 16)) & 1).bool()
        dst.add_(torch.where(present, torch.where(negative, -scale, scale), 0.0).view(-1))


def naive_average(bufs, out):
    torch.mean(torch.stack(bufs), dim=0, out=out)


# ---------------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------------

class Timer:
    """Times one call: perf_counter on the CPU, CUDA events on the current stream on a GPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, setup, fn) -> float:
        setup()
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def measure(timer, variants: dict, repeats: int, warmup: int) -> dict:
    """Median seconds per variant; variants are timed in turn within each repeat (same load for all)."""
    times = {k: [] for k in variants}
    for r in range(warmup + repeats):
        for k, (setup, fn) in variants.items():
            t = timer(setup, fn)
            if r >= warmup:
                times[k].append(t)
    return {k: statistics.median(v) for k, v in times.items()} | {f"{k}_min": min(v) for k, v in times.items()}


def membound_variant(m: int, device):
    a, b = torch.rand(m, device=device), torch.rand(m, device=device)
    c = torch.empty(m, device=device)
    return (lambda: None, lambda: torch.add(a, b, out=c))


def nothing():
    return None


# ---------------------------------------------------------------------------------------------------
# one n
# ---------------------------------------------------------------------------------------------------

def bench_n(n: int, densities, device, repeats: int, warmup: int) -> list:
    timer = Timer(device)
    rows = []
    for density in densities:
        update, residual0 = make_state(n, density, device, seed=n)
        residual = residual0.clone()
        r_naive = residual0.clone()

        def reset():
            residual.copy_(residual0)

        def reset_naive():
            r_naive.copy_(residual0)

        count = ops.count(update, residual0, TAU)
        msg = ops.encode(update, residual0.clone(), TAU)  # "auto": sparse at these densities
        dst = torch.zeros(n, device=device)
        # momentum: a zero velocity keeps the density; the work does not depend on the values
        velocity = torch.zeros(n, device=device)
        kept, new_v, spare = (torch.empty(n, device=device) for _ in range(3))
        checks = {  # the naive versions compute the same thing
            "count": naive_count(update, residual0, TAU) == count,
            "sparse": msgfmt.parse_header(msg).format == msgfmt.SPARSE,
            "encode": torch.equal(naive_encode(update, residual0.clone(), TAU), msg[5:]),
            "momentum": torch.equal(ops.encode(update, residual0, TAU, kept=kept, velocity=velocity, momentum=0.9,
                                               velocity_out=new_v),
                                    unfused_momentum(update, velocity, residual0, TAU, kept, spare))
            and torch.equal(new_v, spare),
        }
        if not all(checks.values()):
            raise AssertionError(f"naive and fused disagree at n={n}, density={density}: {checks}")

        specs = {
            "encode": ({"fused": (reset, lambda: ops.encode(update, residual, TAU)),
                        "naive": (reset_naive, lambda: naive_encode(update, r_naive, TAU))}, 12 * n),
            "encode_kept": ({"fused": (nothing, lambda: ops.encode(update, residual0, TAU, kept=kept)),
                             "naive": (reset_naive, lambda: naive_encode(update, r_naive, TAU))}, 12 * n),
            "bitmap": ({"fused": (reset, lambda: ops.encode(update, residual, TAU, format="bitmap")),
                        "naive": (reset_naive, lambda: naive_bitmap(update, r_naive, TAU))},
                       12 * n + 4 * msgfmt.bitmap_words(n)),
            "momentum": ({"fused": (nothing, lambda: ops.encode(update, residual0, TAU, kept=kept, velocity=velocity,
                                                                momentum=0.9, velocity_out=new_v)),
                          "naive": (nothing, lambda: unfused_momentum(update, velocity, residual0, TAU, kept, spare))},
                         20 * n),
            "count": ({"fused": (nothing, lambda: ops.count(update, residual0, TAU)),
                       "naive": (nothing, lambda: naive_count(update, residual0, TAU))}, 8 * n),
            "decode": ({"fused": (nothing, lambda: ops.decode(dst, msg)),
                        "naive": (nothing, lambda: naive_decode(dst, msg))}, 12 * max(count, 1)),
        }
        for op, (variants, nbytes) in specs.items():
            m = max(1, nbytes // 12)
            variants = dict(variants, membound=membound_variant(m, device))
            t = measure(timer, variants, repeats, warmup)
            rows.append(record(op, n, density, count, nbytes, m, t))
            del variants
    # the chunked codecs, on gradient-like values (a normal distribution), what is kept into a spare buffer
    chunk = 65536
    if n % chunk == 0:
        g = torch.Generator().manual_seed(n)
        update = (torch.randn(n, generator=g) * TAU).to(device)
        residual = (torch.randn(n, generator=g) * TAU).to(device)
        kept, kept_naive = torch.empty_like(residual), torch.empty_like(residual)
        chunked = {f"topk@{d:g}": (lambda k=max(1, round(d * chunk)): ops.encode_topk(
            update, residual, k, chunk=chunk, values="int8", kept=kept),
            lambda k=max(1, round(d * chunk)): naive_topk(update, residual, k, chunk, kept_naive), d)
            for d in densities}
        # the signs layout at 10% (local steps' pseudo-gradient): the same selection, Elias-Fano coded indices
        chunked["topk_sign@0.1"] = (lambda k=round(0.1 * chunk): ops.encode_topk(
            update, residual, k, chunk=chunk, values="sign", kept=kept),
            lambda k=round(0.1 * chunk): naive_topk(update, residual, k, chunk, kept_naive), 0.1)
        # ... and at 2% per 65536-element chunk against the whole buffer one chunk (TopK(values="sign", chunk=None):
        # one selection on one thread where the chunks spread over the threads)
        for name, c in (("topk_sign@0.02", chunk), ("topk_sign_whole@0.02", n)):
            chunked[name] = (lambda c=c: ops.encode_topk(update, residual, round(0.02 * c), chunk=c, values="sign",
                                                         kept=kept),
                             lambda c=c: naive_topk(update, residual, round(0.02 * c), c, kept_naive), 0.02)
        chunked["ternary"] = (lambda: ops.encode_ternary(update, residual, 0.5, chunk=chunk, kept=kept),
                              lambda: naive_ternary(update, residual, 0.5, chunk, kept_naive), None)
        velocity = (torch.randn(n, generator=g) * TAU).to(device)
        new_v, spare = torch.empty_like(residual), torch.empty_like(residual)
        topk2 = lambda u, **kw: ops.encode_topk(u, residual, round(0.02 * chunk), chunk=chunk, values="int8", **kw)
        tern = lambda u, **kw: ops.encode_ternary(u, residual, 0.5, chunk=chunk, **kw)
        for name, enc in (("topk_momentum@0.02", topk2), ("ternary_momentum", tern)):
            chunked[name] = (lambda enc=enc: enc(update, kept=kept, velocity=velocity, momentum=0.9, velocity_out=new_v),
                             lambda enc=enc: unfused_chunked_momentum(enc, update, velocity, spare, kept_naive),
                             0.02 if "@" in name else None)
        for name, (fused, naive, d) in chunked.items():
            # read update + residual, write kept: 12n bytes; with momentum also read velocity, write it: 20n
            nbytes = 20 * n if "momentum" in name else 12 * n
            m = nbytes // 12
            variants = {"fused": (nothing, fused), "naive": (nothing, naive), "membound": membound_variant(m, device)}
            rows.append(record(name.split("@")[0], n, d, None, nbytes, m, measure(timer, variants, repeats, warmup)))
        # four ternary messages decoded into one buffer (a 4-worker exchange): each reads and writes the buffer
        # and reads its codes, 8n + n/4 bytes
        msgs = torch.stack([ops.encode_ternary(update, (torch.randn(n, generator=g) * TAU).to(device), 0.5,
                                               chunk=chunk) for _ in range(4)])
        dst, dst_naive = torch.zeros(n, device=device), torch.zeros(n, device=device)
        ops.decode(dst, msgs)
        naive_ternary_decode(dst_naive, msgs, chunk)
        if not torch.equal(dst, dst_naive):
            raise AssertionError(f"naive and fused ternary decode disagree at n={n}")
        nbytes = 4 * (8 * n + n // 4)
        variants = {"fused": (nothing, lambda: ops.decode(dst, msgs)),
                    "naive": (nothing, lambda: naive_ternary_decode(dst_naive, msgs, chunk)),
                    "membound": membound_variant(nbytes // 12, device)}
        rows.append(record("ternary_decode4", n, None, None, nbytes, nbytes // 12,
                           measure(timer, variants, repeats, warmup)))
        # two signs messages at the defaults' 5% (a 2-worker step) decoded into one buffer: each element's entries
        # added in message order, as the sharing core decodes its mean
        msgs = torch.stack([ops.encode_topk(update, (torch.randn(n, generator=g) * TAU).to(device),
                                            round(0.05 * chunk), chunk=chunk, values="sign") for _ in range(2)])
        dst, dst_naive = torch.zeros(n, device=device), torch.zeros(n, device=device)
        ops.decode(dst, msgs, scale=0.5)
        reference.decode(dst_naive, msgs, scale=0.5)
        if not torch.equal(dst, dst_naive):
            raise AssertionError(f"reference and native signs decode disagree at n={n}")
        variants = {"fused": (nothing, lambda: ops.decode(dst, msgs, scale=0.5)),
                    "naive": (nothing, lambda: reference.decode(dst_naive, msgs, scale=0.5)),
                    "membound": membound_variant(8 * n // 12, device)}
        rows.append(record("topk_sign_decode2", n, 0.05, None, 8 * n, 8 * n // 12,
                           measure(timer, variants, repeats, warmup)))
    # averaging does not depend on the density
    bufs = [torch.rand(n, device=device) for _ in range(4)]
    out = torch.empty(n, device=device)
    nbytes = 20 * n
    m = nbytes // 12
    variants = {"fused": (nothing, lambda: ops.average(bufs, out=out)),
                "naive": (nothing, lambda: naive_average(bufs, out)),
                "membound": membound_variant(m, device)}
    rows.append(record("average4", n, None, None, nbytes, m, measure(timer, variants, repeats, warmup)))
    # the global batch's step does not depend on the density either
    g = torch.Generator().manual_seed(n)
    exp_avg = (torch.randn(n, generator=g) * 1e-3).to(device)
    exp_avg_sq = (exp_avg.cpu() ** 2 * 3 + torch.rand(n, generator=g) * 1e-6).to(device)
    change0 = (torch.randn(n, generator=g) * 1e-3).to(device)
    change, change_naive = change0.clone(), change0.clone()
    kw = dict(bias1=0.651, bias2=0.0296, world=2, eps=1e-8, lr=3e-3)
    # checked against the reference on the CPU: torch's CUDA division by a scalar multiplies by its reciprocal,
    # so only there does the torch reference round as the kernels (and IEEE) do
    ops.global_batch_step(exp_avg, exp_avg_sq, change, **kw)
    expected = change0.to("cpu", copy=True)
    reference.global_batch_step(exp_avg.cpu(), exp_avg_sq.cpu(), expected, **kw)
    if not torch.equal(change.cpu(), expected):
        raise AssertionError(f"global_batch_step and its torch reference disagree at n={n}")
    nbytes = 16 * n
    variants = {"fused": (lambda: change.copy_(change0),
                          lambda: ops.global_batch_step(exp_avg, exp_avg_sq, change, **kw)),
                "naive": (lambda: change_naive.copy_(change0),
                          lambda: reference.global_batch_step(exp_avg, exp_avg_sq, change_naive, **kw)),
                "membound": membound_variant(nbytes // 12, device)}
    rows.append(record("global_batch_step", n, None, None, nbytes, nbytes // 12,
                       measure(timer, variants, repeats, warmup)))
    # the same for RMSprop with momentum: gradshare's mean gradient and momentum of the difference updated too
    grad = (torch.randn(n, generator=g) * 1e-2).to(device)
    second = (grad.cpu() ** 2 * 3 + torch.rand(n, generator=g) * 1e-6).to(device)
    start = [(torch.randn(n, generator=g) * s).to(device) for s in (1e-3, 5e-3, 1e-4)]   # change, mean, buffer
    fused, naive = [t.clone() for t in start], [t.clone() for t in start]
    tkw = dict(kind="rmsprop", world=2, second=second, mean_bias=0.651, scale=0.0296, eps=1e-8, momentum=0.9,
               lr=1e-3)

    def tracked(state, op, grad=grad, tkw=tkw):
        change, mean, buf = state
        op(grad, change, mean, change, extra=buf, **tkw)

    def restore(state):
        return lambda: [t.copy_(s0) for t, s0 in zip(state, start)]

    tracked(fused, ops.global_batch_step_tracked)
    expected = [t.to("cpu", copy=True) for t in start]        # the reference on the CPU, as above
    tracked(expected, reference.global_batch_step_tracked, grad.cpu(), dict(tkw, second=second.cpu()))
    if not all(torch.equal(a.cpu(), b) for a, b in zip(fused, expected)):
        raise AssertionError(f"global_batch_step_tracked and its torch reference disagree at n={n}")
    nbytes = 32 * n
    variants = {"fused": (restore(fused), lambda: tracked(fused, ops.global_batch_step_tracked)),
                "naive": (restore(naive), lambda: tracked(naive, reference.global_batch_step_tracked)),
                "membound": membound_variant(nbytes // 12, device)}
    rows.append(record("global_batch_step_tracked", n, None, None, nbytes, nbytes // 12,
                       measure(timer, variants, repeats, warmup)))
    return rows


def record(op, n, density, count, nbytes, m, t) -> dict:
    return {"op": op, "n": n, "density": density, "count": count, "bytes": nbytes, "membound_elements": m,
            "fused_s": t["fused"], "naive_s": t["naive"], "membound_s": t["membound"],
            "fused_min_s": t["fused_min"], "naive_min_s": t["naive_min"], "membound_min_s": t["membound_min"],
            "fused_gbps": nbytes / t["fused"] / 1e9, "naive_speedup": t["naive"] / t["fused"],
            "membound_ratio": t["fused"] / t["membound"]}


# ---------------------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------------------

def log2(n: int) -> str:
    return f"2^{n.bit_length() - 1}" if n & (n - 1) == 0 else str(n)


def markdown(rows) -> str:
    lines = ["| n | density | op | fused ms | GB/s | naive ms | speedup vs naive | membound ms | fused / membound |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        d = "-" if r["density"] is None else f"{r['density']:g}"
        lines.append(f"| {log2(r['n'])} | {d} | {r['op']} | {r['fused_s'] * 1e3:.3f} | {r['fused_gbps']:.1f} | "
                     f"{r['naive_s'] * 1e3:.3f} | {r['naive_speedup']:.1f}x | {r['membound_s'] * 1e3:.3f} | "
                     f"{r['membound_ratio']:.2f} |")
    return "\n".join(lines)


def target_report(rows) -> list:
    out = []
    for r in rows:
        if r["n"] != 2**24 or r["op"] not in TARGETS or r["density"] not in (None, 1e-3):
            continue
        t = TARGETS[r["op"]]
        if "membound_max" in t:
            ok = r["membound_ratio"] <= t["membound_max"]
            out.append(f"{r['op']} n=2^24: {r['membound_ratio']:.2f}x the memory-bound time "
                       f"(target <= {t['membound_max']}x): {'met' if ok else 'MISSED'}")
        if "naive_speedup_min" in t:
            ok = r["naive_speedup"] >= t["naive_speedup_min"]
            out.append(f"{r['op']} n=2^24: {r['naive_speedup']:.1f}x faster than naive "
                       f"(target >= {t['naive_speedup_min']}x): {'met' if ok else 'MISSED'}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--sizes", default=None, help="comma-separated log2 sizes (default 16,20,24; --quick: 16,20)")
    p.add_argument("--densities", default="1e-4,1e-3,1e-2")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per variant (default 15; --quick: 5)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="torch and gradshare CPU threads")
    p.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    p.add_argument("--json", default=None, help="write the measurements to this file")
    a = p.parse_args(argv)

    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device")
    torch.set_num_threads(a.threads)
    gradshare.set_num_threads(a.threads)
    sizes = [int(s) for s in (a.sizes or ("16,20" if a.quick else "16,20,24")).split(",")]
    densities = [float(d) for d in a.densities.split(",")]
    repeats = a.repeats or (5 if a.quick else 15)
    warmup = min(a.warmup, 1) if a.quick else a.warmup

    rows = []
    for s in sizes:
        rows += bench_n(2**s, densities, device, repeats, warmup)
        print(f"# n=2^{s} done", file=sys.stderr, flush=True)

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    meta = {"command": " ".join(["python", "bench/kernels.py"] + (argv if argv is not None else sys.argv[1:])),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": str(device), "threads": a.threads, "torch": torch.__version__, "cpu": cpu,
            "gradshare": gradshare.build_info(), "repeats": repeats, "warmup": warmup, "tau": TAU,
            "membound": "torch.add(a, b, out=c) over m float32 elements, 12*m = the op's bytes",
            "naive_average": "torch.mean(torch.stack(bufs), dim=0, out=out)",
            "naive_global_batch_step": "gradshare.reference.global_batch_step (float32 torch ops, float64 sqrt)"}
    print(f"device {device}, {a.threads} threads, torch {torch.__version__}, {cpu}; median of {repeats} "
          f"after {warmup} warm-up")
    print()
    print(markdown(rows))
    targets = target_report(rows)
    if targets:
        print()
        for line in targets:
            print(f"- {line}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "rows": rows, "targets": targets}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
