"""Adam's second moment for the global batch, estimated from one rank's own optimizer state.

When W ranks each run Adam on their own share of the batch and average their steps (sharing updates:
gradshare.sharing; local steps: gradshare.averaging), each rank divides its momentum by the second moment
of its *own* gradient, about mu^2 + s^2/b for a per-rank batch b, where DDP's Adam divides by that of the
mean gradient, mu^2 + s^2/(W b). In coordinates where noise dominates, each rank's step is then about
sqrt(W) times smaller than DDP's, and averaging W independent steps shrinks their noise on top of that:
the model moves too little. Measured on the AdamW char LM of bench/quality.py (2 ranks, nothing
compressed, every rank's update averaged): +1.3% validation loss against DDP, all of the gap that
compressed sharing showed.

gradshare rescales the Adam part of each rank's step to the second moment the global batch would have,
estimated from the rank's own bias-corrected moments m and v:

    v_global = m^2 + max(v - m^2, 0) / W

(m^2 estimates the squared mean of the gradient, v - m^2 its variance over steps, which a W-times larger
batch divides by W). A step -lr * m / (sqrt(v) + eps) becomes -lr * m / (sqrt(v_global) + eps): the same
where the gradient's sign is steady, up to sqrt(W) larger where noise dominates, as in DDP. With one rank
v_global = v and nothing changes. Weight decay (decoupled or not) and the learning rate of the moment (a
scheduler's) are the optimizer's own.

The rule reads the optimizer's ``exp_avg_sq`` as the rank's *own* second moment, so that is what it must
hold whenever ranks step on their own gradients: averaging it over ranks keeps it so (each rank's is an
estimate of the same per-rank quantity). Steps on an all-reduced gradient (gradshare.link) are DDP's own
and update it with the mean gradient, so the sharing core converts it when the path changes: to the global
batch's (:func:`to_global`) before the first all-reduce step, and back to a rank's own (:func:`to_own`,
the inverse) before the first step on local gradients. Reading a global second moment as a rank's own
would divide its variance by W again at every round.

Applies to torch.optim.Adam and AdamW (amsgrad: the running maximum is the v used), whose step is
lr * m / (sqrt(v) + eps) exactly, and to NAdam and RAdam, which divide their step by the same sqrt(v) + eps
(RAdam: eps / sqrt(1 - beta2^t), and only once its rectification is on): there the part of this step's
change that the division scaled (all of it but decoupled weight decay) is multiplied by
(sqrt(v) + eps) / (sqrt(v_global) + eps). Other adaptive optimizers (Adamax's infinity norm, RMSprop,
Adagrad and Adadelta, which keep no first moment, Adafactor's factored moments) share their steps as
they are.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, Optional, Tuple

import torch

from gradshare.optimizer_state import state_tensors

CORRECTED = (torch.optim.Adam, torch.optim.AdamW)     # the step from the moments alone
RESCALED = (torch.optim.NAdam, torch.optim.RAdam)      # this step's change, rescaled (needs the change)


def applies(optimizer: Optional[torch.optim.Optimizer]) -> bool:
    """Whether ``optimizer``'s steps are rescaled to the global batch's second moment."""
    return isinstance(optimizer, CORRECTED + RESCALED)


def kind(optimizer: Optional[torch.optim.Optimizer]) -> Optional[str]:
    """How :func:`step_excess` treats ``optimizer``'s steps: "adam", "nadam", "radam" or None (not at all)."""
    if isinstance(optimizer, CORRECTED):
        return "adam"
    if isinstance(optimizer, torch.optim.NAdam):
        return "nadam"
    if isinstance(optimizer, torch.optim.RAdam):
        return "radam"
    return None


def needs_change(optimizer: Optional[torch.optim.Optimizer]) -> bool:
    """Whether :func:`step_excess` needs the step's change (before - after) for ``optimizer``."""
    return isinstance(optimizer, RESCALED)


def _moments(state: Dict[str, Any], group: Dict[str, Any]) -> Optional[Tuple[torch.Tensor, torch.Tensor, float]]:
    """Bias-corrected (m, v) of one parameter as float32 copies, and its Adam step count; None before its
    first step or for a parameter this rule does not cover (complex, or state missing)."""
    m = state.get("exp_avg")
    v = state.get("max_exp_avg_sq") if group.get("amsgrad") else state.get("exp_avg_sq")
    step = state.get("step")
    if m is None or v is None or step is None or m.is_complex():
        return None
    t = float(step)
    if t < 1:
        return None
    b1, b2 = (float(b) for b in group["betas"])
    return m.float() / (1.0 - b1 ** t), v.float() / (1.0 - b2 ** t), t


def _global(m: torch.Tensor, v: torch.Tensor, world: int) -> torch.Tensor:
    """v_global = m^2 + max(v - m^2, 0) / W (module docstring); ``v`` is left as it is."""
    m2 = m * m
    return torch.sub(v, m2).clamp_min_(0.0).div_(world).add_(m2)


@torch.no_grad()
def step_excess(p: torch.Tensor, state: Dict[str, Any], group: Dict[str, Any], world: int, kind: str = "adam",
                change: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """How far the step this rank's optimizer just took on ``p`` falls short of the global-batch step, as a
    float32 tensor shaped like ``p``. Subtract it from ``p`` (or add it to the change before - after) to take
    the global-batch step. ``kind`` (:func:`kind`): "adam": lr * m * (1/(sqrt(v_global) + eps) - 1/(sqrt(v) +
    eps)); "nadam" / "radam": the step's ``change`` (before - after, shaped like ``p``, taken while ``p``
    holds the after), less decoupled weight decay, times (sqrt(v) + eps) / (sqrt(v_global) + eps) - 1. None
    when there is nothing to correct (one rank, no step yet, a parameter without a gradient, which the
    optimizer did not step, RAdam before its rectification, or a state this rule does not cover)."""
    if world <= 1 or p.grad is None:
        return None
    mv = _moments(state, group)
    if mv is None:
        return None
    m, v, t = mv
    lr, eps = float(group["lr"]), float(group["eps"])
    if kind == "adam":
        wide = _global(m, v, world).sqrt_().add_(eps).reciprocal_()
        narrow = v.sqrt_().add_(eps).reciprocal_()
        return wide.sub_(narrow).mul_(m).mul_(lr).view_as(p)
    if change is None:
        raise ValueError(f"second moment: a {kind} step is rescaled from its change; none was given")
    b2 = float(group["betas"][1])
    if kind == "radam":
        rho_inf = 2.0 / (1.0 - b2) - 1.0
        if rho_inf - 2.0 * t * b2 ** t / (1.0 - b2 ** t) <= 5.0:    # not rectified yet: no division by v
            return None
        eps = eps / (1.0 - b2 ** t) ** 0.5                            # RAdam adds eps before bias correction
    adaptive = change.detach().float().reshape(-1).clone()
    wd = float(group.get("weight_decay", 0.0))
    if wd and group.get("decoupled_weight_decay", False):           # p *= 1 - lr * wd came first, undivided
        adaptive.sub_(torch.add(p.detach().float().reshape(-1), adaptive), alpha=lr * wd)
    ratio = v.sqrt().add_(eps).div_(_global(m, v, world).sqrt_().add_(eps)).sub_(1.0)
    return adaptive.mul_(ratio.reshape(-1)).view_as(p)


def _converted(state: Dict[str, Any], group: Dict[str, Any], factor: float) -> Optional[torch.Tensor]:
    """``exp_avg_sq`` with the variance part of its bias-corrected value times ``factor`` (1/W: a rank's own ->
    the global batch's; W: back), in the optimizer's units and dtype; None where there is nothing to convert."""
    if group.get("amsgrad"):
        return None
    mv = _moments(state, group)
    if mv is None:
        return None
    m, v, t = mv
    m2 = m * m
    b2 = float(group["betas"][1])
    return torch.sub(v, m2).clamp_min_(0.0).mul_(factor).add_(m2).mul_(1.0 - b2 ** t).to(state["exp_avg_sq"].dtype)


def global_exp_avg_sq(state: Dict[str, Any], group: Dict[str, Any], world: int) -> Optional[torch.Tensor]:
    """This rank's estimate of the global batch's ``exp_avg_sq`` from its own (in the optimizer's units and
    dtype, not bias-corrected); None: nothing to convert (one rank, no step yet, amsgrad)."""
    return _converted(state, group, 1.0 / world) if world > 1 else None


def groups_of(optimizer: torch.optim.Optimizer) -> Dict[int, Dict[str, Any]]:
    """id(parameter) -> its param group."""
    return {id(p): g for g in optimizer.param_groups for p in g["params"]}


def to_global(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor],
              world: int) -> Iterable[Tuple[torch.Tensor, torch.Tensor]]:
    """(source, destination) pairs of the state tensors of ``params`` to average across ranks before steps on
    the all-reduced gradient: every floating tensor with a dimension, per element or not (Adafactor's factored
    row and column moments too: a state left unaveraged would make the ranks step differently on the same
    gradient). The destination is the optimizer's tensor, the source what this rank contributes (for Adam's
    ``exp_avg_sq``, :func:`global_exp_avg_sq`; otherwise the tensor)."""
    fix = applies(optimizer) and world > 1
    groups = groups_of(optimizer) if fix else {}
    for key, p, t in state_tensors(optimizer, params, per_element=False):
        src = global_exp_avg_sq(optimizer.state[p], groups[id(p)], world) if fix and key == "exp_avg_sq" else None
        yield (t if src is None else src), t


@torch.no_grad()
def to_own(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor], world: int) -> None:
    """After steps on the all-reduced gradient, before steps on the rank's own: Adam's ``exp_avg_sq`` of
    ``params`` made a rank's own again (in place; the inverse of :func:`to_global`, the same on every rank)."""
    if world <= 1 or not applies(optimizer):
        return
    groups = groups_of(optimizer)
    for p in params:
        st = optimizer.state.get(p)
        own = _converted(st, groups[id(p)], float(world)) if st else None
        if own is not None:
            st["exp_avg_sq"].copy_(own)
