"""Gradient sharing as a DDP communication hook: one line added to an existing DDP script.

    from gradshare.hooks import ThresholdState, threshold_hook
    ddp = DistributedDataParallel(model)
    state = ThresholdState(process_group=None, threshold=Adaptive())
    ddp.register_comm_hook(state, threshold_hook)

Each DDP bucket's gradient is threshold-encoded with that bucket's own residual (error feedback) and
threshold, exchanged (gradshare.comm: lengths, then one padded all-gather, dense allreduce fallback when
cheaper) and decoded; the hook returns the MEAN of what all ranks sent, like DDP's allreduce. The hook
does not block: it encodes, launches the lengths gather and returns a future chained on the collectives,
so exchanges overlap the rest of backward.

Residuals are kept per parameter position, not per bucket index: when DDP rebuilds its buckets after the
first iteration, each new bucket gathers its residual from the parameters' previous buckets (and its
threshold from the bucket that held its first parameter). Checkpoints name parameters by the order in
which the hook first met them, which is the same in every process built from the same model and DDP
settings (DDP's initial buckets are deterministic), so ``state_dict`` / ``load_state_dict`` restore
training exactly. The state pickles without its process group (like torch's PowerSGDState).

Non-finite gradients: ``nonfinite="raise"`` (default) fails backward on every rank with
NonFiniteStepError naming the step and rank(s). ``nonfinite="skip"`` restores every bucket's residual and
threshold for that step on every rank, returns zero gradients for the offending bucket, and sets
``state.step_skipped``: guard the optimizer with ``if state.should_step(): opt.step()`` (a hook cannot
stop DDP from handing gradients to the optimizer, and momentum or weight decay move parameters even on
zero gradients). "skip" keeps a copy of each residual (one more float32 per parameter). After a "raise",
residuals are not restored: reload a checkpoint to continue.

Momentum correction (Deep Gradient Compression, Lin et al. 2018), ``momentum=m``: applying momentum
AFTER sparsification (an inner SGD with momentum on the decoded gradient) lets stale, delayed residual
entries keep pushing through the velocity and loses accuracy at high compression. With ``momentum=m``
each bucket keeps a local velocity u = m*u + g (g: this rank's gradient) and encodes u with the residual
as error feedback (the residual accumulates velocities, not gradients); after the exchange u is zeroed
at the elements this rank sent (momentum factor masking). The hook then returns the mean of the sent
velocities, so the optimizer must NOT add momentum again: use ``torch.optim.SGD(params, lr)`` (momentum
0; weight decay is fine) where the script used ``SGD(params, lr, momentum=m)``. The hook cannot see the
optimizer, so this is not checked. Velocities are kept per parameter like residuals (they follow DDP's
bucket rebuild, are in ``state_dict`` and restore exactly) and are rolled back with residuals on a
skipped step. Thresholds then see velocities, about 1/(1-m) times the gradient scale: start ``Adaptive``
near that, let it adapt quickly, and prefer ``clipping=None`` (ResidualClipping's c*tau bound throws
away accumulated velocity). The MNIST CNN benchmark (bench/e2e.py, m=0.9) uses
``Adaptive(initial=0.01, decay=0.8)``, no clipping, no warm-up.

Exact resume: residuals (and velocities) always restore exactly. Thresholds are per bucket; a fresh DDP
runs its first iteration on its initial bucket layout, so training continues bit for bit when that
layout holds the same groups of parameters as the layout at the checkpoint (true when DDP's rebuild
keeps the composition, e.g. a model in one bucket); otherwise each initial bucket starts from the
threshold saved for its first parameter and the run continues closely, not bitwise.
"""

import copy
import threading
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from gradshare.comm import Channel, exchange_async, zero_sent
from gradshare.stats import Statistics, StepRecord, residual_norm
from gradshare.thresholds import Adaptive, ResidualClipping, Threshold, as_threshold

_NONFINITE = ("raise", "skip")


class _Bucket:
    """Residual, velocity, backups and threshold for one composition of parameters (one DDP bucket)."""

    def __init__(self, params, sids, offsets, residual, threshold, velocity=None):
        self.params = list(params)          # strong refs keep the ids used as keys valid
        self.sids = sids
        self.offsets = offsets
        self.residual = residual
        self.velocity: Optional[torch.Tensor] = velocity      # momentum correction only
        self.threshold = threshold
        self.backup: Optional[torch.Tensor] = None
        self.velocity_backup: Optional[torch.Tensor] = None


class ThresholdState:
    """State of ``threshold_hook``: one residual and threshold per DDP bucket, statistics, step counter.

    Args:
        process_group: the group DDP reduces over (None: the default group).
        threshold: template threshold, cloned for every bucket (Adaptive() by default). For gradients
            (not lr-scaled updates) an ``initial`` near typical gradient magnitudes adapts fastest.
        clipping: ResidualClipping or None.
        nonfinite: "raise" or "skip" (see the module docstring).
        average: return the mean (True, what DDP does) or the sum of what the ranks sent.
        fallback: "auto" / "never" / "always" dense allreduce (gradshare.comm).
        stats: a Statistics to record into (default: a new one, ``state.stats``).
        momentum: None (default, off) or m in [0, 1): DGC momentum correction with factor masking (module
            docstring); the optimizer must then run without momentum. Typical: the momentum the script's
            SGD used (0.9), with ``Adaptive(..., warmup_steps=...)`` for the first steps.
    """

    def __init__(self, process_group=None, threshold: Optional[Threshold] = Adaptive(),
                 clipping: Optional[ResidualClipping] = ResidualClipping(), nonfinite: str = "raise", *,
                 average: bool = True, fallback: str = "auto", stats: Optional[Statistics] = None,
                 momentum: Optional[float] = None):
        if nonfinite not in _NONFINITE:
            raise ValueError(f"nonfinite: expected 'raise' or 'skip', got {nonfinite!r}")
        if momentum is not None and not 0.0 <= float(momentum) < 1.0:
            raise ValueError(f"momentum: expected None or a value in [0, 1), got {momentum}")
        self.momentum = None if momentum is None else float(momentum)
        self.process_group = process_group
        self.threshold = as_threshold(threshold).clone()
        self.clipping = copy.deepcopy(clipping)
        self.nonfinite = nonfinite
        self.average = average
        self.fallback = fallback
        self.stats = stats if stats is not None else Statistics()
        self.iteration = 0
        self.step_skipped = False
        self._init_runtime()
        self._buckets: Dict[tuple, _Bucket] = {}
        self._home: Dict[int, tuple] = {}          # id(param) -> (bucket key, offset)
        self._sid: Dict[int, int] = {}             # id(param) -> stable position
        self._pending_residuals: Dict[int, torch.Tensor] = {}
        self._pending_velocities: Dict[int, torch.Tensor] = {}
        self._pending_thresholds: Dict[int, Dict[str, Any]] = {}

    def _init_runtime(self) -> None:
        self._channel: Optional[Channel] = None
        self._lock = threading.Lock()
        self._inflight: List[tuple] = []           # (bucket, future of ExchangeResult, DDP bucket index)

    def channel(self) -> Channel:
        if self._channel is None:
            self._channel = Channel(self.process_group)
        return self._channel

    def should_step(self) -> bool:
        """False when the last backward's exchange was dropped (nonfinite="skip")."""
        return not self.step_skipped

    # -- buckets ---------------------------------------------------------------------------------------
    def _stable_id(self, p) -> int:
        s = self._sid.get(id(p))
        if s is None:
            s = self._sid[id(p)] = len(self._sid)
        return s

    def bucket_for(self, params, buffer: torch.Tensor) -> _Bucket:
        """The state for this composition of parameters; built (from previous buckets) on first sight."""
        key = tuple(id(p) for p in params)
        b = self._buckets.get(key)
        if b is not None:
            return b
        numels = [p.numel() for p in params]
        if sum(numels) != buffer.numel():
            raise ValueError(f"bucket: parameters hold {sum(numels)} elements but the buffer {buffer.numel()}")
        offsets, off = [], 0
        for k in numels:
            offsets.append(off)
            off += k
        residual = torch.zeros(buffer.numel(), dtype=torch.float32, device=buffer.device)
        velocity = torch.zeros_like(residual) if self.momentum is not None else None
        sids = [self._stable_id(p) for p in params]
        threshold = None
        for p, sid, o, k in zip(params, sids, offsets, numels):
            home = self._home.get(id(p))
            if home is not None:
                old = self._buckets[home[0]]
                residual[o:o + k].copy_(old.residual[home[1]:home[1] + k])
                if velocity is not None and old.velocity is not None:
                    velocity[o:o + k].copy_(old.velocity[home[1]:home[1] + k])
                if threshold is None:
                    threshold = old.threshold.clone()
            elif sid in self._pending_residuals:
                saved = self._pending_residuals.pop(sid)
                if saved.numel() != k:
                    raise ValueError(f"load_state_dict: parameter #{sid} has {k} elements, checkpoint {saved.numel()}")
                residual[o:o + k].copy_(saved.view(-1))
            if home is None and sid in self._pending_velocities:
                saved = self._pending_velocities.pop(sid)
                if velocity is not None:
                    if saved.numel() != k:
                        raise ValueError(f"load_state_dict: parameter #{sid} has {k} elements, velocity in the "
                                         f"checkpoint {saved.numel()}")
                    velocity[o:o + k].copy_(saved.view(-1))
            if threshold is None and sid in self._pending_thresholds:
                threshold = self.threshold.clone()
                threshold.load_state_dict(self._pending_thresholds[sid])
        for sid in sids:
            self._pending_thresholds.pop(sid, None)
        b = _Bucket(params, sids, offsets, residual, threshold or self.threshold.clone(), velocity)
        self._buckets[key] = b
        for p, o in zip(params, offsets):
            self._home[id(p)] = (key, o)
        live = {h[0] for h in self._home.values()}
        for k in [k for k in self._buckets if k not in live]:
            del self._buckets[k]
        return b

    # -- checkpoints -------------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Residuals (and velocities) by parameter position, thresholds per bucket, step counter, statistics."""
        residuals = {sid: t.clone() for sid, t in self._pending_residuals.items()}
        velocities = {sid: t.clone() for sid, t in self._pending_velocities.items()}
        buckets = []
        for b in self._buckets.values():
            for sid, o, p in zip(b.sids, b.offsets, b.params):
                residuals[sid] = b.residual[o:o + p.numel()].detach().cpu().clone()
                if b.velocity is not None:
                    velocities[sid] = b.velocity[o:o + p.numel()].detach().cpu().clone()
            buckets.append({"sids": list(b.sids), "threshold": b.threshold.state_dict()})
        pending = {sid: st for sid, st in self._pending_thresholds.items()}
        return {"iteration": self.iteration, "residuals": residuals, "buckets": buckets,
                "pending_thresholds": pending, "template": self.threshold.state_dict(),
                "clipping": None if self.clipping is None else self.clipping.state_dict(),
                "stats": self.stats.state_dict(), "momentum": self.momentum, "velocities": velocities}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore; the buckets are rebuilt from it at the next backward (before or after DDP's rebuild)."""
        self.iteration = int(state["iteration"])
        self.threshold.load_state_dict(state["template"])
        if self.clipping is not None and state.get("clipping") is not None:
            self.clipping.load_state_dict(state["clipping"])
        self.stats.load_state_dict(state["stats"])
        self._pending_residuals = {int(k): v.detach().clone() for k, v in state["residuals"].items()}
        self._pending_velocities = {int(k): v.detach().clone() for k, v in state.get("velocities", {}).items()}
        self._pending_thresholds = {int(k): v for k, v in state.get("pending_thresholds", {}).items()}
        for b in state["buckets"]:
            for sid in b["sids"]:
                self._pending_thresholds[int(sid)] = b["threshold"]
        self._buckets.clear()
        self._home.clear()
        self.step_skipped = False

    def __getstate__(self):
        return {"config": {"threshold": self.threshold, "clipping": self.clipping, "nonfinite": self.nonfinite,
                           "average": self.average, "fallback": self.fallback, "momentum": self.momentum},
                "stats_config": {"max_records": self.stats.records.maxlen, "norm_every": self.stats.norm_every,
                                 "log_every": self.stats.log_every},
                "state": self.state_dict()}

    def __setstate__(self, d):
        cfg = d["config"]
        self.__init__(None, cfg["threshold"], cfg["clipping"], cfg["nonfinite"], average=cfg["average"],
                      fallback=cfg["fallback"], stats=Statistics(**d["stats_config"]),
                      momentum=cfg.get("momentum"))
        self.load_state_dict(d["state"])

    # -- one iteration ---------------------------------------------------------------------------------
    def _finish_iteration(self, futures: List[tuple]) -> None:
        """Runs once every bucket of an iteration is exchanged: thresholds, statistics, skip rollback."""
        results = [(b, f.value(), idx) for b, f, idx in futures]
        skipped = any(r.skipped for _, r, _ in results)
        step = self.iteration
        want_norm = self.stats.wants_norm(step)
        for b, r, idx in results:
            if skipped:
                if b.backup is not None:
                    b.residual.copy_(b.backup)
                if b.velocity_backup is not None:
                    b.velocity.copy_(b.velocity_backup)
            else:
                b.threshold.observe(r.count, r.n, r.message_format)
                if b.velocity is not None:
                    zero_sent(b.velocity, r)          # momentum factor masking
            self.stats.add(StepRecord(step=step, bucket=idx, n=r.n, tau=r.tau, count=r.count, density=r.density,
                                      format=r.format, bytes_sent=r.bytes_sent, dense_bytes=r.dense_bytes,
                                      residual_norm=residual_norm(b.residual) if want_norm else None))
        self.step_skipped = skipped
        if not skipped:
            self.iteration += 1
        self.stats.end_step()


def threshold_hook(state: ThresholdState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: threshold-encoded exchange of ``bucket`` with error feedback; mean of all ranks.

    Register with ``ddp.register_comm_hook(ThresholdState(...), threshold_hook)``.
    """
    buf = bucket.buffer()
    b = state.bucket_for(bucket.parameters(), buf)
    if state.nonfinite == "skip" and b.backup is None:
        b.backup = torch.empty_like(b.residual)
    update = buf
    if b.velocity is not None:                    # momentum correction: encode u = m*u + g
        if state.nonfinite == "skip":
            if b.velocity_backup is None:
                b.velocity_backup = torch.empty_like(b.velocity)
            b.velocity_backup.copy_(b.velocity)
        update = b.velocity.mul_(state.momentum).add_(buf.view(-1))
    step = state.iteration
    clip = state.clipping.factor(step) if state.clipping is not None else None
    fut = exchange_async(update, b.residual, b.threshold.tau, out=buf, channel=state.channel(),
                         group=state.process_group, average=state.average, clip=clip,
                         fallback=state.fallback, backup=b.backup, nonfinite=state.nonfinite, step=step,
                         name=f"DDP bucket {bucket.index()}")
    with state._lock:
        state._inflight.append((b, fut, bucket.index()))
        if not bucket.is_last():
            return fut.then(lambda f: f.value().out)
        inflight, state._inflight = state._inflight, []

    def finish(all_done) -> torch.Tensor:
        all_done.value()                          # raises the first bucket's error, if any
        state._finish_iteration(inflight)
        return fut.value().out

    return torch.futures.collect_all([f for _, f, _ in inflight]).then(finish)
