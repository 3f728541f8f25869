"""The sharing core: one bucket's error-feedback exchange and one step of all of them, written once.

SharedOptimizer (gradshare.optim) and the DDP hook (gradshare.hooks) hold a :class:`Sharing`: it owns the
buckets' state (residual, the policy that encodes them, optional velocity) and runs a step of
them. The hook adds only DDP's bucket mapping and futures; SharedOptimizer only its modes.

What is shared each step:

- **updates** (the default when gradshare knows the optimizer): every rank runs the user's optimizer on
  its own gradient; the change that step made to the parameters is encoded with error feedback, and every
  rank puts its parameters back and applies the same decoded mean of all ranks' changes. The optimizer
  is the user's, unchanged: its learning rate, momentum (Nesterov too), weight decay, Adam moments and
  any scheduler act as they would alone, on the local gradient, and what is shared is what it decided.
  For SGD with momentum this is Deep Gradient Compression's momentum correction (the residual
  accumulates velocity-driven updates, not raw gradients; its factor masking, for the elements that waited
  and swung back, on by default: gradshare.momentum_masking); for Adam it avoids feeding the second moment
  gradients that arrive in rare large bursts. Optimizer state stays local (it differs between ranks);
  parameters stay bitwise identical. With plain or momentum SGD and nothing held back, the mean of the
  ranks' updates is exactly the synchronous step.
- **gradients**: each rank's gradient is encoded with error feedback and replaced by the decoded mean
  before the optimizer runs (the same on every rank); what a DDP hook does when it cannot see the optimizer.

Error feedback: the residual holds what was not sent yet; the policy (gradshare.compression) decides what
to send of residual + update. With ``error_feedback="model"`` (the default sharing updates at once:
:func:`default_error_feedback`) each rank's parameters are the mean result minus its residual, so that its
gradients see what waits (:class:`Sharing`'s argument; the ranks'
parameters then differ until :meth:`Sharing.merge` or a link-aware all-reduce step; with ``show_mean``, which the
DDP hook and SharedOptimizer set, only inside a step: between steps they show the mean result). Non-finite
values (``nonfinite``): "raise" stops every rank with NonFiniteStepError; "skip" drops the step on every rank.

All or nothing: a step either completes on every rank or changes no state. Whatever stops it (a
non-finite value, a rank whose encoder raised, a message the decoder rejects, a failed or timed-out
collective), every bucket's residual and velocity, the policies, the step counter and (updates) the
parameters are as they were, bitwise, and the error is raised on every rank that reaches it. This costs
no copy: each bucket has two residual buffers. The encoder reads residual + update and writes what it
does not send into the spare one (``kept``), so the residual is never written during an exchange; a
completed step swaps the two, a failed one leaves them (velocities likewise).

Link-aware steps (``link``, gradshare.link): sharing updates with the default compression, a step on
which the link makes compressing slower averages the gradients by one float32 all-reduce per bucket
instead (DDP's step, bit for bit) and every rank's optimizer steps on that mean; the first such step after
compressed ones applies the mean residual and averages the optimizer states, so the ranks' states and
parameters are equal again. Every rank takes the same path at the same step.

One step late (``delay=1``, DL4J's asynchronous flavour; sharing updates, compressing every step): a step's
exchange is launched at its end and collected at the end of the next step, so that it travels while the
next step computes. Every rank applies step t's decoded mean at the end of step t+1 (each rank's own
update of step t is not applied alone), so replicas stay identical and each gradient is one update stale.
:meth:`Sharing.flush` applies what is still travelling (before an evaluation, or at the end of training);
a checkpoint holds the arrived mean, so a resumed run goes on as the uninterrupted one would.

Agreement: before a bucket's first exchange (and after DDP rebuilds its buckets) the ranks all-gather a
32-byte digest of their configuration: gradshare's version, world size, mode, compression policy and its
parameters, reduce / nonfinite / fallback / momentum, and the bucket's layout (shapes and dtypes in
order). Ranks that differ raise ConfigurationMismatchError on every rank, naming each field and the
values. Nothing is added to later steps.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import time
import weakref
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from gradshare import comm, momentum_masking as masking, ops, optimizer_state, second_moment
from gradshare.comm import ExchangeResult, NonFiniteStepError, exchange_async
from gradshare.compression import Compression, Dense, as_compression, for_optimizer
from gradshare.costmodel import Link, ring_allreduce_bytes
from gradshare.link import ALLREDUCE, ALLREDUCE_BF16, MODEL_MARGIN, LinkAware
from gradshare.sparse_moments import EVERY as SPARSE_MOMENTS_EVERY, SparseMoments
from gradshare.stats import Statistics, StepRecord, residual_norm

NONFINITE = ("raise", "skip")
PROBE_ELEMENTS = 1 << 18    # the link probe's largest all-reduce: 1 MiB of float32 (gradshare.link)
REDUCE = ("mean", "sum")
ERROR_FEEDBACK = ("buffer", "model")    # pseudo-gradients: where what a round did not send waits (Sharing)


def default_error_feedback(mode: str, delay: int = 0, optimizer: Optional[torch.optim.Optimizer] = None) -> str:
    """Where what a step does not send waits when the user does not say: in each rank's own model ("model")
    wherever updates are shared at once (the DDP hook with ``optimizer=``, SharedOptimizer) over float32 or
    float64 parameters: on every workload of bench/quality.py (SGD, Adam and AdamW; CNNs, an MLP, transformer and
    LSTM LMs, regressions) its default compression ends within 0.21 points of DDP's accuracy and 0.7% of its LM
    losses at 85-87x fewer bytes, where the residual buffer needs Adam's updates ternary-coded (16x) to keep up
    (README, "Training quality"). In the residual ("buffer") where the model cannot hold it: gradients shared
    (the optimizer steps on their mean), a step applied late (``delay=1``), and parameters of a half type (a
    bfloat16 parameter rounds away what waits below its last bit, so its rank's model would be the mean result
    with nothing kept back)."""
    if mode != "updates" or delay:
        return "buffer"
    params = [p for g in (optimizer.param_groups if optimizer is not None else ()) for p in g["params"]]
    if any(p.dtype not in (torch.float32, torch.float64) for p in params):
        return "buffer"
    return "model"


# Cores showing the mean result between steps whose ranks' own models go back on at the next forward that trains
# (Sharing.show_mean), and the global forward pre-hook that does it, registered only while one waits.
_WAITING: "weakref.WeakSet[Sharing]" = weakref.WeakSet()
_wear_hook: List[Any] = []


def _wear_at_forward(module: torch.nn.Module, args: Any) -> None:
    """The first forward that trains (a module in training mode, gradients enabled) after a step, of a module
    that holds parameters a waiting core shares: that core's rank puts its own model back on, before the module
    computes anything (the model's first module with parameters, or the DDP module around it). Another model's
    forward (a second model sharing in the same process: a GAN's, a run resumed beside the first) leaves it be."""
    if module.training and torch.is_grad_enabled():
        for sh in list(_WAITING):
            if any(id(p) in sh._param_ids for p in module.parameters()):
                sh.wear_own()
        _stop_waiting(None)                  # also when the cores that waited are gone


def _wait_for_forward(sh: "Sharing") -> None:
    _WAITING.add(sh)
    if not _wear_hook:
        _wear_hook.append(torch.nn.modules.module.register_module_forward_pre_hook(_wear_at_forward))


def _stop_waiting(sh: Optional["Sharing"]) -> None:
    if sh is not None:
        _WAITING.discard(sh)
    if not _WAITING and _wear_hook:
        _wear_hook.pop().remove()


def _supersede(params: set) -> None:
    """A new core now shares parameters (ids) that a waiting core shows its mean result in (a script that wraps
    the model in a new DDP with a new state, as it must to change its optimizer): the old core no longer puts its
    own model back on at a forward, so the new core starts from the mean result, the same on every rank. The old
    core, if stepped again, still puts its own model on first (Sharing.begin_updates)."""
    for old in [sh for sh in _WAITING if sh._param_ids & params]:
        _stop_waiting(old)


class ConfigurationMismatchError(RuntimeError):
    """Ranks that share a bucket run different configurations (raised on every rank, naming what differs)."""


class Bucket:
    """One group of parameters exchanged as one flat float32 buffer, and its sharing state."""

    def __init__(self, index: int, params: Sequence[torch.Tensor], compression: Compression):
        self.index = index
        self.params = list(params)          # strong references keep ids used as keys valid
        self.numels = [p.numel() for p in self.params]
        self.offsets, off = [], 0
        for k in self.numels:
            self.offsets.append(off)
            off += k
        self.n = off
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.residual = torch.zeros(self.n, dtype=torch.float32, device=self.device)
        self.compression = compression
        self.agreed = False                                   # configuration digest checked with every rank
        self.in_step = False                                  # its exchange started and has not ended yet
        self.spare = torch.empty_like(self.residual)          # what this step's exchange keeps: the next residual
        self.velocity: Optional[torch.Tensor] = None          # momentum correction in gradshare (momentum=m)
        self.velocity_spare: Optional[torch.Tensor] = None
        self._buffer: Optional[torch.Tensor] = None
        self._flat: Optional[torch.Tensor] = None
        self.snapshot: Optional[torch.Tensor] = None          # parameters before the local step (updates)
        self.mean: Optional[torch.Tensor] = None              # delay=1: the decoded mean still to be applied
        self.launched: Optional[torch.Tensor] = None          # an overlapped round: the parameters at its launch
        self.last_sent: Optional[torch.Tensor] = None         # int8 per element: gradshare.momentum_masking
        self.start_held = False                               # error_feedback="model", updates: snapshot is the mean result
        self._slice_cache: Dict[int, Tuple[torch.Tensor, int, List[torch.Tensor]]] = {}

    @property
    def buffer(self) -> torch.Tensor:
        """A float32 work buffer: the bucket's ``n`` elements (:attr:`flat`), then one per parameter (whether
        it has a gradient, all-reduced with the gradients so that every rank knows whether any rank has one)."""
        if self._buffer is None:
            self._buffer = torch.empty(self.n + len(self.params), dtype=torch.float32, device=self.device)
            self._flat = self._buffer[:self.n]
        return self._buffer

    @property
    def flat(self) -> torch.Tensor:
        """A float32 work buffer of the bucket's size (the front of :attr:`buffer`)."""
        if self._flat is None:
            _ = self.buffer
        return self._flat

    def views(self, flat: torch.Tensor) -> Iterable[Tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, its slice of ``flat`` shaped like it) for each parameter."""
        return zip(self.params, self._slices(flat))

    def _slices(self, flat: torch.Tensor) -> List[torch.Tensor]:
        # Slicing costs two tensor ops per parameter and every step makes several passes, which a model of
        # many small tensors feels: the slices of the bucket's own buffers (residual, snapshot, ...) are kept
        # while the buffer is one of them, checked by identity and address (a buffer replaced on load or
        # resized drops its entry); any other tensor is sliced afresh.
        hit = self._slice_cache.get(id(flat))
        if hit is not None and hit[0] is flat and hit[1] == flat.data_ptr():
            return hit[2]
        out = [flat[o:o + k].view_as(p) for p, o, k in zip(self.params, self.offsets, self.numels)]
        owned = (self.residual, self.spare, self.snapshot, self._flat, self.mean, self.launched)
        if any(flat is t for t in owned):
            self._slice_cache = {i: e for i, e in self._slice_cache.items() if any(e[0] is t for t in owned)}
            self._slice_cache[id(flat)] = (flat, flat.data_ptr(), out)
        return out

    def float32(self) -> bool:
        """Whether every parameter is float32 now (the buffers' dtype: copies to and from them round nothing)."""
        return bool(self.params) and all(p.dtype == torch.float32 for p in self.params)

    # The copies below are one multi-tensor call when they can be (torch._foreach_copy_: a fused kernel on
    # CUDA, one C++ loop on CPU), the same single pass over memory as one copy per parameter.
    @torch.no_grad()
    def gather_grads(self, out: torch.Tensor) -> torch.Tensor:
        grads = [p.grad for p in self.params]
        if grads and all(g is not None and not g.is_sparse for g in grads):
            torch._foreach_copy_(self._slices(out), grads)
            return out
        for g, v in zip(grads, self._slices(out)):
            if g is None:
                v.zero_()
            else:
                v.copy_(g.to_dense() if g.is_sparse else g)
        return out

    def grads_present(self) -> torch.Tensor:
        """1.0 for each parameter that has a gradient here, 0.0 for one whose ``grad`` is None."""
        return torch.tensor([float(p.grad is not None) for p in self.params], device=self.device)

    @torch.no_grad()
    def gather_params(self, out: torch.Tensor) -> torch.Tensor:
        if self.params:
            torch._foreach_copy_(self._slices(out), self.params)
        return out

    @torch.no_grad()
    def set_params(self, flat: torch.Tensor) -> None:
        if self.params:
            torch._foreach_copy_(self.params, self._slices(flat))

    @torch.no_grad()
    def change(self, out: torch.Tensor) -> torch.Tensor:
        """``out`` = :attr:`snapshot` - the parameters now (this rank's update), in one pass per parameter."""
        for (p, v), (_, s) in zip(self.views(out), self.views(self.snapshot)):
            torch.sub(s, p, out=v)
        return out

    @torch.no_grad()
    def set_params_before_minus(self, change: torch.Tensor) -> None:
        """Every parameter set to :attr:`snapshot` - ``change`` (the mean update), in one pass per parameter."""
        for (p, c), (_, s) in zip(self.views(change), self.views(self.snapshot)):
            torch.sub(s, c, out=p.detach())

    @torch.no_grad()
    def set_params_own(self, read: bool = False) -> None:
        """``error_feedback="model"``: every parameter set to :attr:`snapshot` - :attr:`residual` (the rank's own
        model: the mean result minus what the rank has not sent), in one pass per parameter. ``read``: the
        snapshot was just read from the parameters, so float32 ones hold it already and only lose the residual
        (one multi-tensor call, the same bits)."""
        if read and self.float32():
            torch._foreach_sub_(self.params, self._slices(self.residual))
            return
        for (p, r), (_, s) in zip(self.views(self.residual), self.views(self.snapshot)):
            torch.sub(s, r, out=p.detach())

    def grads_float32(self, present: Sequence[bool]) -> bool:
        """Whether every parameter has a dense float32 gradient here and on some rank (``present``): then
        gradients can be written from a float32 buffer in place (gradshare.ops.scale_into)."""
        return all(present) and all(p.grad is not None and p.grad.dtype == torch.float32 and not p.grad.is_sparse
                                    and p.grad.device == self.device for p in self.params)

    def set_grads(self, flat: torch.Tensor, present: Optional[Sequence[bool]] = None) -> None:
        """Gradients from ``flat``. A parameter whose entry in ``present`` is False had no gradient on any
        rank: its ``grad`` stays None, so the optimizer leaves it untouched as torch does (no weight decay,
        no state), on every rank alike."""
        if all(p.grad is not None and not p.grad.is_sparse for p in self.params) and \
                (present is None or all(present)):
            if self.params:
                with torch.no_grad():
                    torch._foreach_copy_([p.grad for p in self.params], self._slices(flat))
            return
        for i, (p, v) in enumerate(self.views(flat)):
            if present is not None and not present[i]:
                continue
            if p.grad is None:
                p.grad = v.to(p.dtype).clone()
            elif p.grad.is_sparse:     # stays sparse (SparseAdam needs it): the rows any rank had, mean
                p.grad = v.to(p.dtype).to_sparse(p.grad.sparse_dim())
            else:
                p.grad.copy_(v)


# bucket_cap_mb=None (SharedOptimizer, ThresholdState): a quarter of the shared parameters' float32 size, at least
# AUTO_BUCKET_MIN_MB and at most DDP's 25. A step's exchanges start after the optimizer's step, one bucket after the
# other: in one bucket the link waits while the whole update is encoded and the CPU while the whole message
# travels; in a few, the next bucket is encoded while the last one travels. Models under 8 MiB keep one bucket
# (each exchange has a latency of its own, and so does each bucket's pass in Python), large ones DDP's size.
AUTO_BUCKET_MIN_MB = 8.0
AUTO_BUCKET_MAX_MB = 25.0


def auto_bucket_cap_mb(params: Sequence[torch.Tensor]) -> float:
    """The bucket size ``bucket_cap_mb=None`` gives ``params`` (those that need gradients), in fp32 MiB."""
    total = sum(p.numel() for p in params if p.requires_grad) * 4 / 2**20
    return min(AUTO_BUCKET_MAX_MB, max(AUTO_BUCKET_MIN_MB, total / 4))


def group_parameters(params: Iterable[torch.Tensor], cap_mb: Optional[float]) -> List[List[torch.Tensor]]:
    """Parameters that need gradients, in order, into buckets of one device and dtype of at most ``cap_mb``
    MiB of float32 each (a larger parameter gets a bucket of its own; None: :func:`auto_bucket_cap_mb`)."""
    params = list(params)
    if cap_mb is None:
        cap_mb = auto_bucket_cap_mb(params)
    cap = max(1, int(cap_mb * 2**20 / 4))
    seen, open_, done = set(), {}, []
    for p in params:
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        key = (p.device, p.dtype)
        cur = open_.setdefault(key, [])
        if cur and sum(q.numel() for q in cur) + p.numel() > cap:
            done.append(cur)
            cur = open_[key] = []
        cur.append(p)
    done.extend(v for v in open_.values() if v)
    return done


class SharingFront:
    """What the objects a user holds (ThresholdState, SharedOptimizer) read from their ``sharing`` core."""

    sharing: "Sharing"

    @property
    def stats(self) -> Statistics:
        """Per-step statistics of the exchanges (gradshare.stats)."""
        return self.sharing.stats

    @property
    def step_skipped(self) -> bool:
        """True when the last step was dropped on every rank (nonfinite="skip")."""
        return self.sharing.step_skipped

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has sent so far (gradshare.stats.ReportsTraffic)."""
        return self.sharing.stats.bytes_sent

    @property
    def dense_bytes(self) -> int:
        """Bytes a float32 all-reduce at every step would have sent (gradshare.stats.ReportsTraffic)."""
        return self.sharing.stats.dense_bytes

    @property
    def compression(self) -> Compression:
        """The policy every bucket encodes with (gradshare.compression)."""
        return self.sharing.compression

    def flush(self) -> bool:
        """With ``delay=1``: applies the update still travelling now, on every rank (Sharing.flush)."""
        return self.sharing.flush()

    def merge(self) -> bool:
        """With ``error_feedback="model"``: every rank sends what it still holds back, uncompressed, so that the
        ranks' parameters become the same (Sharing.merge): before an evaluation that compares ranks, a
        checkpoint of one rank's model, or at the end of training. A collective; nothing to do otherwise."""
        ok = True
        for sh in getattr(self, "sharings", [self.sharing]):
            ok = sh.merge() and ok
        return ok

    @contextlib.contextmanager
    def mean_result(self):
        """With ``error_feedback="model"``: inside the block every rank's parameters are the round's mean result,
        the same bits on every rank, and each rank's own model again after it (Sharing.mean_result): evaluate
        or save the model the ranks hold alike without the collective of :meth:`merge`. Nothing changes
        otherwise."""
        with contextlib.ExitStack() as stack:
            for sh in getattr(self, "sharings", [self.sharing]):
                stack.enter_context(sh.mean_result())
            yield


class Sharing:
    """Error-feedback sharing of a set of buckets over a process group; one home for a bucket's step.

    Args:
        compression: a gradshare.compression policy (or a threshold, or None: the default for ``optimizer``,
            gradshare.compression.for_optimizer), cloned for every bucket.
        optimizer: the user's optimizer when known (picks the default compression).
        process_group: the group to share over (None: the default group).
        reduce: "mean" (default) or "sum" (DL4J) of the ranks' contributions.
        nonfinite: "raise" or "skip" (module docstring).
        fallback: "auto" / "never" / "always" dense allreduce (gradshare.comm).
        stats: a Statistics to record into (default: a new one).
        momentum: None, or m in [0, 1): keep a velocity u = m*u + g per bucket in gradshare and encode it
            (Deep Gradient Compression's momentum correction with factor masking), for a momentum-free
            optimizer in "gradients" mode. Not needed when updates are shared.
        clipping: DL4J's residual clipping for Strom policies (ResidualClipping or None).
        residual_decay: beta in (0, 1]: after each exchange what was held back is multiplied by beta, so it
            fades (SparseLoCo's decayed error feedback, for pseudo-gradients that are rare and
            large). 1 (default): plain error feedback.
        link: "auto" (default): link-aware (gradshare.link.LinkAware: a float32 all-reduce of gradients on
            steps where the link makes compression slower) when sharing updates with the default
            compression, mean reduce and fallback; None: always compress; a LinkAware: use it (updates).
        delay: 0 (default) or 1: each step's mean update applied at the end of the next step, its exchange
            overlapping that step (module docstring). Sharing updates only; it compresses every step (no link).
        error_feedback: where what a step (updates) or a round (pseudo-gradients) does not send waits. None
            (default): :func:`default_error_feedback` ("model" sharing updates with ``delay=0`` over float32/float64
            parameters, else "buffer").
            "buffer": in the bucket's residual, each rank's model set to the mean result, identical
            on every rank (SparseLoCo's for rounds); "model": in the rank's own model, which stays the mean
            result minus what the rank has not sent yet, so its next gradients are taken where its own
            progress brought it and its optimizer does not push again what waits (:meth:`residual_into_params`;
            the mean result, the same on every rank, is the buckets' ``snapshot``). Sharing updates every step,
            the ranks' models differ by what each holds back until :meth:`merge` or a link-aware all-reduce
            step (:meth:`make_consistent`) resets them: CSER's bifurcated models and error reset (Xie et al. 2020);
            ``show_mean`` shows the mean result in the parameters between steps.
        show_mean: with ``error_feedback="model"`` sharing updates every step (the DDP hook and SharedOptimizer set
            it): between steps every rank's parameters are the mean result, the same bits on every rank, so that a
            script evaluates and saves one model whatever rank it reads; the rank's own model (the mean result
            minus what it has not sent) is put back on by the first forward that trains (:meth:`wear_own`), or at
            the latest when the optimizer steps, so the training is the same, bit for bit. What a script writes to
            float32 parameters between steps (a clamp, a pruning mask) is kept: it is taken as the mean result.
        momentum_masking: sharing the updates of torch.optim.SGD or Adam's kin (Adam, AdamW, NAdam, RAdam,
            Adamax): zero its momentum (SGD's buffer, Adam's first moment) where an element that waited in the
            residual is sent the other way from its last send (gradshare.momentum_masking). None (default):
            where it applies by default (updates, ``delay=0``, ``error_feedback="buffer"``; SGD with a compression
            that holds something back, Adam's kin with top-k); True: for those optimizers with any compression, refused where it cannot
            apply; False: off.
        sparse_moments: sharing an adaptive optimizer's updates, every this many steps the ranks average its
            second moment of the parameters whose gradients are mostly zero (embedding tables: detected over the
            first steps; gradshare.sparse_moments); 0 or None: never. Not used by local steps.
    """

    def __init__(self, compression: Any = None, *, optimizer: Optional[torch.optim.Optimizer] = None,
                 process_group=None, reduce: str = "mean", nonfinite: str = "raise", fallback: str = "auto",
                 stats: Optional[Statistics] = None, momentum: Optional[float] = None, clipping=None,
                 mode: str = "gradients", residual_decay: float = 1.0, link: Any = "auto", delay: int = 0,
                 momentum_masking: Optional[bool] = None, error_feedback: Optional[str] = None,
                 show_mean: bool = False, sparse_moments: Optional[int] = SPARSE_MOMENTS_EVERY):
        if nonfinite not in NONFINITE:
            raise ValueError(f"nonfinite: expected 'raise' or 'skip', got {nonfinite!r}")
        if reduce not in REDUCE:
            raise ValueError(f"reduce: expected 'mean' or 'sum', got {reduce!r}")
        if momentum is not None and not 0.0 <= float(momentum) < 1.0:
            raise ValueError(f"momentum: expected None or a value in [0, 1), got {momentum}")
        if not 0.0 < float(residual_decay) <= 1.0:
            raise ValueError(f"residual_decay: expected a value in (0, 1], got {residual_decay}")
        if error_feedback is None:
            error_feedback = default_error_feedback(mode, delay, optimizer)
        if error_feedback not in ERROR_FEEDBACK:
            raise ValueError(f"error_feedback: expected None, 'buffer' or 'model', got {error_feedback!r}")
        if error_feedback == "model" and mode == "gradients":
            raise ValueError("error_feedback='model' keeps what a step did not send in each rank's own model: it "
                             "needs the optimizer's updates shared (optimizer=, SharedOptimizer's mode=\"updates\") "
                             "or local steps (gradshare.ParameterAveraging); gradients are averaged before the "
                             "optimizer steps")
        if error_feedback == "model" and delay:
            raise ValueError("error_feedback='model' applies each step's mean at once: use delay=0")
        if isinstance(delay, bool) or delay not in (0, 1):
            raise ValueError(f"delay: expected 0 or 1 (steps an update waits before it is applied), got {delay!r}")
        if delay and mode != "updates":
            raise ValueError("delay=1 applies the shared updates a step late: it needs mode=\"updates\" (an "
                             "optimizer), gradients must be averaged before the optimizer steps")
        if momentum_masking not in (None, True, False):
            raise ValueError("momentum_masking: expected None (where it applies), True or False, got "
                             f"{momentum_masking!r}")
        if momentum_masking and not (mode == "updates" and masking.applies(optimizer)):
            raise ValueError("momentum_masking=True masks the momentum of torch.optim.SGD or Adam's kin (Adam, AdamW, "
                             "NAdam, RAdam, Adamax) where updates are shared (that optimizer given), not "
                             f"{type(optimizer).__name__} in {mode} mode; sharing gradients, momentum= masks "
                             "gradshare's own velocity")
        if momentum_masking and delay:
            raise ValueError("momentum_masking=True needs what each step sent before its next step: use delay=0")
        if delay and isinstance(link, LinkAware):
            raise ValueError("delay=1 compresses every step: it cannot be combined with a LinkAware (pass link=None)")
        self.delay = int(delay)
        self._inflight: Optional[List[Tuple[Bucket, torch.futures.Future]]] = None   # delay=1: last step's exchanges
        self._arrived: Optional[bool] = None   # delay=1: they were collected; True: each bucket's ``mean`` is to apply
        self.residual_decay = float(residual_decay)
        self.error_feedback = error_feedback
        # Updates shared every step with what waits kept in each rank's model: the snapshot (the mean result,
        # the same on every rank) is held from one step's end to the next step's start.
        self.own_models = error_feedback == "model" and mode == "updates"
        self.show_mean = bool(show_mean) and self.own_models
        self._worn = True              # the parameters hold the rank's own model (or nothing is held back)
        self._param_ids: set = set()   # id() of every parameter the buckets hold (the forward pre-hook's test)
        self.optimizer = optimizer
        # Sharing an adaptive optimizer's updates (Adam's kin, RMSprop, Adagrad, Adadelta, Adamax, Adafactor):
        # each rank's step rescaled to the global batch's second moment (gradshare.second_moment); the steps
        # leave the optimizer's state as it is.
        self.global_second_moment = mode == "updates" and second_moment.applies(optimizer)
        self.rescale = second_moment.GlobalBatchStep(optimizer if self.global_second_moment else None)
        # ... and the second moment of mostly-zero gradients' parameters averaged now and then (module docstring)
        self.sparse_moments = SparseMoments(optimizer if self.global_second_moment else None, sparse_moments)
        chosen = as_compression(compression, clipping)
        self.compression = chosen or for_optimizer(optimizer, own_models=self.own_models)
        # The optimizer's momentum masked where an element that waited swung back (gradshare.momentum_masking):
        # by default where elements wait long (with Dense nothing waits, so nothing would be masked) in the
        # residual; not where they wait in the rank's model, whose gradients already see them (on the AdamW LM,
        # seed 0, the top 3% as signs ended 2.2168 with it, 2.1979 without: bench/results/own_model_tried).
        wanted = (mode == "updates" and not delay and not self.own_models
                  and masking.by_default(optimizer, self.compression)
                  if momentum_masking is None else momentum_masking)
        self.masking = masking.MomentumMasking(optimizer) if wanted else None
        self.process_group = process_group
        self.reduce = reduce
        self.nonfinite = nonfinite
        self.fallback = fallback
        self.momentum = None if momentum is None else float(momentum)
        self.mode = mode               # what the front end shares ("updates" / "gradients"): part of the agreement
        self.stats = stats if stats is not None else Statistics()
        self.step = 0                  # steps completed (the policies' step: warm-up, clipping)
        self.step_skipped = False
        self.buckets: List[Bucket] = []
        self.link = _resolve_link(link, chosen is None and mode == "updates" and reduce == "mean" and not delay
                                  and fallback == "auto" and momentum is None and self.residual_decay == 1.0, mode,
                                  self.own_models)
        if self.link is not None:
            self.link.steady_from, self.link.steady_ratio = _warm_up(self.compression)
            # A sparser message where the step waits on the link: only with what waits in each rank's model,
            # where the top 1% trained as well as DDP (README's quality table); in the residual buffer Adam's
            # kin lose there (top 1%: +6.3% of the LM's loss).
            self.link.scalable = self.own_models and self.compression.density_scalable
        # Optimizer states known equal on every rank (link-aware all-reduce steps); None: nothing has run yet.
        self._consistent: Optional[bool] = None
        self._sync_bytes = 0
        self._roundings: Dict[str, torch.Tensor] = {}   # the bfloat16 all-reduce's rounding errors (rounding)

    # ------------------------------------------------------------------------------------------ buckets
    @property
    def world_size(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group)

    @property
    def device(self) -> torch.device:
        """Where the buckets live (the CPU before there is one): the device of the small collectives."""
        return self.buckets[0].device if self.buckets else torch.device("cpu")

    def new_bucket(self, index: int, params: Sequence[torch.Tensor]) -> Bucket:
        b = Bucket(index, params, self.compression.clone())
        if self.momentum is not None:
            b.velocity = torch.zeros_like(b.residual)
            b.velocity_spare = torch.empty_like(b.residual)
        return b

    def build(self, params: Iterable[torch.Tensor], cap_mb: Optional[float] = 25.0) -> List[Bucket]:
        """Buckets for ``params`` (gradshare.sharing.group_parameters); replaces the current ones."""
        self.buckets = []
        self._param_ids = set()
        return self.extend(params, cap_mb)

    def extend(self, params: Iterable[torch.Tensor], cap_mb: Optional[float] = 25.0) -> List[Bucket]:
        """New buckets after the current ones for ``params`` (a parameter group added to the optimizer); a
        parameter some bucket holds already is refused."""
        held = {id(p) for b in self.buckets for p in b.params}
        params = list(params)
        again = [i for i, p in enumerate(params) if id(p) in held]
        if again:
            raise ValueError(f"parameters {again} of the new group are shared already (in an earlier group)")
        new = [self.new_bucket(len(self.buckets) + i, ps) for i, ps in enumerate(group_parameters(params, cap_mb))]
        self.buckets.extend(new)
        added = {id(p) for b in new for p in b.params}
        _supersede(added)                     # before this core holds them: it is not superseded by itself
        self._param_ids |= added
        return new

    # ------------------------------------------------------------------------------------- agreement
    def configuration(self, b: Bucket) -> Dict[str, Any]:
        """What every rank sharing bucket ``b`` must agree on (module docstring)."""
        from gradshare import __version__
        return {"gradshare version": __version__, "world size": self.world_size, "mode": self.mode,
                "compression": b.compression.config(), "reduce": self.reduce, "nonfinite": self.nonfinite,
                "fallback": self.fallback, "momentum": self.momentum, "residual decay": self.residual_decay,
                "error feedback": self.error_feedback,
                "second moment": "global batch" if self.global_second_moment else "own",
                "sparse moments": self.sparse_moments.config() if self.sparse_moments.active else None,
                "link": None if self.link is None else self.link.config(), "delay": self.delay, "bucket": b.index,
                "bucket layout": [f"{tuple(p.shape)} {str(p.dtype).replace('torch.', '')}" for p in b.params]}

    def agree(self, b: Bucket) -> None:
        """One all-gather of a digest of :meth:`configuration`; on a difference every rank gathers the full
        configurations and raises ConfigurationMismatchError naming each field that differs."""
        fields = self.configuration(b)
        raw = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).digest()
        mine = torch.frombuffer(bytearray(raw), dtype=torch.int64).to(b.device)
        world = self.world_size
        every = torch.empty(world * mine.numel(), dtype=torch.int64, device=b.device)
        comm.all_gather_fn()(every, mine, group=self.process_group)
        rows = every.view(world, -1).tolist()
        if all(r == rows[0] for r in rows):
            b.agreed = True
            return
        configs: List[Any] = [None] * world
        dist.all_gather_object(configs, fields, group=self.process_group)
        diffs = []
        for key in fields:
            values = [c.get(key) for c in configs]
            other = next((r for r, v in enumerate(values) if v != values[0]), None)
            if other is not None:
                diffs.append(f"{key}: rank 0 has {values[0]!r}, rank {other} has {values[other]!r}")
        raise ConfigurationMismatchError(
            f"bucket {b.index}: the ranks run different configurations; " + "; ".join(diffs or ["(unknown)"]) +
            ". Every rank must share the same model, optimizer setup and gradshare options.")

    def agree_all(self, buckets: Optional[Iterable[Bucket]] = None) -> None:
        """:meth:`agree` for every bucket (of ``buckets``) not agreed yet, in order, before a step's first
        collective: ranks that would run different collectives stop at the same all-gather instead."""
        for b in self.buckets if buckets is None else buckets:
            if not b.agreed:
                self.agree(b)

    # --------------------------------------------------------------------------------- one bucket's step
    def start(self, b: Bucket, update: torch.Tensor, out: Optional[torch.Tensor], name: str,
              apply_later: bool = False) -> torch.futures.Future:
        """Starts bucket ``b``'s exchange of ``update`` (decoded mean into ``out``; ``apply_later``: into nothing
        yet, the result's ``subtract_from`` applies it); a Future[ExchangeResult]. What is not sent goes to
        ``b.spare``: the residual is only read until :meth:`commit`."""
        if not b.agreed:
            self.agree(b)
        # Momentum correction: the encoders take u = m*u + g and write it, 0 where sent (factor masking), to the
        # spare velocity in the same kernel; commit() makes it the velocity.
        velocity = None if b.velocity is None else (b.velocity, self.momentum, b.velocity_spare)
        b.in_step = True
        scale = 1.0 if self.link is None else self.link.density_scale
        encoder = b.compression if scale == 1.0 else b.compression.scaled(scale)
        return exchange_async(update, b.residual, encoder=encoder, out=out, process_group=self.process_group,
                              average=self.reduce == "mean", fallback=self.fallback, nonfinite=self.nonfinite,
                              step=self.step, name=name, kept=b.spare, velocity=velocity,
                              apply_later=apply_later)

    def finish(self, results: Sequence[Tuple[Bucket, ExchangeResult]]) -> bool:
        """Ends a step once all its exchanges are done: adapts thresholds and records statistics, or, when any
        bucket was skipped, restores every bucket. Returns False when skipped."""
        skipped = any(r.skipped for _, r in results)
        want_norm = self.stats.wants_norm(self.step)
        extra, self._sync_bytes = self._sync_bytes, 0        # a link probe's, since the last record
        for b, r in results:
            if skipped:
                self.restore(b)
            else:
                self.commit(b)
                b.compression.observe(r.count, r.n, r.message_format)
            self.stats.add(StepRecord(step=self.step, bucket=b.index, n=r.n, tau=r.tau, count=r.count,
                                      density=r.density, format="skipped" if skipped else r.format,
                                      bytes_sent=r.bytes_sent + extra, dense_bytes=r.dense_bytes,
                                      residual_norm=residual_norm(b.residual) if (want_norm and not skipped)
                                      else None))
            extra = 0
        self.step_skipped = skipped
        if not skipped:
            self.step += 1
        self.stats.end_step()
        return not skipped

    def commit(self, b: Bucket) -> None:
        """A completed exchange: what the encoder kept (in the spare buffer) becomes the residual, faded by
        ``residual_decay`` for the next step (e = beta*e + update there); the new velocity likewise."""
        b.residual, b.spare = b.spare, b.residual
        if self.residual_decay != 1.0:
            b.residual.mul_(self.residual_decay)
        if b.velocity is not None:
            b.velocity, b.velocity_spare = b.velocity_spare, b.velocity
        b.in_step = False

    @staticmethod
    def restore(b: Bucket) -> None:
        """A bucket whose exchange failed or was skipped keeps its residual and velocity: they were not
        written (module docstring); only the step is marked over."""
        b.in_step = False

    def run(self, items: Sequence[Tuple[Bucket, torch.Tensor, Optional[torch.Tensor]]],
            apply_later: bool = False) -> List[Tuple[Bucket, ExchangeResult]]:
        """Exchanges (bucket, update, out) for every bucket (all launched, then all awaited); raises the first
        error after every exchange has ended, so no collective is left in flight, with every bucket restored."""
        return self.collect(self.launch(items, apply_later))

    def launch(self, items: Sequence[Tuple[Bucket, Any, Optional[torch.Tensor]]],
               apply_later: bool = False) -> List[Tuple[Bucket, Any]]:
        """Starts the exchange of (bucket, update, out) for every bucket, in order. An update may be a callable
        that makes it, called just before the bucket is encoded (while the buckets before it travel). A launch
        that fails leaves its error in place of its future, and none after it is started (:meth:`collect`
        raises it)."""
        futures: List[Tuple[Bucket, Any]] = []
        self.agree_all(b for b, _, _ in items)
        for b, u, o in items:
            try:
                update = u() if callable(u) else u
                futures.append((b, self.start(b, update, o, f"bucket {b.index}", apply_later)))
            except BaseException as e:  # noqa: BLE001  (a launch failed: wait for those launched, restore all)
                futures.append((b, e))
                break
        return futures

    def collect(self, futures: Sequence[Tuple[Bucket, Any]]) -> List[Tuple[Bucket, ExchangeResult]]:
        """Waits for every exchange :meth:`launch` started; raises the first error once all have ended, with
        every bucket restored."""
        results, error = [], None
        for b, f in futures:
            if isinstance(f, BaseException):
                error = error or f
                continue
            try:
                results.append((b, f.wait()))
            except BaseException as e:  # noqa: BLE001  (wait for the rest before raising)
                error = error or e
        if error is not None:
            self.abandon([b for b, _ in futures])
            raise error
        return results

    def abandon(self, buckets: Iterable[Bucket]) -> None:
        """After a failed step: every bucket's residual and velocity as before the step (all or nothing)."""
        for b in buckets:
            self.restore(b)

    # ------------------------------------------------------------------------------ whole-step helpers
    def share_gradients(self) -> bool:
        """Replaces every bucket's gradients by the decoded mean. False when the step was skipped."""
        present = self.grads_present_anywhere()
        items = [(b, b.gather_grads(b.flat), b.flat) for b in self.buckets]
        if not self.finish(self.run(items)):
            return False
        for b, flags in zip(self.buckets, present):
            b.set_grads(b.flat, flags)
        return True

    def grads_present_anywhere(self) -> List[List[bool]]:
        """For each bucket, whether each parameter has a gradient on any rank: one all-reduce of one float
        per parameter (a parameter no rank has a gradient for is left alone by the optimizer, as in torch)."""
        flags = torch.cat([b.grads_present() for b in self.buckets]) if self.buckets else torch.zeros(0)
        if self.world_size > 1 and flags.numel():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.process_group)
        out, off, every = [], 0, (flags > 0).tolist()
        for b in self.buckets:
            out.append(every[off:off + len(b.params)])
            off += len(b.params)
        return out

    def begin_updates(self, buckets: Optional[Sequence[Bucket]] = None) -> None:
        """Before the optimizer's local step: remember every bucket's parameters (or those of ``buckets``). After
        all-reduce steps, the optimizer's second moment is made each rank's own again first
        (gradshare.second_moment.to_own)."""
        if self._consistent and self.global_second_moment:
            second_moment.to_own(self.optimizer, (p for b in self.buckets for p in b.params), self.world_size,
                                 self.rescale)
        self._consistent = False           # each rank's optimizer now steps on its own gradient
        self.wear_own()                    # show_mean: the optimizer steps the rank's own model
        for b in (self.buckets if buckets is None else buckets):
            if self.own_models and b.start_held:
                continue                   # the last step's mean result; the parameters are it minus the residual
            if b.snapshot is None:
                b.snapshot = torch.empty(b.n, dtype=torch.float32, device=b.device)
            b.gather_params(b.snapshot)
            if self.own_models:            # taken as the mean result (a first step, a checkpoint without one)
                b.start_held = True
                self.residual_into_params([b])

    def share_updates(self, outer: Optional[torch.optim.Optimizer] = None, share_grads: bool = False,
                      buckets: Optional[Sequence[Bucket]] = None, joined: bool = False) -> bool:
        """After the optimizer's local step(s): shares each bucket's change since :meth:`begin_updates` and
        sets every rank's parameters to (before - decoded mean change). With an ``outer`` optimizer over the
        buckets' parameters (DiLoCo), the parameters are set back to before and ``outer`` steps with the
        decoded mean change as their gradient (the gradients are put back afterwards); the same on every
        rank, so replicas stay identical. False when the step was skipped (parameters restored).
        ``share_grads``: this rank's gradients are not finite and its optimizer did not step; it shares them
        instead of a change, so that the exchange stops every rank (NonFiniteStepError, naming the element).
        With ``delay=1`` (:meth:`_share_updates_late`) the mean applied is the previous step's. ``buckets``: only
        those (a fragment of the model, gradshare.averaging's streaming rounds). ``joined``: this rank is out of
        inputs under torch's ``Join`` (``DDP.join()``, SharedOptimizer) and its optimizer did not step; it shares a zero update (its residual still
        goes out) and applies the same mean as the ranks still training."""
        if self.delay:
            return self._share_updates_late(share_grads, joined)
        bs = self.buckets if buckets is None else list(buckets)
        masked = self.masking is not None and outer is None and not (share_grads or joined)
        # Each bucket's update is made just before it is encoded (the buckets before it travel meanwhile), but
        # where momentum masking reads every update first.
        deltas = self._deltas(share_grads, bs, joined, lazy=not masked)
        watched = self.masking.before(bs, deltas) if masked else None
        # The mean result moves by the decoded mean: decoded straight into it (once every bucket's exchange is
        # in), where nothing else reads the mean.
        into_snapshot = self.own_models and outer is None and not watched
        items = [(b, d, None if into_snapshot else b.flat) for b, d in zip(bs, deltas)]
        try:
            results = self.run(items, apply_later=into_snapshot)
        except BaseException:
            self.restore_params(bs)
            if self.show_mean:
                self._await_forward()
            else:
                self.residual_into_params(bs)     # error_feedback="model": the rank's own start
            raise
        ok = self.finish(results)
        if ok and watched:
            self.masking.after(watched, results)
        if self.own_models and outer is None:
            for b, (_, r) in zip(bs, results):   # the mean result, then each rank's model minus what it kept
                if ok:
                    if into_snapshot:
                        r.subtract_from(b.snapshot)
                    else:
                        b.snapshot.sub_(b.flat)
                if self.show_mean:
                    b.set_params(b.snapshot)
                else:
                    b.set_params_own()
            if self.show_mean:
                self._await_forward()
        else:
            self._apply_mean(bs, [b.flat for b in bs], ok, outer)
        self._after_shared_step()
        self.link_step_ended()
        return ok

    def _after_shared_step(self) -> None:
        """After a step that shared updates, on every rank: the sparse parameters' second moments averaged when
        due (gradshare.sparse_moments; its bytes go into the next step's record)."""
        if self.sparse_moments.active:
            self._sync_bytes += self.sparse_moments.after_step([p for b in self.buckets for p in b.params],
                                                               self.step, self.process_group)

    def _apply_mean(self, buckets: Sequence[Bucket], means: Sequence[torch.Tensor], ok: bool,
                    outer: Optional[torch.optim.Optimizer]) -> None:
        """Each bucket's parameters set to its snapshot - the decoded mean change (``outer``: the outer
        optimizer's step on it from the snapshot); back to the snapshot when the step was skipped."""
        if ok and outer is not None:
            self.apply_outer(outer, buckets, means)
            return
        for b, m in zip(buckets, means):
            if ok:
                b.set_params_before_minus(m)               # before - mean update
            else:
                b.set_params(b.snapshot)

    def _deltas(self, share_grads: bool, buckets: Optional[Sequence[Bucket]] = None,
                joined: bool = False, lazy: bool = False) -> List[Any]:
        """Each bucket's update of this step in its ``flat`` buffer: the change since :meth:`begin_updates` (as
        Adam on the global batch would have made it), the gradients (``share_grads``), or zero (``joined``).
        ``lazy``: for each bucket a callable that makes it (:meth:`launch` calls them in turn)."""
        groups = second_moment.groups_of(self.optimizer) if self.global_second_moment and not share_grads else None

        def delta_of(b: Bucket) -> torch.Tensor:
            if joined:
                return b.flat.zero_()
            if share_grads:
                return b.gather_grads(b.flat)
            delta = b.change(b.flat)                      # before - after: this rank's update
            if self.error_feedback == "model":            # the rank's own start is snapshot - residual
                delta.sub_(b.residual)
            if groups is not None:                        # this rank's own step, made the global batch's
                self._to_global_batch(b, delta, groups)
            return delta

        bs = self.buckets if buckets is None else buckets
        if lazy:
            return [lambda b=b: delta_of(b) for b in bs]
        return [delta_of(b) for b in bs]

    def _land(self) -> None:
        """delay=1: waits for the last step's exchanges and ends that step (residuals committed, statistics);
        its decoded means stay in each bucket's ``mean`` until applied. Raises what stopped them (every
        bucket restored)."""
        if self._inflight is None:
            return
        inflight, self._inflight = self._inflight, None
        self._arrived = self.finish(self.collect(inflight))

    def _share_updates_late(self, share_grads: bool, joined: bool = False) -> bool:
        """delay=1: this step's updates are launched (into each bucket's ``mean``, read and written by
        nothing else until they land) and the parameters set to before this step - the last step's mean.
        Returns False when the last step's exchange was skipped (nothing applied for it)."""
        try:
            self._land()
        except BaseException:
            self.restore_params()
            raise
        arrived, self._arrived = self._arrived, None
        deltas = self._deltas(share_grads, joined=joined)
        for b in self.buckets:
            if arrived:
                b.set_params_before_minus(b.mean)
            else:
                b.set_params(b.snapshot)
            if b.mean is None:
                b.mean = torch.empty_like(b.residual)
        launched = self.launch([(b, d, b.mean) for b, d in zip(self.buckets, deltas)])
        if any(isinstance(f, BaseException) for _, f in launched):
            self.collect(launched)                # a launch failed: waits for the others and raises
        self._inflight = launched
        self._after_shared_step()
        return arrived is not False

    @torch.no_grad()
    def flush(self) -> bool:
        """delay=1: applies now, on every rank, the update still travelling (the last step's mean), so that
        the parameters hold every step taken: before an evaluation, a comparison between runs, or at the end
        of training. Nothing to do (True) without delay or when nothing travels. A collective: every rank
        calls it at the same point. False when that step was skipped."""
        self._land()
        arrived, self._arrived = self._arrived, None
        if arrived:
            for b in self.buckets:
                b.set_params(b.gather_params(b.flat).sub_(b.mean))
        return arrived is not False

    @torch.no_grad()
    def merge(self) -> bool:
        """``error_feedback="model"`` sharing updates: one exchange in which every rank sends its whole residual
        (Dense, float32) and no step of its own, so that every rank's parameters become the same mean result
        and every residual zero, as if each rank had sent all it held back. A collective: every rank calls it
        at the same point. Nothing to do (True) otherwise. False when the exchange was skipped (a non-finite
        residual with nonfinite="skip"; nothing changed)."""
        if not self.own_models or self.world_size <= 1 or not self.buckets:
            return True
        self.begin_updates()
        with self.uncompressed():
            return self.share_updates(joined=True)

    @contextlib.contextmanager
    def mean_result(self):
        """``error_feedback="model"`` sharing updates: inside the block every rank's parameters are the round's
        mean result (the buckets' ``snapshot``, the same bits on every rank), and after it the rank's own model
        again (snapshot - residual), also when the block raised. No collective: for reading the model that every
        rank holds alike (an evaluation, one rank's checkpoint) between steps; what the block writes to the
        parameters is not kept. Nothing changes otherwise."""
        held = [b for b in self.buckets if self.own_models and b.start_held]
        worn = self._worn
        self._read_shown()                        # show_mean: what a script wrote to the shown mean result counts
        self.restore_params(held)                 # Bucket's setters write under no_grad
        try:
            yield
        finally:
            for b in held:
                if worn:
                    b.set_params_own()
                else:
                    b.set_params(b.snapshot)      # show_mean, between steps: the mean result, as before the block

    @contextlib.contextmanager
    def uncompressed(self):
        """Inside the block every bucket encodes with Dense (float32, nothing held back), whatever its policy:
        the round that sends all that each rank holds back (:meth:`merge`, and local steps' ``average()``).
        The policies come back after it, also when the round raised."""
        kept = [b.compression for b in self.buckets]
        for b in self.buckets:
            b.compression = Dense()
        try:
            yield
        finally:
            for b, c in zip(self.buckets, kept):
                b.compression = c

    @torch.no_grad()
    def _to_global_batch(self, b: Bucket, delta: torch.Tensor, groups: Dict[int, Dict[str, Any]]) -> None:
        """This rank's change in ``delta`` (before - after) made the step its optimizer on the global batch
        would take (gradshare.second_moment)."""
        self.rescale.apply_all(((p, groups[id(p)], view, view) for p, view in b.views(delta)), self.world_size)

    @torch.no_grad()
    def apply_outer(self, outer: torch.optim.Optimizer, buckets: Optional[Sequence[Bucket]] = None,
                    means: Optional[Sequence[torch.Tensor]] = None) -> None:
        """Parameters back to the snapshot, then ``outer.step()`` on the mean change (in every bucket's flat
        buffer, or ``means``) as the gradient; the parameters' own gradients are put back afterwards. With
        ``buckets``, the outer optimizer's other parameters have no gradient meanwhile, so it leaves them and
        their state alone (torch's optimizers skip a parameter whose ``grad`` is None)."""
        bs = self.buckets if buckets is None else list(buckets)
        means = [b.flat for b in bs] if means is None else list(means)
        mine = {id(p) for b in bs for p in b.params}
        saved = [(p, p.grad) for g in outer.param_groups for p in g["params"] if id(p) not in mine]
        for p, _ in saved:
            p.grad = None
        for b, m in zip(bs, means):
            b.set_params(b.snapshot)
            for p, v in b.views(m):
                saved.append((p, p.grad))
                p.grad = v.to(p.dtype)
        try:
            outer.step()
        finally:
            for p, g in saved:
                p.grad = g

    # ------------------------------------------------------ overlapped pseudo-gradient rounds (streaming)
    def launch_changes(self, buckets: Sequence[Bucket]) -> List[Tuple[Bucket, Any]]:
        """Starts sharing each bucket's change since :meth:`begin_updates` (decoded mean into its ``mean``)
        while training goes on; the parameters now are kept in ``launched``. :meth:`arrive` waits for the
        exchanges, :meth:`land_changes` applies them."""
        for b in buckets:
            if b.mean is None:
                b.mean = torch.empty_like(b.residual)
            if b.launched is None:
                b.launched = torch.empty_like(b.residual)
            b.gather_params(b.launched)
        deltas = self._deltas(False, buckets)
        if self.world_size <= 1:                  # nothing to exchange: the mean is the rank's own change
            for b, d in zip(buckets, deltas):
                b.mean.copy_(d)
            return [(b, None) for b in buckets]
        launched = self.launch([(b, d, b.mean) for b, d in zip(buckets, deltas)])
        if any(isinstance(f, BaseException) for _, f in launched):
            self.collect(launched)                # a launch failed: waits for the others and raises
        return launched

    def arrive(self, launched: Sequence[Tuple[Bucket, Any]]) -> bool:
        """Waits for the exchanges :meth:`launch_changes` started and ends their step (residuals committed,
        statistics). False when the step was skipped. On an error the buckets' parameters are set back to
        where their round started (on every rank), and it is raised."""
        if all(f is None for _, f in launched):
            return True
        try:
            return self.finish(self.collect(launched))
        except BaseException:
            self.restore_params([b for b, _ in launched])
            self.residual_into_params([b for b, _ in launched])     # error_feedback="model": the rank's own start
            raise

    @torch.no_grad()
    def land_changes(self, buckets: Sequence[Bucket], ok: bool, outer: Optional[torch.optim.Optimizer] = None) -> None:
        """Applies an arrived overlapped round: the round's start moves by the mean change (or by ``outer``'s
        step on it), the same on every rank, and becomes the next round's start; the steps each rank took
        since the launch stay on top of it, so they are shared by the next round and nothing is lost. A
        skipped round (``ok`` False) sets the parameters back to the round's start, steps since included,
        so that every rank holds the same. With ``error_feedback="model"`` each rank's model then goes on
        holding what it has not sent (:meth:`residual_into_params`): the new start minus the rank's residual,
        plus its steps since the launch; a skipped round leaves it at its own start of the round."""
        for b in buckets:
            torch.sub(b.gather_params(b.flat), b.launched, out=b.flat)    # the steps since the launch
        self._apply_mean(buckets, [b.mean for b in buckets], ok, outer)
        for b in buckets:
            b.gather_params(b.snapshot)
            if ok:
                for p, v in b.views(b.flat):
                    p.detach().add_(v.to(p.dtype))
        self.residual_into_params(buckets)

    def _grads_flag(self) -> torch.Tensor:
        grads = [p.grad for b in self.buckets for p in b.params if p.grad is not None]
        return comm.grads_nonfinite(grads).to(self.device)

    def grads_nonfinite(self) -> bool:
        """Whether this rank's gradients hold a NaN or Inf (local: no collective)."""
        return bool(self._grads_flag().item())

    def nonfinite_ranks(self) -> List[int]:
        """The ranks whose gradients hold a NaN or Inf (an all-gather of one flag per rank: the same list on
        every rank), checked before the optimizer's local step so that a step dropped for them changes
        nothing, optimizer state included (nonfinite="skip")."""
        return self.flagged_ranks(self._grads_flag())

    def flagged_ranks(self, flag: torch.Tensor) -> List[int]:
        """The ranks whose 1-element float ``flag`` is > 0: one all-gather, the same list on every rank."""
        every = torch.empty(self.world_size, dtype=flag.dtype, device=flag.device)
        comm.all_gather_fn()(every, flag, group=self.process_group)
        return [r for r, x in enumerate(every.tolist()) if x > 0]

    def skip_step(self) -> None:
        """Records a step dropped before any exchange (every rank agreed its gradients were not finite)."""
        self.step_skipped = True
        self.show_mean_now()
        self.stats.end_step()
        self.link_step_ended()

    # ------------------------------------------------------------- link-aware steps (gradshare.link)
    def allreduce_now(self) -> bool:
        """Whether this step averages gradients by an all-reduce (the link-aware choice) instead of sharing the
        optimizer's update compressed. The same on every rank."""
        return self.link is not None and self.link.mode == ALLREDUCE

    def rounding(self, key: str, n: int, device: torch.device) -> torch.Tensor:
        """This rank's rounding error of the bfloat16 all-reduce of ``key`` (a bucket of this core's, or one of
        DDP's), float32, ``n`` elements: zeros at first (or where the bucket changed size), then what the last
        message's rounding left out (gradshare.comm.round_bf16); checkpointed."""
        r = self._roundings.get(key)
        if r is None or r.numel() != n or r.device != torch.device(device):
            r = self._roundings[key] = torch.zeros(n, dtype=torch.float32, device=device)
        return r

    def pending_rounding(self, key: str, n: int) -> Optional[torch.Tensor]:
        """What the bfloat16 all-reduce of ``key`` last left out (:meth:`rounding`), taken to be sent by a float32
        all-reduce of it now (in units of the mean, as kept), or None where nothing waits. Taken, it is gone: a
        later bfloat16 message starts from zero."""
        r = self._roundings.pop(key, None)
        return r if r is not None and r.numel() == n else None

    def allreduce_bf16(self) -> bool:
        """Whether this step's all-reduce goes in bfloat16 with error feedback (gradshare.link's precision
        choice; :func:`gradshare.comm.round_bf16`) rather than float32. The same on every rank."""
        return self.allreduce_now() and self.link.allreduce_precision == "bfloat16"

    def exchange_ready(self) -> None:
        """The front's mark of where this step's exchange could first start (gradshare.link: the work before it
        adds to the link probe's bound on an all-reduce step)."""
        if self.link is not None:
            self.link.exchange_ready()

    def link_step_ended(self) -> None:
        if self.link is not None and self.world_size > 1:
            self.link.step_ended(self._max_over_ranks, self._allreduce_bound)

    def _allreduce_bound(self) -> float:
        """The least an all-reduce step's exchange takes on this link, measured now (gradshare.link): the ranks
        time all-reduces of one element and of up to 1 MiB (a quarter of the model at most), and the larger's
        time per byte, the latency taken off, is extrapolated to every bucket's float32 all-reduce
        (gradshare.costmodel.Link.measured). The slowest rank's figure, the same on every rank; the probe's
        bytes count in the next step's statistics."""
        world, n = self.world_size, sum(b.n for b in self.buckets)
        dev = self.device
        k = max(1, min(PROBE_ELEMENTS, n // 4))
        one, probe = torch.zeros(1, device=dev), torch.zeros(k, device=dev)

        def seconds(t: torch.Tensor) -> float:
            start = time.perf_counter()
            dist.all_reduce(t, group=self.process_group)
            if t.is_cuda:
                torch.cuda.synchronize(t.device)
            return time.perf_counter() - start

        seconds(one)                    # waits for the last rank to arrive: the timed ones start together
        latency = min(seconds(one), seconds(one))
        took = min(seconds(probe), seconds(probe))
        self._sync_bytes += 3 * ring_allreduce_bytes(world, 1) + 2 * ring_allreduce_bytes(world, k)
        link = Link.measured(ring_allreduce_bytes(world, k), took, latency)
        return self._max_over_ranks([link.time(ring_allreduce_bytes(world, n), rounds=0)])[0]

    def _max_over_ranks(self, values: List[float]) -> List[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.process_group)
        return t.tolist()

    def allreduce_gradients(self) -> bool:
        """Every bucket's gradients replaced by their mean over the ranks (one float32 all-reduce each, all in
        flight together; bfloat16 with error feedback where the link chose it, :meth:`allreduce_bf16`). A non-finite mean (the same on every rank) raises NonFiniteStepError everywhere
        or, with nonfinite="skip", skips the step (False)."""
        self.agree_all()
        world = self.world_size
        half = self.allreduce_bf16()
        works, messages = [], []
        for b in self.buckets:                  # each parameter's has-a-gradient flag rides along (buffer)
            b.gather_grads(b.flat)
            b.buffer[b.n:].copy_(b.grads_present())
            if half:                            # the mean's share and the last rounding error, in bfloat16
                rounding = self.rounding(f"bucket {b.index}", b.n, b.device)
                message = torch.empty(b.buffer.numel(), dtype=torch.bfloat16, device=b.buffer.device)
                comm.round_bf16(b.flat, rounding, 1.0 / world, out=message[:b.n])
                message[b.n:].copy_(b.buffer[b.n:])
                messages.append(message)
                works.append(dist.all_reduce(message, group=self.process_group, async_op=True))
            else:
                pending = self.pending_rounding(f"bucket {b.index}", b.n)
                if pending is not None:         # the last bfloat16 messages' rounding goes out now (a sum here)
                    b.flat.add_(pending, alpha=world)
                works.append(dist.all_reduce(b.buffer, group=self.process_group, async_op=True))
        bad = []
        for i, (b, w) in enumerate(zip(self.buckets, works)):   # the sum scaled to the mean in the pass that checks it
            w.wait()
            present = (b.buffer[b.n:] > 0).tolist()
            if half:
                b.buffer.copy_(messages[i])
                bad.append(comm.any_nonfinite([b.flat]))
            elif b.grads_float32(present):             # and written straight into the gradients
                bad.append(ops.scale_into([p.grad for p in b.params], b._slices(b.flat), 1.0 / world))
                continue
            else:
                bad.append(comm.scale_nonfinite(b.flat, 1.0 / world))
            b.set_grads(b.flat, present)
        if bad and bool(torch.cat(bad).any()):
            if self.nonfinite == "raise":
                raise NonFiniteStepError(self.step, [], [], "mean gradient")
            self.skip_step()
            return False
        return True

    def before_allreduce_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Before the optimizer steps on an all-reduced gradient: :meth:`make_consistent`, and the mean
        gradient that RMSprop's, Adagrad's and Adadelta's rescaling keeps follows that gradient too
        (gradshare.second_moment.GlobalBatchStep), ready for the next compressed steps."""
        self.make_consistent(optimizer)
        for b in self.buckets:             # error_feedback="model": the next compressed step starts from here
            b.start_held = False
        self._await_forward()              # show_mean: nothing held now, so nothing to wait for
        self.rescale.observe((p for b in self.buckets for p in b.params), self.world_size)

    @torch.no_grad()
    def make_consistent(self, optimizer: torch.optim.Optimizer) -> None:
        """Before the optimizer steps on an all-reduced gradient: the same optimizer state and parameters on
        every rank. After compressed steps each rank's optimizer state is its own and the residuals hold
        what was not sent yet (``error_feedback="model"``: in each rank's parameters, which are put back to the
        mean result first); all-reduces, all in flight together, apply the mean residual to the parameters and
        average the optimizer's state tensors (momenta, Adam's moments; a rescaled optimizer's second moment as
        each rank's estimate of the global batch's, gradshare.second_moment). Each residual and each large
        state tensor is averaged where it lies, the small ones together in one buffer: a copy of everything
        into one buffer cost as much as the all-reduce itself (its first touch of that memory). Nothing is sent
        when the states are known equal already, or empty on every rank (a fresh start: one 8-byte all-reduce
        says so)."""
        if self._consistent:
            return
        if self._consistent is None:
            fresh = not any(optimizer.state.get(p) for b in self.buckets for p in b.params)
            if self._max_over_ranks([0.0 if fresh else 1.0])[0] == 0.0:
                self._consistent = True
                return
        world = self.world_size
        # The same entries and counters on every rank (a parameter only some ranks stepped: optimizer_state)
        optimizer_state.agree(optimizer, (p for b in self.buckets for p in b.params), self.process_group,
                              self.buckets[0].device if self.buckets else None)
        works, small, back = [], [], []

        def mean_of(t: torch.Tensor) -> None:       # in place: its sum over the ranks, divided first
            works.append(dist.all_reduce(t.div_(world), group=self.process_group, async_op=True))
            self._sync_bytes += ring_allreduce_bytes(world, t.numel())

        for b in self.buckets:
            mean_of(b.residual)
            # Adam's exp_avg_sq goes in as each rank's estimate of the global batch's (gradshare.second_moment)
            for src, dst in second_moment.to_global(optimizer, b.params, world, self.rescale):
                flat = src.detach().reshape(-1).float()
                if flat.numel() < _IN_PLACE_MIN:
                    small.append((flat, dst))       # averaged together, in one buffer
                    continue
                mean_of(flat)
                if flat.data_ptr() != dst.data_ptr() or flat.dtype != dst.dtype:
                    back.append((flat, dst))        # a converted copy (or not laid out flat): written back
        if small:
            joined = torch.cat([f for f, _ in small])
            mean_of(joined)
            off = 0
            for f, dst in small:
                back.append((joined[off:off + f.numel()], dst))
                off += f.numel()
        for w in works:
            w.wait()
        for b in self.buckets:                      # the mean of what the ranks held back, applied
            if self.own_models and b.start_held:
                b.set_params_own()
            else:
                b.set_params(b.gather_params(b.flat).sub_(b.residual))
            b.residual.zero_()
        for flat, dst in back:
            dst.copy_(flat.view_as(dst))
        self._consistent = True

    def end_allreduce_step(self) -> None:
        """Records a completed all-reduce step (one record per bucket, format "allreduce")."""
        world = self.world_size
        extra, self._sync_bytes = self._sync_bytes, 0
        half = self.allreduce_bf16()
        for b in self.buckets:
            sent = ring_allreduce_bytes(world, b.buffer.numel(), 2 if half else 4) + extra
            extra = 0
            self.stats.add(StepRecord(step=self.step, bucket=b.index, n=b.n, tau=float("nan"), count=b.n,
                                      density=1.0, format=ALLREDUCE_BF16 if half else ALLREDUCE, bytes_sent=sent,
                                      dense_bytes=ring_allreduce_bytes(world, b.n)))
        self.step += 1
        self.stats.end_step()
        self.link_step_ended()

    # ------------------------------------------------------------- show_mean: the mean result between steps
    def _await_forward(self) -> None:
        """show_mean: the parameters were just set to the mean result (or nothing is held back); the own model goes
        back on at the next forward that trains."""
        self._worn = not any(b.start_held for b in self.buckets)
        if self._worn:
            _stop_waiting(self)
        else:
            _wait_for_forward(self)

    @torch.no_grad()
    def show_mean_now(self) -> None:
        """show_mean: every parameter the mean result (a step that ended without an exchange: skipped, or a
        checkpoint just loaded); nothing otherwise."""
        if not self.show_mean:
            return
        held = [b for b in self.buckets if b.start_held]
        if self._worn:
            self.restore_params(held)
        self._await_forward()

    @torch.no_grad()
    def wear_own(self) -> None:
        """show_mean: each rank's own model back on, the mean result minus what the rank has not sent (called by
        the first forward that trains after a step, else by :meth:`begin_updates`). Float32 parameters are read
        as the mean result first, so that what a script wrote to them between steps (identically on every rank,
        as with DDP) is kept; others (bfloat16, say) hold it rounded, so it is taken from the ``snapshot``."""
        if self._worn:
            return
        self._read_shown()
        _stop_waiting(self)
        self._worn = True
        for b in self.buckets:
            if b.start_held:
                b.set_params_own(read=True)

    @torch.no_grad()
    def _read_shown(self) -> None:
        """show_mean, between steps: the mean result read back from the float32 parameters that show it (what a
        script wrote to them, the same on every rank, becomes part of it)."""
        if self._worn:
            return
        for b in self.buckets:
            if not b.start_held:
                continue
            if b.float32():
                b.gather_params(b.snapshot)
                continue
            for p, s in b.views(b.snapshot):
                if p.dtype == torch.float32:
                    s.copy_(p.detach())

    @torch.no_grad()
    def residual_into_params(self, buckets: Optional[Sequence[Bucket]] = None) -> None:
        """``error_feedback="model"``: each parameter minus its residual, after a round set it to the round's
        mean result (the ``snapshot``, the same on every rank): the rank's model keeps what it has not sent.
        Nothing otherwise."""
        if self.error_feedback != "model":
            return
        for b in (self.buckets if buckets is None else buckets):
            for p, r in b.views(b.residual):
                p.sub_(r.to(p.dtype))

    def restore_params(self, buckets: Optional[Sequence[Bucket]] = None) -> None:
        for b in (self.buckets if buckets is None else buckets):
            if b.snapshot is not None:
                b.set_params(b.snapshot)

    # ----------------------------------------------------------------------------------------- state
    def state_dict(self) -> Dict[str, Any]:
        """Residuals, velocities, policy state and the signs last sent (gradshare.momentum_masking) per bucket,
        the step counter and statistics totals (with delay=1 after the update in flight has landed, and its
        mean, not applied yet)."""
        late = self._late_means()               # first: landing commits residuals and counts the step
        self._read_shown()                      # show_mean: what a script wrote to the shown mean result counts
        return {"step": self.step, "stats": self.stats.state_dict(),
                "compression": self.compression.config(),
                "buckets": [{"n": b.n, "residual": b.residual.detach().cpu().clone(),
                             "velocity": None if b.velocity is None else b.velocity.detach().cpu().clone(),
                             "last sent": None if b.last_sent is None else b.last_sent.detach().cpu().clone(),
                             "compression": b.compression.state_dict()} for b in self.buckets],
                "link": None if self.link is None else self.link.state_dict(),
                # error_feedback="model", updates: the mean result each rank's parameters are minus its residual
                "starts": ([None if not b.start_held else b.snapshot.detach().cpu().clone() for b in self.buckets]
                           if self.own_models else None),
                "states equal": self._consistent, "delay": self.delay, "late mean": late,
                "mean gradient": self.rescale.state_dict(),
                "sparse moments": self.sparse_moments.state_dict(),
                "rounding": {k: r.detach().cpu().clone() for k, r in self._roundings.items()}}

    def _late_means(self) -> Optional[List[torch.Tensor]]:
        """delay=1: the last step's decoded means, waited for (a collective) and not applied yet; None when
        there are none."""
        if not self.delay:
            return None
        self._land()
        if not self._arrived:
            return None
        return [b.mean.detach().cpu().clone() for b in self.buckets]

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        saved = state["buckets"]
        starts = state.get("starts") if self.own_models else None
        if [int(s["n"]) for s in saved] != [b.n for b in self.buckets]:
            saved, starts = _rebucket(saved, starts, [b.n for b in self.buckets])
        for i, (b, s) in enumerate(zip(self.buckets, saved)):
            if int(s["n"]) != b.n:
                raise ValueError(f"load_state_dict: bucket {b.index} has {b.n} elements, the checkpoint {s['n']}")
            start = starts[i] if starts is not None and i < len(starts) else None
            if start is not None and (not torch.is_tensor(start) or start.numel() != b.n):
                held = f"{start.numel()} elements" if torch.is_tensor(start) else type(start).__name__
                raise ValueError(f"load_state_dict: bucket {b.index}'s mean result should be a tensor of {b.n} "
                                 f"elements, the checkpoint holds {held}")
            last = s.get("last sent")
            if last is not None and (not torch.is_tensor(last) or last.numel() != b.n):
                held = f"{last.numel()} elements" if torch.is_tensor(last) else type(last).__name__
                raise ValueError(f"load_state_dict: bucket {b.index}'s signs last sent should be a tensor of {b.n} "
                                 f"elements, the checkpoint holds {held}")
        for b, s in zip(self.buckets, saved):
            b.residual.copy_(s["residual"])
            b.compression.load_state_dict(s["compression"])
            if b.velocity is not None:
                b.velocity.zero_()
                if s.get("velocity") is not None:
                    b.velocity.copy_(s["velocity"])
            last = s.get("last sent")
            b.last_sent = None if last is None else last.reshape(-1).to(device=b.device, dtype=torch.int8).clone()
        for i, b in enumerate(self.buckets):
            start = starts[i] if starts is not None and i < len(starts) else None
            b.start_held = start is not None   # without one the parameters at the next step are taken as it
            if start is not None:
                if b.snapshot is None:
                    b.snapshot = torch.empty(b.n, dtype=torch.float32, device=b.device)
                b.snapshot.copy_(start.reshape(-1))
        self._worn = True
        self.show_mean_now()                   # show_mean: the mean result until the next forward that trains
        self.step = int(state["step"])
        self.stats.load_state_dict(state["stats"])
        self.step_skipped = False
        if self.link is not None and state.get("link") is not None:
            self.link.load_state_dict(state["link"])
        self.rescale.load_state_dict(state.get("mean gradient"))
        self.sparse_moments.load_state_dict(state.get("sparse moments"), sum(len(b.params) for b in self.buckets))
        rounding = state.get("rounding") or {}
        if not all(isinstance(k, str) and torch.is_tensor(r) and r.dim() == 1 for k, r in rounding.items()):
            raise ValueError("load_state_dict: the bfloat16 all-reduce's rounding should map names to flat tensors")
        self._roundings = {k: r.to(device=self.device, dtype=torch.float32).clone() for k, r in rounding.items()}
        # Whether the ranks' optimizer states were equal when this was saved (all-reduce steps keep them so).
        self._consistent = state.get("states equal", False)
        late = state.get("late mean")
        if int(state.get("delay", 0)) != self.delay:
            raise ValueError(f"load_state_dict: the checkpoint was written with delay={state.get('delay', 0)}, "
                             f"this state has delay={self.delay}")
        self._inflight, self._arrived = None, None
        if late is not None:
            for b, m in zip(self.buckets, late):
                if b.mean is None:
                    b.mean = torch.empty_like(b.residual)
                b.mean.copy_(m)
            self._arrived = True


def _rebucket(saved: List[Dict[str, Any]], starts: Optional[List[Any]], sizes: List[int]):
    """A checkpoint's buckets cut as ``sizes`` (the same parameters in the same order, bucketed another way: another
    ``bucket_cap_mb``, or a checkpoint of an earlier default): the per-element state joined and cut again; each
    new bucket's compression state (thresholds, warm-up) is that of the saved bucket its first element was in."""
    total = sum(int(s["n"]) for s in saved)
    if total != sum(sizes):
        raise ValueError(f"load_state_dict: the checkpoint's buckets hold {total} elements in {len(saved)} buckets, "
                         f"this one's {sum(sizes)} in {len(sizes)} (the same parameters are needed)")
    for s in saved:
        if not torch.is_tensor(s.get("residual")) or s["residual"].numel() != int(s["n"]):
            raise ValueError("load_state_dict: a checkpoint bucket's residual does not hold its n elements")

    def joined(key: str, dtype: torch.dtype) -> Optional[torch.Tensor]:
        parts = [s.get(key) for s in saved]
        if all(t is None for t in parts):
            return None
        bad = [i for i, (t, s) in enumerate(zip(parts, saved)) if t is not None and
               (not torch.is_tensor(t) or t.numel() != int(s["n"]))]
        if bad:
            raise ValueError(f"load_state_dict: bucket {bad[0]}'s {key} should be a tensor of {saved[bad[0]]['n']} "
                             "elements")
        return torch.cat([torch.zeros(int(s["n"]), dtype=dtype) if t is None else t.detach().reshape(-1).cpu().to(dtype)
                          for t, s in zip(parts, saved)])

    fields = {"residual": joined("residual", torch.float32), "velocity": joined("velocity", torch.float32),
              "last sent": joined("last sent", torch.int8)}
    held = None                                  # error_feedback="model": the mean result, joined
    if starts is not None and any(t is not None for t in starts):
        if len(starts) != len(saved) or any(t is None for t in starts):
            raise ValueError("load_state_dict: the checkpoint holds the mean result of some buckets and not of "
                             "others; it loads only into its own bucket sizes")
        bad = [i for i, (t, s) in enumerate(zip(starts, saved)) if not torch.is_tensor(t) or t.numel() != int(s["n"])]
        if bad:
            raise ValueError(f"load_state_dict: bucket {bad[0]}'s mean result should be a tensor of "
                             f"{saved[bad[0]]['n']} elements")
        held = torch.cat([t.detach().reshape(-1).cpu().float() for t in starts])
    firsts, off = [], 0
    for s in saved:
        firsts.append(off)
        off += int(s["n"])
    out, new_starts, off = [], [], 0
    for n in sizes:
        home = next((i for i, (f, s) in enumerate(zip(firsts, saved)) if f <= off < f + int(s["n"])), len(saved) - 1)
        b = {"n": n, "compression": saved[home]["compression"]}
        for key, t in fields.items():
            b[key] = None if t is None else t[off:off + n].clone()
        out.append(b)
        new_starts.append(None if held is None else held[off:off + n].clone())
        off += n
    return out, (None if starts is None else new_starts)


# make_consistent: a state tensor of at least this many elements is averaged where it is (no copy); smaller ones
# together in one buffer (one collective for a model's many small tensors: biases, norms, a 0-dim's moments).
_IN_PLACE_MIN = 1 << 16


def _warm_up(compression: Compression) -> Tuple[int, float]:
    """The steps of ``compression``'s warm-up and how small its message then gets against its first step's (the
    link-aware policy's first measurement: gradshare.link; 0.0 where the size is not known before encoding)."""
    steps = int(getattr(compression, "warmup_steps", 0))
    first, steady = compression.words(1 << 20, 0), compression.words(1 << 20, steps)
    return steps, (steady / first if first and steady else 0.0)


def _resolve_link(link: Any, default_ok: bool, mode: str, own_models: bool = False) -> Optional[LinkAware]:
    """The LinkAware for a sharing core: "auto" means one when ``default_ok`` (module docstring of
    gradshare.link; its margin MODEL_MARGIN where what waits is in each rank's model), None none, a LinkAware a
    copy of it (sharing updates only)."""
    if link is None:
        return None
    if isinstance(link, str) and link == "auto":
        if not default_ok:
            return None
        return LinkAware(margin=MODEL_MARGIN) if own_models else LinkAware()
    if isinstance(link, LinkAware):
        if mode != "updates":
            raise ValueError("link: link-aware sharing chooses between all-reduced gradients and shared updates; "
                             'it needs mode="updates" (an optimizer)')
        return LinkAware(**link.config(), clock=link.clock)
    raise TypeError(f"link: expected 'auto', None or a gradshare.LinkAware, got {link!r}")
