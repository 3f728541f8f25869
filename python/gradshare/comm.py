"""The exchange: every rank threshold-encodes its buffer, all ranks receive every message, all decode.

One exchange of a flat buffer of n elements over W ranks:

1. encode: ``ops.encode(update, residual, tau, on_nonfinite="flag")`` (the residual keeps what was not
   sent; a non-finite buffer yields a marker message and leaves the residual as it was);
2. lengths: one small all-gather of 4 int64 per rank (message words, format, n, count). It carries the
   non-finite flag too, so every rank learns at the same point that a step is bad and no rank hangs;
3. payload: ONE all-gather of the messages as int32 rows zero-padded to the longest (gloo aborts on
   unequal sizes), on the device of the buffer (gloo for CPU tensors, NCCL for CUDA ones, same code);
4. decode: ``ops.decode(out, rows, scale)`` adds every rank's message in rank order, so every rank gets
   bitwise the same result. ``average=True`` (default) uses scale = 1/W: out is the MEAN of what the
   ranks sent (what DDP and gradient averaging expect); ``average=False`` gives the sum (DL4J's rule).

Cost: the lengths step is one extra collective round trip per exchange (32 bytes per rank, latency
bound: tens of microseconds on a LAN, the price of variable-length messages over fixed-size
collectives). Per rank, a ring all-gather of W rows of L words sends (W-1)*4*L bytes; a dense fp32 ring
allreduce of n elements sends 2*(W-1)/W*4*n bytes.

Dense fallback (``fallback="auto"``): the padded gather is used only while W*L <= 2*n, i.e. the longest
message is at most 2n/W words (density about 2/W for sparse messages; a bitmap row, n/16 words, only
loses from W = 32 on; tiny buffers lose to their 5-word headers). Otherwise the step is an fp32
allreduce of residual + update: each rank adds its own sent message back into its residual (which then
holds everything not yet applied), allreduces that, and zeroes the residual. All ranks decide from the
same gathered lengths, so all take the same path. ``fallback="never"`` / ``"always"`` force a path.

Non-finite buffers (``nonfinite``): "raise" makes every rank raise NonFiniteStepError naming the step
and the offending rank(s) right after the lengths exchange; "skip" returns a result with
``skipped=True`` on every rank, ``out`` zeroed, and the residual restored from ``backup`` (pass a
float32 buffer like the residual: it receives a copy of the residual before encoding; without it only
the offending rank's residual is untouched).

``exchange`` blocks; ``exchange_async`` returns a torch.futures.Future chained on asynchronous
collectives (for DDP comm hooks). Pipelined async exchanges on one group go through a Channel, which
launches each payload gather in the order the exchanges were started, on a private copy of the group,
so every rank issues collectives in the same order whatever order the lengths arrive in.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from gradshare import ops
from gradshare.message import BITMAP, FORMAT_NAMES, HEADER_WORDS, NONFINITE, SPARSE
from gradshare.ops import NonFiniteError

META_WORDS = 4          # per rank in the lengths gather: words, format, n, count (or first bad index)
FALLBACKS = ("auto", "never", "always")
POLICIES = ("raise", "skip")


class NonFiniteStepError(NonFiniteError):
    """A rank's residual + update held NaN or Inf during an exchange; raised on every rank."""

    def __init__(self, step: Optional[int], ranks: List[int], indices: List[int], name: str = "buffer"):
        where = f"step {step}" if step is not None else "exchange"
        detail = ", ".join(f"rank {r} (element {i})" for r, i in zip(ranks, indices))
        FloatingPointError.__init__(
            self, f"{where}, {name}: non-finite gradient/update (NaN or Inf) on {detail}; every rank stops "
                  "here (use nonfinite='skip' to drop such steps instead)")
        self.index = indices[0] if indices else -1
        self.step, self.ranks, self.indices, self.name = step, list(ranks), list(indices), name


@dataclass
class ExchangeResult:
    """What one exchange did. ``out`` holds the decoded mean (or sum) unless ``skipped``."""
    out: torch.Tensor
    format: str                 # "sparse", "bitmap" (largest message), "dense" (fallback) or "skipped"
    world: int
    n: int
    tau: float                  # this rank's tau
    words: List[int]            # message words per rank
    counts: List[int]           # entries sent per rank
    formats: List[int]          # message format per rank (message.SPARSE / BITMAP / NONFINITE)
    bytes_sent: int             # per rank, ring model (lengths + payload)
    dense_bytes: int            # per rank, a dense fp32 ring allreduce of the buffer
    nonfinite_ranks: List[int] = field(default_factory=list)
    message: Optional[torch.Tensor] = None   # this rank's own encoded message (None for a skipped step)

    @property
    def skipped(self) -> bool:
        return self.format == "skipped"

    @property
    def count(self) -> int:
        """Mean entries sent per rank (rounded down): what every rank's threshold observes."""
        return sum(self.counts) // max(1, len(self.counts))

    @property
    def density(self) -> float:
        return self.count / self.n if self.n else 0.0

    @property
    def message_format(self) -> int:
        """BITMAP if any rank sent a bitmap, else SPARSE (what thresholds observe)."""
        return BITMAP if BITMAP in self.formats else SPARSE


# ---------------------------------------------------------------------------------------------------
# Cost model
# ---------------------------------------------------------------------------------------------------

def dense_allreduce_bytes(n: int, world: int) -> int:
    """Bytes one rank sends in a ring allreduce of n fp32 elements."""
    return (2 * (world - 1) * 4 * n) // world if world > 1 else 0


def gather_bytes(max_words: int, world: int) -> int:
    """Bytes one rank sends: the lengths all-gather plus the padded int32 all-gather."""
    return (world - 1) * (8 * META_WORDS + 4 * max_words)


def prefers_dense(max_words: int, n: int, world: int) -> bool:
    """True when the padded gather would move more than a dense allreduce (W * L > 2 * n)."""
    return world > 1 and world * max_words > 2 * n


# ---------------------------------------------------------------------------------------------------
# The stages
# ---------------------------------------------------------------------------------------------------

def _gather_fn():
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Exchange:
    """One exchange in flight: the stages share this object."""

    def __init__(self, update, residual, tau, out, group, average, clip, format, fallback, backup, nonfinite,
                 step, name):
        if fallback not in FALLBACKS:
            raise ValueError(f"fallback: expected one of {FALLBACKS}, got {fallback!r}")
        if nonfinite not in POLICIES:
            raise ValueError(f"nonfinite: expected one of {POLICIES}, got {nonfinite!r}")
        if not isinstance(update, torch.Tensor) or not isinstance(residual, torch.Tensor):
            raise TypeError("update and residual: expected torch tensors")
        self.update = update.view(-1)
        self.residual = residual.view(-1)
        self.out = self.update if out is None else out
        if self.out.numel() != self.update.numel():
            raise ValueError(f"out: {self.out.numel()} elements but update has {self.update.numel()}")
        if backup is not None and (backup.numel() != self.residual.numel() or backup.dtype != torch.float32):
            raise ValueError("backup: must be a float32 buffer the size of the residual")
        self.group, self.average, self.clip, self.format = group, average, clip, format
        self.fallback, self.backup, self.nonfinite, self.step, self.name = fallback, backup, nonfinite, step, name
        self.world = dist.get_world_size(group)
        self.tau = float(tau)
        self.n = self.update.numel()
        self.device = self.update.device

    # stage 1: encode locally, prepare the lengths row
    def encode(self) -> torch.Tensor:
        if self.backup is not None:
            self.backup.copy_(self.residual)
        self.msg = ops.encode(self.update, self.residual, self.tau, clip=self.clip, format=self.format,
                              on_nonfinite="flag")
        meta = torch.empty(META_WORDS, dtype=torch.int64, device=self.msg.device)
        meta[0] = self.msg.numel()
        meta[1:4].copy_(self.msg[1:4])
        self.meta_all = torch.empty(self.world * META_WORDS, dtype=torch.int64, device=self.msg.device)
        return meta

    # stage 2: read everyone's lengths, decide the path (or stop on a non-finite step)
    def plan(self) -> Optional[ExchangeResult]:
        table = self.meta_all.view(self.world, META_WORDS).tolist()
        self.words = [r[0] for r in table]
        self.formats = [r[1] for r in table]
        ns = [r[2] for r in table]
        self.counts = [r[3] for r in table]
        if len(set(ns)) != 1:
            raise ValueError(f"{self.name}: ranks exchange buffers of different sizes {ns}: every rank must "
                             "pass the same buffer layout")
        bad = [r for r, f in enumerate(self.formats) if f == NONFINITE]
        if bad:
            if self.backup is not None:
                self.residual.copy_(self.backup)
            if self.nonfinite == "raise":
                raise NonFiniteStepError(self.step, bad, [self.counts[r] for r in bad], self.name)
            self.out.zero_()
            return self._result("skipped", 0, bad)
        self.max_words = max(self.words)
        if self.fallback == "always":
            self.dense = True
        elif self.fallback == "never":
            self.dense = False
        else:
            self.dense = prefers_dense(self.max_words, self.n, self.world)
        return None

    # stage 3: launch the payload collective
    def launch(self, group, async_op: bool):
        if self.dense:
            ops.decode(self.residual, self.msg)          # residual := everything not yet applied
            return dist.all_reduce(self.residual, group=group, async_op=async_op)
        L = self.max_words
        if self.msg.numel() == L:
            row = self.msg
        else:
            row = torch.zeros(L, dtype=torch.int32, device=self.device)
            row[:self.msg.numel()] = self.msg
        self.rows = torch.empty(self.world * L, dtype=torch.int32, device=self.device)
        return _gather_fn()(self.rows, row, group=group, async_op=async_op)

    # stage 4: decode into out
    def finish(self) -> ExchangeResult:
        scale = 1.0 / self.world if self.average else 1.0
        if self.dense:
            if scale != 1.0:
                self.residual.mul_(scale)
            self.out.copy_(self.residual)
            self.residual.zero_()
            return self._result("dense", dense_allreduce_bytes(self.n, self.world) + gather_bytes(0, self.world))
        if self.out.dtype == torch.float32 and self.out.is_contiguous():
            dst = self.out.view(-1)
            dst.zero_()
        else:
            dst = torch.zeros(self.n, dtype=torch.float32, device=self.device)
        ops.decode(dst, self.rows.view(self.world, self.max_words), scale=scale)
        if dst is not self.out and dst.data_ptr() != self.out.data_ptr():
            self.out.copy_(dst.view_as(self.out))
        fmt = FORMAT_NAMES[BITMAP if BITMAP in self.formats else SPARSE]
        return self._result(fmt, gather_bytes(self.max_words, self.world))

    def _result(self, fmt: str, sent: int, bad=None) -> ExchangeResult:
        if fmt == "skipped":
            sent = gather_bytes(0, self.world)
        return ExchangeResult(out=self.out, format=fmt, world=self.world, n=self.n, tau=self.tau,
                              words=self.words, counts=self.counts, formats=self.formats, bytes_sent=sent,
                              dense_bytes=dense_allreduce_bytes(self.n, self.world),
                              nonfinite_ranks=list(bad or []), message=None if bad else self.msg)


def zero_sent(target: torch.Tensor, result: ExchangeResult) -> None:
    """Zero ``target`` (flat, the exchanged buffer's size) where this rank's message of ``result`` sent.

    After a dense-fallback step everything was sent: all of ``target`` is zeroed; after a skipped step
    nothing is. Used for momentum factor masking (Deep Gradient Compression): the local velocity of
    elements that were just sent starts again from zero.
    """
    t = target.view(-1)
    if result.skipped:
        return
    if result.format == "dense":
        t.zero_()
        return
    msg = result.message
    fmt, count = int(msg[1]), int(msg[3])
    if count == 0:
        return
    if fmt == SPARSE:
        idx = msg[HEADER_WORDS:HEADER_WORDS + count].abs().long() - 1
        t.index_fill_(0, idx.to(t.device), 0.0)
    else:
        sent = torch.zeros(t.numel(), dtype=torch.float32, device=t.device)
        ops.decode(sent, msg)
        t.masked_fill_(sent != 0, 0.0)


def exchange(update: torch.Tensor, residual: torch.Tensor, tau: float, *, out: Optional[torch.Tensor] = None,
             group=None, average: bool = True, clip: Optional[float] = None, format: str = "auto",
             fallback: str = "auto", backup: Optional[torch.Tensor] = None, nonfinite: str = "raise",
             step: Optional[int] = None, name: str = "buffer") -> ExchangeResult:
    """Blocking exchange of one flat buffer; returns an ExchangeResult (``result.out`` holds the mean).

    Args:
        update: flat float32/fp16/bf16 buffer to share (a gradient or an optimizer update).
        residual: this rank's float32 residual for that buffer (error feedback), updated in place.
        tau: this rank's threshold. clip: residual clipping factor for this step (ResidualClipping).
        out: where the decoded result goes (default: ``update``, in place). average: mean (scale 1/W)
            or sum. format: message format for encode. fallback: "auto" / "never" / "always" dense path.
        backup, nonfinite, step, name: non-finite handling and error text (see the module docstring).

    Every rank of ``group`` must call it with a buffer of the same size, in the same order as its
    other collectives on ``group``.
    """
    ex = _Exchange(update, residual, tau, out, group, average, clip, format, fallback, backup, nonfinite,
                   step, name)
    meta = ex.encode()
    _gather_fn()(ex.meta_all, meta, group=group)
    skipped = ex.plan()
    if skipped is not None:
        return skipped
    ex.launch(group, async_op=False)
    return ex.finish()


class Channel:
    """Orders the payload collectives of pipelined async exchanges on one process group.

    Exchanges take a ticket when started (on the caller's thread, so in the same order on every rank);
    their payload collectives are launched in ticket order on a private group with the same ranks, so
    lengths that complete in a different order on different ranks cannot reorder the collectives.
    Create one per process group and pipeline (ThresholdState keeps its own); not picklable.
    """

    def __init__(self, group=None):
        self.group = group
        self._payload_group = None
        self._lock = threading.RLock()
        self._issued = 0
        self._next = 0
        self._ready: Dict[int, Callable[[], None]] = {}

    def payload_group(self):
        if self._payload_group is None:
            ranks = dist.get_process_group_ranks(self.group or dist.group.WORLD)
            self._payload_group = dist.new_group(ranks, use_local_synchronization=True)
        return self._payload_group

    def ticket(self) -> int:
        with self._lock:
            t = self._issued
            self._issued += 1
            return t

    def launch(self, ticket: int, fn: Optional[Callable[[], None]]) -> None:
        """Runs ``fn`` (or nothing) once every earlier ticket has launched or given up."""
        with self._lock:
            self._ready[ticket] = fn
            while self._next in self._ready:
                f = self._ready.pop(self._next)
                self._next += 1
                if f is not None:
                    f()

    def __getstate__(self):
        raise TypeError("Channel holds process groups and cannot be pickled")


_default_channels: Dict[int, Channel] = {}


def default_channel(group=None) -> Channel:
    key = id(group) if group is not None else 0
    ch = _default_channels.get(key)
    if ch is None or ch.group is not group:
        ch = _default_channels[key] = Channel(group)
    return ch


def exchange_async(update: torch.Tensor, residual: torch.Tensor, tau: float, *,
                   out: Optional[torch.Tensor] = None, group=None, average: bool = True,
                   clip: Optional[float] = None, format: str = "auto", fallback: str = "auto",
                   backup: Optional[torch.Tensor] = None, nonfinite: str = "raise", step: Optional[int] = None,
                   name: str = "buffer", channel: Optional[Channel] = None) -> torch.futures.Future:
    """Non-blocking exchange: encodes now, returns a Future[ExchangeResult] chained on async collectives.

    Same arguments as ``exchange``; ``channel`` (default: one per group) orders pipelined exchanges.
    The lengths gather goes on ``group`` (launched here, on the caller's thread); the payload gather on the
    channel's private group (launched when the lengths arrive). Errors (NonFiniteStepError, a failed
    collective) are set on the returned future: ``wait()`` raises them on every rank.
    """
    ch = channel if channel is not None else default_channel(group)
    if channel is not None and group is None:
        group = ch.group
    ex = _Exchange(update, residual, tau, out, group, average, clip, format, fallback, backup, nonfinite,
                   step, name)
    payload_group = ch.payload_group()
    meta = ex.encode()
    ticket = ch.ticket()
    result: torch.futures.Future = torch.futures.Future()

    def fail(e: BaseException) -> None:
        if not result.done():
            result.set_exception(e)

    def on_payload(fut) -> None:
        try:
            fut.value()
            result.set_result(ex.finish())
        except BaseException as e:  # noqa: BLE001  (must complete the future whatever happens)
            fail(e)

    def go() -> None:
        try:
            ex.launch(payload_group, async_op=True).get_future().then(on_payload)
        except BaseException as e:  # noqa: BLE001
            fail(e)

    def on_lengths(fut) -> None:
        launched = False
        try:
            fut.value()
            skipped = ex.plan()
            if skipped is None:
                launched = True
                ch.launch(ticket, go)
            else:
                launched = True
                ch.launch(ticket, None)
                result.set_result(skipped)
        except BaseException as e:  # noqa: BLE001
            if not launched:
                ch.launch(ticket, None)
            fail(e)

    try:
        work = _gather_fn()(ex.meta_all, meta, group=group, async_op=True)
    except BaseException:
        ch.launch(ticket, None)
        raise
    work.get_future().then(on_lengths)
    return result
