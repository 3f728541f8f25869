"""Gradient sharing for code without DDP: wrap the optimizer (like Horovod's DistributedOptimizer).

    opt = SharedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), mode="gradients")
    opt.zero_grad(); loss.backward(); opt.step()

Parameters are grouped into buckets (same device and dtype, at most ``bucket_cap_mb`` each, in
parameter order), each with a flat float32 buffer, its own residual and its own threshold.

Which mode:
- ``mode="gradients"`` (default): before the inner step, each bucket's gradient is threshold-encoded
  with error feedback, exchanged and replaced by the decoded mean; then every rank runs the inner
  optimizer on the same gradient. Optimizer state is identical on every rank. The closest drop-in for a
  DDP script; thresholds are on the gradient's scale.
- ``mode="updates"``: DL4J's semantics. Each rank runs its inner optimizer locally on its own gradient,
  the parameter change (params_before - params_after, the post-optimizer update with the learning rate
  in it) is encoded with error feedback, parameters are put back and every rank applies the same decoded
  combination of all ranks' updates. Optimizer state (momentum, Adam moments) stays local and differs
  between ranks; parameters stay bitwise identical. Thresholds are on the update's scale (DL4J's 1e-3
  default fits learning rates near 1e-2..1e-1). Choose it for adaptive optimizers whose state should see
  only the local gradient, or to match DL4J.

Sum or mean: DL4J SUMS the workers' updates, so its effective step grows with the number of workers and
learning rates must be retuned when the cluster changes. gradshare AVERAGES by default (``reduce="mean"``)
in both modes: with plain SGD and nothing held back, "updates" then equals synchronous data-parallel SGD
with the same learning rate, and a script's hyper-parameters mean the same on 1 or 64 ranks.
``reduce="sum"`` gives DL4J's rule.

Non-finite values: ``nonfinite="raise"`` (default) raises NonFiniteStepError on every rank, naming the
step and the rank(s). ``nonfinite="skip"`` drops the step on every rank: residuals, thresholds,
parameters and the step counter are left as they were and ``step()`` returns without stepping
(``opt.step_skipped`` is True). "skip" keeps a copy of each residual (one more float32 per parameter)
to restore it. In "updates" mode the skip check of the gradients costs one tiny allreduce per step before
the inner step, so that optimizer state is not touched either (a non-finite update from finite gradients
is still caught by the exchange; parameters and residuals are restored, the inner optimizer's state has
advanced). With "raise", residuals of buckets exchanged earlier in the failed step are not restored:
reload a checkpoint to continue.

Momentum correction (``momentum=m``, mode="gradients" only; Deep Gradient Compression, Lin et al. 2018):
with a momentum SGD as inner optimizer, momentum is applied AFTER sparsification, and at high compression
that costs accuracy. With ``momentum=m`` each bucket keeps a local velocity u = m*u + g of this rank's
gradient, encodes u (the residual accumulates velocities), zeroes u where this rank sent (momentum factor
masking), and hands the decoded mean to an inner optimizer WITHOUT momentum: write
``SharedOptimizer(torch.optim.SGD(params, lr), momentum=0.9)`` instead of ``SGD(params, lr, momentum=0.9)``.
The constructor raises ValueError if an inner param group has momentum > 0. Velocities are in
``state_dict`` and are rolled back on a skipped step. Thresholds see velocities (about 1/(1-m) times the
gradient scale: start ``Adaptive`` near that) and ``clipping=None`` keeps accumulated velocity that
ResidualClipping would discard; see gradshare.hooks for what the MNIST CNN benchmark uses. A density
warm-up (``Adaptive(..., warmup_steps=K)``, gradshare.thresholds) is available for the first steps.

Buckets are fixed when the wrapper is built: parameter groups added later are not shared.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from gradshare.comm import NonFiniteStepError, exchange, zero_sent
from gradshare.stats import Statistics, StepRecord, residual_norm
from gradshare.thresholds import Adaptive, ResidualClipping, Threshold, as_threshold
from gradshare.wrapped_optimizer import WrappedOptimizer

MODES = ("gradients", "updates")


class _Bucket:
    def __init__(self, index: int, params: List[torch.Tensor], threshold: Threshold, skip: bool):
        self.index = index
        self.params = params
        self.numels = [p.numel() for p in params]
        self.offsets = []
        off = 0
        for k in self.numels:
            self.offsets.append(off)
            off += k
        self.n = off
        dev = params[0].device
        self.flat = torch.zeros(self.n, dtype=torch.float32, device=dev)
        self.residual = torch.zeros(self.n, dtype=torch.float32, device=dev)
        self.backup = torch.empty(self.n, dtype=torch.float32, device=dev) if skip else None
        self.velocity: Optional[torch.Tensor] = None           # momentum correction only
        self.velocity_backup: Optional[torch.Tensor] = None
        self.snapshot: Optional[torch.Tensor] = None
        self.threshold = threshold

    def views(self, flat: torch.Tensor):
        for p, o, k in zip(self.params, self.offsets, self.numels):
            yield p, flat[o:o + k].view_as(p)

    def gather_grads(self) -> torch.Tensor:
        for p, v in self.views(self.flat):
            if p.grad is None:
                v.zero_()
            else:
                v.copy_(p.grad)
        return self.flat

    def gather_params(self, out: torch.Tensor) -> torch.Tensor:
        for p, v in self.views(out):
            v.copy_(p.detach())
        return out


class SharedOptimizer(WrappedOptimizer):
    """Wraps a torch optimizer; ``step()`` shares gradients or updates over a process group first.

    Args:
        optimizer: the inner optimizer (its param_groups define the shared parameters).
        mode: "gradients" or "updates" (module docstring).
        threshold: template threshold, cloned per bucket (Adaptive() by default).
        clipping: ResidualClipping or None.
        process_group: the group to share over (None: default group; gloo or NCCL).
        nonfinite: "raise" or "skip".
        reduce: "mean" (default) or "sum" (DL4J) of the ranks' contributions.
        bucket_cap_mb: bucket size cap (fp32 MiB). fallback: "auto" / "never" / "always" dense path.
        stats: a Statistics to record into (default: a new one, ``opt.stats``).
        momentum: None (default, off) or m in [0, 1): DGC momentum correction with factor masking, mode
            "gradients" only; the inner optimizer must have no momentum (module docstring).

    The wrapper forwards ``param_groups``, ``state``, ``zero_grad``; give LR schedulers ``opt.optimizer``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, mode: str = "gradients",
                 threshold: Optional[Threshold] = Adaptive(),
                 clipping: Optional[ResidualClipping] = ResidualClipping(), process_group=None,
                 nonfinite: str = "raise", *, reduce: str = "mean", bucket_cap_mb: float = 25.0,
                 fallback: str = "auto", stats: Optional[Statistics] = None,
                 momentum: Optional[float] = None):
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        if momentum is not None:
            if not 0.0 <= float(momentum) < 1.0:
                raise ValueError(f"momentum: expected None or a value in [0, 1), got {momentum}")
            if mode != "gradients":
                raise ValueError('momentum correction needs mode="gradients" (in "updates" mode the inner '
                                 "optimizer's own momentum is local already)")
            inner = [g.get("momentum", 0) for g in optimizer.param_groups if g.get("momentum", 0)]
            if inner:
                raise ValueError(f"momentum={momentum}: the inner optimizer has momentum={inner[0]}; with "
                                 "momentum correction the velocity lives in SharedOptimizer, give the inner "
                                 "optimizer momentum=0 (e.g. torch.optim.SGD(params, lr))")
        self.momentum = None if momentum is None else float(momentum)
        if nonfinite not in ("raise", "skip"):
            raise ValueError(f"nonfinite: expected 'raise' or 'skip', got {nonfinite!r}")
        if reduce not in ("mean", "sum"):
            raise ValueError(f"reduce: expected 'mean' or 'sum', got {reduce!r}")
        self.optimizer = optimizer
        self.mode = mode
        self.threshold = as_threshold(threshold).clone()
        self.clipping = copy.deepcopy(clipping)
        self.process_group = process_group
        self.nonfinite = nonfinite
        self.reduce = reduce
        self.fallback = fallback
        self.stats = stats if stats is not None else Statistics()
        self.step_count = 0
        self.step_skipped = False
        self._buckets = self._make_buckets(bucket_cap_mb)
        if self.momentum is not None:
            for b in self._buckets:
                b.velocity = torch.zeros_like(b.residual)
                if nonfinite == "skip":
                    b.velocity_backup = torch.empty_like(b.residual)

    def _make_buckets(self, cap_mb: float) -> List[_Bucket]:
        cap = max(1, int(cap_mb * 2**20 / 4))
        seen, open_, done = set(), {}, []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
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
        return [_Bucket(i, ps, self.threshold.clone(), self.nonfinite == "skip") for i, ps in enumerate(done)]

    # -- gradshare state -------------------------------------------------------------------------------
    @property
    def thresholds(self) -> List[Threshold]:
        """One threshold per bucket."""
        return [b.threshold for b in self._buckets]

    # -- the step -------------------------------------------------------------------------------------------
    def step(self, closure: Optional[Callable[[], Any]] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.step_skipped = False
        if self.mode == "gradients":
            results = self._exchange(lambda b: b.gather_grads())
            if results is None:
                return loss
            for b, _ in results:
                for p, v in b.views(b.flat):
                    if p.grad is None:
                        p.grad = v.to(p.dtype).clone()
                    else:
                        p.grad.copy_(v)
            self.optimizer.step()
        else:
            if self.nonfinite == "skip" and not self._grads_finite():
                self._skip([], reason="gradients")
                return loss
            for b in self._buckets:
                if b.snapshot is None:
                    b.snapshot = torch.empty(b.n, dtype=torch.float32, device=b.flat.device)
                b.gather_params(b.snapshot)
            self.optimizer.step()

            def update_of(b: _Bucket) -> torch.Tensor:
                b.gather_params(b.flat)
                return torch.sub(b.snapshot, b.flat, out=b.flat)   # params_before - params_after

            results = self._exchange(update_of, restore_params=True)
            if results is None:
                return loss
            with torch.no_grad():
                for b, _ in results:
                    torch.sub(b.snapshot, b.flat, out=b.flat)       # before - combined update
                    for p, v in b.views(b.flat):
                        p.copy_(v)
        self._finish_step(results)
        return loss

    def _exchange(self, buffer_of, restore_params: bool = False):
        step = self.step_count
        clip = self.clipping.factor(step) if self.clipping is not None else None
        done = []
        for b in self._buckets:
            buf = buffer_of(b)
            if b.velocity is not None:                # momentum correction: encode u = m*u + g
                if b.velocity_backup is not None:
                    b.velocity_backup.copy_(b.velocity)
                buf = b.velocity.mul_(self.momentum).add_(buf)
            try:
                r = exchange(buf, b.residual, b.threshold.tau, out=b.flat, group=self.process_group,
                             average=self.reduce == "mean", clip=clip, fallback=self.fallback, backup=b.backup,
                             nonfinite=self.nonfinite, step=step, name=f"bucket {b.index}")
            except NonFiniteStepError:
                if restore_params:
                    self._restore_params()
                raise
            if r.skipped:
                if restore_params:
                    self._restore_params()
                if b.velocity_backup is not None:
                    b.velocity.copy_(b.velocity_backup)
                self._skip(done + [(b, r)], reason="exchange")
                return None
            done.append((b, r))
        return done

    def _restore_params(self) -> None:
        with torch.no_grad():
            for b in self._buckets:
                for p, v in b.views(b.snapshot):
                    p.copy_(v)

    def _grads_finite(self) -> bool:
        """Agreed on all ranks: every gradient finite (one 1-element allreduce)."""
        dev = self._buckets[0].flat.device if self._buckets else torch.device("cpu")
        flags = [torch.isfinite(p.grad).all() for b in self._buckets for p in b.params if p.grad is not None]
        bad = (~torch.stack(flags)).any().float().reshape(1).to(dev) if flags else torch.zeros(1, device=dev)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.process_group)
        return bad.item() == 0

    def _skip(self, done, reason: str) -> None:
        for b, r in done:
            if b.backup is not None and not r.skipped:
                b.residual.copy_(b.backup)
            if b.velocity_backup is not None and not r.skipped:
                b.velocity.copy_(b.velocity_backup)
        for b, r in done:
            self.stats.add(self._record(b, r, skipped=True))
        self.step_skipped = True
        self.stats.end_step()

    def _record(self, b: _Bucket, r, skipped: bool = False) -> StepRecord:
        norm = residual_norm(b.residual) if (not skipped and self.stats.wants_norm(self.step_count)) else None
        return StepRecord(step=self.step_count, bucket=b.index, n=r.n, tau=r.tau, count=r.count,
                          density=r.density, format="skipped" if skipped else r.format,
                          bytes_sent=r.bytes_sent, dense_bytes=r.dense_bytes, residual_norm=norm)

    def _finish_step(self, results) -> None:
        for b, r in results:
            b.threshold.observe(r.count, r.n, r.message_format)
            if b.velocity is not None:
                zero_sent(b.velocity, r)              # momentum factor masking
            self.stats.add(self._record(b, r))
        self.step_count += 1
        self.stats.end_step()

    # -- checkpoints ----------------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Inner optimizer state plus residuals, thresholds, step counter and statistics totals."""
        return {"optimizer": self.optimizer.state_dict(),
                "gradshare": {"mode": self.mode, "step": self.step_count,
                              "residuals": [b.residual.detach().cpu().clone() for b in self._buckets],
                              "thresholds": [b.threshold.state_dict() for b in self._buckets],
                              "clipping": None if self.clipping is None else self.clipping.state_dict(),
                              "stats": self.stats.state_dict(), "momentum": self.momentum,
                              "velocities": None if self.momentum is None else
                              [b.velocity.detach().cpu().clone() for b in self._buckets]}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        g = state["gradshare"]
        if len(g["residuals"]) != len(self._buckets):
            raise ValueError(f"load_state_dict: checkpoint has {len(g['residuals'])} buckets, this optimizer "
                             f"{len(self._buckets)} (same parameters and bucket_cap_mb needed)")
        for b, r in zip(self._buckets, g["residuals"]):
            if r.numel() != b.n:
                raise ValueError(f"load_state_dict: bucket {b.index} has {b.n} elements, checkpoint {r.numel()}")
        self.optimizer.load_state_dict(state["optimizer"])
        for b, r, t in zip(self._buckets, g["residuals"], g["thresholds"]):
            b.residual.copy_(r)
            b.threshold.load_state_dict(t)
        if self.clipping is not None and g.get("clipping") is not None:
            self.clipping.load_state_dict(g["clipping"])
        self.step_count = int(g["step"])
        self.stats.load_state_dict(g["stats"])
        for b in self._buckets:
            if b.velocity is not None:
                b.velocity.zero_()
        if self.momentum is not None and g.get("velocities") is not None:
            for b, v in zip(self._buckets, g["velocities"]):
                b.velocity.copy_(v)

    def __repr__(self) -> str:
        return (f"SharedOptimizer({type(self.optimizer).__name__}, mode={self.mode!r}, buckets={len(self._buckets)}, "
                f"threshold={self.threshold!r}, clipping={self.clipping!r}, reduce={self.reduce!r}, "
                f"momentum={self.momentum!r})")
