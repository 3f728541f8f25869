"""Gradient sharing as a DDP communication hook: one line added to an existing DDP script.

    from gradshare import ThresholdState, threshold_hook
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    ddp.register_comm_hook(ThresholdState(optimizer=opt), threshold_hook)

With ``optimizer=`` (recommended) the hook shares what the optimizer does (gradshare.sharing, "updates"):
during backward it hands each bucket's local gradient to DDP unchanged (under a GradScaler, or with
``nonfinite="skip"``, it also agrees with the other ranks on whether any gradient was non-finite, one flag
per rank); ``opt.step()`` then runs the user's optimizer locally, and
gradshare, from the optimizer's step hooks, shares the change it made with error feedback and gives every
rank the same decoded mean. The optimizer, its scheduler, gradient clipping and a GradScaler are used as
in plain DDP. What a step does not send waits in each rank's own model (``error_feedback``), whose default
compression is the top 5% as signs; between steps every rank's parameters show the round's mean result, the
same bits on every rank (gradshare.sharing, ``show_mean``). With one
rank the hook returns DDP's own result and nothing is encoded. With the default compression the state is
link-aware (gradshare.link): on steps where compressing is slower than DDP's all-reduce on this link, the
hook is DDP's all-reduce (overlapped with backward) and the optimizer steps on the mean gradient.

Without ``optimizer=`` the hook shares gradients (gradshare.sharing, "gradients"): each DDP bucket's
gradient is encoded with that bucket's residual and exchanged, and the hook returns the MEAN of what all
ranks sent, like DDP's allreduce. It launches the exchange and returns a future, so exchanges overlap
the rest of backward. Adam-like optimizers train worse this way: pass ``optimizer=`` (a warning says so
at the first ``opt.step()`` of one that steps these parameters).

Residuals of the gradients mode are kept per parameter position, not per bucket index: when DDP rebuilds
its buckets after the first iteration, each new bucket gathers its residual from the parameters' previous
buckets (and its policy state from the bucket that held its first parameter). Checkpoints name
parameters by the order in which the hook first met them, which is the same in every process built from
the same model and DDP settings (DDP's initial buckets are deterministic), so ``state_dict`` /
``load_state_dict`` restore training exactly; thresholds of +-tau policies continue bit for bit when
DDP's initial layout holds the same groups of parameters as the layout at the checkpoint (e.g. a model
in one bucket), and closely otherwise. In updates mode buckets are the optimizer's and always restore
exactly. The state pickles without its process group and optimizer (like torch's PowerSGDState).

Non-finite gradients: ``nonfinite="raise"`` (default) fails on every rank with NonFiniteStepError naming
the step and rank(s): in backward (gradients mode) or in ``opt.step()`` (updates mode: a rank whose gradients
are not finite does not step and shares them, and the exchange stops every rank). A GradScaler skips
``step()`` on a rank whose scaled gradients overflowed, so every rank must see that overflow before its
step: until a step shows that no GradScaler calls it (the first one, without a scaler), the last bucket of
each backward gathers one non-finite flag per rank and, if any is set, makes that bucket non-finite on every
rank, so every scaler skips together as with DDP; a script without a scaler then saves that round trip.
``nonfinite="skip"`` drops the step on every rank: residuals, thresholds and (updates mode) parameters and
optimizer state are left as they were, ``state.step_skipped`` is set; in gradients mode guard the optimizer
with ``if state.should_step(): opt.step()``.

Mixed precision: with ``optimizer=`` the updates are shared after a GradScaler unscaled the gradients, so the
loss scale changes nothing that is sent. Sharing gradients under a GradScaler, pass it
(``ThresholdState(scaler=scaler)``): buckets are encoded in unscaled units, and an overflow on any rank makes
every rank's scaler skip the step and back off.
"""

import inspect
import sys
import threading
import warnings
import weakref
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from gradshare import comm, momentum_masking as masking
from gradshare._deprecation import RenamedAttribute, renamed_kwargs
from gradshare.comm import NonFiniteStepError
from gradshare.sharing import Bucket, Sharing, SharingFront
from gradshare.sparse_moments import EVERY as SPARSE_MOMENTS_EVERY
from gradshare.costmodel import ring_allreduce_bytes
from gradshare.link import ALLREDUCE
from gradshare.process_group import chain
from gradshare.stats import Statistics, StepRecord
from gradshare.thresholds import ResidualClipping

_DEFAULT = object()


class ThresholdState(SharingFront):
    """State of ``threshold_hook``: the sharing core, DDP's bucket mapping, and the step's futures.

    Args:
        process_group: the group DDP reduces over (None: the default group).
        compression: what is sent (gradshare.compression; default: chosen for ``optimizer``, TopK()
            without one). DL4J's +-tau thresholds (Fixed, Adaptive) work too.
        clipping: DL4J's residual clipping for +-tau thresholds (default ResidualClipping() with them).
        nonfinite: "raise" or "skip" (see the module docstring).
        average: return the mean (True, what DDP does) or the sum of what the ranks sent.
        fallback: "auto" / "never" / "always" dense allreduce (gradshare.comm).
        stats: a Statistics to record into (default: a new one, ``state.stats``).
        momentum: None (default) or m in [0, 1): momentum correction in gradshare for gradients mode
            (the optimizer must then run without momentum). Not used with ``optimizer=``.
        optimizer: the optimizer that steps the DDP model: share its updates (recommended). Several
            optimizers (a list: Muon for the matrices and AdamW for the rest, say): each one's updates are
            shared with the compression chosen for it, the first one's link-aware choice taken by all. A
            parameter of the DDP model that no optimizer given steps is all-reduced as DDP does; an optimizer
            not given that steps parameters a given one steps raises (the replicas would differ).
        bucket_cap_mb: bucket size (fp32 MiB) of the updates mode; None (default): a quarter of the shared
            parameters' size, between 8 and 25 MiB (gradshare.sharing.auto_bucket_cap_mb: a few buckets, so that
            one is encoded while another travels).
        link: "auto" (default): with ``optimizer=`` and the default compression, steps on which the link
            makes compression slower than DDP's all-reduce are DDP's all-reduce (gradshare.link); None:
            always compress.
        scaler: the ``torch.amp.GradScaler`` of a mixed-precision script, for gradients mode (without
            ``optimizer=``, which needs none: updates are shared after the scaler unscaled them). Each bucket
            is encoded divided by the loss scale and the mean multiplied back (exact: the scale is a power
            of two), so thresholds and residuals are in unscaled units whatever the scale does; a step whose
            gradients overflowed on any rank is dropped on every rank (``nonfinite`` is "skip") and the hook
            returns NaN, so every rank's scaler skips it and backs off, as with DDP. Not pickled.
        delay: 0 (default) or 1, with ``optimizer=``: each step's shared update is applied at the end of the
            next ``opt.step()``, so that its exchange travels while that step computes (gradshare.sharing;
            compresses every step). ``state.flush()`` applies the last one, e.g. before evaluating.
        momentum_masking: with ``optimizer=`` torch.optim.SGD or Adam's kin (of several optimizers, those), its
            momentum (Adam's first moment) is zeroed where an element that waited in the residual is sent the
            other way from its last send: the residual's stale push, which otherwise swings the waiting elements
            where gradients carry little noise (regression) and stalls the loss (gradshare.momentum_masking).
            None (default): SGD with any compression that holds something back, Adam's kin with top-k, where
            what waits is in the residual (``error_feedback="buffer"``); False: off; True: those optimizers with
            any compression, refused where it cannot apply.
        error_feedback: with ``optimizer=``, where what a step does not send waits. None (default): "model"
            with ``delay=0`` over float32/float64 parameters, "buffer" otherwise
            (gradshare.sharing.default_error_feedback). "model": in each
            rank's own parameters (the mean result plus the progress it has not sent yet), so that its next
            gradient is taken where its own progress brought it and its optimizer does not push again what
            waits; its default compression is the top 5% as signs for every optimizer (README, "Training
            quality"). Between steps every rank's parameters show the mean result, the same bits on every rank
            (evaluate and save them as with DDP); the first forward that trains puts each rank's own model back
            on (gradshare.sharing, ``show_mean``). ``state.merge()`` sends what waits, uncompressed. "buffer":
            in gradshare's residual, every rank's parameters the same mean result at every point (Adam's kin
            ternary-coded by default, SGD top-k with 8-bit values, momentum masking).
        sparse_moments: with ``optimizer=`` an adaptive optimizer (Adam's kin, RMSprop, Adagrad, Adadelta), every
            this many steps the ranks average its second moment of the parameters whose gradients are mostly zero
            (embedding tables, found over the first steps): each rank's own counts only its share of their rare
            gradients (gradshare.sparse_moments). Default 50; 0 or None: never.
        threshold: the former name of ``compression`` (deprecated).
    """

    @renamed_kwargs(threshold="compression")
    def __init__(self, process_group=None, compression: Any = None, clipping: Any = _DEFAULT,
                 nonfinite: str = "raise", *, average: bool = True, fallback: str = "auto",
                 stats: Optional[Statistics] = None, momentum: Optional[float] = None,
                 optimizer: Any = None, bucket_cap_mb: Optional[float] = None,
                 link: Any = "auto", scaler: Optional[Any] = None, delay: int = 0,
                 momentum_masking: Optional[bool] = None, error_feedback: Optional[str] = None,
                 sparse_moments: Optional[int] = SPARSE_MOMENTS_EVERY):
        optimizers = _optimizers(optimizer)
        optimizer = optimizers[0] if optimizers else None
        if len(optimizers) > 1 and delay:
            raise ValueError("delay=1 shares one optimizer's updates: with several optimizers use delay=0")
        if optimizer is not None and momentum is not None:
            raise ValueError("momentum= is for sharing gradients; with optimizer= the optimizer's own momentum "
                             "is used (leave momentum=None)")
        self.process_group = process_group
        clip = ResidualClipping() if clipping is _DEFAULT else clipping
        self._config = {"compression": compression, "clipping": clip, "nonfinite": nonfinite,
                        "average": average, "fallback": fallback, "momentum": momentum,
                        "bucket_cap_mb": bucket_cap_mb, "link": link, "delay": delay,
                        "error_feedback": error_feedback, "sparse_moments": sparse_moments}
        # Gradients mode under a GradScaler: an overflow is the scaler's to handle (every rank skips it).
        self.scaler = scaler if optimizer is None else None
        if self.scaler is not None and not callable(getattr(self.scaler, "get_scale", None)):
            raise TypeError(f"scaler: expected a torch.amp.GradScaler, got {type(scaler).__name__}")
        self.sharing = Sharing(compression, optimizer=optimizer, process_group=process_group,
                               reduce="mean" if average else "sum",
                               nonfinite="skip" if self.scaler is not None else nonfinite, fallback=fallback,
                               stats=stats, momentum=momentum, clipping=clip,
                               mode="updates" if optimizer is not None else "gradients", link=link, delay=delay,
                               momentum_masking=momentum_masking and (masking.applies(optimizer) or not any(
                                   masking.applies(o) for o in optimizers)), error_feedback=error_feedback,
                               show_mean=True, sparse_moments=sparse_moments)
        self.optimizer = optimizer                 # the first optimizer given: its core decides the path
        self.optimizers = optimizers
        self.sharings: List[Sharing] = [self.sharing]
        self.mode = self.sharing.mode
        self._init_runtime()
        # gradients mode: DDP's buckets, keyed by their parameters, and where each parameter lives
        self._buckets: Dict[tuple, Bucket] = {}
        self._home: Dict[int, tuple] = {}          # id(param) -> (bucket key, offset)
        self._sid: Dict[int, int] = {}             # id(param) -> stable position
        self._pending_residuals: Dict[int, torch.Tensor] = {}
        self._pending_velocities: Dict[int, torch.Tensor] = {}
        self._pending_policies: Dict[int, Dict[str, Any]] = {}
        # updates mode: per DDP bucket (keyed by its parameters), the slices of its buffer that hold
        # parameters no optimizer given steps (all-reduced as DDP does; see uncovered)
        self._uncovered: Dict[tuple, List[tuple]] = {}
        self._warned_uncovered = False
        self._core_of: Dict[int, Sharing] = {}    # id(optimizer) -> its sharing core
        self._handles = []
        for i, opt in enumerate(optimizers):
            # Several optimizers (Muon and AdamW, say): one sharing core each, with the compression chosen for
            # it; the first one's core takes the link-aware decision, which the others follow at each step.
            sh = self.sharing if i == 0 else Sharing(
                compression, optimizer=opt, process_group=process_group, reduce="mean" if average else "sum",
                nonfinite=nonfinite, fallback=fallback, stats=self.sharing.stats, clipping=clip, mode="updates",
                link=None, momentum_masking=momentum_masking and masking.applies(opt), error_feedback=error_feedback,
                show_mean=True, sparse_moments=sparse_moments)
            sh.build((p for g in opt.param_groups for p in g["params"]), bucket_cap_mb)
            if i:
                first = sum(len(c.buckets) for c in self.sharings)
                for b in sh.buckets:               # one numbering over all cores (statistics, agreement)
                    b.index += first
                self.sharings.append(sh)
            self._core_of[id(opt)] = sh
            self._handles += [opt.register_step_pre_hook(self._before_step),
                              opt.register_step_post_hook(self._after_step)]
        _watch_optimizer_steps(self)

    def uncovered(self, params) -> List[tuple]:
        """Updates mode: ``(offset, numel)`` of each parameter of a DDP bucket (``params``, in the bucket's
        order) that the optimizer given to this state does not step: a second optimizer's, or one added to
        a param group later. Their gradients are all-reduced as DDP would, so that whatever steps them sees
        the same mean gradient on every rank; a warning says so, once."""
        key = tuple(id(p) for p in params)
        out = self._uncovered.get(key)
        if out is None:
            covered = {id(p) for sh in self.sharings for b in sh.buckets for p in b.params}
            out, off = [], 0
            for p in params:
                if id(p) not in covered:
                    out.append((off, p.numel()))
                off += p.numel()
            self._uncovered[key] = out
            if out and not self._warned_uncovered:
                self._warned_uncovered = True
                warnings.warn(
                    f"gradshare: {len(out)} parameter(s) ({sum(k for _, k in out)} elements) that DDP reduces are "
                    f"not in the optimizer given to ThresholdState "
                    f"({', '.join(type(o).__name__ for o in self.optimizers)}); their gradients are all-reduced "
                    "uncompressed, as DDP does, so that the optimizer that steps them sees the same mean gradient "
                    "on every rank (pass every optimizer, optimizer=[...], to share theirs compressed too).",
                    UserWarning, stacklevel=3)
        return out

    def _init_runtime(self) -> None:
        self._lock = threading.Lock()
        self._inflight: List[tuple] = []           # (bucket, future of ExchangeResult)
        self._iteration: Optional[torch.futures.Future] = None   # gradients mode: this backward's outcome
        self._scale: Optional[float] = None        # gradients mode: this backward's loss scale (scaler=)
        self._bad = None                           # updates mode: this backward's non-finite flag
        self._nonfinite_ranks: List[int] = []      # updates mode: ranks whose gradients were not finite
        self._saved_grads: Dict[int, list] = {}    # updates mode, a dropped step: per core, the grads put aside
        self._allreduce_step: Dict[int, bool] = {}  # updates mode: per core, whether this step was all-reduced
        self._mean_bad = None                      # ... and whether the mean gradient holds a NaN or Inf
        self._backward_allreduce = False           # the path the last backward took (the first core's choice)
        self._backward_bf16 = False                # ... and whether its all-reduce went in bfloat16
        self._dropped: set = set()                 # cores that dropped this backward's step (nonfinite="skip")
        # updates mode: whether a GradScaler calls opt.step() (None: no step seen yet). Until known not to, every
        # backward gathers the ranks' non-finite flags (module docstring); _flagged: this backward did.
        self._scaled: Optional[bool] = None
        self._flagged = False
        self._share_grads: set = set()             # cores whose rank shares its non-finite gradients this step
        self._joined = False                       # in _joined_step (DDP.join(): this rank is out of inputs)
        self._backward_seen = False                # updates mode: a backward since the optimizer's last step

    # -- what the rest of gradshare reads ------------------------------------------------------------
    @property
    def step_count(self) -> int:
        """Steps shared so far (skipped steps not counted); the name SharedOptimizer and ParameterAveraging use."""
        return self.sharing.step

    iteration = RenamedAttribute("step_count")

    @property
    def nonfinite(self) -> str:
        return self.sharing.nonfinite

    def loss_scale(self) -> Optional[float]:
        """The scaler's current loss scale (gradients mode with ``scaler=``), or None when nothing is scaled."""
        if self.scaler is None or not self.scaler.is_enabled():
            return None
        return float(self.scaler.get_scale())

    def should_step(self) -> bool:
        """False when the last step's exchange was dropped (nonfinite="skip")."""
        return not self.sharing.step_skipped

    # -- updates mode: the optimizer's step hooks ------------------------------------------------------
    def flags_gathered(self) -> bool:
        """Updates mode: whether this backward's last bucket gathers every rank's non-finite flag: needed where
        a rank could skip ``opt.step()`` alone (a GradScaler) or where a dropped step must move no optimizer
        state (nonfinite="skip"); otherwise each rank checks its own gradients in ``opt.step()``."""
        return self._scaled is not False or self.sharing.nonfinite == "skip"

    def _before_step(self, optimizer, args, kwargs) -> None:
        sh = self._core_of.get(id(optimizer), self.sharing)
        sh.step_skipped = False
        if sh.world_size == 1:
            return
        if self._scaled is None:          # the same on every rank: each calls this step, from a scaler or not
            self._scaled = _called_by_grad_scaler()
        # The first core's link-aware choice; the others follow the path their gradients took in backward.
        allreduce = self._allreduce_step[id(sh)] = (sh.allreduce_now() if sh is self.sharing
                                                    else self._backward_allreduce)
        if allreduce:                     # the mean gradient is the same on every rank: a local check agrees
            with self._lock:
                bad, self._mean_bad = self._mean_bad, None
            self._nonfinite_ranks = [-1] if (sh.grads_nonfinite() if bad is None else bool(bad.item())) else []
        if self._nonfinite_ranks:
            if sh.nonfinite == "raise":
                ranks, self._nonfinite_ranks = self._nonfinite_ranks, []
                if ranks == [-1]:
                    raise NonFiniteStepError(sh.step, [], [], "mean gradient")
                raise NonFiniteStepError(sh.step, ranks, [-1] * len(ranks), "gradients")
            # Skip: the optimizer steps no parameter whose grad is None, so its state is not touched either.
            saved = self._saved_grads[id(sh)] = [(p, p.grad) for b in sh.buckets for p in b.params]
            for p, _ in saved:
                p.grad = None
            return
        if allreduce:
            sh.before_allreduce_step(optimizer)
            return
        sh.begin_updates()
        if not self._flagged and not self._joined and sh.nonfinite == "raise" and sh.grads_nonfinite():
            # no flags gathered in backward: this rank does not step and shares its gradients, and the exchange
            # stops every rank (SharedOptimizer's rule; "skip" always gathers them)
            self._saved_grads[id(sh)] = [(p, p.grad) for b in sh.buckets for p in b.params]
            self._share_grads.add(id(sh))
            for p, _ in self._saved_grads[id(sh)]:
                p.grad = None

    def _after_step(self, optimizer, args, kwargs) -> None:
        sh = self._core_of.get(id(optimizer), self.sharing)
        self._backward_seen = False
        if sh.world_size == 1:
            return
        saved = self._saved_grads.pop(id(sh), None)
        if id(sh) in self._share_grads:
            self._share_grads.discard(id(sh))
            for p, g in saved:
                p.grad = g
            sh.share_updates(share_grads=True)     # raises NonFiniteStepError on every rank
            return
        if saved is not None:
            for p, g in saved:
                p.grad = g
            self._dropped.add(id(sh))
            if len(self._dropped) == len(self.sharings):   # every core has dropped this backward's step
                self._nonfinite_ranks, self._dropped = [], set()
            sh.skip_step()
            return
        if self._allreduce_step.get(id(sh), False):
            sh.end_allreduce_step()
        else:
            sh.share_updates(joined=self._joined)

    def _joined_step(self) -> None:
        """``DDP.join()``, on a rank out of inputs, after DDP's shadow of the others' backward: the optimizer steps
        the ranks still training take. On an all-reduce step it steps on the mean gradient as they do; on a
        compressed one it shares a zero update (its residual still goes out) and its optimizer does not step.
        Either way it runs the same collectives and applies the same means, so replicas stay identical (DDP's
        joined ranks likewise contribute zero gradients)."""
        if self._backward_allreduce:
            for opt in self.optimizers:
                opt.step()                         # its step hooks run as on every other rank
            return
        self._joined = True
        try:
            for opt in self.optimizers:
                self._before_step(opt, (), {})
                self._after_step(opt, (), {})
        finally:
            self._joined = False

    # -- gradients mode: DDP's buckets ---------------------------------------------------------------
    def _stable_id(self, p) -> int:
        s = self._sid.get(id(p))
        if s is None:
            s = self._sid[id(p)] = len(self._sid)
        return s

    def bucket_for(self, params, buffer: torch.Tensor) -> Bucket:
        """The state for this composition of parameters; built (from previous buckets) on first sight."""
        key = tuple(id(p) for p in params)
        b = self._buckets.get(key)
        if b is not None:
            return b
        numels = [p.numel() for p in params]
        if sum(numels) != buffer.numel():
            raise ValueError(f"bucket: parameters hold {sum(numels)} elements but the buffer {buffer.numel()}")
        b = self.sharing.new_bucket(len(self._buckets), params)
        sids = [self._stable_id(p) for p in params]
        policy_from = None
        for p, sid, o, k in zip(params, sids, b.offsets, numels):
            home = self._home.get(id(p))
            if home is not None:
                old = self._buckets[home[0]]
                b.residual[o:o + k].copy_(old.residual[home[1]:home[1] + k])
                if b.velocity is not None and old.velocity is not None:
                    b.velocity[o:o + k].copy_(old.velocity[home[1]:home[1] + k])
                if policy_from is None:
                    policy_from = old.compression.state_dict()
                continue
            if sid in self._pending_residuals:
                saved = self._pending_residuals.pop(sid)
                if saved.numel() != k:
                    raise ValueError(f"load_state_dict: parameter #{sid} has {k} elements, checkpoint {saved.numel()}")
                b.residual[o:o + k].copy_(saved.view(-1))
            if sid in self._pending_velocities:
                saved = self._pending_velocities.pop(sid)
                if b.velocity is not None:
                    if saved.numel() != k:
                        raise ValueError(f"load_state_dict: parameter #{sid} has {k} elements, velocity in the "
                                         f"checkpoint {saved.numel()}")
                    b.velocity[o:o + k].copy_(saved.view(-1))
            if policy_from is None and sid in self._pending_policies:
                policy_from = self._pending_policies[sid]
        for sid in sids:
            self._pending_policies.pop(sid, None)
        if policy_from is not None:
            b.compression.load_state_dict(policy_from)
        b.sids = sids
        self._buckets[key] = b
        for p, o in zip(params, b.offsets):
            self._home[id(p)] = (key, o)
        live = {h[0] for h in self._home.values()}
        for k in [k for k in self._buckets if k not in live]:
            del self._buckets[k]
        return b

    def _finish_iteration(self, inflight: List[tuple]) -> None:
        self.sharing.finish([(b, f.value()) for b, f in inflight])

    # -- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Updates mode: the sharing core's state. Gradients mode: residuals (and velocities) by parameter
        position, policy state per bucket, step counter, statistics."""
        if self.mode == "updates":
            out = {"mode": "updates", "sharing": self.sharing.state_dict()}
            if len(self.sharings) > 1:             # the other optimizers' cores, in the order given
                out["others"] = [sh.state_dict() for sh in self.sharings[1:]]
            return out
        residuals = {sid: t.clone() for sid, t in self._pending_residuals.items()}
        velocities = {sid: t.clone() for sid, t in self._pending_velocities.items()}
        buckets = []
        for b in self._buckets.values():
            for sid, o, k in zip(b.sids, b.offsets, b.numels):
                residuals[sid] = b.residual[o:o + k].detach().cpu().clone()
                if b.velocity is not None:
                    velocities[sid] = b.velocity[o:o + k].detach().cpu().clone()
            buckets.append({"sids": list(b.sids), "policy": b.compression.state_dict()})
        return {"mode": "gradients", "iteration": self.sharing.step, "residuals": residuals, "buckets": buckets,
                "pending_policies": dict(self._pending_policies), "stats": self.sharing.stats.state_dict(),
                "momentum": self.sharing.momentum, "velocities": velocities}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore; gradients mode rebuilds its buckets from it at the next backward."""
        mode = state.get("mode", "gradients")
        if mode != self.mode:
            raise ValueError(f"load_state_dict: the checkpoint was written in {mode} mode, this state shares "
                             f"{self.mode} ({'with' if self.mode == 'updates' else 'without'} optimizer=)")
        if mode == "updates":
            others = state.get("others", [])
            if len(others) != len(self.sharings) - 1:
                raise ValueError(f"load_state_dict: the checkpoint shares the updates of {len(others) + 1} "
                                 f"optimizer(s), this state of {len(self.sharings)}")
            for sh, saved in zip(self.sharings, [state["sharing"]] + list(others)):
                sh.load_state_dict(saved)
            return
        self.sharing.step = int(state["iteration"])
        self.sharing.stats.load_state_dict(state["stats"])
        self._pending_residuals = {int(k): v.detach().clone() for k, v in state["residuals"].items()}
        self._pending_velocities = {int(k): v.detach().clone() for k, v in state.get("velocities", {}).items()}
        self._pending_policies = {int(k): v for k, v in state.get("pending_policies", {}).items()}
        for b in state["buckets"]:
            for sid in b["sids"]:
                self._pending_policies[int(sid)] = b["policy"]
        self._buckets.clear()
        self._home.clear()
        self.sharing.step_skipped = False

    def __getstate__(self):
        cfg = dict(self._config)
        return {"config": cfg, "mode": self.mode,
                "stats_config": {"max_records": self.stats.records.maxlen, "norm_every": self.stats.norm_every,
                                 "log_every": self.stats.log_every},
                "state": self.state_dict() if self.mode == "gradients" else None}

    def __setstate__(self, d):
        cfg = d["config"]
        self.__init__(None, cfg["compression"], cfg["clipping"], cfg["nonfinite"], average=cfg["average"],
                      fallback=cfg["fallback"], stats=Statistics(**d["stats_config"]), momentum=cfg["momentum"],
                      bucket_cap_mb=cfg["bucket_cap_mb"], link=cfg.get("link", "auto"),
                      error_feedback=cfg.get("error_feedback"),
                      sparse_moments=cfg.get("sparse_moments", SPARSE_MOMENTS_EVERY))
        if d.get("state") is not None:
            self.load_state_dict(d["state"])


def _watch_optimizer_steps(state: ThresholdState) -> None:
    """A global optimizer step hook (held by the state, which it holds weakly) that catches a script whose
    optimizer is not the one the state knows:

    - Updates mode: another optimizer stepping parameters whose updates the state shares, after a backward
      through the hook, raises before it steps. That backward's gradients are each rank's own (the exchange
      comes in the given optimizer's step), so its step would make the replicas differ, silently: a script
      that builds its optimizer again (a new phase, a resume) after ``ThresholdState(optimizer=opt)``. A
      wrapper of the given optimizer (its ``param_groups``, or ``.optimizer``) is the given one.
    - Gradients mode: an optimizer of Adam's kin stepping the parameters whose gradients the state shares is
      told, once, to be given as ``optimizer=``. Written as for torch's own hooks
      (``PowerSGDState(process_group=None)``), ``ThresholdState()`` trains it on a compressed mean gradient,
      worse than sharing its updates (README, "What is shared"). It looks until the state's second shared
      step: every optimizer of the loop has stepped once by then."""
    from gradshare.compression import ADAPTIVE, _caller_outside_gradshare

    ref = weakref.ref(state)
    verdicts: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()  # optimizer -> steps shared params
    covered: set = set()

    def holds(opt, ids) -> bool:
        return any(id(p) in ids for g in opt.param_groups for p in g["params"])

    def given(st, opt) -> bool:
        return any(opt is o or getattr(opt, "optimizer", None) is o or opt.param_groups is o.param_groups
                   for o in st.optimizers)

    def look(opt, args, kwargs) -> None:
        st = ref()
        if st is None:
            handle.remove()
            return
        if st.mode == "updates":
            if not st._backward_seen:
                return
            foreign = verdicts.get(opt)
            if foreign is None:
                if not covered:
                    covered.update(id(p) for sh in st.sharings for b in sh.buckets for p in b.params)
                foreign = verdicts[opt] = not given(st, opt) and holds(opt, covered)
            if foreign:
                for sh in st.sharings:     # error_feedback="model": the mean result again, the same on every rank
                    sh.show_mean_now()
                raise RuntimeError(
                    f"gradshare: a {type(opt).__name__} that ThresholdState(optimizer=...) was not given steps "
                    "parameters whose updates it shares, on each rank's own gradients: the replicas would differ. "
                    "Give the state the optimizer that steps the model (a script that builds its optimizer again "
                    "registers the hook on a new DDP model with a new ThresholdState(optimizer=new_opt)).")
            return
        if st.sharing.step >= 2:
            handle.remove()
            return
        if not isinstance(opt, ADAPTIVE) or not holds(opt, st._home):
            return
        handle.remove()
        name = type(opt).__name__
        warnings.warn(f"gradshare: ThresholdState() without optimizer= shares gradients, and {name} then steps on "
                      f"their compressed mean, which trains {name} worse than sharing its updates. Pass the "
                      "optimizer: ThresholdState(optimizer=opt).", UserWarning,
                      stacklevel=_caller_outside_gradshare(also=(torch,)))

    handle = register_optimizer_step_pre_hook(look)
    weakref.finalize(state, handle.remove)


def _done(t: torch.Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(t)
    return fut


def threshold_hook(state: ThresholdState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: shares ``bucket`` through gradshare (module docstring); register with
    ``ddp.register_comm_hook(ThresholdState(optimizer=opt), threshold_hook)``."""
    buf = bucket.buffer()
    sh = state.sharing
    if sh.world_size == 1:
        return _done(buf)
    if state.mode == "updates":
        return _updates_hook(state, bucket, buf)
    b = state.bucket_for(bucket.parameters(), buf)
    with state._lock:
        if state._iteration is None:              # completes when every bucket of this backward has
            state._iteration = torch.futures.Future()
            state._scale = state.loss_scale()
        iteration, scale = state._iteration, state._scale
    try:
        if buf.is_sparse:
            raise ValueError("threshold_hook: a sparse gradient (nn.Embedding(sparse=True) or EmbeddingBag) cannot "
                             "be threshold-encoded as a gradient; pass the optimizer (ThresholdState(optimizer=opt): "
                             "its dense updates are shared) or use sparse=False")
        if scale is not None:
            buf.div_(scale)                       # unscaled units: what thresholds and residuals mean
        fut = sh.start(b, buf, buf, f"DDP bucket {bucket.index()}")
    except BaseException as e:
        with state._lock:                         # this backward is over: nothing it started may stay applied
            started, state._inflight, state._iteration = [x for x, _ in state._inflight] + [b], [], None
        sh.abandon(started)
        iteration.set_exception(e)
        raise
    with state._lock:
        state._inflight.append((b, fut))
        if not bucket.is_last():
            # Each bucket's result is released with the whole step's, so that when any bucket fails DDP
            # sees the error only after every bucket has been put back (all or nothing).
            return chain(iteration, lambda done, fut=fut: _after(done, fut, scale))
        inflight, state._inflight, state._iteration = state._inflight, [], None

    def finish(all_done) -> torch.Tensor:
        try:
            for _, f in inflight:
                f.value()                         # raises the first bucket's error, if any
            state._finish_iteration(inflight)
        except BaseException as e:
            sh.abandon([x for x, _ in inflight])
            iteration.set_exception(e)
            raise
        out = _rescaled(fut.value(), scale)
        comm.settle(out.device)                   # queued on this callback's stream (comm.settle)
        iteration.set_result(None)
        return out

    return chain(torch.futures.collect_all([f for _, f in inflight]), finish)


def _after(done: torch.futures.Future, fut: torch.futures.Future, scale: Optional[float]) -> torch.Tensor:
    done.value()                                  # the step's error, if any bucket failed
    out = _rescaled(fut.value(), scale)
    comm.settle(out.device)
    return out


def _rescaled(result, scale: Optional[float]) -> torch.Tensor:
    """A bucket's decoded mean in the loss-scaled units DDP hands to the GradScaler (``scale`` None: as it is).
    A step dropped for a non-finite value is NaN there, so that every rank's scaler skips it and backs off."""
    if scale is None:
        return result.out
    if result.skipped:
        return result.out.fill_(float("nan"))
    return result.out.mul_(scale)


def _updates_hook(state: ThresholdState, bucket, buf: torch.Tensor) -> torch.futures.Future:
    """Updates mode (:func:`_updates_exchange`). Under ``DDP.join()`` a rank out of inputs runs this hook on zero
    buckets, outside any backward, to match the others' collectives; the others' exchange of updates comes in
    their ``opt.step()``, which this rank then matches too (:meth:`ThresholdState._joined_step`)."""
    joined = _outside_backward() and not bool(buf.any())     # DDP's shadow buckets are zeros
    fut = _updates_exchange(state, bucket, buf)
    if joined:
        out = fut.wait()
        if state._backward_allreduce:              # the mean gradient, which this rank's optimizer steps on too
            off = 0
            for p in bucket.parameters():
                p.grad = out[off:off + p.numel()].view_as(p).clone()
                off += p.numel()
        if bucket.is_last():
            state._joined_step()
    return fut


def _outside_backward() -> bool:
    """Whether DDP called the hook outside a backward pass: its join hook's shadow of one, on a joined rank."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() == -1


def _updates_exchange(state: ThresholdState, bucket, buf: torch.Tensor) -> torch.futures.Future:
    """Updates mode: the local gradient goes back to DDP unchanged. Where flags are gathered
    (:meth:`ThresholdState.flags_gathered`: a GradScaler, or nonfinite="skip") the last bucket agrees with every
    rank on which ranks saw a non-finite gradient in this backward (an all-gather of one flag per rank) and, if
    any did, makes this rank's last bucket non-finite too, so that every rank sees it (a GradScaler then skips
    the step everywhere, as with DDP)."""
    if bucket.index() == 0:
        state._backward_seen = True
        for sh in state.sharings:                  # the first step's first collective: ranks agree their configuration
            sh.agree_all()
        state._backward_allreduce = state.sharing.allreduce_now()
        state._backward_bf16 = state.sharing.allreduce_bf16()
        state.sharing.exchange_ready()             # DDP's first bucket: where an all-reduce would start
        state._dropped = set()
    if state._backward_allreduce:                  # DDP's own step: the mean gradient, overlapped with backward
        if bucket.index() == 0:                    # DDP reduces its buckets in order: a new backward
            with state._lock:
                state._mean_bad = None
        _record_uncovered(state, state.uncovered(bucket.parameters()))
        world = dist.get_world_size(state.process_group)
        if state._backward_bf16:                   # the link-aware precision: bfloat16 with error feedback
            return _bf16_allreduce(state, bucket.index(), buf, world)
        # Summed, then scaled in the pass that checks it (comm.scale_nonfinite); a half-precision bucket is
        # divided first, so that its sum cannot overflow.
        wide = buf.dtype in (torch.float32, torch.float64)
        if not wide:
            buf.div_(world)
        pending = state.sharing.pending_rounding(f"ddp bucket {bucket.index()}", buf.numel())
        if pending is not None:                    # what the last bfloat16 messages' rounding left out goes now
            buf.reshape(-1).add_(pending, alpha=world if wide else 1)
        work = dist.all_reduce(buf, group=state.process_group, async_op=True)

        def reduced(f) -> torch.Tensor:
            out = f.value()[0]
            # checked here, off the critical path, read in opt.step()
            bad = comm.scale_nonfinite(out, 1.0 / world) if wide else comm.any_nonfinite([out])
            with state._lock:
                state._mean_bad = bad if state._mean_bad is None else torch.maximum(state._mean_bad, bad)
            return out

        return chain(work.get_future(), reduced)
    uncovered = _allreduce_uncovered(state, bucket.parameters(), buf)
    if not state.flags_gathered():                 # each rank checks its own gradients in opt.step()
        state._flagged = False
        return _done(buf) if uncovered is None else uncovered
    state._flagged = True
    bad = comm.any_nonfinite([buf])
    with state._lock:
        state._bad = bad if state._bad is None else torch.maximum(state._bad, bad)
        if not bucket.is_last():
            return _done(buf) if uncovered is None else uncovered
        flag, state._bad = state._bad, None
    flags = torch.empty(dist.get_world_size(state.process_group), dtype=flag.dtype, device=flag.device)
    work = comm.all_gather_fn()(flags, flag, group=state.process_group, async_op=True)

    def agreed(f) -> torch.Tensor:
        for x in f.value():
            x.value()
        # Set on every backward: a step that a GradScaler skips runs no optimizer hook to clear it.
        state._nonfinite_ranks = [r for r, x in enumerate(flags.tolist()) if x > 0]
        if state._nonfinite_ranks:
            buf.fill_(float("nan"))
        return buf

    return chain(torch.futures.collect_all([work.get_future()] + ([uncovered] if uncovered is not None else [])), agreed)


def _bf16_allreduce(state: ThresholdState, index: int, buf: torch.Tensor, world: int) -> torch.futures.Future:
    """DDP's bucket ``buf`` replaced by the ranks' mean through a bfloat16 all-reduce with error feedback
    (gradshare.comm.round_bf16; the rounding error kept per DDP bucket by the sharing core, checkpointed)."""
    rounding = state.sharing.rounding(f"ddp bucket {index}", buf.numel(), buf.device)
    message = comm.round_bf16(buf.reshape(-1), rounding, 1.0 / world)
    work = dist.all_reduce(message, group=state.process_group, async_op=True)

    def reduced(f) -> torch.Tensor:
        buf.copy_(message.view_as(buf))
        bad = comm.any_nonfinite([buf])            # checked here, off the critical path, read in opt.step()
        with state._lock:
            state._mean_bad = bad if state._mean_bad is None else torch.maximum(state._mean_bad, bad)
        return buf

    return chain(work.get_future(), reduced)


def _called_by_grad_scaler() -> bool:
    """Whether a torch.amp.GradScaler (or a subclass: torch.cuda.amp's, FSDP's ShardedGradScaler) is on the call
    stack, i.e. calls this optimizer step (directly, or through Lightning, Accelerate, a Trainer).

    Frames are told by their code, and only a scaler's own ``step`` frame has its locals read: reading a
    frame's ``f_locals`` (before Python 3.13) leaves on it a snapshot of its variables that lives as long as
    the frame, so reading the caller's frames would keep whatever the user's script later deletes or
    rebinds (a model, its DDP wrapper, their memory) alive until that function returns."""
    codes = _scaler_step_codes()
    f = sys._getframe(1)
    while f is not None:
        if f.f_code in codes:
            scaler = f.f_locals.get("self")
            if isinstance(scaler, torch.amp.GradScaler):
                return scaler.is_enabled()        # a disabled scaler calls step() on every rank, every step
        f = f.f_back
    return False


def _scaler_step_codes() -> set:
    """The code objects of ``step`` as torch.amp.GradScaler and its subclasses define it (unwrapped)."""
    codes, classes = set(), [torch.amp.GradScaler]
    while classes:
        cls = classes.pop()
        classes.extend(cls.__subclasses__())
        fn = inspect.unwrap(cls.__dict__["step"]) if "step" in cls.__dict__ else None
        if getattr(fn, "__code__", None) is not None:
            codes.add(fn.__code__)
    return codes


def _allreduce_uncovered(state: ThresholdState, params, buf: torch.Tensor) -> Optional[torch.futures.Future]:
    """Updates mode, a compressed step: the mean gradient, as DDP's, of the parameters in this bucket that
    the optimizer does not step (ThresholdState.uncovered); None when there are none. The future gives
    ``buf`` once their slices hold the mean."""
    slices = state.uncovered(params)
    if not slices:
        return None
    _record_uncovered(state, slices)
    world = dist.get_world_size(state.process_group)
    flat = torch.cat([buf[o:o + k] for o, k in slices]).div_(world)     # divided first, as DDP's hook does
    work = dist.all_reduce(flat, group=state.process_group, async_op=True)

    def reduced(f) -> torch.Tensor:
        out = f.value()[0]
        at = 0
        for o, k in slices:
            buf[o:o + k].copy_(out[at:at + k])
            at += k
        return buf

    return chain(work.get_future(), reduced)


def _record_uncovered(state: ThresholdState, slices: List[tuple]) -> None:
    """Counts the all-reduce of parameters the optimizer does not step in the statistics (bucket -1)."""
    n = sum(k for _, k in slices)
    if n:
        sent = ring_allreduce_bytes(dist.get_world_size(state.process_group), n)
        state.stats.add(StepRecord(step=state.sharing.step, bucket=-1, n=n, tau=float("nan"), count=n, density=1.0,
                                   format=ALLREDUCE, bytes_sent=sent, dense_bytes=sent))


def _optimizers(optimizer: Any) -> List[torch.optim.Optimizer]:
    """``optimizer=`` as a list: [] (None), [it], or the optimizers of a list or tuple, checked to be distinct
    torch optimizers over disjoint parameters, none a ZeroRedundancyOptimizer."""
    if optimizer is None:
        return []
    many = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if not many:
        raise ValueError("optimizer: an empty list; pass None to share gradients")
    seen: Dict[int, int] = {}
    for i, opt in enumerate(many):
        if type(opt).__name__ == "ZeroRedundancyOptimizer":
            raise ValueError(
                "ThresholdState(optimizer=ZeroRedundancyOptimizer): ZeRO steps each rank's shard of the "
                "parameters and broadcasts it, so no rank makes an update of its own to share. Use "
                "ThresholdState() without optimizer= (gradshare shares the gradients, ZeRO steps on their "
                "mean), or the inner optimizer without ZeRO.")
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"optimizer: expected a torch.optim.Optimizer or a list of them, got "
                            f"{type(opt).__name__}")
        for g in opt.param_groups:
            for p in g["params"]:
                if seen.setdefault(id(p), i) != i:
                    raise ValueError(f"optimizer: optimizers #{seen[id(p)]} and #{i} both step a parameter of "
                                     f"shape {tuple(p.shape)}; each parameter needs one optimizer")
    return many
