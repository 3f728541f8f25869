"""Link-aware sharing: compress only where the link makes it pay, measured on the run itself.

Compression costs time to encode and decode and wins time on the wire; on a fast link DDP's float32
all-reduce, overlapped with backward, is the faster step and trains exactly. :class:`LinkAware` chooses,
for each step of a sharing core in "updates" mode, between

- **allreduce**: the gradients are averaged by one float32 all-reduce per bucket (what DDP does, overlapped
  with backward through the hook; in bfloat16 with error feedback where that is faster, below) and every rank's
  optimizer steps on the same mean gradient; and
- **compressed**: the optimizer steps on the local gradient and its update is shared compressed with
  error feedback (gradshare.sharing).

It decides from what it measures, the time from one step's end to the next (compute, exchange and
whatever the user's loop does), not from a model of the link (a probe of the link only rules out what cannot
win, below): it times a few steps of each, agrees the
medians with every rank (one all-reduce of two numbers, taking the slowest rank's), and keeps the
faster, preferring the all-reduce unless compression makes the step faster by more than ``margin``. That is
10% where what a step does not send waits in each rank's model (gradshare's defaults: the sharing core passes
``MODEL_MARGIN``), which trains as well as DDP at equal steps (the README's quality table) and reached its
end-to-end targets in as few steps or fewer (MNIST CNN 95% at step 150 against DDP's 175, the MLP 90% at step 100
against 125), so the margin only guards against step times that differ by noise; it is 25% (the default here)
where what waits is in the residual buffer (``error_feedback="buffer"``), which can take more steps to reach the
same accuracy early in training, by up to a quarter in gradshare's end-to-end benchmarks. A pause of the
user's loop (an evaluation, a checkpoint, a log flush) lands in one step now and then, and is not the
exchange's time: no choice is judged on a single step, and the median taken is the lower one (of two
steps, the faster), so one such step among the samples moves nothing.

It starts compressed and measures the all-reduce second, and only where it could win: on a slow link one
all-reduce step costs many compressed ones (1.3 s against 0.08 s for a 3.7M-parameter model at 100 Mbit/s),
and a few of them spent measuring it would cost a short run more than a quarter of its time. So before any
all-reduce step the ranks time a few small all-reduces (at most 1 MiB, a quarter of the model; about 0.2 s
at 100 Mbit/s) and extrapolate what moving every bucket would take, a lower bound on the all-reduce step
(gradshare.costmodel.Link.measured: the probe's per-byte time, its latency taken off), after the part of a
step that comes before any exchange can start (data, forward and the backward up to DDP's first bucket, or to
the optimizer's step: measured on the compressed steps). Where that bound is slower than the compressed step
by ``clear_loss`` (2x), the all-reduce is not run; elsewhere (every fast link) it is measured as below. The
bound is taken again each time the all-reduce is due to be measured again. It rules out only at
``clear_loss``, not at the margin that decides between two measured steps: a probe of a few milliseconds on
a loaded machine can come out several times too slow (one rank descheduled while it runs; measured on two
ranks sharing two cores: 12 to 51 ms for the same 15 MB all-reduce), and a fast link taken for a slow one
would then run every step compressed, and slower, until the next look. Measuring an all-reduce the bound puts
between the margin and ``clear_loss`` costs a few steps that lose less than twice over.

A link that changes is followed. On the all-reduce its cost shows in the step itself: every
``check_every`` steps the ranks agree their recent all-reduce step time, and compression is measured
again only once that has grown by ``margin`` both past the compressed step's and past its own when it was
chosen (and never within ``min_interval`` steps of a decision or a restart: no flapping on noise), so a
fast link that stays fast sees no compressed step after the first measurement. On compressed steps a faster link does not show,
so the all-reduce is measured again from time to time, as rarely as keeps the cost of looking below
``overhead`` of the run. That cost is measured, not assumed: the slower choice's extra time on the steps
a measurement takes, and both switches (into the measurement, and back) over what the faster choice's
step would have taken. A link 30x slower than the compressed step is looked at again every few thousand
steps, one about as fast every 50. Every rank takes the same decision at
the same step, so replicas stay identical.

Once compression wins, how much it sends is measured too, where the compression has a density to lower
(TopK, the defaults): steps at ``sparsest`` times its density (the top 1% where it sends 5%) and at the full
density take turns, one of each in every pair, as the all-reduce's precisions do (below), so that a machine whose
step times drift moves both alike (timed in two stretches, steps at the run's start ran slower and chose a lower
density for a step that waits on compute); a change of density is no switch (the same path, a shorter message),
so every step of the turns is timed, and a step at the sparsest sends less only for now (what it leaves waits as
any other part not sent). Where the step is faster by more than ``margin`` at the sparsest, the step waits on
the link at the full density, and the density
is set as high as the link carries within ``margin`` of the sparser step: the step's time taken as linear in
the density between the two measured (the exchange's bytes are), the largest density whose step is at most
``margin`` slower than the sparsest's; as much information as fits in the time, no more. Elsewhere (the step
waits on compute, not the link) the full density stays. It is measured once each time compression is chosen
over the all-reduce, the same on every rank from the agreed times; ``density_scale`` is what the sharing core
applies (gradshare.compression's ``scaled``).

Once the all-reduce wins, its precision is measured too (``bf16``, the default): steps all-reducing the gradients
in bfloat16 and in float32 take turns, one of each in every pair, so that a machine whose step times drift from
one stretch of the run to the next (10-30% here) moves both alike; a switch of precision costs nothing of its own,
so every step of the measurement is timed. The all-reduce stays in bfloat16 where its steps are faster
(``bf16_margin``: 0, the faster of the two as measured side by side; with error feedback bfloat16 trained as
float32 does, README, "In what precision it all-reduces", so a wrong choice costs only the difference that the
noise hid): half the bytes where the link still shows in the step (DDP's own fp16 hook saved 4-7% of the
transformer LM's step at 1 Gbit/s), float32 where it does not (the casts cost what the bytes save). Each rank
rounds the mean's share of its gradient plus what its last rounding left out, and keeps the new rounding error
for the next step: every rank applies the same bfloat16 sum (itself rounded once more, as DDP's fp16 hook's is),
so replicas stay identical, and nothing is lost to the rounding of what each rank sends: the error is in the
sharing core's checkpoints, and the next float32 all-reduce sends what is left of it.
``allreduce_precision`` is what the sharing core applies.

Switching to the all-reduce makes the ranks' optimizer states and parameters consistent first: what the
residuals still hold is applied (mean over ranks) and the optimizer states are averaged (all-reduces in
flight together, each large tensor where it lies). Switching back needs nothing: states and parameters are then equal on every rank.
"""
from __future__ import annotations

import math
import statistics
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional

ALLREDUCE, COMPRESSED = "allreduce", "compressed"
ALLREDUCE_BF16 = "allreduce_bf16"  # the statistics' format of a step all-reduced in bfloat16
SPARSE, FULL = "sparse", "full"    # a density measurement's steps: compressed at ``sparsest`` times the density, and at it
HALF, FLOAT32 = "bf16", "fp32"     # a precision measurement's steps: all-reduced in bfloat16, and in float32
# The measurement that follows each choice, and the labels of its two kinds of steps (the cheaper one first),
# which take turns: a step of one after one of the other is on the same path (no switch) and is timed
REFINE = {COMPRESSED: (SPARSE, FULL), ALLREDUCE: (HALF, FLOAT32)}
REFINING = {label for pair in REFINE.values() for label in pair}
TURNS = [set(pair) for pair in REFINE.values()]
LABELS = (ALLREDUCE, COMPRESSED, SPARSE, FULL, HALF, FLOAT32)
MODEL_MARGIN = 0.1      # the margin with what waits in each rank's model (module docstring)


class LinkAware:
    """Chooses per step between a float32 all-reduce of gradients and compressed updates (module docstring).

    The run starts by measuring compression for up to ``probe_steps`` steps (after one untimed step: a first
    step's own cost is not the link's), then, unless the link probe rules it out (module docstring),
    ``calibration_steps`` steps by all-reduce (the first untimed: a switch's own cost is not the link's either),
    and decides. A measurement of either choice goes on past those steps, up to 16 timed steps,
    until its timed steps add up to ``min_seconds`` (0.25 s): steps vary from one to the next by more than the
    margin, and a few of them would decide by chance (on two ranks sharing two cores, 50 ms all-reduce steps
    varied by +-20%, and two of them timed at 65 ms against compression's 54 chose compression, which then ran
    at 60 ms against the all-reduce's 47 for 170 steps). A measurement stops early once the measured choice is ``clear_loss`` times slower
    than the other, judged on two timed steps at least (one could hold a pause of the user's loop): on a slow
    link the all-reduce is looked at for three steps, not five.

    Args:
        margin: compression is chosen only when its step is faster by more than this fraction (the sharing
            core's default: ``MODEL_MARGIN`` where what waits is in each rank's model, else this default).
        probe_steps: steps timed per measurement of a choice, at most.
        calibration_steps: all-reduce steps of its first measurement (>= 2).
        clear_loss: a measurement ends as soon as its choice is this many times slower; the link probe's bound
            rules the all-reduce out only at this many times the compressed step.
        overhead: the largest fraction of the run spent re-measuring the slower choice (2%: a fast link is
            where the all-reduce wins, and there gradshare's step should cost what DDP's does).
        min_seconds: the least time a measurement of a choice covers (up to 16 timed steps).
        min_interval, max_interval: bounds on the steps between two measurements of the slower choice.
        check_every: on the all-reduce, the steps between two agreements of its recent step time.
        sparsest: the lowest fraction of the compression's density tried where its step waits on the link
            (module docstring; 1: the density is never lowered). The default 0.2 tries the top 1% where the
            defaults send 5%, which trained as well as DDP in the README's quality table (README, "How much it
            sends"); only a compression with a density to lower (``scalable``, set by the sharing core) is
            measured so, in ``2 * probe_steps`` to 16 pairs of steps as the precisions (``bf16``).
        bf16: whether the all-reduce is measured in bfloat16 too, once chosen, and kept so where faster by more
            than ``bf16_margin`` (module docstring); the measurement takes ``2 * probe_steps`` to 16 pairs of
            steps, as many as cover ``min_seconds`` on each side.
        probe: whether the link probe's bound may rule the all-reduce out without a step of it (False: the
            all-reduce is measured at the start and at every look, whatever the probe would say; the steps
            taken then follow from the settings alone, e.g. with ``min_seconds=0``).
        clock: seconds, monotonic (time.perf_counter).

    ``steady_from`` and ``steady_ratio`` (set by the sharing core from the compression's warm-up, e.g. TopK's
    100 steps at a higher density): compressed steps measured before ``steady_from`` cost more than they will,
    their messages shrinking to ``steady_ratio`` of the size measured (0: unknown). When the all-reduce wins on
    such a measurement, compression is measured again as soon as the warm-up is over, unless it could not win
    even if its whole step shrank with its message.
    """

    def __init__(self, margin: float = 0.25, probe_steps: int = 4, overhead: float = 0.02,
                 min_interval: int = 50, max_interval: int = 5000, calibration_steps: int = 3,
                 clear_loss: float = 2.0, check_every: int = 10, min_seconds: float = 0.25,
                 probe: bool = True, sparsest: float = 0.2, bf16: bool = True, bf16_margin: float = 0.0,
                 clock: Callable[[], float] = time.perf_counter):
        if not (0 <= float(margin) < 1):
            raise ValueError(f"margin: expected a value in [0, 1), got {margin}")
        for name, v, low in (("probe_steps", probe_steps, 1), ("calibration_steps", calibration_steps, 2),
                             ("check_every", check_every, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name}: expected an int >= {low}, got {v!r}")
        if not (0 < float(overhead) < 1):
            raise ValueError(f"overhead: expected a value in (0, 1), got {overhead}")
        if not (0 <= float(min_seconds) < math.inf):
            raise ValueError(f"min_seconds: expected a finite value >= 0, got {min_seconds}")
        if not float(clear_loss) > 1 + float(margin):
            raise ValueError(f"clear_loss: expected a value above 1 + margin, got {clear_loss}")
        if not (1 <= int(min_interval) <= int(max_interval)):
            raise ValueError(f"min_interval, max_interval: expected 1 <= min <= max, got {min_interval}, {max_interval}")
        self.margin, self.probe_steps, self.overhead = float(margin), probe_steps, float(overhead)
        self.calibration_steps, self.clear_loss, self.check_every = calibration_steps, float(clear_loss), check_every
        self.min_interval, self.max_interval = int(min_interval), int(max_interval)
        self.min_seconds = float(min_seconds)
        if not (0 < float(sparsest) <= 1):
            raise ValueError(f"sparsest: expected a value in (0, 1], got {sparsest}")
        self.sparsest = float(sparsest)
        if not isinstance(bf16, bool):
            raise ValueError(f"bf16: expected True or False, got {bf16!r}")
        if not (0 <= float(bf16_margin) < 1):
            raise ValueError(f"bf16_margin: expected a value in [0, 1), got {bf16_margin}")
        self.bf16, self.bf16_margin = bf16, float(bf16_margin)
        self.half = False                   # the chosen all-reduce goes in bfloat16
        self.scalable = False               # the compression has a density to lower (set by the sharing core)
        self.scale = 1.0                    # the chosen fraction of the compression's density
        if not isinstance(probe, bool):
            raise ValueError(f"probe: expected True or False, got {probe!r}")
        self.probe = probe
        self.clock = clock
        self.steps = 0                      # steps ended (every rank counts the same ones)
        self.choice: Optional[str] = None   # what was decided (None: not yet)
        self.plan: Deque[str] = deque()
        self.probing: Optional[str] = None  # the choice being measured (its plan may end early)
        self._calibrate()
        self.next_probe: Optional[int] = None
        self.steady_from = 0
        self.steady_ratio = 0.0
        self.seconds: Dict[str, Optional[float]] = {ALLREDUCE: None, COMPRESSED: None}   # agreed medians
        self.sparsest_seconds: Optional[float] = None     # the agreed step at ``sparsest`` times the density
        self.half_seconds: Optional[float] = None         # the agreed step all-reducing in bfloat16
        self.decisions = 0
        self.estimated = False              # seconds[ALLREDUCE] is the link probe's bound, not a measurement
        self._samples: Dict[str, Deque[float]] = {m: deque(maxlen=16) for m in LABELS}
        # This rank's last first step of each choice after the other (untimed: a switch's own cost; 0: none yet)
        self._first: Dict[str, float] = {m: 0.0 for m in LABELS}
        self._decided_at = 0                # the step of the last decision
        self._quiet_until = 0               # no measurement triggered by the all-reduce's time before this step
        self._last_end: Optional[float] = None
        self._last_mode: Optional[str] = None
        # From a step's start (the last one's end) to the point where its exchange could first start (DDP's
        # first bucket ready, or the optimizer's step): what an all-reduce step spends before its link does.
        self._ready: Deque[float] = deque(maxlen=16)
        self._ready_in_step: Optional[float] = None

    def _calibrate(self) -> None:
        self.plan = deque([COMPRESSED] * (self.probe_steps + 1))
        self.probing = COMPRESSED

    # ------------------------------------------------------------------------------------ the step
    @property
    def _label(self) -> str:
        """This step's place in the plan: ALLREDUCE, COMPRESSED, a density measurement's SPARSE and FULL, or a
        precision measurement's HALF and FLOAT32."""
        return self.plan[0] if self.plan else self.choice  # type: ignore[return-value]

    @property
    def mode(self) -> str:
        """What this step does: ALLREDUCE or COMPRESSED."""
        label = self._label
        return COMPRESSED if label in (SPARSE, FULL) else ALLREDUCE if label in (HALF, FLOAT32) else label

    @property
    def density_scale(self) -> float:
        """The fraction of the compression's density this step sends (1 on all-reduce steps)."""
        label = self._label
        return {SPARSE: self.sparsest, COMPRESSED: self.scale}.get(label, 1.0)

    @property
    def allreduce_precision(self) -> str:
        """What this step's all-reduce sends: "bfloat16" or "float32" (also on compressed steps, which send none)."""
        label = self._label
        return "bfloat16" if label == HALF or (label == ALLREDUCE and not self.plan and self.half) else "float32"

    def exchange_ready(self) -> None:
        """Called when this step's exchange could first start (the first call of a step counts): the work
        before it (data, forward, the backward up to the first bucket) comes before any all-reduce, so it adds
        to the link probe's bound on an all-reduce step."""
        if self._ready_in_step is None and self._last_end is not None:
            self._ready_in_step = self.clock() - self._last_end

    def step_ended(self, agree: Callable[[List[float]], List[float]],
                   bound: Optional[Callable[[], float]] = None) -> None:
        """Called on every rank at the end of every step (skipped ones too), with no collective in flight.
        ``agree(values)`` returns the element-wise maximum over the ranks (one all-reduce); ``bound()`` the
        link probe's lower bound on an all-reduce step, in seconds, the same on every rank (a few collectives;
        None, or ``probe=False``: the all-reduce is always measured)."""
        if not self.probe:
            bound = None
        now = self.clock()
        mode = self._label
        # The first step after a switch is not timed; one between the turns of a density's or a precision's
        # measurement is no switch
        timed = self._last_end is not None and (mode == self._last_mode or {mode, self._last_mode} in TURNS)
        returned = False
        ready, self._ready_in_step = self._ready_in_step, None
        if timed:
            self._samples[mode].append(now - self._last_end)
            if ready is not None:
                self._ready.append(ready)
        elif self._last_end is not None:
            self._first[mode] = now - self._last_end
            returned = not self.plan and mode == self.choice    # back on the choice after measuring the other
        self._last_end, self._last_mode = now, mode
        self.steps += 1
        if returned:
            # What going back cost is known only now (the decision came a step before): the next measurement
            # is scheduled again with it (the same step on every rank: one more all-reduce of a few numbers).
            self._schedule(self._agree(agree))
        elif self.plan:
            self.plan.popleft()
            agreed = None                           # the ranks' times, agreed at most once a step
            if timed and mode not in REFINING and (not self.plan or self.plan[0] != mode) and self._room(mode):
                agreed = self._agree(agree)
                if agreed[mode] * len(self._samples[mode]) < self.min_seconds:
                    self.plan.appendleft(mode)      # too little measured yet: one more step of it
            if not self.plan:
                agreed = agreed or self._agree(agree)
                if mode in REFINE[COMPRESSED]:
                    self._choose_scale(agreed)
                elif mode in REFINE[ALLREDUCE]:
                    self._choose_precision(agreed)
                elif mode == COMPRESSED and not self._samples[ALLREDUCE]:    # the start, or a resumed run's
                    self._measure(ALLREDUCE, self.calibration_steps, agreed, bound)
                else:
                    self._decide(agreed)
            elif timed and mode == self.probing and mode in (ALLREDUCE, COMPRESSED) and len(self._samples[mode]) >= 2:
                agreed = agreed or self._agree(agree)
                other = ALLREDUCE if mode == COMPRESSED else COMPRESSED
                if agreed[mode] > self.clear_loss * agreed[other]:
                    self.plan.clear()               # a clear loser: no need to measure it further
                    self._decide(agreed)
        elif self._probe_due(agree):
            other = COMPRESSED if self.choice == ALLREDUCE else ALLREDUCE
            self._measure(other, self.probe_steps + 1,
                          self._agree(agree) if bound is not None and other == ALLREDUCE else None, bound)

    def _measure(self, mode: str, steps: int, agreed: Optional[Dict[str, Any]],
                 bound: Optional[Callable[[], float]]) -> None:
        """Plans ``steps`` steps of ``mode`` (the first untimed), unless ``mode`` is the all-reduce and the link
        probe's bound alone makes it ``clear_loss`` times slower than the compressed step (``agreed``): then
        compression is chosen again, the bound standing for the all-reduce's time, without a step of it."""
        if mode == ALLREDUCE and bound is not None and agreed is not None and math.isfinite(agreed[COMPRESSED]):
            estimate = float(bound()) + agreed["ready"]       # the link's share, after what comes before it
            if estimate > self.clear_loss * agreed[COMPRESSED]:
                self._decide(dict(agreed, **{ALLREDUCE: estimate}), estimated=True)
                return
        self._samples[mode].clear()                 # its earlier times are stale: the link may have changed
        self.plan.extend([mode] * steps)
        self.probing = mode

    def _room(self, mode: str) -> bool:
        """Whether a measurement of ``mode`` may take another step to reach ``min_seconds`` (the timed steps'
        count is the same on every rank; their time is compared once agreed, the slowest rank's)."""
        return self.min_seconds > 0 and len(self._samples[mode]) < self._samples[mode].maxlen

    def _probe_due(self, agree: Callable[[List[float]], List[float]]) -> bool:
        """Whether the slower choice is measured again now: its time has come, or (on the all-reduce) the
        ranks' recent all-reduce steps have become slower by ``margin`` than both compression's and their own
        when the all-reduce was chosen (the same answer on every rank: the times are agreed)."""
        if self.next_probe is not None and self.steps >= self.next_probe:
            return True
        if (self.choice != ALLREDUCE or self.steps < self._quiet_until or self.steps % self.check_every
                or not self._samples[ALLREDUCE]):
            return False
        t_comp, t_all = self.seconds[COMPRESSED], self.seconds[ALLREDUCE]
        if t_comp is None or not math.isfinite(t_comp):
            return False
        bar = (1 + self.margin) * max(t_comp, t_all if t_all is not None and math.isfinite(t_all) else 0.0)
        return self._agree(agree)[ALLREDUCE] > bar

    def _agree(self, agree: Callable[[List[float]], List[float]]) -> Dict[str, float]:
        ready = statistics.median_low(self._ready) if self._ready else 0.0
        values = agree([self._median(m) for m in LABELS] + [self._first[ALLREDUCE], self._first[COMPRESSED], ready])
        agreed: Dict[str, Any] = dict(zip(LABELS, values))
        agreed.update(first={ALLREDUCE: values[-3], COMPRESSED: values[-2]}, ready=values[-1])
        return agreed

    def _decide(self, agreed: Dict[str, Any], estimated: bool = False) -> None:
        t_all, t_comp = agreed[ALLREDUCE], agreed[COMPRESSED]
        self.seconds.update({ALLREDUCE: t_all, COMPRESSED: t_comp})
        self.estimated = estimated
        choice = COMPRESSED if t_comp * (1 + self.margin) < t_all else ALLREDUCE
        self.decisions += 1
        previous, self.choice, self.probing = self.choice, choice, None
        self._decided_at = self.steps
        self._quiet_until = self.steps + self.min_interval
        self._schedule(agreed)
        if choice == ALLREDUCE:
            self.scale = 1.0
        else:
            self.half = False
        if previous != choice and (self.scalable and self.sparsest < 1 if choice == COMPRESSED else self.bf16):
            # How much to send, at the sparsest density and the full one, or in bfloat16 and float32: steps of the
            # two in turns, the cheaper first (untimed: the switch from the choice's last steps), then pairs of
            # the other and it (module docstring).
            low, full = REFINE[choice]
            self._samples[low].clear()
            self._samples[full].clear()
            self.plan.extend([low] + [full, low] * self._pairs(t_comp if choice == COMPRESSED else t_all))
            self.probing = low

    def _pairs(self, step: float) -> int:
        """The pairs of steps a density's or a precision's measurement takes: ``2 * probe_steps`` at least, as many
        as time ``min_seconds`` of each side at ``step`` seconds a step, 16 at most (the samples each side keeps)."""
        cover = math.ceil(self.min_seconds / step) if math.isfinite(step) and step > 0 else 0
        return min(16, max(2 * self.probe_steps, cover))

    def _choose_scale(self, agreed: Dict[str, Any]) -> None:
        """The density after a measurement at ``sparsest`` (module docstring): the step's time taken as linear
        in the density between the two measured steps, the largest density whose step is within ``margin`` of
        the sparsest's; the full density unless the sparsest step is faster by more than ``margin``."""
        t_full, t_low, low = agreed[FULL], agreed[SPARSE], self.sparsest
        self.sparsest_seconds = t_low
        self.probing = None
        if not (math.isfinite(t_full) and math.isfinite(t_low)) or t_low * (1 + self.margin) >= t_full:
            self.scale = 1.0
            self.seconds[COMPRESSED] = t_full if math.isfinite(t_full) else self.seconds[COMPRESSED]
            return
        per_scale = (t_full - t_low) / (1 - low)              # seconds a step per unit of density scale
        self.scale = min(1.0, low + self.margin * t_low / per_scale)
        self.seconds[COMPRESSED] = t_low + per_scale * (self.scale - low)
        self._samples[COMPRESSED].clear()                     # they were at another density

    def _choose_precision(self, agreed: Dict[str, Any]) -> None:
        """The all-reduce's precision after its steps in turns (module docstring): bfloat16 where its step is
        faster than float32's by more than ``bf16_margin``."""
        t_full, t_half = agreed[FLOAT32], agreed[HALF]
        self.half_seconds = t_half
        self.probing = None
        self.half = math.isfinite(t_half) and math.isfinite(t_full) and t_half * (1 + self.bf16_margin) < t_full
        chosen = t_half if self.half else t_full
        if math.isfinite(chosen):
            self.seconds[ALLREDUCE] = chosen
        self._samples[ALLREDUCE].clear()                      # in the other precision, or before it

    def _schedule(self, agreed: Dict[str, float]) -> None:
        """When to measure the slower choice again. Against staying on the faster one, a measurement costs its
        first step (a switch: the slower choice's step and the switch's own work), the slower choice's extra
        time on the steps it is timed (two when it loses clearly, else ``probe_steps``) and the first step
        back (after compressed steps, the all-reduce step that averages the optimizer states); each switch
        as last measured, or a plain step of that choice before any was. Spread so that this stays below
        ``overhead`` of the time."""
        t_all, t_comp = self.seconds[ALLREDUCE], self.seconds[COMPRESSED]
        win, lose = (t_comp, t_all) if self.choice == COMPRESSED else (t_all, t_comp)
        if self.choice == ALLREDUCE:
            interval = self.max_interval      # a slower link shows in the all-reduce steps (_probe_due)
        elif win is not None and lose is not None and math.isfinite(lose):
            other = ALLREDUCE if self.choice == COMPRESSED else COMPRESSED
            into, back = agreed["first"][other] or lose, agreed["first"][self.choice] or win
            timed = 2 if lose > self.clear_loss * win else min(16, max(self.probe_steps,
                                                                      math.ceil(self.min_seconds / lose)))
            cost = max(0.0, into - win) + timed * max(0.0, lose - win) + max(0.0, back - win)
            interval = math.ceil(cost / (self.overhead * win)) if win > 0 else self.max_interval
        else:
            interval = self.max_interval
        self.next_probe = self._decided_at + min(self.max_interval, max(self.min_interval, interval))
        if self.choice == ALLREDUCE and self.steps < self.steady_from and self._may_win_when_steady():
            self.next_probe = min(self.next_probe, self.steady_from)

    def _may_win_when_steady(self) -> bool:
        """Whether compression, measured during its warm-up and beaten, could win once the warm-up is over: its
        step then takes at least ``steady_ratio`` times the step measured (only the message shrinks, to that
        fraction at most), and must still beat the all-reduce's by the margin."""
        t_all, t_comp = self.seconds[ALLREDUCE], self.seconds[COMPRESSED]
        if t_all is None or t_comp is None or not (math.isfinite(t_all) and math.isfinite(t_comp)):
            return True
        return t_comp * self.steady_ratio * (1 + self.margin) < t_all

    def _median(self, mode: str) -> float:
        """The lower median of a choice's recent steps: one step that held a pause of the user's loop moves
        it not at all (of two steps it takes the faster), a link that changed moves it within a few steps."""
        recent = list(self._samples[mode])[-self.probe_steps * 4:]
        return statistics.median_low(recent) if recent else math.inf

    # ------------------------------------------------------------------------------------ reporting
    def summary(self) -> Dict[str, Any]:
        """The current choice and the agreed step times it was made from (seconds)."""
        return {"choice": self.choice, "mode": self.mode, "allreduce_step_s": self.seconds[ALLREDUCE],
                "allreduce_estimated": self.estimated,
                "compressed_step_s": self.seconds[COMPRESSED], "sparsest_step_s": self.sparsest_seconds,
                "density_scale": self.scale, "bf16_step_s": self.half_seconds,
                "allreduce_precision": "bfloat16" if self.half else "float32", "decisions": self.decisions,
                "next_probe": self.next_probe}

    def config(self) -> Dict[str, Any]:
        """What every rank must share (part of the configuration agreement)."""
        return {"margin": self.margin, "probe_steps": self.probe_steps, "overhead": self.overhead,
                "min_interval": self.min_interval, "max_interval": self.max_interval,
                "calibration_steps": self.calibration_steps, "clear_loss": self.clear_loss,
                "check_every": self.check_every, "min_seconds": self.min_seconds, "probe": self.probe,
                "sparsest": self.sparsest, "bf16": self.bf16, "bf16_margin": self.bf16_margin}

    def state_dict(self) -> Dict[str, Any]:
        return {"steps": self.steps, "choice": self.choice, "plan": list(self.plan), "next_probe": self.next_probe,
                "seconds": dict(self.seconds), "decisions": self.decisions, "estimated": self.estimated,
                "scale": self.scale, "sparsest_seconds": self.sparsest_seconds, "half": self.half,
                "half_seconds": self.half_seconds}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        plan = list(state["plan"])
        if any(m not in LABELS for m in plan) or state["choice"] not in (None, ALLREDUCE, COMPRESSED):
            raise ValueError(f"load_state_dict: not a link-aware state: {state!r}")
        if not plan and state["choice"] is None:
            raise ValueError("load_state_dict: a link-aware state with neither a plan nor a choice")
        self.steps, self.choice = int(state["steps"]), state["choice"]
        # Timings from another process say nothing about this one: a measurement under way starts over, and
        # the next one waits until this process has timed its current choice. One of how much the choice made
        # sends (density, precision) goes on with the steps it had left, timed afresh: the choice stands, and the
        # steps take the same paths as they would have without the restart.
        self.plan, self.probing = deque(), None
        if plan and state["choice"] is not None and all(m in REFINING for m in plan):
            self.plan, self.probing = deque(plan), plan[0]
        elif plan:
            self._calibrate()
        self.next_probe = None if state["next_probe"] is None else max(int(state["next_probe"]),
                                                                         self.steps + self.min_interval)
        self.seconds = {ALLREDUCE: state["seconds"].get(ALLREDUCE), COMPRESSED: state["seconds"].get(COMPRESSED)}
        self.sparsest_seconds = state.get("sparsest_seconds")
        scale = float(state.get("scale", 1.0))
        if not (0 < scale <= 1):
            raise ValueError(f"load_state_dict: a link-aware state with density scale {scale!r}, not in (0, 1]")
        self.scale = scale
        self.half = bool(state.get("half", False)) and self.bf16 and self.choice == ALLREDUCE
        self.half_seconds = state.get("half_seconds")
        self.decisions = int(state["decisions"])
        self.estimated = bool(state.get("estimated", False))
        for samples in self._samples.values():
            samples.clear()
        self._first = {m: 0.0 for m in LABELS}
        self._decided_at, self._quiet_until = self.steps, self.steps + self.min_interval
        self._last_end = self._last_mode = None
        self._ready.clear()
        self._ready_in_step = None

    def __repr__(self) -> str:
        return "LinkAware(" + ", ".join(f"{k}={v!r}" for k, v in self.config().items()) + ")"
