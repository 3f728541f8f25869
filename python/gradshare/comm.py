"""The exchange: every rank encodes its buffer, all ranks receive every message, all decode.

One exchange of a flat buffer of n elements over W ranks, with an encoder (a gradshare.compression policy):

1. encode: the policy writes this rank's message and keeps what it did not send in the residual (error
   feedback). A non-finite buffer yields a non-finite marker and leaves the residual as it was;
2. for policies whose messages vary in length (Strom's +-tau): one small all-gather of 4 int64 per rank
   (message words, format, n, count), which also carries the non-finite flag. Top-k and ternary messages
   have a length every rank can compute, so they skip this round;
3. payload: ONE all-gather of the messages as int32 rows (zero-padded to the longest when lengths vary;
   gloo aborts on unequal sizes), on the device of the buffer (gloo for CPU tensors, NCCL for CUDA ones);
4. decode: every rank checks the gathered headers (a non-finite marker from any rank stops the step on
   every rank at once), then adds every rank's message in rank order, so every rank gets bitwise the same
   result. ``average=True`` (default) scales by 1/W: out is the MEAN of what the ranks sent (what DDP and
   gradient averaging expect); ``average=False`` gives the sum (DL4J's rule).

Cost: per rank, a ring all-gather of W rows of L words sends (W-1)*4*L bytes (+ (W-1)*32 for the lengths
round when there is one); a dense fp32 ring allreduce of n elements sends 2*(W-1)/W*4*n bytes.

Dense fallback (``fallback="auto"``): the gather is used only while W*L <= 2*n, i.e. while it moves no
more than a dense ring allreduce. Otherwise the step is an fp32 allreduce of residual + update (which
then holds everything not yet applied), and the residual is zeroed. For fixed-length messages this is
known before encoding; for Strom's, all ranks decide from the same gathered lengths. Either way all ranks
take the same path. ``fallback="never"`` / ``"always"`` force a path.

Non-finite buffers (``nonfinite``): "raise" makes every rank raise NonFiniteStepError naming the step
and the offending rank(s); "skip" returns a result with ``skipped=True`` on every rank, ``out`` zeroed,
and the residual restored from ``backup`` (pass a float32 buffer like the residual: it receives a copy of
the residual before encoding; without it only the offending rank's residual is untouched). With ``kept``
(a float32 buffer like the residual) what is not sent goes there and the residual is only read: any
exchange that does not complete leaves it as it was, at no cost (gradshare.sharing swaps the two after
each step).

``exchange`` blocks; ``exchange_async`` returns a torch.futures.Future chained on asynchronous
collectives (for DDP comm hooks). Pipelined async exchanges of varying length on one group go through a
Channel, which launches each payload gather in the order the exchanges were started, on a private copy
of the group, so every rank issues collectives in the same order whatever order the lengths arrive in.
Fixed-length exchanges launch their one gather at once, in call order, and need no channel.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from gradshare import message as msgfmt
from gradshare import ops
from gradshare.process_group import chain
from gradshare._deprecation import RenamedAttribute, renamed_kwargs
from gradshare.costmodel import allgather_bytes, fixed_allgather_bytes, ring_allreduce_bytes
from gradshare.message import (BITMAP, FAILED, FORMAT_NAMES, HEADER_WORDS, LENGTHS_WORDS, NONFINITE, SPARSE,
                               TERNARY, TOPK_FORMATS)
from gradshare.ops import NonFiniteError

FALLBACKS = ("auto", "never", "always")
POLICIES = ("raise", "skip")


class NonFiniteStepError(NonFiniteError):
    """A rank's residual + update held NaN or Inf during an exchange; raised on every rank."""

    def __init__(self, step: Optional[int], ranks: List[int], indices: List[int], name: str = "buffer"):
        where = f"step {step}" if step is not None else "exchange"
        detail = ", ".join(f"rank {r}" + (f" (element {i})" if i >= 0 else "") for r, i in zip(ranks, indices)) \
            or "a rank"
        FloatingPointError.__init__(
            self, f"{where}, {name}: non-finite gradient/update (NaN or Inf) on {detail}; every rank stops "
                  "here (use nonfinite='skip' to drop such steps instead)")
        self.index = indices[0] if indices else -1
        self.step, self.ranks, self.indices, self.name = step, list(ranks), list(indices), name


class ExchangeAbortedError(RuntimeError):
    """A rank's encoder raised during an exchange; raised on every rank at that exchange (on the rank that
    failed, with its own exception as ``__cause__``), with every rank's residual as it was before."""

    def __init__(self, step: Optional[int], ranks: List[int], name: str = "buffer", detail: str = ""):
        where = f"step {step}" if step is not None else "exchange"
        who = ", ".join(f"rank {r}" for r in ranks)
        super().__init__(f"{where}, {name}: {who} could not encode its update{detail}; every rank stops here")
        self.step, self.ranks, self.name = step, list(ranks), name


@dataclass
class ExchangeResult:
    """What one exchange did. ``out`` holds the decoded mean (or sum) unless ``skipped``, or, from an exchange
    started with ``apply_later=True``, is None: :meth:`subtract_from` then decodes the mean into a buffer."""
    out: Optional[torch.Tensor]
    format: str                 # "sparse", "bitmap" (largest message), "topk", "ternary", "dense" (fallback)
                                # or "skipped"
    world: int
    n: int
    tau: Optional[float]        # this rank's tau (+-tau schemes only)
    words: List[int]            # message words per rank
    counts: List[int]           # entries sent per rank
    formats: List[int]          # message format per rank (message.SPARSE / BITMAP / NONFINITE)
    bytes_sent: int             # per rank, ring model (lengths + payload)
    dense_bytes: int            # per rank, a dense fp32 ring allreduce of the buffer
    nonfinite_ranks: List[int] = field(default_factory=list)
    message: Optional[torch.Tensor] = None   # this rank's own encoded message (None for a skipped step)
    pending: Optional[Callable[[torch.Tensor], None]] = field(default=None, repr=False)

    @property
    def skipped(self) -> bool:
        return self.format == "skipped"

    def subtract_from(self, dst: torch.Tensor) -> None:
        """``apply_later``: ``dst -= the decoded mean`` (a float32 buffer of ``n`` elements), in one pass over what
        was sent (a sparse message adds its entries into ``dst``, scaled by minus the mean's scale: no buffer
        of the mean is zeroed, filled and subtracted). Call it once, and only for a step that was not skipped."""
        if self.pending is None:
            raise RuntimeError("subtract_from: not an exchange started with apply_later=True, or applied already")
        pending, self.pending = self.pending, None
        pending(dst)

    @property
    def count(self) -> int:
        """Mean entries sent per rank (rounded down): what every rank's threshold observes."""
        return sum(self.counts) // max(1, len(self.counts))

    @property
    def density(self) -> float:
        return self.count / self.n if self.n else 0.0

    @property
    def message_format(self) -> int:
        """BITMAP if any rank sent a bitmap, else SPARSE (what +-tau thresholds observe)."""
        return BITMAP if BITMAP in self.formats else SPARSE


class _TauEncoder:
    """The +-tau encoder behind ``exchange(update, residual, tau)`` (gradshare.compression.Strom's rule)."""

    def __init__(self, tau: float, clip: Optional[float], format: str):
        self.tau, self.clip, self.format = float(tau), clip, format

    def words(self, n: int, step) -> None:
        return None

    def encode(self, update, residual, step, kept=None, velocity=None):
        return ops.encode(update, residual, self.tau, clip=self.clip, format=self.format, on_nonfinite="flag",
                          kept=kept, **ops.momentum_kwargs(velocity))


# ---------------------------------------------------------------------------------------------------
# Path choice (the bytes of each path: gradshare.costmodel)
# ---------------------------------------------------------------------------------------------------

def prefers_dense(max_words: int, n: int, world: int) -> bool:
    """True when the padded gather would move more than a dense allreduce (W * L > 2 * n)."""
    return world > 1 and world * max_words > 2 * n


# ---------------------------------------------------------------------------------------------------
# The stages
# ---------------------------------------------------------------------------------------------------

def settle(device: torch.device) -> None:
    """Waits for the work queued on ``device``'s current stream (nothing on a CPU). A CUDA collective's future
    runs its callbacks with a side stream current, so what a callback queues there (the decode into the
    result's buffer) would still be running when a plain future hands the buffer to a thread whose stream
    knows nothing of it: every callback that produces a result for another thread settles first."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def all_gather_fn():
    """torch's all-gather into one flat tensor under its current name (every gradshare all-gather uses it)."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Exchange:
    """One exchange in flight: the stages share this object."""

    def __init__(self, update, residual, encoder, step, out, group, average, fallback, backup, nonfinite, name,
                 kept=None, velocity=None, apply_later=False):
        if fallback not in FALLBACKS:
            raise ValueError(f"fallback: expected one of {FALLBACKS}, got {fallback!r}")
        if nonfinite not in POLICIES:
            raise ValueError(f"nonfinite: expected one of {POLICIES}, got {nonfinite!r}")
        if not isinstance(update, torch.Tensor) or not isinstance(residual, torch.Tensor):
            raise TypeError("update and residual: expected torch tensors")
        self.update = update.view(-1)
        self.residual = residual.view(-1)
        # apply_later: the mean is decoded by the result's subtract_from, into a buffer the caller names then
        self.apply_later = bool(apply_later)
        if self.apply_later and out is not None:
            raise ValueError("out: an exchange with apply_later=True writes no out (result.subtract_from does)")
        self.out = None if self.apply_later else (self.update if out is None else out)
        if self.out is not None and self.out.numel() != self.update.numel():
            raise ValueError(f"out: {self.out.numel()} elements but update has {self.update.numel()}")
        if backup is not None and (backup.numel() != self.residual.numel() or backup.dtype != torch.float32):
            raise ValueError("backup: must be a float32 buffer the size of the residual")
        if kept is not None and (kept.numel() != self.residual.numel() or kept.dtype != torch.float32):
            raise ValueError("kept: must be a float32 buffer the size of the residual")
        # Where what is not sent goes: the residual itself, or `kept` (the residual is then only read, so a
        # failed exchange leaves it as it was without a backup).
        self.kept = self.residual if kept is None else kept.view(-1)
        if self.kept is not self.residual:
            backup = None
        # A fused momentum (velocity, m, velocity_out): the encoders take m * velocity + update and write the
        # new velocity, 0 where sent, to velocity_out; a dense exchange sends everything (velocity_out all 0).
        if velocity is not None and self.kept is self.residual:
            raise ValueError("velocity: a fused momentum needs kept= (the residual and velocity are then only read)")
        self.velocity = velocity
        self.encoder, self.step, self.group, self.average = encoder, step, group, average
        self.fallback, self.backup, self.nonfinite, self.name = fallback, backup, nonfinite, name
        self.world = dist.get_world_size(group)
        self.n = self.update.numel()
        self.device = self.update.device
        self.tau = getattr(encoder, "tau", None)
        self.fixed = encoder.words(self.n, step)          # None: message lengths vary (lengths round)
        self.dense = False
        if self.fixed is not None:                       # known before encoding, the same on every rank
            self.dense = self.world > 1 and (fallback == "always" or
                                             (fallback == "auto" and prefers_dense(self.fixed, self.n, self.world)))

    # stage 1: encode locally; returns the lengths row (varying lengths) or None (fixed: no lengths round).
    # If the encoder raises, this rank sends a failed marker instead (so no rank waits for a message that
    # never comes) and raises ExchangeAbortedError with every other rank once the gather is done.
    def encode(self) -> Optional[torch.Tensor]:
        self.error: Optional[BaseException] = None
        if self.backup is not None:
            self.backup.copy_(self.residual)
        if self.dense:                                    # fixed-length policy past the crossover
            update = self.update
            if self.velocity is not None:
                v, m, v_out = self.velocity
                update = torch.mul(v, m, out=v_out).add_(self.update)
            torch.add(self.residual, update, out=self.kept)
            if self.velocity is not None:
                v_out.zero_()
            self.msg = None
            return None
        try:
            if self.kept is self.residual:
                self.msg = self.encoder.encode(self.update, self.residual, self.step)
            elif self.velocity is None:
                self.msg = self.encoder.encode(self.update, self.residual, self.step, kept=self.kept)
            else:
                self.msg = self.encoder.encode(self.update, self.residual, self.step, kept=self.kept,
                                               velocity=self.velocity)
            if self.fixed is not None and self.msg.numel() != self.fixed:
                raise RuntimeError(f"{self.name}: encoder wrote {self.msg.numel()} words, expected {self.fixed}")
        except Exception as e:  # noqa: BLE001  (every rank must reach the gather; raised after it)
            self.error = e
            if self.backup is not None:
                self.residual.copy_(self.backup)
            self.msg = msgfmt.failed_marker(self.n, self.device, self.fixed or HEADER_WORDS)
        if self.fixed is not None:
            self.max_words = self.fixed
            return None
        meta = torch.empty(LENGTHS_WORDS, dtype=torch.int64, device=self.msg.device)
        meta[0] = self.msg.numel()
        meta[1:4].copy_(self.msg[1:4])
        self.meta_all = torch.empty(self.world * LENGTHS_WORDS, dtype=torch.int64, device=self.msg.device)
        return meta

    # stage 2 (varying lengths only): read everyone's lengths, decide the path (or stop on a non-finite step)
    def plan(self) -> Optional[ExchangeResult]:
        table = self.meta_all.view(self.world, LENGTHS_WORDS).tolist()
        self.words = [r[0] for r in table]
        self.formats = [r[1] for r in table]
        ns = [r[2] for r in table]
        self.counts = [r[3] for r in table]
        if len(set(ns)) != 1:
            raise ValueError(f"{self.name}: ranks exchange buffers of different sizes {ns}: every rank must "
                             "pass the same buffer layout")
        self._check_failed()
        bad = [r for r, f in enumerate(self.formats) if f == NONFINITE]
        if bad:
            return self._nonfinite(bad, [self.counts[r] for r in bad])
        self.max_words = max(self.words)
        if self.fallback == "always":
            self.dense = True
        elif self.fallback == "never":
            self.dense = False
        else:
            self.dense = prefers_dense(self.max_words, self.n, self.world)
        return None

    def _check_failed(self) -> None:
        failed = [r for r, f in enumerate(self.formats) if f == FAILED]
        if failed:
            if self.backup is not None:
                self.residual.copy_(self.backup)
            detail = f" ({type(self.error).__name__}: {self.error})" if self.error is not None else ""
            raise ExchangeAbortedError(self.step, failed, self.name, detail) from self.error

    def _nonfinite(self, bad: List[int], indices: List[int]) -> ExchangeResult:
        if self.backup is not None:
            self.residual.copy_(self.backup)
        if self.nonfinite == "raise":
            raise NonFiniteStepError(self.step, bad, indices, self.name)
        if self.out is not None:
            self.out.zero_()
        return self._result("skipped", 0, bad)

    # stage 3: launch the payload collective
    def launch(self, group, async_op: bool):
        if self.dense:
            if self.msg is not None:
                ops.decode(self.kept, self.msg)          # kept := everything not yet applied
                if self.velocity is not None:
                    self.velocity[2].zero_()             # ... all of it sent now
            return dist.all_reduce(self.kept, group=group, async_op=async_op)
        L = self.max_words
        if self.msg.numel() == L:
            row = self.msg
        else:
            row = torch.zeros(L, dtype=torch.int32, device=self.device)
            row[:self.msg.numel()] = self.msg
        self.rows = torch.empty(self.world * L, dtype=torch.int32, device=self.device)
        return all_gather_fn()(self.rows, row, group=group, async_op=async_op)

    # stage 4: decode into out
    def finish(self) -> ExchangeResult:
        scale = 1.0 / self.world if self.average else 1.0
        if self.dense:
            if self.fixed is not None:
                self.words, self.formats = [0] * self.world, [-1] * self.world
                self.counts = [self.n] * self.world
                if any_nonfinite([self.kept]).item():   # the same sum on every rank
                    return self._nonfinite([], [])
            if scale != 1.0:
                self.kept.mul_(scale)
            lengths = allgather_bytes(self.world, 0) if self.fixed is None else 0
            if self.apply_later:                          # kept holds the mean until it is applied
                kept = self.kept

                def apply(dst: torch.Tensor) -> None:
                    dst.view(-1).sub_(kept)
                    kept.zero_()                          # everything was sent: nothing waits

                return self._result("dense", ring_allreduce_bytes(self.world, self.n) + lengths, pending=apply)
            self.out.copy_(self.kept)
            self.kept.zero_()
            return self._result("dense", ring_allreduce_bytes(self.world, self.n) + lengths)
        rows = self.rows.view(self.world, self.max_words)
        if self.fixed is not None:
            heads = rows[:, :HEADER_WORDS].tolist()
            self.words = [self.fixed] * self.world
            self.formats = [h[1] for h in heads]
            self.counts = [_entries(h, self.n) for h in heads]
            self._check_failed()
            bad = [r for r, f in enumerate(self.formats) if f == NONFINITE]
            if bad:
                return self._nonfinite(bad, [heads[r][3] for r in bad])
        ops.validate(rows, self.n, scale=scale)          # a rejected message leaves out as it was
        fmt = (FORMAT_NAMES[self.formats[0]] if self.fixed is not None
               else FORMAT_NAMES[BITMAP if BITMAP in self.formats else SPARSE])
        sent = (fixed_allgather_bytes(self.world, self.fixed) if self.fixed is not None
                else allgather_bytes(self.world, self.max_words))
        if self.apply_later:
            def apply(dst: torch.Tensor) -> None:
                ops.decode(dst.view(-1), rows, scale=-scale)

            return self._result(fmt, sent, pending=apply)
        if self.out.dtype == torch.float32 and self.out.is_contiguous():
            dst = self.out.view(-1)
            dst.zero_()
        else:
            dst = torch.zeros(self.n, dtype=torch.float32, device=self.device)
        ops.decode(dst, rows, scale=scale)
        if dst is not self.out and dst.data_ptr() != self.out.data_ptr():
            self.out.copy_(dst.view_as(self.out))
        return self._result(fmt, sent)

    def _result(self, fmt: str, sent: int, bad=None, pending=None) -> ExchangeResult:
        if fmt == "skipped":
            sent = allgather_bytes(self.world, 0) if self.fixed is None else fixed_allgather_bytes(self.world, self.fixed)
        return ExchangeResult(out=self.out, format=fmt, world=self.world, n=self.n, tau=self.tau,
                              words=self.words, counts=self.counts, formats=self.formats, bytes_sent=sent,
                              dense_bytes=ring_allreduce_bytes(self.world, self.n),
                              nonfinite_ranks=list(bad or []), message=None if bad is not None else self.msg,
                              pending=pending)


def _entries(head: List[int], n: int) -> int:
    """Entries a fixed-length message carries, from its header."""
    if head[1] in TOPK_FORMATS:
        return msgfmt.topk_entries(n, head[3], head[4])
    if head[1] == TERNARY:
        return head[4]
    return 0


def scale_nonfinite(t: torch.Tensor, scale: float) -> torch.Tensor:
    """``t *= scale`` in place, and in the same pass the test of :func:`any_nonfinite` (a 1-element float
    tensor on t's device, 1 when t held a NaN or Inf). One read and one write of ``t``, where scaling and
    then checking would read it twice: the all-reduce of a mean gradient divides after summing, as DDP
    without a hook divides while copying into its bucket. Uses torch's fused GradScaler kernel (float32 and
    float64, CPU and CUDA); other dtypes and sparse tensors (an nn.Embedding(sparse=True)'s gradient) scale,
    then check."""
    if t.dtype in (torch.float32, torch.float64) and not t.is_sparse:
        found = torch.zeros(1, dtype=torch.float32, device=t.device)
        torch._amp_foreach_non_finite_check_and_unscale_(
            [t], found, torch.full((1,), scale, dtype=torch.float32, device=t.device))
        return found
    return any_nonfinite([t.mul_(scale)])


def round_bf16(flat: torch.Tensor, rounding: torch.Tensor, scale: float,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The message of a bfloat16 all-reduce with error feedback (gradshare.link): ``flat * scale + rounding``
    rounded to bfloat16 (returned; written into ``out``, a bfloat16 tensor of ``flat``'s size, where given, so that
    a message with more in it needs no copy), and ``rounding`` (float32, ``flat``'s size) set to what the rounding
    left out, for the next step's message: over steps every rank sends what it has, nothing is lost to the
    rounding. No temporary: the sum is formed in ``rounding`` itself, and rounded into the message. Where a value is not finite,
    its NaN or Inf goes out in the message (the mean shows it, and the step is dropped or raises as any other)
    and its rounding is 0: none is kept for later steps."""
    message = torch.empty(flat.shape, dtype=torch.bfloat16, device=flat.device) if out is None else out
    if message.dtype != torch.bfloat16 or message.numel() != flat.numel():
        raise ValueError(f"round_bf16: out should be a bfloat16 tensor of {flat.numel()} elements, "
                         f"got {message.dtype} of {message.numel()}")
    v = rounding.view(flat.shape)
    v.add_(flat, alpha=scale)
    message.view(flat.shape).copy_(v)
    v.sub_(message.view(flat.shape))               # float32 minus its bfloat16 rounding, computed in float32
    rounding.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    return message


def any_nonfinite(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A 1-element float tensor on the tensors' device: 1 when any of them holds a NaN or Inf, else 0.

    On CPU one sum per tensor is the test (a sum is finite only when every element is): about 30x faster
    than ``isfinite().all()``, which writes a mask as large as the tensor. A sum that is not finite, which
    finite values that overflow can also give, is then checked element by element. On GPUs the element
    test is bandwidth-bound and needs no host sync, so it is used directly. A sparse tensor is tested by its
    stored values."""
    ts = [t.detach()._values() if t.is_sparse else t.detach() for t in tensors]
    if not ts:
        return torch.zeros(1)
    if ts[0].device.type == "cpu":
        sums = torch.stack([t.sum(dtype=torch.promote_types(t.dtype, torch.float32)).double() for t in ts])
        if bool(torch.isfinite(sums).all()):
            return torch.zeros(1)
    return (~torch.stack([torch.isfinite(t).all() for t in ts])).any().float().reshape(1)


_CHECKED_BY_SCALER_KERNEL = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def grads_nonfinite(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """:func:`any_nonfinite` of gradients, in one multi-tensor pass per device and dtype: torch's GradScaler
    kernel, as ``GradScaler.unscale_`` runs it on them, with a scale of 1 (each value is written back as it is,
    NaN, Inf, -0 and subnormals included). A model of many small tensors paid one sum per tensor for the
    test (a transformer's 54: 0.36 ms against 0.13 on one CPU core; on a GPU, two kernels per tensor against one
    per group). What that kernel does not take goes through :func:`any_nonfinite`: sparse gradients, a gradient
    that is part of a graph (``create_graph=True``: no in-place write may touch it), tensor subclasses, other
    dtypes."""
    groups: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}
    rest = []
    for g in grads:
        if type(g) is not torch.Tensor or g.is_sparse or g.requires_grad or g.dtype not in _CHECKED_BY_SCALER_KERNEL:
            rest.append(g)
        else:
            groups.setdefault((g.device, g.dtype), []).append(g)
    flags = [any_nonfinite(rest)] if rest else []
    for (device, _), ts in groups.items():
        found = torch.zeros(1, dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(ts, found, torch.ones(1, dtype=torch.float32, device=device))
        flags.append(found)
    if not flags:
        return torch.zeros(1)
    if len(flags) == 1:
        return flags[0]
    device = flags[0].device
    return torch.stack([f.to(device).reshape(()) for f in flags]).amax().reshape(1)


def _make(update, residual, tau, encoder, clip, format, step, out, group, average, fallback, backup, nonfinite,
          name, kept=None, velocity=None, apply_later=False) -> _Exchange:
    if (tau is None) == (encoder is None):
        raise TypeError("exchange: pass either tau (+-tau threshold encoding) or encoder= (a compression policy)")
    if encoder is None:
        encoder = _TauEncoder(tau, clip, format)
    return _Exchange(update, residual, encoder, step if step is not None else 0, out, group, average, fallback,
                     backup, nonfinite, name, kept, velocity, apply_later)


@renamed_kwargs(group="process_group")
def exchange(update: torch.Tensor, residual: torch.Tensor, tau: Optional[float] = None, *,
             encoder=None, out: Optional[torch.Tensor] = None, process_group=None, average: bool = True,
             clip: Optional[float] = None, format: str = "auto", fallback: str = "auto",
             backup: Optional[torch.Tensor] = None, nonfinite: str = "raise", step: Optional[int] = None,
             name: str = "buffer", kept: Optional[torch.Tensor] = None) -> ExchangeResult:
    """Blocking exchange of one flat buffer; returns an ExchangeResult (``result.out`` holds the mean).

    Args:
        update: flat float32/fp16/bf16 buffer to share (a gradient or an optimizer update).
        residual: this rank's float32 residual for that buffer (error feedback), updated in place.
        tau: this rank's threshold for +-tau encoding (clip: residual clipping factor; format: message
            format). Or ``encoder``: a gradshare.compression policy (TopK, Ternary, Strom), given ``step``.
        out: where the decoded result goes (default: ``update``, in place). average: mean (scale 1/W)
            or sum. fallback: "auto" / "never" / "always" dense path.
        backup, nonfinite, step, name: non-finite handling and error text (see the module docstring).
        kept: a float32 buffer like the residual that receives what is not sent (error feedback); the
            residual is then only read, so an exchange that fails leaves it as it was (no backup needed).

    Every rank of ``process_group`` (None: the default group; ``group`` is its former name) must call it
    with a buffer of the same size, in the same order as its other collectives on that group.
    """
    ex = _make(update, residual, tau, encoder, clip, format, step, out, process_group, average, fallback, backup,
               nonfinite, name, kept)
    meta = ex.encode()
    if meta is not None:
        all_gather_fn()(ex.meta_all, meta, group=process_group)
        skipped = ex.plan()
        if skipped is not None:
            return skipped
    ex.launch(process_group, async_op=False)
    return ex.finish()


class Channel:
    """Orders the payload collectives of pipelined async exchanges on one process group.

    Exchanges take a ticket when started (on the caller's thread, so in the same order on every rank);
    their payload collectives are launched in ticket order on a private group with the same ranks, so
    lengths that complete in a different order on different ranks cannot reorder the collectives.
    Create one per process group and pipeline (ThresholdState keeps its own); not picklable.

    The channel references its groups weakly: ``dist.destroy_process_group()`` must be able to free them
    (a group kept alive past it keeps its backend threads running into interpreter shutdown, see
    gradshare.process_group). After a destroy and a new ``init_process_group`` the private group is
    created again.
    """

    @renamed_kwargs(group="process_group")
    def __init__(self, process_group=None):
        self._group = None if process_group is None else weakref.ref(process_group)
        self._payload_group = None
        self._lock = threading.RLock()
        self._issued = 0
        self._next = 0
        self._ready: Dict[int, Callable[[], None]] = {}

    @property
    def process_group(self):
        """The group exchanged over (None: the default group)."""
        if self._group is None:
            return None
        g = self._group()
        if g is None:
            raise RuntimeError("Channel: its process group was destroyed")
        return g

    def payload_group(self):
        g = self._payload_group() if self._payload_group is not None else None
        if g is None:
            ranks = dist.get_process_group_ranks(self.process_group or dist.group.WORLD)
            g = dist.new_group(ranks, use_local_synchronization=True)
            self._payload_group = weakref.ref(g)   # torch's registry owns it until destroy_process_group()
        return g

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

    group = RenamedAttribute("process_group")


# One channel per group for exchange_async calls without a channel; keyed weakly so that a destroyed
# group is not kept alive by its channel.
_default_channel: Optional[Channel] = None
_group_channels: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@renamed_kwargs(group="process_group")
def default_channel(process_group=None) -> Channel:
    """The channel exchange_async uses on ``process_group`` when given none (one per group)."""
    global _default_channel
    if process_group is None:
        if _default_channel is None:
            _default_channel = Channel(None)
        return _default_channel
    ch = _group_channels.get(process_group)
    if ch is None:
        ch = _group_channels[process_group] = Channel(process_group)
    return ch


@renamed_kwargs(group="process_group")
def exchange_async(update: torch.Tensor, residual: torch.Tensor, tau: Optional[float] = None, *,
                   encoder=None, out: Optional[torch.Tensor] = None, process_group=None, average: bool = True,
                   clip: Optional[float] = None, format: str = "auto", fallback: str = "auto",
                   backup: Optional[torch.Tensor] = None, nonfinite: str = "raise", step: Optional[int] = None,
                   name: str = "buffer", channel: Optional[Channel] = None,
                   kept: Optional[torch.Tensor] = None, velocity=None,
                   apply_later: bool = False) -> torch.futures.Future:
    """Non-blocking exchange: encodes now, returns a Future[ExchangeResult] chained on async collectives.

    Same arguments as ``exchange``, and ``velocity``: None, or (velocity, m, velocity_out) to encode
    m * velocity + update instead of the update, the new velocity (0 where sent) written to velocity_out in
    the same kernel (Deep Gradient Compression's momentum correction; needs ``kept``). ``apply_later``: no
    ``out``; the messages are checked when they arrive and the result's ``subtract_from(dst)`` decodes the
    mean into ``dst`` (minus it), once the caller knows every exchange of its step succeeded (all or nothing). Fixed-length messages (TopK, Ternary) are gathered at once, on
    ``process_group``, in call order. Varying-length ones first gather the lengths on ``process_group``
    (launched here, on the caller's thread) and then the payload on ``channel``'s private group (default: one
    channel per group), launched in call order when the lengths arrive. Errors (NonFiniteStepError, a failed
    collective) are set on the returned future: ``wait()`` raises them on every rank.
    """
    ex = _make(update, residual, tau, encoder, clip, format, step, out, process_group, average, fallback, backup,
               nonfinite, name, kept, velocity, apply_later)
    result: torch.futures.Future = torch.futures.Future()

    def fail(e: BaseException) -> None:
        try:
            settle(ex.device)
        except BaseException:  # noqa: BLE001  (the error being reported is the one that matters)
            pass
        if not result.done():
            result.set_exception(e)

    def on_payload(fut) -> None:
        try:
            fut.value()
            done = ex.finish()
            settle(ex.device)
            result.set_result(done)
        except BaseException as e:  # noqa: BLE001  (must complete the future whatever happens)
            fail(e)

    if ex.fixed is not None:
        ex.encode()
        chain(ex.launch(process_group, async_op=True).get_future(), on_payload)
        return result

    ch = channel if channel is not None else default_channel(process_group)
    if channel is not None and process_group is None:
        process_group = ex.group = ch.process_group
    payload_group = ch.payload_group()
    meta = ex.encode()
    ticket = ch.ticket()

    def go() -> None:
        try:
            chain(ex.launch(payload_group, async_op=True).get_future(), on_payload)
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
                settle(ex.device)
                result.set_result(skipped)
        except BaseException as e:  # noqa: BLE001
            if not launched:
                ch.launch(ticket, None)
            fail(e)

    try:
        work = all_gather_fn()(ex.meta_all, meta, group=process_group, async_op=True)
    except BaseException:
        ch.launch(ticket, None)
        raise
    chain(work.get_future(), on_lengths)
    return result
