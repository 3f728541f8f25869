"""Gradient sharing for code without DDP: wrap the optimizer (like Horovod's DistributedOptimizer).

    opt = SharedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3))
    opt.zero_grad(); loss.backward(); opt.step()

Parameters are grouped into buckets (same device and dtype, at most ``bucket_cap_mb`` each, in
parameter order); gradshare.sharing runs the exchange of each.

Which mode:
- ``mode="updates"`` (default): each rank runs the inner optimizer on its own gradient; the change it made
  to the parameters is shared with error feedback and every rank applies the same decoded mean of all
  ranks' changes (gradshare.sharing explains why this is the default). Optimizer state stays local and
  differs between ranks; parameters stay bitwise identical. This is DL4J's own semantics.
- ``mode="gradients"``: before the inner step, each bucket's gradient is encoded with error feedback,
  exchanged and replaced by the decoded mean; every rank then runs the inner optimizer on the same
  gradient (optimizer state identical on every rank). Suits SGD; Adam trains worse this way.

What is sent (``compression``): by default what gradshare.compression.for_optimizer picks: with what a step
does not send kept in each rank's model (``error_feedback``'s default sharing updates), the top 5% as signs for
every optimizer; with it in the residual, TopK() for SGD, Ternary() for Adam-like optimizers. Pass a TopK,
Ternary, or DL4J's +-tau thresholds (Fixed, Adaptive; with ``clipping``) to choose.

Sum or mean: DL4J SUMS the workers' updates, so its effective step grows with the number of workers and
learning rates must be retuned when the cluster changes. gradshare AVERAGES by default (``reduce="mean"``):
a script's hyper-parameters mean the same on 1 or 64 ranks. ``reduce="sum"`` gives DL4J's rule.

Non-finite values: ``nonfinite="raise"`` (default) raises NonFiniteStepError on every rank, naming the
step and the rank(s), with parameters and residuals as they were (in "updates" mode a rank whose gradients
are not finite skips its inner step; the other ranks' inner optimizers have taken theirs: resume from a
checkpoint). ``nonfinite="skip"`` drops the step on every rank: residuals, parameters and the step counter
are left as they were and ``step()`` returns without stepping (``opt.step_skipped``). In "updates" mode the
skip check of the gradients costs one tiny all-gather per step before the inner step, so that optimizer
state is not touched either (a non-finite update from finite gradients is still caught by the exchange;
parameters and residuals are restored, the inner optimizer's state has advanced).

Momentum correction in gradshare (``momentum=m``, mode="gradients" only; Deep Gradient Compression): each
bucket keeps a velocity u = m*u + g and encodes it, for an inner optimizer WITHOUT momentum. "updates" mode
does the same with the optimizer's own momentum and needs none of this.

Uneven inputs: ``with torch.distributed.algorithms.join.Join([opt]):`` (and ``Join([ddp, opt])``): a rank
out of batches takes part in the others' steps with no gradient of its own (a zero update, its residual
still sent) and applies the same means, so replicas stay identical.

With one rank nothing is encoded: ``step()`` is the inner optimizer's step.
A parameter group added later (``add_param_group``) gets buckets of its own after the others.
Parameters whose ``grad`` is None on every rank are left untouched, as torch's optimizers leave them.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from gradshare._deprecation import renamed_kwargs
from gradshare.compression import Strom
from gradshare.sharing import Sharing, SharingFront
from gradshare.sparse_moments import EVERY as SPARSE_MOMENTS_EVERY
from gradshare.stats import Statistics
from gradshare.thresholds import ResidualClipping
from gradshare.wrapped_optimizer import WrappedOptimizer, steps_the_inner_optimizer

MODES = ("updates", "gradients")
_DEFAULT = object()


class SharedOptimizer(SharingFront, WrappedOptimizer, Joinable):
    """Wraps a torch optimizer; ``step()`` shares updates (or gradients) over a process group.

    Args:
        optimizer: the inner optimizer (its param_groups define the shared parameters).
        mode: "updates" (default) or "gradients" (module docstring).
        compression: what is sent (gradshare.compression; default: chosen for the inner optimizer).
        clipping: DL4J's residual clipping for +-tau thresholds (default ResidualClipping() with them).
        process_group: the group to share over (None: default group; gloo or NCCL).
        nonfinite: "raise" or "skip".
        reduce: "mean" (default) or "sum" (DL4J) of the ranks' contributions.
        bucket_cap_mb: bucket size cap (fp32 MiB); None (default): a quarter of the group's parameters' size,
            between 8 and 25 MiB (gradshare.sharing.auto_bucket_cap_mb). fallback: "auto" / "never" / "always"
            dense path.
        stats: a Statistics to record into (default: a new one, ``opt.stats``).
        momentum: None (default) or m in [0, 1): momentum correction in gradshare, mode "gradients" only;
            the inner optimizer must have no momentum.
        link: "auto" (default): in "updates" mode with the default compression, steps on which the link
            makes compression slower than a float32 all-reduce of the gradients all-reduce them instead
            (gradshare.link); None: always compress.
        delay: 0 (default) or 1: each step's shared update is applied at the end of the next step, so that
            its exchange travels while that step computes (DL4J's asynchronous flavour; "updates" mode,
            compressing every step). Call ``opt.flush()`` to apply the last one, e.g. before evaluating.
        momentum_masking: for an inner torch.optim.SGD or one of Adam's kin in "updates" mode, its momentum
            (Adam's first moment) is zeroed where an element that waited in the residual is sent the other way
            from its last send: the residual's stale push, which otherwise swings the waiting elements where
            gradients carry little noise (regression) and stalls the loss (gradshare.momentum_masking). None
            (default): SGD with any compression that holds something back, Adam's kin with top-k, where what
            waits is in the residual (``error_feedback="buffer"``); False: off; True: those optimizers with any
            compression, refused where it cannot apply.
        error_feedback: "updates" mode: where what a step does not send waits. None (default): "model" with
            ``delay=0`` over float32/float64 parameters, "buffer" otherwise
            (gradshare.sharing.default_error_feedback). "model": in each rank's
            own parameters (the mean result plus the progress it has not sent yet), so that its next gradient is
            taken where its own progress brought it (gradshare.sharing); the top 5% as signs by default. Between
            steps every rank's parameters show the mean result, the same bits on every rank; the first forward
            that trains puts each rank's own model back on (gradshare.sharing, ``show_mean``). ``opt.merge()``
            sends what waits, uncompressed. "buffer": in gradshare's residual, every rank's parameters the same
            mean result at every point.
        sparse_moments: "updates" mode with an adaptive inner optimizer (Adam's kin, RMSprop, Adagrad, Adadelta):
            every this many steps the ranks average its second moment of the parameters whose gradients are
            mostly zero (embedding tables, found over the first steps): each rank's own counts only its share of
            their rare gradients (gradshare.sparse_moments). Default 50; 0 or None: never.
        threshold: the former name of ``compression`` (deprecated).

    It is a torch.optim.Optimizer over the inner optimizer's ``param_groups`` and ``state`` (the same objects):
    LR schedulers, ``add_param_group``, Lightning and torch.distributed.checkpoint take it like the inner one;
    its ``state_dict()`` is the inner one's plus a ``"gradshare"`` entry (gradshare.wrapped_optimizer).
    Under ``torch.amp.GradScaler`` (``scaler.step(opt)``) the gradients are unscaled before anything is
    shared, and a step whose scaled gradients overflowed on any rank is skipped on every rank.
    """

    @renamed_kwargs(threshold="compression")
    def __init__(self, optimizer: torch.optim.Optimizer, mode: str = "updates", compression: Any = None,
                 clipping: Any = _DEFAULT, process_group=None, nonfinite: str = "raise", *, reduce: str = "mean",
                 bucket_cap_mb: Optional[float] = None, fallback: str = "auto", stats: Optional[Statistics] = None,
                 momentum: Optional[float] = None, link: Any = "auto", delay: int = 0,
                 momentum_masking: Optional[bool] = None, error_feedback: Optional[str] = None,
                 sparse_moments: Optional[int] = SPARSE_MOMENTS_EVERY):
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        if momentum is not None:
            if mode != "gradients":
                raise ValueError('momentum correction needs mode="gradients" (in "updates" mode the inner '
                                 "optimizer's own momentum is local already)")
            inner = [g.get("momentum", 0) for g in optimizer.param_groups if g.get("momentum", 0)]
            if inner:
                raise ValueError(f"momentum={momentum}: the inner optimizer has momentum={inner[0]}; with "
                                 "momentum correction the velocity lives in SharedOptimizer, give the inner "
                                 "optimizer momentum=0 (e.g. torch.optim.SGD(params, lr))")
        self._wrap(optimizer)
        Joinable.__init__(self)
        self._joined = False                      # in a step taken for a rank out of inputs (join_hook)
        self._scaler_seen = False                 # whether a GradScaler has called step() (its flags gathered)
        self.mode = mode
        self.bucket_cap_mb = None if bucket_cap_mb is None else float(bucket_cap_mb)
        clip = ResidualClipping() if clipping is _DEFAULT else clipping
        self.sharing = Sharing(compression, optimizer=optimizer, process_group=process_group, reduce=reduce,
                               nonfinite=nonfinite, fallback=fallback, stats=stats, momentum=momentum,
                               clipping=clip, mode=mode, link=link, delay=delay, momentum_masking=momentum_masking,
                               error_feedback=error_feedback, show_mean=True, sparse_moments=sparse_moments)
        self.sharing.build((p for g in optimizer.param_groups for p in g["params"]), bucket_cap_mb)

    # -- gradshare state -------------------------------------------------------------------------------
    @property
    def step_count(self) -> int:
        """Steps shared so far (skipped steps not counted)."""
        return self.sharing.step

    @property
    def buckets(self):
        return self.sharing.buckets

    @property
    def thresholds(self) -> List[Any]:
        """The +-tau threshold of each bucket (Strom policies only)."""
        return [b.compression.threshold for b in self.sharing.buckets if isinstance(b.compression, Strom)]

    # -- the step -------------------------------------------------------------------------------------------
    # A GradScaler (torch.amp) calls step() on every rank and leaves skipping it to the optimizer (setting
    # ``found_inf``, this rank's overflow flag, and ``grad_scale`` for that call). Without this a rank whose
    # scaled gradients overflowed would skip the step alone, and the ranks' exchanges would pair different
    # steps.
    _step_supports_amp_scaling = True

    def _grad_scaler_skips(self) -> bool:
        """Under a GradScaler: True when any rank's gradients overflowed (every rank then skips the step;
        each rank's scaler backs off for its own overflow only); otherwise the gradients are unscaled in
        place exactly as GradScaler.unscale_ does, so what is shared is in the units of an unscaled run."""
        sh = self.sharing
        found = self.found_inf
        if sh.world_size > 1:
            overflowed = bool(sh.flagged_ranks(found.detach().float().reshape(1)))
        else:
            overflowed = bool(found.item())
        if overflowed:
            return True
        scale = getattr(self, "grad_scale", None)      # None: the user called scaler.unscale_(opt) already
        if scale is not None:
            inv = scale.double().reciprocal().float()
            grads: Dict[Any, List[torch.Tensor]] = {}
            for g in self.optimizer.param_groups:
                for p in g["params"]:
                    if p.grad is not None:
                        grads.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
            for (device, _), ts in grads.items():
                torch._amp_foreach_non_finite_check_and_unscale_(ts, torch.zeros(1, device=device),
                                                                 inv.to(device))
        return False

    @steps_the_inner_optimizer
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        sh = self.sharing
        if sh.world_size > 1 and not self._joined:
            Join.notify_join_context(self)        # under Join: this rank has not run out of inputs
        sh.step_skipped = False
        sh.exchange_ready()                       # the gradients are complete: an all-reduce could start now
        scaled = getattr(self, "found_inf", None) is not None
        self._scaler_seen = self._scaler_seen or (scaled and not self._joined)
        if scaled and self._grad_scaler_skips():
            sh.skip_step()
            return loss
        if sh.world_size == 1:
            self.optimizer.step()
            return loss
        if self.mode == "gradients":
            if sh.share_gradients():
                self.optimizer.step()
            return loss
        if sh.allreduce_now():                    # the link-aware choice on a fast link: DDP's step
            if sh.allreduce_gradients():
                sh.before_allreduce_step(self.optimizer)
                self.optimizer.step()
                sh.end_allreduce_step()
            return loss
        bad_here = False
        if sh.nonfinite == "skip":
            if sh.nonfinite_ranks():              # one flag per rank: a dropped step moves no optimizer state
                sh.skip_step()
                return loss
        else:
            # "raise" adds no collective: a rank whose gradients are not finite does not step and shares
            # them instead, and the exchange stops every rank (parameters and residuals unchanged).
            bad_here = sh.grads_nonfinite()
        sh.begin_updates()
        if not bad_here and not self._joined:
            self.optimizer.step()
        sh.share_updates(share_grads=bad_here, joined=self._joined)
        return loss

    def _ranks(self) -> int:
        return self.sharing.world_size

    # -- uneven inputs (torch.distributed.algorithms.join) ---------------------------------------------------
    def join_hook(self, **kwargs) -> JoinHook:
        return _JoinedStep(self)

    @property
    def join_device(self) -> torch.device:
        return self.sharing.device

    @property
    def join_process_group(self) -> Any:
        return self.sharing.process_group if self.sharing.process_group is not None else dist.group.WORLD

    def _joined_step(self) -> None:
        """The step the ranks still training take, on a rank out of inputs: no gradient of its own (every
        parameter's None, as for a rank that saw none), so it contributes zero to the mean gradient, or a zero
        update in "updates" mode (its inner optimizer does not step there); the same collectives, the same
        means applied."""
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                p.grad = None
        self._joined = True
        if self._scaler_seen:                     # the others' GradScaler gathers overflow flags: none here
            self.found_inf = torch.zeros(1, device=self.sharing.device)
        try:
            self.step()
        finally:
            self._joined = False
            self.__dict__.pop("found_inf", None)

    def _share_new_group(self, params) -> None:
        """A parameter group added with ``add_param_group`` is shared too, in buckets after the others (every
        rank must add the same groups in the same order)."""
        self.sharing.extend(params, self.bucket_cap_mb)

    # -- checkpoints (gradshare.wrapped_optimizer: torch-shaped plus "gradshare") ----------------------------
    def _gradshare_state(self) -> Dict[str, Any]:
        """Residuals, policy state, step counter, statistics totals, and the mode."""
        return {"mode": self.mode, "sharing": self.sharing.state_dict()}

    def _load_gradshare_state(self, own: Dict[str, Any]) -> None:
        mode = own.get("mode", own["sharing"].get("mode", self.mode))
        if mode != self.mode:
            raise ValueError(f"load_state_dict: the checkpoint was written in mode {mode!r}, this optimizer "
                             f"shares {self.mode!r}")
        self.sharing.load_state_dict(own["sharing"])

    def __getstate__(self) -> Dict[str, Any]:
        raise TypeError("gradshare: a SharedOptimizer cannot be copied or pickled: it holds this rank's part of a "
                        "live exchange with the other ranks. Save its state_dict() (gradshare.checkpoint.save "
                        "does) and load it into a new SharedOptimizer over the model's optimizer.")

    def __repr__(self) -> str:
        return (f"SharedOptimizer({type(self.optimizer).__name__}, mode={self.mode!r}, "
                f"buckets={len(self.sharing.buckets)}, compression={self.sharing.compression!r}, "
                f"reduce={self.sharing.reduce!r}, momentum={self.sharing.momentum!r})")


class _JoinedStep(JoinHook):
    """SharedOptimizer's join hook: one :meth:`SharedOptimizer._joined_step` per step of the others."""

    def __init__(self, opt: SharedOptimizer):
        self.opt = opt

    def main_hook(self) -> None:
        self.opt._joined_step()
