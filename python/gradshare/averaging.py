"""Synchronous parameter averaging (DL4J's ParameterAveragingTrainingMaster / ParallelWrapper AVERAGING).

Use it when every rank should train on its own for a few steps and then agree: it talks once every
``frequency`` steps instead of every step, at the price of some convergence for large frequencies
(DL4J's guidance: much above ~20 hurts).

How an averaging round works: the parameters, floating-point buffers and (by default) the floating-point
optimizer state (SGD momentum, Adam moments, ...) are copied into ONE flat float32 buffer, summed with
one ``all_reduce`` and scaled by 1/world_size with :func:`gradshare.ops.average`, then copied back. An
all-reduce (rather than all-gather + average) moves 2(W-1)/W of the buffer per rank instead of (W-1)
buffers and needs no W-fold memory; ring/tree all-reduce hands every rank the same reduced bits, and
the scaling is the same local operation everywhere, so after a round all ranks hold bitwise-identical
values (verified by the tests). Works on any process group (gloo on CPU, NCCL on CUDA).

Local steps with a pseudo-gradient (``outer_optimizer=`` and/or ``compression=``): the inner optimizer's
state stays on its rank; a round shares only the parameters' change since the last round (the
pseudo-gradient) through gradshare's sharing core (gradshare.sharing), with error feedback:

- DiLoCo (Douillard et al. 2023): ``outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9,
  nesterov=True)``. The mean change is applied by the outer optimizer, as its gradient, to the
  parameters of the last round (the same on every rank: its state is identical everywhere).
- SparseLoCo (Sarfi et al. 2025): ``compression=gradshare.TopK(0.02, warmup_steps=0)`` and
  ``residual_decay=0.9``: each rank sends the top entries of its decayed error-feedback buffer plus the
  change, at a few bytes an entry; the mean of what was sent is applied (``outer_optimizer=None``: a step of
  exactly the mean change) or handed to the outer optimizer.
- The top entries as signs: ``compression=gradshare.TopK(0.04, warmup_steps=0, values="sign")`` sends each
  entry as +-s (s: its chunk's mean |entry|) with its index Elias-Fano coded, about 7.6 bits an entry at 4%
  where 8-bit values take 24; with ``error_feedback="model"`` the residual soon sends what the sign dropped.
  There ``outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=1.15)`` applies 1.15 times the mean of what was sent:
  an entry only some ranks sent arrives at a fraction of its size, so the mean result trails the ranks' progress
  along their largest entries (measured: README, "Local steps"; ``gradshare train --mode sparse_local``'s default).

Where what a round does not send waits (``error_feedback``, with ``compression``). "buffer" (default,
SparseLoCo's): in an error-feedback buffer; every rank's model becomes the round's mean result, and its next
inner steps start from there, so the progress it kept back is made again by those steps and counted twice
(hence SparseLoCo's decay). "model": in the rank's own model, which stays the round's mean result minus
what the rank has not sent, so its inner steps go on from its own progress and the mean of the ranks'
models is what they trained to: a round moves each rank's model by what the others sent, less the share of
its own that it sent. The round's mean result (the buckets' ``snapshot``) is identical on every rank; the
ranks' models differ by what each holds back until :meth:`ParameterAveraging.average` sends the whole change
(a float32 all-reduce: an epoch's end in gradshare's loops) and ends with identical replicas.

Streaming (Streaming DiLoCo, Douillard et al. 2025), pseudo-gradient modes: ``fragments=F`` splits the model
into F fragments of consecutive parameters, of about equal size, whose rounds are staggered, fragment f's at steps
``f*H//F`` after fragment 0's, each every H steps: the same bytes, spread over the period, so the peak a link
must carry falls F-fold. ``overlap=T`` lets each round's exchange travel while training goes on for T more
inner steps (at most ``H // F``), so that the link's time hides behind compute. When it lands, the round's
start moves by the mean change (or by the outer optimizer's step on it), the same on every rank, and the
steps each rank took meanwhile stay on top of it: they are part of the next round's change, so nothing is
lost (with ``error_feedback="model"`` the rank's model is that, minus what the rank has not sent: only the
others' share of the round arrives late). Warm-up rounds and :meth:`ParameterAveraging.average` (an epoch's end in gradshare's loops) are whole
and synchronous; they land what still travels first.

Adaptive optimizers (Adam, AdamW, NAdam, RAdam, RMSprop, Adagrad, Adadelta, Adamax, Adafactor): each inner
step is rescaled to the second moment of the global batch (W ranks' batches), estimated from the rank's own
moments (gradshare.second_moment): averaging W ranks' steps then moves the model as much as one step on the
global batch would. A round that averages optimizer state averages the
ranks' own second moments, which the next inner steps read as such.

Floating buffers (BatchNorm statistics) are averaged densely at each round in every mode. With one rank
nothing is sent; an outer optimizer still applies the rank's own change, so a run means the same on 1 or
many ranks.
"""
from __future__ import annotations

import itertools
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from gradshare import ops, optimizer_state, second_moment
from gradshare.compression import Dense
from gradshare.costmodel import ring_allreduce_bytes
from gradshare.sharing import Sharing
from gradshare.stats import Statistics
from gradshare.wrapped_optimizer import WrappedOptimizer, steps_the_inner_optimizer


class ParameterAveraging(WrappedOptimizer):
    """Wraps an optimizer: ``step()`` runs it, and every ``frequency`` steps averages across ranks.

    Args:
        model: the module whose parameters ``optimizer`` updates (its floating buffers are averaged too).
        optimizer: any torch optimizer over ``model``'s parameters.
        frequency: average after every ``frequency`` optimizer steps (1 = after each step).
        average_optimizer_state: also average floating-point optimizer state tensors (not step counters).
            Default: True when parameters are averaged, False (and not allowed) with a pseudo-gradient.
        warmup_steps: the first ``warmup_steps`` steps average after every step (a synchronous start,
            when the model moves fastest), then every ``frequency`` steps.
        process_group: the group to average over (default: the global group).
        sync_initial: broadcast rank 0's parameters and buffers at construction (a collective), so that
            all ranks start from the same point.
        outer_optimizer: a callable ``params -> torch.optim.Optimizer`` (module docstring: DiLoCo); it is
            called once, with the model's parameters that need gradients.
        compression: what a round sends of the pseudo-gradient (gradshare.compression: TopK, Ternary, Strom
            thresholds, "dense"); default with an outer optimizer: Dense() (a float32 all-reduce).
        residual_decay: beta in (0, 1] for the pseudo-gradient's error feedback (gradshare.sharing).
        error_feedback: with ``compression``, where what a round does not send waits: "buffer" (default,
            SparseLoCo's): in an error-feedback buffer, every rank's model set to the round's mean result;
            "model": in the rank's own model, which keeps its unsent progress (module docstring). The ranks'
            models then differ between rounds by what each has not sent; :meth:`average` ends with identical
            replicas by a float32 all-reduce of the whole change.
        fragments: pseudo-gradient modes: rounds of F fragments of the model, staggered over the period (module
            docstring: streaming). 1 (default): every round covers the whole model.
        overlap: pseudo-gradient modes: inner steps a round's exchange travels while training goes on, from 0
            (default: the round waits for it) to ``frequency // fragments``.
        nonfinite, bucket_cap_mb, stats: as for SharedOptimizer (pseudo-gradient modes).

    Use ``opt.zero_grad(); loss.backward(); opt.step()`` as with the wrapped optimizer. ``average()``
    forces a round now (collective; with ``error_feedback="model"`` a float32 one that leaves identical
    replicas). ``bytes_sent`` / ``dense_bytes``: what this rank sent, and what an
    all-reduce of the gradients at every step would have sent.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, frequency: int = 5,
                 average_optimizer_state: Optional[bool] = None, warmup_steps: int = 0, process_group=None,
                 sync_initial: bool = True, *, outer_optimizer: Optional[Callable[..., torch.optim.Optimizer]] = None,
                 compression: Any = None, residual_decay: float = 1.0, nonfinite: str = "raise",
                 bucket_cap_mb: float = 25.0, stats: Optional[Statistics] = None, fragments: int = 1,
                 overlap: int = 0, error_feedback: str = "buffer"):
        if int(frequency) < 1:
            raise ValueError(f"frequency: must be >= 1, got {frequency}")
        for name, v in (("fragments", fragments), ("overlap", overlap)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name}: expected an int, got {v!r}")
        if not 1 <= fragments <= int(frequency):
            raise ValueError(f"fragments: expected 1 to frequency ({frequency}) fragments, got {fragments}")
        if not 0 <= overlap <= int(frequency) // fragments:
            raise ValueError(f"overlap: expected 0 to frequency // fragments ({int(frequency) // fragments}) steps, "
                             f"got {overlap}: a fragment's exchange must land before the next round is sent")
        if int(warmup_steps) < 0:
            raise ValueError(f"warmup_steps: must be >= 0, got {warmup_steps}")
        if outer_optimizer is not None and not callable(outer_optimizer):
            raise TypeError("outer_optimizer: expected a callable params -> torch.optim.Optimizer, e.g. "
                            "lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)")
        pseudo = outer_optimizer is not None or compression is not None
        if (fragments > 1 or overlap > 0) and not pseudo:
            raise ValueError("fragments / overlap: streaming rounds share a pseudo-gradient; pass outer_optimizer= "
                             "or compression= (averaging parameters and optimizer state is whole and synchronous)")
        if error_feedback == "model" and compression is None:
            raise ValueError("error_feedback='model' keeps what a compressed round did not send in the rank's model: "
                             "pass compression= (without it a round sends the whole change)")
        if pseudo and average_optimizer_state:
            raise ValueError("average_optimizer_state=True: with outer_optimizer or compression only the "
                             "pseudo-gradient is shared; the inner optimizer's state stays on its rank")
        self.model = model
        self._wrap(optimizer)
        self.frequency = int(frequency)
        self.average_optimizer_state = (not pseudo) if average_optimizer_state is None else bool(average_optimizer_state)
        self.warmup_steps = int(warmup_steps)
        self.process_group = process_group
        self.step_count = 0
        self.rounds = 0
        self.bytes_sent = 0
        self.dense_bytes = 0
        self.last_averaged = False     # the last step ended with a round of the whole model
        self.last_round = False        # ... with a round (of a fragment, with fragments / overlap) sent or applied
        self._flat: Optional[torch.Tensor] = None
        self.rescale = second_moment.GlobalBatchStep(optimizer)   # each inner step as the global batch's
        self._param_count = sum(p.numel() for p in model.parameters() if p.requires_grad)
        if sync_initial and self.world_size > 1:
            self._broadcast_from_rank0()
        self.sharing: Optional[Sharing] = None
        self.outer: Optional[torch.optim.Optimizer] = None
        self._fragments: List[List[Any]] = []    # buckets of each fragment (streaming rounds)
        if pseudo:
            self.sharing = Sharing(Dense() if compression is None else compression, optimizer=optimizer,
                                   process_group=process_group, nonfinite=nonfinite, stats=stats,
                                   mode="pseudo-gradient", residual_decay=residual_decay,
                                   error_feedback=error_feedback)
            # Fragments of consecutive parameters, each in buckets of its own (one fragment with streaming off).
            self._fragments = []
            self.sharing.build([], bucket_cap_mb)
            for part in _split(model.parameters(), fragments):
                self._fragments.append(self.sharing.extend(part, bucket_cap_mb))
            if outer_optimizer is not None:
                self.outer = outer_optimizer([p for b in self.sharing.buckets for p in b.params])
                if not isinstance(self.outer, torch.optim.Optimizer):
                    raise TypeError(f"outer_optimizer returned {type(self.outer).__name__}, not a torch.optim.Optimizer")
        # A round's change is measured from the parameters the last round ended with (the same on every rank),
        # held as that round ends, so that another optimizer stepping other parameters of the model before
        # this one does is part of the change; the first round's from the parameters just before its first
        # step, so that weights loaded after construction are not mistaken for a change to share.
        self.fragments = fragments
        self.overlap = overlap
        self._offsets = [(f * self.frequency) // fragments for f in range(fragments)]
        self._inflight: List[_InFlight] = []     # overlapped rounds not applied yet, in launch order
        self._round_open = False       # the round's starting parameters are held (the sharing's snapshots)
        self._stepped = False          # a step was taken since the last round
        self._start_unchecked = False  # ... held at a step, not where a round ended: compared across ranks

    # ------------------------------------------------------------------------------------ optimizer API
    @steps_the_inner_optimizer
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One optimizer step; then an averaging round when one is due. Returns the closure's loss."""
        if self.sharing is not None and not self._round_open:
            self.sharing.begin_updates()
            self._round_open = True
            self._start_unchecked = self._others_step_the_model()
        before = self._before_step()
        loss = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        self._stepped = True
        self._to_global_batch(before)
        self.step_count += 1
        self.dense_bytes += ring_allreduce_bytes(self.world_size, self._param_count)
        if self._streaming and self.step_count > self.warmup_steps:
            self.last_averaged = False
            self.last_round = self._stream(self.step_count)
            return loss
        self.last_averaged = self.last_round = self.due(self.step_count)
        if self.last_averaged:
            self._round()
        return loss

    @property
    def _streaming(self) -> bool:
        return self.fragments > 1 or self.overlap > 0

    def due_fragments(self, step: int) -> List[int]:
        """The fragments whose round ends after optimizer step ``step`` (1-based), past the warm-up."""
        k = step - self.warmup_steps
        return [] if k < 1 else [f for f, o in enumerate(self._offsets) if (k - o) % self.frequency == 0]

    @torch.no_grad()
    def _stream(self, step: int) -> bool:
        """Streaming rounds after step ``step``: what lands now is applied, then the fragments due are sent
        (and, without overlap, applied at once). Whether any round landed or was sent."""
        landed = bool(self._inflight) and self._inflight[0].land_at <= step
        while self._inflight and self._inflight[0].land_at <= step:
            self._land(self._inflight.pop(0))
        due = self.due_fragments(step)
        for f in due:
            if self._start_unchecked and self.world_size > 1:
                self._agree_round_start(self.world_size)
            frag = self._fragments[f]
            if self.overlap:
                self._inflight.append(_InFlight(f, step + self.overlap, self.sharing.launch_changes(frag)))
            else:
                self._fragment_round(frag)
            if f == 0 and self.world_size > 1:    # floating buffers: once a period, with the first fragment
                self._average_dense([(b, b) for b in self.model.buffers() if b.is_floating_point()], self.world_size)
        return landed or bool(due)

    def _fragment_round(self, frag: List[Any]) -> None:
        """One synchronous round of these buckets (a fragment's, or all); the next round starts where it ends."""
        sh = self.sharing
        if self.world_size <= 1:
            if self.outer is not None:                    # the rank's own change, through the outer optimizer
                for b in frag:
                    b.change(b.flat)
                sh.apply_outer(self.outer, frag)
        else:
            before = sh.stats.bytes_sent
            try:
                sh.share_updates(outer=self.outer, buckets=frag)
            finally:
                self.bytes_sent += sh.stats.bytes_sent - before
        self.rounds += 1
        sh.begin_updates(frag)                            # the round's mean result, the same on every rank
        sh.residual_into_params(frag)                     # error_feedback="model": minus what the rank kept

    def _arrive(self, r: "_InFlight") -> None:
        """Waits for an overlapped round's exchanges (no new collective) and ends its step."""
        if r.launched is not None:
            before = self.sharing.stats.bytes_sent
            launched, r.launched = r.launched, None
            r.ok = self.sharing.arrive(launched)
            self.bytes_sent += self.sharing.stats.bytes_sent - before

    def _land(self, r: "_InFlight") -> None:
        self._arrive(r)
        self.sharing.land_changes(self._fragments[r.fragment], bool(r.ok), self.outer)
        self.rounds += 1

    @torch.no_grad()
    def _before_step(self) -> Optional[Dict[int, torch.Tensor]]:
        """The parameters before an inner step, where rescaling that step needs its change (NAdam, RAdam)."""
        if self.world_size <= 1 or not second_moment.needs_change(self.optimizer):
            return None
        return {id(p): p.detach().clone() for g in self.optimizer.param_groups for p in g["params"]}

    @torch.no_grad()
    def _to_global_batch(self, before: Optional[Dict[int, torch.Tensor]] = None) -> None:
        """The inner step just taken made the step the optimizer on the global batch would take (module docstring)."""
        world = self.world_size
        if world <= 1 or self.rescale.kind is None:
            return
        self.rescale.apply_all(((p, group, p.data, None if before is None else before[id(p)] - p.detach())
                                for group in self.optimizer.param_groups for p in group["params"]), world, sign=-1.0)

    def due(self, step: int) -> bool:
        """Whether an averaging round follows optimizer step number ``step`` (1-based)."""
        return step <= self.warmup_steps or (step - self.warmup_steps) % self.frequency == 0

    # ------------------------------------------------------------------------------------- averaging
    @property
    def world_size(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group)

    def _ranks(self) -> int:
        return self.world_size

    def tensors(self) -> List[torch.Tensor]:
        """What a round averages, in a fixed order: parameters, floating buffers, optimizer state."""
        return [dst for _, dst in self._averaged()]

    def _averaged(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """(what this rank contributes, where the mean goes) for each tensor of :meth:`tensors`."""
        ts = [p.data for p in self.model.parameters()] + [b for b in self.model.buffers() if b.is_floating_point()]
        if self.average_optimizer_state:
            # Per-element state only: 0-dim tensors are counters such as Adam's "step".
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            ts += [t for _, _, t in optimizer_state.state_tensors(self.optimizer, params, per_element=False)]
        return [(t, t) for t in ts]

    def _flatten(self, ts: List[torch.Tensor]) -> torch.Tensor:
        n = sum(t.numel() for t in ts)
        dev = ts[0].device
        if self._flat is None or self._flat.numel() != n or self._flat.device != dev:
            self._flat = torch.empty(n, dtype=torch.float32, device=dev)
        off = 0
        for t in ts:
            self._flat[off:off + t.numel()].copy_(t.reshape(-1))
            off += t.numel()
        return self._flat

    @staticmethod
    def _unflatten(flat: torch.Tensor, ts: List[torch.Tensor]) -> None:
        off = 0
        for t in ts:
            t.copy_(flat[off:off + t.numel()].view_as(t))
            off += t.numel()

    @property
    def stats(self) -> Optional[Statistics]:
        """The pseudo-gradient exchanges' statistics (None when parameters are averaged)."""
        return None if self.sharing is None else self.sharing.stats

    @torch.no_grad()
    def average(self) -> None:
        """Averages now across the group (a collective: every rank must call it). Streaming rounds still
        travelling land first; then the whole model's round. With ``error_feedback="model"`` that round sends
        the whole change (float32 all-reduce, residuals included), so the replicas end identical."""
        self._round(merge=True)

    @torch.no_grad()
    def _round(self, merge: bool = False) -> None:
        """The whole model's round (:meth:`average`; ``merge``: a float32 one where each rank's model holds
        what it has not sent)."""
        if self.sharing is not None:
            self.flush()
            if merge and self.sharing.error_feedback == "model":
                self._merge()
            else:
                self._share_pseudo_gradient()
            self.last_averaged = True
            return
        world = self.world_size
        self.rounds += 1
        if world <= 1:
            return
        if self.average_optimizer_state:   # the same entries on every rank first (gradshare.optimizer_state)
            optimizer_state.agree(self.optimizer, (p for g in self.optimizer.param_groups for p in g["params"]),
                                  self.process_group)
        self._average_dense(self._averaged(), world)

    def _average_dense(self, pairs: List[Tuple[torch.Tensor, torch.Tensor]], world: int) -> None:
        """For each (source, destination): the destination replaced by the mean of the ranks' sources, by one
        all-reduce of one flat float32 buffer."""
        if not pairs:
            return
        flat = self._flatten([src for src, _ in pairs])
        dist.all_reduce(flat, group=self.process_group)
        dsts = [dst for _, dst in pairs]
        if all(d.dtype == torch.float32 for d in dsts):      # the sum scaled into place in one pass
            offsets = itertools.accumulate((d.numel() for d in dsts), initial=0)
            ops.scale_into(dsts, [flat[o:o + d.numel()] for o, d in zip(offsets, dsts)], 1.0 / world)
        else:
            ops.average([flat], weights=[1.0 / world], out=flat)
            self._unflatten(flat, dsts)
        self.bytes_sent += ring_allreduce_bytes(world, flat.numel())

    @torch.no_grad()
    def flush(self) -> None:
        """Applies now the streaming rounds still travelling (``overlap``), on every rank: before an evaluation
        or at the end of training. It waits for their exchanges (no new collective); every rank calls it at the
        same step. Nothing to do otherwise. :meth:`average` goes further: a round of the whole model."""
        while self._inflight:
            self._land(self._inflight.pop(0))

    @torch.no_grad()
    def _share_pseudo_gradient(self) -> None:
        """One round with a pseudo-gradient (module docstring); parameters restored if it fails."""
        sh = self.sharing
        world = self.world_size
        if not self._stepped:            # no step since the last round (the same on every rank): nothing to share
            self.rounds += 1
            return
        if world > 1 and self._start_unchecked:
            self._agree_round_start(world)
        self._fragment_round(sh.buckets)    # the next round starts where it ends (comment in __init__)
        if world > 1:
            self._average_dense([(b, b) for b in self.model.buffers() if b.is_floating_point()], world)
        self._stepped = False
        self._round_open = True

    def _merge(self) -> None:
        """``error_feedback="model"``: a round in which every bucket sends its whole change and residual (Dense),
        so every rank's model becomes the same mean result."""
        # after a round with no step since, the residuals still hold what the ranks kept (the same on every rank)
        self._stepped = self._stepped or self.rounds > 0
        with self.sharing.uncompressed():
            self._share_pseudo_gradient()

    def _others_step_the_model(self) -> bool:
        """Whether the model has trainable parameters that the inner optimizer does not step (another
        optimizer's, which may have stepped before it)."""
        mine = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        return any(p.requires_grad and id(p) not in mine for p in self.model.parameters())

    @torch.no_grad()
    def _agree_round_start(self, world: int) -> None:
        """A round whose starting parameters were held at its first step (the first round, or the first after
        loading a checkpoint without them) while another optimizer steps parameters of the model: it may have
        stepped before, on its rank's own gradient, so the ranks' starts may differ. One all-gather of a
        digest per bucket tells; where they differ, every rank starts from their mean (one all-reduce), so
        that the round ends with the same parameters on every rank."""
        self._start_unchecked = False
        sh = self.sharing
        dev = sh.buckets[0].device
        mine = torch.tensor([[float(b.snapshot.double().sum()), float(b.snapshot.double().abs().sum())]
                             for b in sh.buckets], dtype=torch.float64, device=dev)
        every = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(every, mine, group=self.process_group)
        self.bytes_sent += (world - 1) * mine.numel() * 8
        if all(torch.equal(every[0], e) for e in every[1:]):
            return
        self._average_dense([(b.snapshot, b.snapshot) for b in sh.buckets], world)

    @torch.no_grad()
    def _broadcast_from_rank0(self) -> None:
        ts = [p.data for p in self.model.parameters()] + [b for b in self.model.buffers() if b.is_floating_point()]
        if not ts:
            return
        flat = self._flatten(ts)
        own = flat.clone()
        src = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        dist.broadcast(flat, src=src, group=self.process_group)
        self._unflatten(flat, ts)
        # A resume that loaded this rank's own mid-round model before building this object just lost it:
        # load_state_dict says so (a rank's model differs from rank 0's only mid-round).
        self._replaced_own_model = not torch.equal(own, flat)

    def _share_new_group(self, params) -> None:
        """``add_param_group``: the model's parameters are averaged (or their change shared) already; a
        parameter from outside the model would drift apart between ranks, and is refused."""
        mine = {id(p) for p in self.model.parameters()}
        outside = [i for i, p in enumerate(params) if id(p) not in mine]
        if outside:
            self.optimizer.param_groups.pop()
            raise ValueError(f"add_param_group: parameters {outside} of the new group are not parameters of the "
                             "model that ParameterAveraging averages")

    # ------------------------------------------------------------------------------------- state
    def _gradshare_state(self) -> Dict[str, Any]:
        """The step and round counters and byte totals; with a pseudo-gradient also the sharing state
        (residuals), the parameters of the last round and the outer optimizer's state, so that a resume
        mid-round is exact."""
        state = {"step": self.step_count, "rounds": self.rounds, "bytes_sent": self.bytes_sent,
                 "dense_bytes": self.dense_bytes, "frequency": self.frequency, "warmup_steps": self.warmup_steps,
                 "mean gradient": self.rescale.state_dict()}
        if self.sharing is not None:
            state["round_start"] = ([b.snapshot.detach().cpu().clone() for b in self.sharing.buckets]
                                    if self._round_open else None)
            state["outer"] = None if self.outer is None else self.outer.state_dict()
            state["stepped"] = self._stepped
            state["streaming"] = {"fragments": self.fragments, "overlap": self.overlap, "inflight": []}
            for r in self._inflight:            # waited for (no new collective), applied when due
                self._arrive(r)
                frag = self._fragments[r.fragment]
                state["streaming"]["inflight"].append(
                    {"fragment": r.fragment, "land_at": r.land_at, "ok": bool(r.ok),
                     "mean": [b.mean.detach().cpu().clone() for b in frag],
                     "launched": [b.launched.detach().cpu().clone() for b in frag]})
            state["sharing"] = self.sharing.state_dict()       # after them: arriving commits residuals
            state["bytes_sent"] = self.bytes_sent
        return state

    def _load_gradshare_state(self, state: Dict[str, Any]) -> None:
        pseudo = "sharing" in state
        if pseudo != (self.sharing is not None):
            raise ValueError("load_state_dict: the checkpoint was written " +
                             ("with a pseudo-gradient (outer_optimizer / compression)" if pseudo else
                              "averaging parameters") + ", this ParameterAveraging is configured otherwise")
        if pseudo:
            streaming = state.get("streaming") or {"fragments": 1, "overlap": 0, "inflight": []}
            if (streaming["fragments"], streaming["overlap"]) != (self.fragments, self.overlap):
                raise ValueError(f"load_state_dict: the checkpoint was written with fragments="
                                 f"{streaming['fragments']}, overlap={streaming['overlap']}; this ParameterAveraging "
                                 f"has fragments={self.fragments}, overlap={self.overlap}")
            if (state.get("outer") is None) != (self.outer is None):
                raise ValueError("load_state_dict: outer_optimizer given in one of the checkpoint and this "
                                 "ParameterAveraging, not in the other")
            starts = state["round_start"]
            if starts is not None and (len(starts) != len(self.sharing.buckets) or any(
                    s.numel() != b.n for s, b in zip(starts, self.sharing.buckets))):
                raise ValueError("load_state_dict: the checkpoint's round-start parameters do not match the buckets")
            self.sharing.load_state_dict(state["sharing"])
            self._round_open = starts is not None
            self._stepped = bool(state.get("stepped", starts is not None))   # earlier files: held only mid-round
            self._start_unchecked = False
            if starts is not None:
                self.sharing.begin_updates()              # allocates the buffers, then the saved values
                for b, s in zip(self.sharing.buckets, starts):
                    b.snapshot.copy_(s)
            if self.outer is not None:
                self.outer.load_state_dict(state["outer"])
            self._inflight = []
            for r in streaming["inflight"]:
                frag = self._fragments[int(r["fragment"])]
                for b, m, l in zip(frag, r["mean"], r["launched"]):
                    for name, src in (("mean", m), ("launched", l)):
                        if getattr(b, name) is None:
                            setattr(b, name, torch.empty_like(b.residual))
                        getattr(b, name).copy_(src)
                self._inflight.append(_InFlight(int(r["fragment"]), int(r["land_at"]), None, bool(r["ok"])))
        self.rescale.load_state_dict(state.get("mean gradient"))
        self.step_count = int(state["step"])
        mid_round = self.step_count > 0 and (self._streaming or not self.due(self.step_count))
        if getattr(self, "_replaced_own_model", False) and mid_round:
            warnings.warn("ParameterAveraging.load_state_dict: a checkpoint from the middle of a round, but this rank's "
                          "model was replaced by rank 0's when ParameterAveraging was built (sync_initial=True): "
                          "its own progress since the round began is lost. Load the model's state after building "
                          "ParameterAveraging, or pass sync_initial=False when resuming.", RuntimeWarning,
                          stacklevel=3)
        self.rounds = int(state.get("rounds", 0))
        self.bytes_sent = int(state.get("bytes_sent", 0))
        self.dense_bytes = int(state.get("dense_bytes", 0))

    def __repr__(self) -> str:
        extra = ""
        if self.sharing is not None:
            extra = (f", outer={type(self.outer).__name__ if self.outer is not None else None}, "
                     f"compression={self.sharing.compression!r}, residual_decay={self.sharing.residual_decay}")
            if self._streaming:
                extra += f", fragments={self.fragments}, overlap={self.overlap}"
        return (f"ParameterAveraging({type(self.optimizer).__name__}, frequency={self.frequency}, "
                f"average_optimizer_state={self.average_optimizer_state}, warmup_steps={self.warmup_steps}{extra})")


class _InFlight:
    """An overlapped round of one fragment: its exchanges (None once arrived), the step after which it is
    applied, and whether it completed (None until it arrived)."""

    def __init__(self, fragment: int, land_at: int, launched: Optional[List[Any]], ok: Optional[bool] = None):
        self.fragment, self.land_at, self.launched, self.ok = fragment, land_at, launched, ok


def _split(params, parts: int) -> List[List[torch.Tensor]]:
    """The trainable parameters, in order and each once, into ``parts`` fragments of consecutive parameters whose
    largest is as small as it can be (the peak a round sends)."""
    seen, ps = set(), []
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            ps.append(p)
    if parts == 1:
        return [ps]
    if len(ps) < parts:
        raise ValueError(f"fragments: the model has {len(ps)} trainable parameters (a parameter is never split), "
                         f"fewer than {parts} fragments")

    def pack(cap: int) -> List[List[torch.Tensor]]:      # consecutive parameters, a fragment up to cap elements
        out, acc = [[]], 0
        for p in ps:
            if out[-1] and acc + p.numel() > cap:
                out.append([])
                acc = 0
            out[-1].append(p)
            acc += p.numel()
        return out

    lo, hi = max(p.numel() for p in ps), sum(p.numel() for p in ps)
    while lo < hi:                                        # the smallest cap that needs no more than `parts`
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if len(pack(mid)) <= parts else (mid + 1, hi)
    out = pack(lo)
    while len(out) < parts:        # fewer: the largest fragment of several parameters gives up its last one
        i = max((i for i, f in enumerate(out) if len(f) > 1), key=lambda i: sum(p.numel() for p in out[i]))
        out[i:i + 1] = [out[i][:-1], out[i][-1:]]
    return out
