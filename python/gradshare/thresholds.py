"""Threshold algorithms (how tau moves between steps) and residual clipping.

A threshold object says which tau to encode with (``th.tau``) and learns from what the last step sent
(``th.observe(count, n, format)``). Use:

- ``Fixed(tau)`` when the update scale is known and stable (benchmarks, tests).
- ``Adaptive()`` (the default, DL4J's): keeps the measured density count/n inside [min_sparsity,
  max_sparsity] by multiplicative steps; the usual choice.
- ``TargetSparsity()`` to steer towards one density (a fixed traffic budget per step).

Every step moves tau by one factor ``decay`` (or its inverse), as DL4J does: tau halves or doubles in
about 20 steps with the default decay 0.965936 = 0.5 ** (1/20). After a bitmap step the density is
taken as 1/16 (the bitmap's break-even), whatever the true count, again as DL4J does: a bitmap step
means "too dense" for any target below 1/16.

gradshare keeps one threshold object per bucket (group of parameters): the DDP hook and
SharedOptimizer clone the object the user passes (``th.clone()``) for every bucket. All ranks observe
the same counts (the exchange shares them), so per-bucket thresholds stay identical on every rank.

Density warm-up (Deep Gradient Compression, Lin et al. 2018): ``Adaptive(..., warmup_steps=K)`` and
``TargetSparsity(..., warmup_steps=K)`` aim at a higher density during their first K observations, so
early, fast-changing gradients are sent more completely. The density band (or target) is multiplied by
``warmup_factor(s) = (warmup_density / max) ** (1 - s / K)`` for observation s < K (``max`` is
max_sparsity, or the target), i.e. its upper edge falls exponentially from ``warmup_density`` (1/16 by
default) to the configured value, and is the configured band from step K on. ``band(s)`` gives the
exact values. Warm-up moves only the band: tau still changes by one factor ``decay`` per step, so pick
K of the order of the number of steps tau needs to follow (tens to hundreds). Messages carry +-tau per
element, so a denser start also means a smaller tau and less movement per element and step: on the MNIST
CNN run of bench/e2e.py (188 steps, momentum correction) warm-up cost accuracy; measure before using it.

``ResidualClipping(c, every)`` is DL4J's residual post-processor: on steps where ``step % every == 0``
the kept residual is clipped to [-c*tau, c*tau] (``factor(step)`` returns c then, else None).
"""
from __future__ import annotations

import copy
import math
from typing import Any, Dict, Optional, Union

from gradshare.message import BITMAP, FORMAT_NAMES, NONFINITE, SPARSE

BITMAP_DENSITY = 1.0 / 16.0
# tau stays a positive, finite float32 whatever the observations.
TAU_MIN, TAU_MAX = 1e-30, 1e30

FormatLike = Union[int, str]


def _format_code(fmt: FormatLike) -> int:
    if isinstance(fmt, str):
        names = {v: k for k, v in FORMAT_NAMES.items()}
        names["dense"] = -1
        if fmt not in names:
            raise ValueError(f"format: expected 'sparse', 'bitmap' or 'dense', got {fmt!r}")
        return names[fmt]
    return int(fmt)


def _positive(name: str, value: float) -> float:
    v = float(value)
    if not (v > 0 and math.isfinite(v)):
        raise ValueError(f"{name}: must be a positive finite number, got {value}")
    return v


class Threshold:
    """Base class: a tau that may move after each step. Subclasses implement ``_update(density)``."""

    def __init__(self, tau: float):
        self._tau = _positive("tau", tau)
        self.steps = 0            # observations so far
        self.last_density: Optional[float] = None

    @property
    def tau(self) -> float:
        """The threshold to encode the next step with."""
        return self._tau

    def density_of(self, count: int, n: int, format: FormatLike = SPARSE) -> float:
        """The density the algorithm sees: count/n, or 1/16 after a bitmap step."""
        code = _format_code(format)
        if code == NONFINITE:
            raise ValueError("format: a non-finite step has no density (do not observe it)")
        if code == BITMAP:
            return BITMAP_DENSITY
        return (count / n) if n > 0 else 0.0

    def observe(self, count: int, n: int, format: FormatLike = SPARSE) -> float:
        """Learn from one step that sent ``count`` of ``n`` elements in ``format``; returns the new tau.

        ``format``: gradshare.message.SPARSE / BITMAP or "sparse" / "bitmap" / "dense" (a dense-fallback
        step still reports the count its encoding reached, and is treated by that count).
        """
        if count < 0 or n < 0:
            raise ValueError(f"count and n must be >= 0, got count={count}, n={n}")
        d = self.density_of(count, n, format)
        self.last_density = d
        self.steps += 1
        self._update(d)
        self._tau = min(max(self._tau, TAU_MIN), TAU_MAX)
        return self._tau

    def _update(self, density: float) -> None:
        raise NotImplementedError

    def clone(self) -> "Threshold":
        """An independent copy (one per bucket)."""
        return copy.deepcopy(self)

    def state_dict(self) -> Dict[str, Any]:
        return {"kind": type(self).__name__, "tau": self._tau, "steps": self.steps,
                "last_density": self.last_density}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        kind = state.get("kind", type(self).__name__)
        if kind != type(self).__name__:
            raise ValueError(f"state_dict: saved from {kind}, cannot load into {type(self).__name__}")
        self._tau = _positive("tau", state["tau"])
        self.steps = int(state.get("steps", 0))
        self.last_density = state.get("last_density")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(tau={self._tau:.4g})"


def _warmup_args(warmup_steps: int, warmup_density: float, top: float):
    k = int(warmup_steps)
    if k < 0:
        raise ValueError(f"warmup_steps: must be >= 0, got {warmup_steps}")
    d = _positive("warmup_density", warmup_density)
    if k and not top <= d <= BITMAP_DENSITY:
        raise ValueError(f"warmup_density: must be in [{top:g}, 1/16], got {warmup_density}")
    return k, d


def warmup_factor(step: int, warmup_steps: int, warmup_density: float, top: float) -> float:
    """Factor on the density band at observation ``step`` (0-based): (warmup_density/top)**(1-step/K), then 1."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return 1.0
    return (warmup_density / top) ** (1.0 - step / warmup_steps)


class Fixed(Threshold):
    """A constant tau. Use when the scale of what is encoded is known (or for reproducible benchmarks)."""

    def __init__(self, tau: float = 1e-3):
        super().__init__(tau)

    def _update(self, density: float) -> None:
        pass


class Adaptive(Threshold):
    """DL4J's adaptive threshold: keep the density inside [min_sparsity, max_sparsity].

    After each step: density < min_sparsity (too few elements sent) -> tau *= decay;
    density > max_sparsity (too many, or a bitmap step) -> tau /= decay; otherwise tau stays.
    ``initial`` should be near the typical magnitude of what is encoded (gradients for the DDP hook and
    SharedOptimizer mode="gradients"; lr-scaled updates for mode="updates", where DL4J's 1e-3 fits).

    ``warmup_steps`` K > 0: for the first K observations both band edges are multiplied by
    ``(warmup_density / max_sparsity) ** (1 - s/K)`` (module docstring), so the band starts at
    [min_sparsity * warmup_density / max_sparsity, warmup_density] and narrows exponentially to the
    configured one. 0 (default): no warm-up.
    """

    def __init__(self, initial: float = 1e-3, min_sparsity: float = 1e-4, max_sparsity: float = 1e-2,
                 decay: float = 0.965936, *, warmup_steps: int = 0, warmup_density: float = BITMAP_DENSITY):
        super().__init__(initial)
        self.initial = self._tau
        self.min_sparsity = _positive("min_sparsity", min_sparsity)
        self.max_sparsity = _positive("max_sparsity", max_sparsity)
        if self.min_sparsity > self.max_sparsity:
            raise ValueError(f"min_sparsity {min_sparsity} must be <= max_sparsity {max_sparsity}")
        self.decay = float(decay)
        if not 0 < self.decay < 1:
            raise ValueError(f"decay: must be in (0, 1), got {decay}")
        self.warmup_steps, self.warmup_density = _warmup_args(warmup_steps, warmup_density, self.max_sparsity)

    def band(self, step: int):
        """(min, max) density band used at observation ``step`` (0-based), warm-up included."""
        f = warmup_factor(step, self.warmup_steps, self.warmup_density, self.max_sparsity)
        return self.min_sparsity * f, self.max_sparsity * f

    def _update(self, density: float) -> None:
        lo, hi = self.band(self.steps - 1)
        if density < lo:
            self._tau *= self.decay
        elif density > hi:
            self._tau /= self.decay

    def __repr__(self) -> str:
        warm = f", warmup_steps={self.warmup_steps}" if self.warmup_steps else ""
        return (f"Adaptive(tau={self._tau:.4g}, min_sparsity={self.min_sparsity:g}, "
                f"max_sparsity={self.max_sparsity:g}, decay={self.decay:g}{warm})")


class TargetSparsity(Threshold):
    """Steer the density towards one ``target`` (< 1/16): below it tau *= decay, above it tau /= decay.

    Use when a fixed traffic budget per step matters more than holding tau still (it never rests).
    ``warmup_steps`` K > 0: the target at observation s < K is ``target * (warmup_density/target) **
    (1 - s/K)`` (from warmup_density, default 1/16, down to ``target``); 0: no warm-up. None (default):
    none for this threshold itself, and TopK's default warm-up where gradshare sends it as
    ``TopK(density=target)`` (gradshare.compression.as_compression: what ``compression=TargetSparsity(d)``
    means).
    """

    def __init__(self, initial: float = 1e-4, target: float = 1e-3, decay: float = 0.965936, *,
                 warmup_steps: Optional[int] = None, warmup_density: float = BITMAP_DENSITY):
        super().__init__(initial)
        self.initial = self._tau
        self.target = _positive("target", target)
        if self.target >= BITMAP_DENSITY:
            raise ValueError(f"target: must be below 1/16 (the bitmap break-even), got {target}")
        self.decay = float(decay)
        if not 0 < self.decay < 1:
            raise ValueError(f"decay: must be in (0, 1), got {decay}")
        self.warmup_given = warmup_steps is not None
        self.warmup_steps, self.warmup_density = _warmup_args(warmup_steps or 0, warmup_density, self.target)

    def target_at(self, step: int) -> float:
        """The target density used at observation ``step`` (0-based), warm-up included."""
        return self.target * warmup_factor(step, self.warmup_steps, self.warmup_density, self.target)

    def _update(self, density: float) -> None:
        target = self.target_at(self.steps - 1)
        if density < target:
            self._tau *= self.decay
        elif density > target:
            self._tau /= self.decay

    def __repr__(self) -> str:
        return f"TargetSparsity(tau={self._tau:.4g}, target={self.target:g}, decay={self.decay:g})"


class ResidualClipping:
    """Clip the kept residual to [-c*tau, c*tau] every ``every`` steps (DL4J's default post-processor).

    Bounds how much unsent error a rank can accumulate (stale residual from early, large gradients).
    ``factor(step)`` is what the encoder's ``clip`` argument receives: ``c`` when ``step % every == 0``,
    else None.
    """

    def __init__(self, c: float = 5.0, every: int = 5):
        self.c = _positive("c", c)
        self.every = int(every)
        if self.every < 1:
            raise ValueError(f"every: must be >= 1, got {every}")

    def factor(self, step: int) -> Optional[float]:
        return self.c if step % self.every == 0 else None

    def state_dict(self) -> Dict[str, Any]:
        return {"c": self.c, "every": self.every}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.c = _positive("c", state["c"])
        self.every = int(state["every"])

    def __repr__(self) -> str:
        return f"ResidualClipping(c={self.c:g}, every={self.every})"


def as_threshold(value: Union[Threshold, float, None]) -> Threshold:
    """A Threshold from a Threshold, a float (Fixed) or None (Adaptive())."""
    if value is None:
        return Adaptive()
    if isinstance(value, Threshold):
        return value
    if isinstance(value, (int, float)):
        return Fixed(float(value))
    raise TypeError(f"threshold: expected a Threshold, a float or None, got {type(value).__name__}")
