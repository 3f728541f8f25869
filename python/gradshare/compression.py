"""What a bucket sends each step: the compression policies, and the one gradshare picks for an optimizer.

Every policy keeps an error-feedback residual per bucket (what was not sent waits for later steps) and
writes one int32 message per rank and step (gradshare.message):

- ``TopK(density=0.02)``: in every chunk of 65536 elements, the entries with the largest accumulated
  magnitude, with their values (8-bit, one scale per chunk), after a warm-up at higher density.
  About 55-60x fewer bytes than a float32 allreduce with two ranks over a 1000-step run. For updates with
  a few large entries and many small ones: SGD's.
- ``Ternary(fraction=0.5)``: every element as -s, 0 or +s with one scale s per chunk (2 bits per
  element: 16x fewer bytes). For updates whose entries are all of similar size: Adam's (and Muon's), whose
  normalised steps leave top-k nothing to pick between, and whose second moment would be distorted by
  gradients that arrive in rare large bursts.
- ``Strom(threshold)``: DL4J's scheme, each entry that reached tau sent as +-tau (``Fixed`` / ``Adaptive``
  thresholds, gradshare.thresholds). Kept for DL4J semantics; it moves an element by at most tau per step.
- ``Dense()``: everything, summed by one float32 all-reduce (the exchange's dense path); nothing is held
  back. For exchanges that are rare already (ParameterAveraging's pseudo-gradient, DiLoCo).

``for_optimizer(opt)`` is the default choice: ``TopK`` for SGD-like optimizers (and Rprop), ``Ternary`` for
adaptive ones (Adam, AdamW, RMSprop, ...) and, with a warning, for optimizers gradshare does not know.
How these were chosen (measured): README, "Training quality".

TopK and Ternary messages have a length fixed by (n, chunk, k): every rank knows every message's size,
so an exchange is a single all-gather. Strom messages vary in length, so their exchange first gathers
the lengths.
"""
from __future__ import annotations

import copy
import math
import os
import sys
import warnings
from typing import Any, Dict, Optional, Union

import torch

from gradshare import ops
from gradshare import message as msgfmt
from gradshare.thresholds import (Adaptive, Fixed, ResidualClipping, TargetSparsity, Threshold, as_threshold)

DEFAULT_CHUNK = 4096                     # Ternary's: one scale per 4096 elements
TOPK_CHUNK = msgfmt.MAX_TOPK_CHUNK       # TopK's: the widest window a 16-bit position can address


class Compression:
    """Base class. ``words(n, step)``: the fixed message length (None: it varies, lengths are gathered
    first); ``encode(update, residual, step, kept=None, velocity=None)``: one message, what is not sent kept
    in the residual (in place) or, when given, in ``kept`` (the residual only read); ``velocity`` (None, or
    (velocity, m, velocity_out)): momentum correction fused into the encode (gradshare.ops.encode);
    ``observe``: learn from the finished exchange (adaptive thresholds)."""

    name = "compression"

    def words(self, n: int, step: int) -> Optional[int]:
        raise NotImplementedError

    def encode(self, update: torch.Tensor, residual: torch.Tensor, step: int,
               kept: Optional[torch.Tensor] = None, velocity=None) -> torch.Tensor:
        raise NotImplementedError

    def observe(self, count: int, n: int, message_format: int) -> None:
        pass

    #: Whether :meth:`scaled` changes anything (a policy with a density to lower).
    density_scalable = False

    def scaled(self, scale: float) -> "Compression":
        """This policy sending ``scale`` (0 < scale <= 1) times as many entries a step: what the link-aware
        policy takes where a step waits on the link (gradshare.link). Policies without a density: itself."""
        return self

    @property
    def tau(self) -> Optional[float]:
        """The threshold of a +-tau scheme (None for the others)."""
        return None

    def clone(self) -> "Compression":
        return copy.deepcopy(self)

    def config(self) -> Dict[str, Any]:
        """The settings that every rank must share (compared across ranks)."""
        return {"kind": type(self).__name__}

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        pass

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items() if k != "kind")
        return f"{type(self).__name__}({args})"


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return value


def _fraction(name: str, value: Any, high: float = 1.0) -> float:
    v = float(value)
    if not (0 < v <= high and math.isfinite(v)):
        raise ValueError(f"{name}: must be in (0, {high:g}], got {value}")
    return v


class TopK(Compression):
    """Send, per chunk, the ``density`` fraction of entries with the largest accumulated magnitude.

    Args:
        density: fraction of entries sent each step (0.02: 1311 of every 65536). Bytes on the wire are about
            ``1.5 * density`` times those of a float32 allreduce with two ranks (3 bytes per entry: a 16-bit
            position and an 8-bit value; 4 with bfloat16 values).
        chunk: elements per chunk (<= 65536, the default). Each chunk sends its own share (``density`` of
            its elements): within a chunk entries compete by magnitude alone. Small chunks turn that into a
            quota per chunk, which starves the chunks that matter at low densities (measured on the MNIST
            CNN at 0.1%: 4096-element chunks ended 1.5 points below DDP, 65536-element ones 0.1). With
            ``values="sign"`` (no 16-bit index) a chunk may be longer, and ``chunk=None`` makes each bucket one
            chunk: its top entries compete over the whole bucket, every layer's against every other's, with
            one scale. The selection of one chunk runs on one thread (or one GPU block): meant for rare
            exchanges (local steps' pseudo-gradient), not every step's. On the README's AdamW LM it gained
            0.2-0.3 points at 2% on a short run, 0.1 on a four times longer one, none at 4% or 10% (README
            "Local steps").
        values: "int8" (one scale per chunk and each value as a rounded multiple of it: 3 bytes an entry),
            "bf16" (each value rounded to bfloat16: 4 bytes an entry) or "sign" (each entry sent as +-s, s the
            mean |value| of the chunk's entries, its index Elias-Fano coded: 3 + log2(1 / density) bits an
            entry, 6.3 at 10%, where int8 takes 24). Either way the rounding error stays in the residual and is
            sent later; at equal bytes int8 sends a third more entries than bf16, and "sign" three to four
            times more than int8 (for exchanges whose residual soon sends what the sign dropped: local steps'
            pseudo-gradient, README "Local steps").
        warmup_steps, warmup_density: over the first ``warmup_steps`` steps the density falls
            exponentially from ``warmup_density`` to ``density`` (Deep Gradient Compression's warm-up),
            when the model changes fastest and a stale residual costs most. The default (100 steps from
            1/16) trained better than a shorter, denser start (50 steps from 25%) at fewer bytes, at 2% and
            at 0.1% (README, "Training quality"); it costs about a tenth more bytes than none over a
            1000-step run at 2%.
    """

    name = "topk"

    def __init__(self, density: float = 0.02, *, chunk: Optional[int] = TOPK_CHUNK, warmup_steps: int = 100,
                 warmup_density: float = 1 / 16, values: str = "int8"):
        if values not in ops.TOPK_VALUES:
            raise ValueError(f"values: expected 'bf16', 'int8' or 'sign', got {values!r}")
        self.values = values
        self.density = _fraction("density", density)
        longest = msgfmt.max_topk_chunk(ops.TOPK_VALUES[values])
        if chunk is None and values != "sign":
            raise ValueError(f"chunk=None (each bucket one chunk) needs values='sign': {values!r} values carry "
                             f"16-bit indices, at most {msgfmt.MAX_TOPK_CHUNK} elements a chunk")
        self.chunk = None if chunk is None else _positive_int("chunk", chunk)
        if self.chunk is not None and self.chunk > longest:
            raise ValueError(f"chunk: at most {longest} with values={values!r}, got {chunk}"
                             + (" (values='sign' allows longer chunks, or chunk=None)" if values != "sign" else ""))
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps: expected an int >= 0, got {warmup_steps!r}")
        self.warmup_steps = warmup_steps
        self.warmup_density = _fraction("warmup_density", warmup_density)

    def density_at(self, step: int) -> float:
        if step < self.warmup_steps and self.warmup_density > self.density:
            return self.warmup_density * (self.density / self.warmup_density) ** (step / self.warmup_steps)
        return self.density

    def chunk_for(self, n: int) -> int:
        """The chunk a buffer of ``n`` elements is split by (``chunk=None``: the whole buffer)."""
        return self.chunk if self.chunk is not None else max(1, int(n))

    def k(self, step: int, n: Optional[int] = None) -> int:
        """Entries sent per full chunk at ``step`` (of a buffer of ``n`` elements where ``chunk=None``)."""
        if self.chunk is None and n is None:
            raise TypeError("TopK(chunk=None).k: pass n, the buffer's elements (its chunk)")
        chunk = self.chunk_for(n)
        return min(chunk, max(1, math.ceil(self.density_at(step) * chunk - 1e-9)))

    def words(self, n: int, step: int) -> int:
        return msgfmt.chunked_words(ops.TOPK_VALUES[self.values], n, self.chunk_for(n), self.k(step, n))

    density_scalable = True

    def scaled(self, scale: float) -> "TopK":
        if not 0 < scale <= 1:
            raise ValueError(f"scale: expected a value in (0, 1], got {scale}")
        if scale == 1:
            return self
        return TopK(self.density * scale, chunk=self.chunk, warmup_steps=self.warmup_steps,
                    warmup_density=self.warmup_density * scale, values=self.values)

    def encode(self, update, residual, step, kept=None, velocity=None):
        n = update.numel()
        return ops.encode_topk(update, residual, self.k(step, n), chunk=self.chunk_for(n), values=self.values,
                               kept=kept, **ops.momentum_kwargs(velocity))

    def config(self):
        return {"kind": "TopK", "density": self.density, "chunk": self.chunk, "warmup_steps": self.warmup_steps,
                "warmup_density": self.warmup_density, "values": self.values}


class Ternary(Compression):
    """Send every element as -s, 0 or +s, one scale s per chunk: 2 bits per element (16x fewer bytes).

    An entry is sent when |u| >= ``fraction`` * mean|u| of its chunk (u: accumulated update); s is the mean
    |u| of the entries sent, so what arrives has the right size on average and the rest stays in the
    residual. Leaving the small entries at 0 (rather than +-s, as 1-bit sign schemes do) keeps them from
    oscillating around zero. A ``fraction`` above 1 sends fewer entries, each a larger step, from a residual
    that grows with what it holds back: on the quality table's AdamW LM (seed 0) 1.5 ended at loss 3.08 and
    2.0 diverged (5.03), against 2.19 at the default 0.5 (bench/results/ternary_fraction_tried); the message
    is 2 bits an element whatever it is.
    """

    name = "ternary"

    def __init__(self, fraction: float = 0.5, *, chunk: int = DEFAULT_CHUNK):
        self.fraction = _fraction("fraction", fraction, high=64.0)
        self.chunk = _positive_int("chunk", chunk)
        if self.chunk % 16:
            raise ValueError(f"chunk: must be a multiple of 16, got {chunk}")

    def words(self, n: int, step: int) -> int:
        return msgfmt.ternary_words(n, self.chunk)

    def encode(self, update, residual, step, kept=None, velocity=None):
        return ops.encode_ternary(update, residual, self.fraction, chunk=self.chunk, kept=kept,
                                  **ops.momentum_kwargs(velocity))

    def config(self):
        return {"kind": "Ternary", "fraction": self.fraction, "chunk": self.chunk}


class Strom(Compression):
    """DL4J's threshold encoding: entries of the accumulated update that reach tau are sent as +-tau.

    ``threshold``: Fixed(tau) or Adaptive(...) (one clone per bucket); ``clipping``: DL4J's residual
    clipping (ResidualClipping) or None.
    """

    name = "strom"

    def __init__(self, threshold: Union[Threshold, float, None] = None,
                 clipping: Optional[ResidualClipping] = None):
        self.threshold = as_threshold(threshold).clone()
        self.clipping = copy.deepcopy(clipping)

    @property
    def tau(self) -> float:
        return self.threshold.tau

    def words(self, n: int, step: int) -> None:
        return None

    def encode(self, update, residual, step, kept=None, velocity=None):
        clip = self.clipping.factor(step) if self.clipping is not None else None
        return ops.encode(update, residual, self.threshold.tau, clip=clip, on_nonfinite="flag", kept=kept,
                          **ops.momentum_kwargs(velocity))

    def observe(self, count: int, n: int, message_format: int) -> None:
        self.threshold.observe(count, n, message_format)

    def config(self):
        return {"kind": "Strom", "threshold": repr(self.threshold), "clipping": repr(self.clipping)}

    def state_dict(self):
        return {"threshold": self.threshold.state_dict(),
                "clipping": None if self.clipping is None else self.clipping.state_dict()}

    def load_state_dict(self, state):
        self.threshold.load_state_dict(state["threshold"])
        if self.clipping is not None and state.get("clipping") is not None:
            self.clipping.load_state_dict(state["clipping"])

    def __repr__(self) -> str:
        return f"Strom({self.threshold!r}, clipping={self.clipping!r})"


class Dense(Compression):
    """No compression: the whole buffer is summed by one float32 all-reduce (the exchange's dense path), so
    the residual is empty after every exchange. Its "message" is declared larger than the buffer, which
    sends every exchange with it down the dense path (``fallback="never"`` cannot send it)."""

    name = "dense"

    def words(self, n: int, step: int) -> int:
        return n + msgfmt.HEADER_WORDS

    def encode(self, update, residual, step, kept=None, velocity=None):
        raise ValueError("Dense() is sent by all-reduce; it cannot be used with fallback='never'")


# --------------------------------------------------------------------------------------- the default
# TopK for optimizers whose steps differ in size from entry to entry (Rprop's step sizes range over decades);
# Ternary for those that divide by a second-moment estimate, whose entries are of similar size.
SGD_LIKE = (torch.optim.SGD, torch.optim.ASGD, torch.optim.Rprop)
ADAPTIVE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
            torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.RMSprop) + tuple(
            getattr(torch.optim, name) for name in ("Adafactor", "Muon") if hasattr(torch.optim, name))
# (Muon's steps are orthogonalized matrices: every entry of similar size too.)
_warned: set = set()


# With what waits kept in each rank's model (error_feedback="model"), the top 5% as signs for every optimizer:
# 3 seeds, 11 workloads (SGD, Adam, AdamW; CNNs, an MLP, transformer and LSTM LMs, regressions, a copy task):
# within 0.21 points of DDP's accuracy and 0.7% of its LM losses at 85-87x fewer bytes, the copy task +7.8%
# where the residual buffer is +6.8% (README, "Training quality"). The top 1% (228-286x) ends as close on the
# 300-step table but lags where the loss falls fast at a constant rate: the mean result every rank shows trails
# by what the ranks have not sent yet (bench/results/copy_lstm_constant_lr: +24% against +8% at 5%).
OWN_MODEL_DEFAULT = dict(density=0.05, values="sign")


def for_optimizer(optimizer: Optional[torch.optim.Optimizer], own_models: bool = False) -> Compression:
    """The default for ``optimizer``. ``own_models`` (sharing updates with error_feedback="model", the default
    of the DDP hook and SharedOptimizer): TopK(0.05, values="sign") for any optimizer, whose gradients see what
    waits, so Adam's steps of similar size need not every element sent. Otherwise (what waits in the residual):
    TopK() for SGD-like ones, Ternary() for adaptive ones and for classes gradshare does not know. None (no
    optimizer known): TopK(). A class gradshare does not know gets a warning (once per class) naming what was
    assumed."""
    known = optimizer is None or isinstance(optimizer, SGD_LIKE + ADAPTIVE)
    name = type(optimizer).__name__
    if not known and name not in _warned:
        _warned.add(name)
        assumed = ("sharing each rank's steps as it takes them (an adaptive step is not rescaled to the global "
                   "batch's second moment), the top 5% as signs" if own_models else
                   "assuming its updates are like Adam's (entries of similar size) and sharing them ternary-coded, "
                   "16x smaller than float32")
        warnings.warn(f"gradshare: {name} is not an optimizer gradshare knows; {assumed}. Pass "
                      "compression=gradshare.TopK(...) or gradshare.Ternary(...) to choose.",
                      UserWarning, stacklevel=_caller_outside_gradshare())
    if own_models:
        return TopK(**OWN_MODEL_DEFAULT)
    if optimizer is None or isinstance(optimizer, SGD_LIKE):
        return TopK()
    return Ternary()


def _caller_outside_gradshare(also: tuple = ()) -> int:
    """The ``stacklevel`` (for a warning raised by this module's caller) of the first frame outside the
    gradshare package (and the packages of the modules ``also``), so that the warning names the user's line
    whichever front end built the sharing."""
    packages = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (sys.modules[__package__],) + also)
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(packages):
        frame, level = frame.f_back, level + 1
    return level


def as_compression(value: Union[Compression, Threshold, float, str, None],
                   clipping: Optional[ResidualClipping] = None) -> Optional[Compression]:
    """A Compression from what a user passes: a Compression as is; a Fixed / Adaptive threshold (or a float
    tau) as Strom; a TargetSparsity(target) as TopK(density=target) (its fixed traffic budget, now with
    values); "dense" -> Dense(); None or "auto" -> None (the caller picks with for_optimizer)."""
    if value is None or (isinstance(value, str) and value == "auto"):
        return None
    if isinstance(value, str) and value == "dense":
        return Dense()
    if isinstance(value, Compression):
        return value.clone()
    if isinstance(value, TargetSparsity):
        if not value.warmup_given:                       # TopK's own warm-up (a sparse start costs most)
            return TopK(density=value.target)
        return TopK(density=value.target, warmup_steps=value.warmup_steps,
                    warmup_density=max(value.warmup_density, value.target))
    if isinstance(value, (Fixed, Adaptive, Threshold, int, float)) and not isinstance(value, bool):
        return Strom(value, clipping)
    raise TypeError(f"compression: expected TopK, Ternary, Dense, a threshold (Fixed, Adaptive, TargetSparsity), a "
                    f"float tau, 'dense' or 'auto', got {value!r}")
