"""An adaptive optimizer's second moment for the global batch, estimated from one rank's own state.

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

    v_global = s + max(v - s, 0) * max(0, (1/W - k) / (1 - k))

For gradients of mean mu and independent noise of variance sigma^2, v estimates mu^2 + sigma^2 and the
global batch's second moment is mu^2 + sigma^2 / W. s, the squared mean, estimates mu^2 + k sigma^2: m is an
average of a few noisy gradients, and its square keeps k of their variance (:func:`mean_noise`: 1/19 for
beta1 = 0.9 once m has warmed up, 1 at the first step, when m is the gradient). Solving for mu^2 and sigma^2
gives the rule above, unbiased; with k = 0 it is s + (v - s) / W, which counted m's own noise as signal and
put v_global 5% too high with 2 ranks and 37% with 8 where noise dominates (steps 3% and 15% shorter than DDP's;
tests/test_second_moment.py). Where k >= 1/W (the first steps; more ranks than 1/k) v_global is s: never
below the squared mean, and still no smaller than the global batch's on average. The kernels take it as
v_global = s + max(v - s, 0) / D with D = gradshare.reference.effective_world(W, k).

s is the average of m^2 over v's own window: an exponential average with the
optimizer's beta2, bias-corrected, kept per parameter by :class:`GlobalBatchStep` (one float per element,
saved in gradshare's checkpoints). m alone averages over about 1 / (1 - beta1) steps (10) where v averages over
up to 1 / (1 - beta2) (1000): where the gradient's mean has grown over v's window, m^2 overstates what v
holds of it, v_global comes out too large and the shared steps fall short of DDP's (RAdam, whose
rectification holds back its first steps: 6% of loss on bench/optimizers.py, uncompressed; README, "Every
optimizer torch ships"); k is averaged over the same window (``squared_mean_noise``, one float per parameter).
Without that state (:func:`step_excess` called alone) s is this step's m^2 and k its share. A step
-lr * m / (sqrt(v) + eps) becomes -lr * m / (sqrt(v_global) + eps): the same
where the gradient's sign is steady, up to sqrt(W) larger where noise dominates, as in DDP. With one rank
v_global = v and nothing changes. Weight decay (decoupled or not) and the learning rate of the moment (a
scheduler's) are the optimizer's own.

The rule reads the optimizer's ``exp_avg_sq`` as the rank's *own* second moment, so that is what it must
hold whenever ranks step on their own gradients: averaging it over ranks keeps it so (each rank's is an
estimate of the same per-rank quantity). Steps on an all-reduced gradient (gradshare.link) are DDP's own
and update it with the mean gradient, so the sharing core converts it when the path changes: to the global
batch's (:func:`to_global`) before the first all-reduce step, and back to a rank's own (:func:`to_own`,
the inverse) before the first step on local gradients. Reading a global second moment as a rank's own
would divide its variance by W again at every round. The squared mean the conversions keep whole is capped at
v, so that a conversion and its inverse give v back exactly, and counts the all-reduced steps too (which it does
not see: each with the mean as it is when next read), so that it stays an average over v's window: left as the
compressed steps last left it, the first steps' large mean would pass for signal long after, and every look at
compression on a fast link would raise v to it (the transformer LM with a look every 25 steps: +1.1% and +1.4%
of loss against DDP, 2 seeds; -0.05% and -0.09% since; bench/results/link_looks_adam).

Applies to torch.optim.Adam and AdamW (amsgrad: the running maximum is the v used), whose step is
lr * m / (sqrt(v) + eps) exactly, and to NAdam and RAdam, which divide their step by the same sqrt(v) + eps
(RAdam: eps / sqrt(1 - beta2^t), and only once its rectification is on): there the part of this step's
change that the division scaled (all of it but decoupled weight decay) is multiplied by
(sqrt(v) + eps) / (sqrt(v_global) + eps).

RMSprop, Adagrad and Adadelta divide by a second moment too but keep no mean gradient to tell signal from
noise, so :class:`GlobalBatchStep` keeps one per parameter for them: an exponential average of the gradient
the optimizer saw (weight decay included) with Adam's default beta1 = 0.9, bias-corrected, m. With v their
own second moment in bias-corrected form (RMSprop's and Adadelta's ``square_avg`` / (1 - rho^t), Adagrad's
``sum`` less its initial value, / t) and s the squared mean (as for Adam, the average of m^2 over v's own
window: RMSprop's alpha, Adadelta's rho; for Adagrad, whose sum never forgets, the mean of m^2 over its steps;
centered RMSprop's own ``grad_avg``, bias-corrected, squared, since that is what it subtracts), capped at v,
v_global = s + (v - s) * max(0, (1/W - k) / (1 - k)) with k the share of noise in s (averaged over the window
as s is; centered RMSprop's from its alpha), converted back to the optimizer's units. Adagrad keeps k = 0:
its sum weighs every step of the run alike, so its s and v are dominated by the first steps, whose gradients
are large and whose mean moves fast within m's window; there m^2 understates the signal already, and counting
k as well made its steps too long (bench/optimizers.py, 3 seeds: +2.4% to +4.8% of DDP's training loss, where
k = 0 ends -0.8% to +0.4%). The
step then divides by v_global where the optimizer divided by v: sqrt(v) + eps (RMSprop; centered:
sqrt(v - grad_avg^2) + eps), sqrt(sum) + eps (Adagrad), sqrt(v + eps) (Adadelta, whose numerator, the
running size of its own steps, is left as it is). RMSprop's momentum buffer accumulates the step's divided
gradient, so the difference is accumulated alike in a buffer of gradshare's (the same momentum), and folded
into the optimizer's buffer when the ranks go over to all-reduced gradients.

Adamax (an infinity norm, not a mean square) and Adafactor (a factored estimate of it) divide by what
:class:`GlobalBatchStep` cannot convert element by element, so it keeps both moments itself: the mean m as
above and the mean square v of the gradient (Adamax's beta2, bias-corrected; Adafactor's own decay schedule,
1 - beta2_t = t^-0.8), and s, the average of m^2 over that same window. The part of the step they divided
(all but Adafactor's decoupled weight decay) is divided by r = sqrt(v_global / v), with v_global from s and v
as above: the global batch's divisor is about
r times the rank's (for Adamax's running maximum of |g| as for a root mean square, noise scales it alike).
Those moments follow the rank's own gradients only, so an all-reduced phase leaves r as it was, and the
switch to it and back multiplies and divides the optimizer's state by the same r (Adamax's ``exp_inf``;
Adafactor's ``variance`` by r^2, or its column factor by the mean of r^2).

The conversions of the optimizer's state between a rank's own second moment and the global batch's (below)
take k = 0, so that each is exactly the other's inverse whatever k is; they run only where the exchange
changes path.

Optimizers gradshare does not know share their steps as they are.

Each step's rule runs as one native pass over memory: for Adam, AdamW, NAdam and RAdam over the moments and
the change (gradshare.ops.global_batch_step), for the others over the gradient, the change and the moments kept
here, which it updates (gradshare.ops.global_batch_step_tracked). Their element logic is
csrc/gradshare/element.h's, shared by the CPU and CUDA kernels; their pure-torch references are in
gradshare.reference. The conversions of state between a rank's own and the global batch's, which run only when
the exchange changes path, are torch ops here.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from gradshare import ops, reference
from gradshare.optimizer_state import state_tensors

CORRECTED = (torch.optim.Adam, torch.optim.AdamW)     # the step from the moments alone
RESCALED = (torch.optim.NAdam, torch.optim.RAdam)      # this step's change, rescaled (needs the change)
# Optimizers that keep no mean gradient: GlobalBatchStep keeps one for them. Kind -> its second-moment state.
OWN_MEAN = {"rmsprop": "square_avg", "adagrad": "sum", "adadelta": "square_avg"}
MEAN_BETA = 0.9                                        # that mean's decay: Adam's default beta1
# Optimizers whose divisor is no mean square of the gradient (Adamax's infinity norm, Adafactor's factored
# estimate): GlobalBatchStep keeps the mean and the mean square itself, and rescales by their ratio.
TRACKED = ("adamax", "adafactor")
ADAM_FAMILY = ("adam", "nadam", "radam")               # rescaled from the optimizer's own moments, natively


def applies(optimizer: Optional[torch.optim.Optimizer]) -> bool:
    """Whether ``optimizer``'s steps are rescaled to the global batch's second moment."""
    return kind(optimizer) is not None


def kind(optimizer: Optional[torch.optim.Optimizer]) -> Optional[str]:
    """How :func:`step_excess` treats ``optimizer``'s steps: "adam", "nadam", "radam", "rmsprop",
    "adagrad", "adadelta", "adamax", "adafactor" or None (not at all)."""
    if isinstance(optimizer, CORRECTED):
        return "adam"
    kinds = ((torch.optim.NAdam, "nadam"), (torch.optim.RAdam, "radam"), (torch.optim.RMSprop, "rmsprop"),
             (torch.optim.Adagrad, "adagrad"), (torch.optim.Adadelta, "adadelta"), (torch.optim.Adamax, "adamax"))
    if hasattr(torch.optim, "Adafactor"):
        kinds += ((torch.optim.Adafactor, "adafactor"),)
    for cls, name in kinds:
        if isinstance(optimizer, cls):
            return name
    return None


def needs_change(optimizer: Optional[torch.optim.Optimizer]) -> bool:
    """Whether :func:`step_excess` needs the step's change (before - after) for ``optimizer``."""
    return kind(optimizer) not in (None, "adam")


def _adam_state(state: Dict[str, Any], group: Dict[str, Any]
                ) -> Optional[Tuple[torch.Tensor, torch.Tensor, float, float, float]]:
    """One parameter's Adam-family moments as the optimizer holds them (m; v, or amsgrad's running maximum),
    its step count and betas; None before its first step or for a parameter this rule does not cover
    (complex, or state missing)."""
    m = state.get("exp_avg")
    v = state.get("max_exp_avg_sq") if group.get("amsgrad") else state.get("exp_avg_sq")
    step = state.get("step")
    if m is None or v is None or step is None or m.is_complex():
        return None
    t = float(step)
    if t < 1:
        return None
    b1, b2 = (float(b) for b in group["betas"])
    return m, v, t, b1, b2


def _moments(state: Dict[str, Any], group: Dict[str, Any]) -> Optional[Tuple[torch.Tensor, torch.Tensor, float]]:
    """Bias-corrected (m, v) of one parameter as float32 copies, and its Adam step count; None as for
    :func:`_adam_state`."""
    held = _adam_state(state, group)
    if held is None:
        return None
    m, v, t, b1, b2 = held
    return m.float() / (1.0 - b1 ** t), v.float() / (1.0 - b2 ** t), t


def _gradient(p: torch.Tensor, group: Dict[str, Any], before: torch.Tensor) -> Optional[torch.Tensor]:
    """The gradient an RMSprop / Adagrad / Adadelta step divided (maximize's sign, coupled weight decay on the
    parameters ``before`` the step), flat float32; None for a sparse or complex one (not rescaled)."""
    grad = p.grad
    if grad is None or grad.is_sparse or grad.is_complex():
        return None
    g = grad.detach().float().reshape(-1)
    g = -g if group.get("maximize") else g.clone()
    wd = float(group.get("weight_decay", 0.0))
    if wd:                                      # rounded as the native step rounds it (element.h: tracked_inputs)
        g.add_(before.detach().float().reshape(-1) * wd)
    return g


def _window(kind: str, group: Dict[str, Any]) -> Optional[Callable[[int], Tuple[float, float]]]:
    """k -> (weight, bias correction) of the k-th step of an exponential average over the window of the second
    moment that ``kind``'s step divides by (the optimizer's beta2, alpha or rho; Adafactor's own schedule,
    1 - beta2_k = k^-0.8, needs no correction); None for Adagrad, whose running sum of m^2 spans its window."""
    if kind == "adafactor":
        decay = float(group.get("beta2_decay", -0.8))
        return lambda k: (float(k) ** decay, 1.0)
    if kind == "adagrad":
        return None
    b = float(group["alpha"] if kind == "rmsprop" else group["rho"] if kind == "adadelta" else group["betas"][1])
    return lambda k: (1.0 - b, 1.0 - b ** k)


def _keeps_squared_mean(kind: str, group: Dict[str, Any], state: Dict[str, Any]) -> bool:
    """Whether the squared mean is averaged over the second moment's window (module docstring): every kind but
    Adagrad (its sum of m^2 does that) and centered RMSprop (it subtracts its own mean, ``grad_avg``)."""
    return kind != "adagrad" and not (kind == "rmsprop" and group.get("centered") and state.get("grad_avg") is not None)


def mean_noise(beta: float, bias: float) -> float:
    """The share of the gradient's variance that the square of its bias-corrected exponential average m holds:
    E[m^2] = mu^2 + k sigma^2 for gradients of mean mu and independent noise of variance sigma^2, with k =
    (1 - beta) / (1 + beta) * (1 + beta^t) / (1 - beta^t) after t steps (``bias`` = 1 - beta^t): 1 at the first
    step (m is the gradient), (1 - beta) / (1 + beta) later (Adam's beta1 = 0.9: 1/19)."""
    return (1.0 - beta) / (1.0 + beta) * (2.0 - bias) / bias


def _held_noise(aux: Dict[str, Any], noise: float, bias: float) -> float:
    """The share of noise the squared mean ``aux`` keeps holds, not bias-corrected (``squared_mean_noise``); a
    squared mean kept without it (a checkpoint from before it was kept) counts its earlier steps at ``noise``
    (``bias``: their bias correction)."""
    held = aux.get("squared_mean_noise")
    return noise * bias if held is None else held


def _noise_average(aux: Dict[str, Any], noise: float, weight: float, steps: int, bias: Callable[[int], float]) -> float:
    """The average share of noise (:func:`mean_noise`) in the squared mean ``aux`` keeps, updated with this step's
    ``noise`` at ``weight``, the squared mean's own average (its ``steps``-th step, ``bias``: its correction)."""
    held = _held_noise(aux, noise, bias(steps - 1))
    held = held + (noise - held) * weight
    aux["squared_mean_noise"] = held
    return min(max(held / bias(steps), 0.0), 1.0)


def _with_squared_mean(args: Dict[str, Any], kind: str, group: Dict[str, Any], p: torch.Tensor,
                       aux: Optional[Dict[str, Any]], noise: float) -> Dict[str, Any]:
    """``args`` with the average of m^2 over the second moment's window that ``aux`` keeps (module docstring:
    the squared mean), counting this step, and the share of noise it holds (``noise``: this step's m^2's,
    :func:`mean_noise`); without ``aux``, this step's m^2 and ``noise``."""
    if aux is None:
        return dict(args, noise=noise)
    if aux.get("squared_mean") is None:
        aux.update(squared_mean=torch.zeros(p.numel(), dtype=torch.float32, device=p.device), squared_mean_steps=0,
                   squared_mean_noise=0.0)
    aux["squared_mean_steps"] += 1
    window = _window(kind, group)
    weight, bias = window(aux["squared_mean_steps"])
    noise = _noise_average(aux, noise, weight, aux["squared_mean_steps"], lambda k: window(k)[1] if k else 0.0)
    return dict(args, signal=aux["squared_mean"], signal_weight=weight, signal_bias=bias, noise=noise)


def _catch_up(group: Dict[str, Any], aux: Optional[Dict[str, Any]], exp_avg: torch.Tensor, bias1: float,
              t: float) -> None:
    """Adam family: the squared mean brought to the optimizer's step ``t``. Steps on the all-reduced gradient
    (gradshare.link) update v but not the squared mean, which only the rescaled steps update; each step it did
    not see is counted in with the bias-corrected mean as it is now (``exp_avg / bias1``) standing for that step's, so that it
    averages over v's window again, as v does. Left stale it would hold the steps it saw at their old weight:
    a run's first steps, whose mean is large, passing for its signal hundreds of steps later, the next
    compressed steps made smaller than the rank's own."""
    if not aux or aux.get("squared_mean") is None or aux.get("squared_mean_at") is None:
        return
    k = int(t) - int(aux["squared_mean_at"])
    if k <= 0:
        return
    d = float(group["betas"][1]) ** k
    m = exp_avg.detach().float().reshape(-1) / bias1
    aux["squared_mean"].mul_(d).add_(m * m, alpha=1.0 - d)
    noise = mean_noise(float(group["betas"][0]), bias1)
    held = _held_noise(aux, noise, 1.0 - float(group["betas"][1]) ** aux["squared_mean_steps"])
    aux["squared_mean_noise"] = held * d + noise * (1.0 - d)
    aux["squared_mean_steps"] += k
    aux["squared_mean_at"] = int(t)


def _squared_mean(kind: str, group: Dict[str, Any], aux: Optional[Dict[str, Any]]) -> Optional[torch.Tensor]:
    """The bias-corrected squared mean ``aux`` keeps (a new tensor); None where it keeps none."""
    if not aux or aux.get("squared_mean") is None or not aux.get("squared_mean_steps"):
        return None
    return aux["squared_mean"] / _window(kind, group)(aux["squared_mean_steps"])[1]


def _observe(kind: str, group: Dict[str, Any], state: Dict[str, Any], aux: Dict[str, Any], g: torch.Tensor) -> None:
    """GlobalBatchStep's moments of an RMSprop / Adagrad / Adadelta parameter after a step on the all-reduced
    gradient ``g``: the mean gradient, Adagrad's running sum of its square or the others' squared mean over
    their second moment's window, as the native step updates them (gradshare.reference.global_batch_step_tracked)."""
    if aux.get("mean") is None:
        aux.update(mean=torch.zeros_like(g), count=0)
        if kind == "adagrad":
            aux["signal"] = torch.zeros_like(g)
    aux["count"] += 1
    m = reference.ema_(aux["mean"], g, 1.0 - MEAN_BETA) / (1.0 - MEAN_BETA ** aux["count"])
    if kind == "adagrad":
        aux["signal"].add_(m * m)
    elif _keeps_squared_mean(kind, group, state):
        args = _with_squared_mean({}, kind, group, g, aux, mean_noise(MEAN_BETA, 1.0 - MEAN_BETA ** aux["count"]))
        reference.ema_(args["signal"], m * m, args["signal_weight"])


def _own_units(kind: str, state: Dict[str, Any], group: Dict[str, Any]) -> Optional[Tuple[torch.Tensor, float, float]]:
    """(v, c, k): an RMSprop / Adagrad / Adadelta second moment as flat float32 (read only), with v = c + k * (its
    bias-corrected mean square); None before the first step or for a state this rule does not cover."""
    v, step = state.get(OWN_MEAN[kind]), state.get("step")
    if v is None or step is None or v.is_sparse or v.is_complex() or float(step) < 1:
        return None
    t = float(step)
    if kind == "adagrad":
        return v.float().reshape(-1), float(group.get("initial_accumulator_value", 0.0)), t
    decay = float(group["alpha"] if kind == "rmsprop" else group["rho"])
    return v.float().reshape(-1), 0.0, 1.0 - decay ** t


def _own_global(kind: str, group: Dict[str, Any], state: Dict[str, Any], units: Tuple[torch.Tensor, float, float],
                aux: Dict[str, Any], factor: float) -> torch.Tensor:
    """v's variance part times ``factor`` (1/W: the global batch's), in the optimizer's units: c + k * (s +
    (v_hat - s) * factor) with s the squared mean gradient (module docstring) capped at v_hat, so that the
    global batch's second moment is never above the rank's own (and W undoes 1/W exactly)."""
    v, c, k = units
    n = aux["count"]
    if kind == "adagrad":
        s = aux["signal"] / n
    elif kind == "rmsprop" and state.get("grad_avg") is not None:     # centered: its own mean, which it subtracts
        s = state["grad_avg"].float().reshape(-1) / k
        s = s * s
    else:
        s = _squared_mean(kind, group, aux)
        if s is None:
            m = aux["mean"] / (1.0 - MEAN_BETA ** n)
            s = m * m
    v_hat = torch.sub(v, c).div_(k)
    s = s.clamp_(max=v_hat)             # min(s, v_hat), in place (torch.minimum is several times slower on CPU)
    return v_hat.sub_(s).mul_(factor).add_(s).mul_(k).add_(c)


def _tracked_ratio(kind: str, group: Dict[str, Any], aux: Dict[str, Any], world: int) -> torch.Tensor:
    """r = sqrt(v_global / v) from GlobalBatchStep's own moments of an Adamax or Adafactor parameter (module
    docstring): 1 where the mean dominates, down to 1 / sqrt(W) where noise does."""
    n = aux["count"]
    v = aux["square"] / (1.0 - float(group["betas"][1]) ** n) if kind == "adamax" else aux["square"]
    s = _squared_mean(kind, group, aux)
    if s is None:
        m = aux["mean"] / (1.0 - MEAN_BETA ** n)
        s = torch.mul(m, m)
    s = s.clamp_(max=v)
    # v_global / v >= 1 / W; the bound also covers v = 0 (a gradient that was always 0: nothing to divide)
    ratio = torch.sub(v, s).div_(world).add_(s).div_(v.clamp_min(torch.finfo(torch.float32).tiny))
    return ratio.clamp_min_(1.0 / world).sqrt_()


def _tracked_args(p: torch.Tensor, state: Dict[str, Any], group: Dict[str, Any], world: int, kind: str,
                 aux: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The arguments of gradshare.ops.global_batch_step_tracked for an RMSprop, Adagrad, Adadelta, Adamax or
    Adafactor step (less target and change), with ``aux`` (GlobalBatchStep's entry for ``p``) allocated and its
    step counted; None when there is nothing to correct."""
    grad = p.grad
    if grad is None or grad.is_sparse or grad.is_complex():
        return None
    args: Dict[str, Any] = {}
    if kind in OWN_MEAN:
        units = _own_units(kind, state, group)
        if units is None:
            return None
        args.update(second=units[0].detach(), offset=units[1], scale=units[2], eps=float(group["eps"]))
    elif state.get("step") is None or float(state["step"]) < 1:
        return None
    if aux.get("mean") is None:
        aux.update(mean=torch.zeros(p.numel(), dtype=torch.float32, device=p.device), count=0)
        extra = {"adagrad": "signal", "adamax": "square", "adafactor": "square"}.get(kind)
        if extra is not None:
            aux[extra] = torch.zeros_like(aux["mean"])
    aux["count"] += 1
    n = aux["count"]
    noise = mean_noise(MEAN_BETA, 1.0 - MEAN_BETA ** n)
    wd = float(group.get("weight_decay", 0.0))
    args.update(kind=kind, world=world, grad=grad.detach().reshape(-1), mean=aux["mean"], maximize=bool(group.get("maximize")),
                mean_weight=1.0 - MEAN_BETA, mean_bias=1.0 - MEAN_BETA ** n)
    if kind == "adafactor":
        args["decay"] = float(group["lr"]) * wd                # p *= 1 - lr * wd came first, undivided
    else:
        args["weight_decay"] = wd
    if wd:
        args["after"] = p.detach().reshape(-1)
    if kind == "adagrad":
        args.update(extra=aux["signal"], count=float(n))           # k = 0 (module docstring)
    elif kind == "rmsprop":
        if group.get("centered") and state.get("grad_avg") is not None:
            args.update(grad_avg=state["grad_avg"].detach().reshape(-1),
                        noise=mean_noise(float(group["alpha"]), args["scale"]))
        momentum = float(group.get("momentum", 0.0))
        if momentum > 0.0:       # the optimizer's buffer sums its divided gradients; the difference is summed alike
            if aux.get("momentum_buffer") is None:
                aux["momentum_buffer"] = torch.zeros_like(aux["mean"])
            args.update(extra=aux["momentum_buffer"], momentum=momentum, lr=float(group["lr"]))
    elif kind in TRACKED:
        b2 = float(group["betas"][1]) if kind == "adamax" else None
        args.update(extra=aux["square"],
                    square_weight=1.0 - b2 if kind == "adamax" else float(n) ** float(group.get("beta2_decay", -0.8)),
                    square_bias=1.0 - b2 ** n if kind == "adamax" else 1.0)
    return _with_squared_mean(args, kind, group, p, aux, noise) if _keeps_squared_mean(kind, group, state) else args


def _apply_tracked(p: torch.Tensor, state: Dict[str, Any], group: Dict[str, Any], world: int, kind: str,
                   change: torch.Tensor, aux: Dict[str, Any], target: torch.Tensor, sign: float) -> bool:
    """target +-= :func:`step_excess` of an RMSprop, Adagrad, Adadelta, Adamax or Adafactor step
    (gradshare.ops.global_batch_step_tracked: one native pass where every tensor is contiguous float32, the
    same float32 torch ops otherwise), updating ``aux``; False: nothing to do."""
    args = _tracked_args(p, state, group, world, kind, aux)
    if args is None:
        return False
    change = change.detach().reshape(-1)
    tensors = [target, change] + [args[k] for k in ("grad", "second", "grad_avg", "after", "signal") if k in args]
    if all(x.dtype == torch.float32 and x.is_contiguous() and x.device == target.device for x in tensors):
        ops.global_batch_step_tracked(change=change, target=target.view(-1), sign=sign, **args)
        return True
    reference.global_batch_step_tracked(change=change, target=target, sign=sign, **args)
    return True


@torch.no_grad()
def step_excess(p: torch.Tensor, state: Dict[str, Any], group: Dict[str, Any], world: int, kind: str = "adam",
                change: Optional[torch.Tensor] = None, aux: Optional[Dict[str, Any]] = None) -> Optional[torch.Tensor]:
    """How far the step this rank's optimizer just took on ``p`` falls short of the global-batch step, as a
    float32 tensor shaped like ``p``. Subtract it from ``p`` (or add it to the change before - after) to take
    the global-batch step. ``kind`` (:func:`kind`): "adam": lr * m * (1/(sqrt(v_global) + eps) - 1/(sqrt(v) +
    eps)); "nadam" / "radam": the step's ``change`` (before - after, shaped like ``p``, taken while ``p``
    holds the after), less decoupled weight decay, times (sqrt(v) + eps) / (sqrt(v_global) + eps) - 1. None
    when there is nothing to correct (one rank, no step yet, a parameter without a gradient, which the
    optimizer did not step, RAdam before its rectification, or a state this rule does not cover).
    "rmsprop" / "adagrad" / "adadelta": the same with the divisors of the module docstring; "adamax" /
    "adafactor": the divided part of the change times 1/r - 1; both from the ``change`` and ``aux``, the
    parameter's entry of :class:`GlobalBatchStep` (updated here: call once per step)."""
    if world <= 1 or p.grad is None:
        return None
    target = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
    if kind in OWN_MEAN or kind in TRACKED:
        _check_tracked(kind, change, aux)
        return target if _apply_tracked(p, state, group, world, kind, change, aux, target, 1.0) else None
    return target if _apply_adam_family(p, state, group, world, kind, change, target, 1.0, aux) else None


def _check_tracked(kind: str, change: Optional[torch.Tensor], aux: Optional[Dict[str, Any]]) -> None:
    if change is None or aux is None:
        raise ValueError(f"second moment: a {kind} step is rescaled from its change and the moments gradshare "
                         "keeps for it (GlobalBatchStep); "
                         + ("no change was given" if change is None else "no state was given"))


def _adam_family_args(p: torch.Tensor, state: Dict[str, Any], group: Dict[str, Any], world: int, kind: str,
                      change: Optional[torch.Tensor], aux: Optional[Dict[str, Any]] = None) -> Optional[Dict[str, Any]]:
    """The arguments of gradshare.ops.global_batch_step for an Adam, AdamW, NAdam or RAdam step (less the
    target); None when there is nothing to correct. With ``aux`` (the parameter's entry of
    :class:`GlobalBatchStep`) the squared mean is its average of m^2 over v's window, which the step updates."""
    held = _adam_state(state, group)
    if held is None:
        return None
    m, v, t, b1, b2 = held
    lr, eps = float(group["lr"]), float(group["eps"])
    args = dict(exp_avg=m.detach().reshape(-1), exp_avg_sq=v.detach().reshape(-1), bias1=1.0 - b1 ** t,
                bias2=1.0 - b2 ** t, world=world, eps=eps)
    if kind == "adam":
        return _counted(dict(args, lr=lr), kind, group, p, aux, m, t)
    if change is None:
        raise ValueError(f"second moment: a {kind} step is rescaled from its change; none was given")
    if kind == "radam":
        rho_inf = 2.0 / (1.0 - b2) - 1.0
        if rho_inf - 2.0 * t * b2 ** t / (1.0 - b2 ** t) <= 5.0:    # not rectified yet: no division by v
            return None
        args["eps"] = eps / (1.0 - b2 ** t) ** 0.5                    # RAdam adds eps before bias correction
    args["change"] = change.detach().reshape(-1)
    wd = float(group.get("weight_decay", 0.0))
    if wd and group.get("decoupled_weight_decay", False):           # p *= 1 - lr * wd came first, undivided
        args.update(after=p.detach().reshape(-1), decay=lr * wd)
    return _counted(args, kind, group, p, aux, m, t)


def _counted(args: Dict[str, Any], kind: str, group: Dict[str, Any], p: torch.Tensor, aux: Optional[Dict[str, Any]],
             exp_avg: torch.Tensor, t: float) -> Dict[str, Any]:
    """An Adam-family step's arguments with the squared mean, which the step counts: the steps before it that the
    squared mean did not see counted in first (:func:`_catch_up`)."""
    b1 = float(group["betas"][0])
    if aux is not None:
        _catch_up(group, aux, exp_avg, 1.0 - b1 ** t, t - 1)
        aux["squared_mean_at"] = int(t)
    return _with_squared_mean(args, kind, group, p, aux, mean_noise(b1, 1.0 - b1 ** t))


def _apply_adam_family(p: torch.Tensor, state: Dict[str, Any], group: Dict[str, Any], world: int, kind: str,
                       change: Optional[torch.Tensor], target: torch.Tensor, sign: float,
                       aux: Optional[Dict[str, Any]] = None, batch: Optional[List[Tuple]] = None) -> bool:
    """target +-= :func:`step_excess` of an Adam-family step (gradshare.ops.global_batch_step: one native pass
    where every tensor is contiguous float32, the same float32 torch ops otherwise); False: nothing to do.
    ``batch``: a native pass is added to it (gradshare.ops.global_batch_steps' form) for the caller to run."""
    args = _adam_family_args(p, state, group, world, kind, change, aux)
    if args is None:
        return False
    tensors = [target] + [args[k] for k in ("exp_avg", "exp_avg_sq", "change", "after", "signal") if k in args]
    if all(x.dtype == torch.float32 and x.is_contiguous() for x in tensors):
        if batch is None:
            ops.global_batch_step(target=target.view(-1), sign=sign, **args)
        else:
            batch.append((args["exp_avg"], args["exp_avg_sq"], target, args.get("change"), args.get("after"),
                          args.get("signal"), args["bias1"], args["bias2"],
                          reference.effective_world(world, args.get("noise", 0.0)), args["eps"], args.get("lr", 0.0),
                          args.get("decay", 0.0), sign, args.get("signal_weight", 0.0), args.get("signal_bias", 1.0)))
    else:
        reference.global_batch_step(target=target, sign=sign, **args)
    return True


def _converted(state: Dict[str, Any], group: Dict[str, Any], factor: float,
               squared: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """``exp_avg_sq`` with the variance part of its bias-corrected value times ``factor`` (1/W: a rank's own ->
    the global batch's; W: back), in the optimizer's units and dtype; None where there is nothing to convert.
    ``squared``: the squared mean (:meth:`GlobalBatchStep.squared_mean`); None: m^2."""
    if group.get("amsgrad"):
        return None
    mv = _moments(state, group)
    if mv is None:
        return None
    m, v, t = mv
    # The squared mean is the part of v that is signal, so at most v: capped there, a conversion and its inverse
    # give v back exactly whatever it is (one to the global batch's then back leaves a rank's own as it was, and
    # one back then to the global batch's leaves the global batch's, where a squared mean above v would put v up
    # to it and keep it there for v's whole window).
    m2 = torch.minimum(m * m if squared is None else squared.view_as(m), v)
    b2 = float(group["betas"][1])
    return torch.sub(v, m2).mul_(factor).add_(m2).mul_(1.0 - b2 ** t).to(state["exp_avg_sq"].dtype)


def global_exp_avg_sq(state: Dict[str, Any], group: Dict[str, Any], world: int,
                      squared: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """This rank's estimate of the global batch's ``exp_avg_sq`` from its own (in the optimizer's units and
    dtype, not bias-corrected); None: nothing to convert (one rank, no step yet, amsgrad). ``squared``: the
    squared mean to keep whole (:meth:`GlobalBatchStep.squared_mean`; None: m^2)."""
    return _converted(state, group, 1.0 / world, squared) if world > 1 else None


def groups_of(optimizer: torch.optim.Optimizer) -> Dict[int, Dict[str, Any]]:
    """id(parameter) -> its param group."""
    return {id(p): g for g in optimizer.param_groups for p in g["params"]}


def to_global(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor], world: int,
              rescale: Optional["GlobalBatchStep"] = None) -> Iterable[Tuple[torch.Tensor, torch.Tensor]]:
    """(source, destination) pairs of the state tensors of ``params`` to average across ranks before steps on
    the all-reduced gradient: every floating tensor with a dimension, per element or not (Adafactor's factored
    row and column moments too: a state left unaveraged would make the ranks step differently on the same
    gradient). The destination is the optimizer's tensor, the source what this rank contributes (for Adam's
    ``exp_avg_sq``, :func:`global_exp_avg_sq`; for RMSprop's, Adagrad's and Adadelta's second moment, the
    same from ``rescale``'s mean gradient, and RMSprop's momentum with ``rescale``'s difference folded in;
    otherwise the tensor)."""
    name = kind(optimizer) if world > 1 else None
    if (name in OWN_MEAN or name in TRACKED) and rescale is not None:
        yield from rescale.to_global(params, world)
        return
    groups = groups_of(optimizer) if name is not None else {}
    for key, p, t in state_tensors(optimizer, params, per_element=False):
        src = None
        if groups and key == "exp_avg_sq":
            squared = rescale.squared_mean(p, groups[id(p)]) if rescale is not None else None
            src = global_exp_avg_sq(optimizer.state[p], groups[id(p)], world, squared)
        yield (t if src is None else src), t


@torch.no_grad()
def to_own(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor], world: int,
           rescale: Optional["GlobalBatchStep"] = None) -> None:
    """After steps on the all-reduced gradient, before steps on the rank's own: the second moment of
    ``params`` made a rank's own again (in place; the inverse of :func:`to_global`, the same on every rank)."""
    name = kind(optimizer)
    if world <= 1 or name is None:
        return
    if name in OWN_MEAN or name in TRACKED:
        if rescale is not None:
            rescale.to_own(params, world)
        return
    groups = groups_of(optimizer)
    for p in params:
        st = optimizer.state.get(p)
        squared = rescale.squared_mean(p, groups[id(p)]) if rescale is not None and st else None
        own = _converted(st, groups[id(p)], float(world), squared) if st else None
        if own is not None:
            st["exp_avg_sq"].copy_(own)


class GlobalBatchStep:
    """This module's rule for one optimizer, and the state it keeps: per parameter, the average of m^2 over
    the second moment's window (all but Adagrad and centered RMSprop); for RMSprop, Adagrad, Adadelta, Adamax
    and Adafactor also the mean gradient (and Adagrad's running sum of its square, RMSprop's momentum of the
    step's difference, Adamax's and Adafactor's mean square). Each rank keeps its own; the sharing fronts hold one and save it in their
    checkpoints."""

    def __init__(self, optimizer: Optional[torch.optim.Optimizer]):
        self.optimizer = optimizer
        self.kind = kind(optimizer)
        self._aux: Dict[int, Dict[str, Any]] = {}

    def _entry(self, p: torch.Tensor) -> Optional[Dict[str, Any]]:
        return self._aux.setdefault(id(p), {}) if self.kind is not None else None

    def squared_mean(self, p: torch.Tensor, group: Dict[str, Any]) -> Optional[torch.Tensor]:
        """Adam family: the bias-corrected average of m^2 over v's window that this object keeps for ``p``
        (flat float32, a copy), brought to the optimizer's step first (:func:`_catch_up`); None before its first
        step here, or for other optimizers."""
        if self.kind not in ADAM_FAMILY:
            return None
        aux = self._aux.get(id(p))
        held = _adam_state(self.optimizer.state.get(p, {}), group)
        if held is not None:
            m, _, t, b1, _ = held
            _catch_up(group, aux, m, 1.0 - b1 ** t, t)
        return _squared_mean(self.kind, group, aux)

    def excess(self, p: torch.Tensor, group: Dict[str, Any], world: int,
               change: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """:func:`step_excess` for the step the optimizer just took on ``p`` (``change``: before - after)."""
        st = self.optimizer.state.get(p) if self.kind is not None else None
        if not st:
            return None
        return step_excess(p, st, group, world, self.kind, change, self._entry(p))

    @torch.no_grad()
    def apply(self, p: torch.Tensor, group: Dict[str, Any], world: int, target: torch.Tensor,
              change: Optional[torch.Tensor] = None, sign: float = 1.0, batch: Optional[List[Tuple]] = None) -> None:
        """Makes the step the optimizer just took on ``p`` the global batch's: ``target`` += :meth:`excess`
        (the step's change, before - after, which ``target`` may be) or, with ``sign`` -1, ``target`` -= it
        (the parameters after the step). Adam, AdamW, NAdam and RAdam in one native pass over memory (``batch``:
        added to it, for :func:`gradshare.ops.global_batch_steps`; :meth:`apply_all` runs them)."""
        self._apply(p, group, world, target, change, sign, batch)

    def _apply(self, p: torch.Tensor, group: Dict[str, Any], world: int, target: torch.Tensor,
               change: Optional[torch.Tensor], sign: float, batch: Optional[List[Tuple]]) -> None:
        """:meth:`apply`, under the caller's ``torch.no_grad()`` (entered once for a whole bucket by :meth:`apply_all`)."""
        st = self.optimizer.state.get(p) if self.kind is not None else None
        if not st or world <= 1 or p.grad is None:
            return
        if self.kind in ADAM_FAMILY:
            _apply_adam_family(p, st, group, world, self.kind, change, target, sign, self._entry(p), batch)
            return
        aux = self._entry(p)
        _check_tracked(self.kind, change, aux)
        _apply_tracked(p, st, group, world, self.kind, change, aux, target, sign)

    @torch.no_grad()
    def apply_all(self, items: Iterable[Tuple[torch.Tensor, Dict[str, Any], torch.Tensor, Optional[torch.Tensor]]],
                  world: int, sign: float = 1.0) -> None:
        """:meth:`apply` for each (parameter, its group, target, change), the Adam family's native passes in one
        call (each parameter's pass is independent of the others': the same bits as one call each)."""
        if world <= 1 or self.kind is None:
            return
        batch: List[Tuple] = []
        for p, group, target, change in items:
            self._apply(p, group, world, target, change, sign, batch)
        ops.global_batch_steps(batch)

    @torch.no_grad()
    def observe(self, params: Iterable[torch.Tensor], world: int) -> None:
        """Before a step on the all-reduced gradient (the parameters still before it): the mean gradient of
        RMSprop, Adagrad and Adadelta follows that gradient too, ready for the next steps on a rank's own."""
        if world <= 1 or self.kind not in OWN_MEAN:
            return
        groups = groups_of(self.optimizer)
        for p in params:
            g = _gradient(p, groups[id(p)], p)
            if g is not None:
                _observe(self.kind, groups[id(p)], self.optimizer.state.get(p, {}), self._entry(p), g)

    def _converted(self, p: torch.Tensor, group: Dict[str, Any], world: int, inverse: bool) -> Dict[str, torch.Tensor]:
        """The state of ``p`` that :meth:`to_global` replaces (``inverse``: :meth:`to_own`), key -> new value in
        the optimizer's dtype: RMSprop's, Adagrad's, Adadelta's second moment with its variance part divided
        (multiplied) by W; Adamax's infinity norm times (over) r, Adafactor's second moment times (over) r^2
        (factored: its column factor by the mean of r^2), r from the moments this object keeps (module
        docstring), which steps on the all-reduced gradient leave as they are."""
        st = self.optimizer.state.get(p)
        aux = self._aux.get(id(p))
        if not st or not aux or not aux.get("count"):
            return {}
        if self.kind in OWN_MEAN:
            units = _own_units(self.kind, st, group)
            if units is None:
                return {}
            key = OWN_MEAN[self.kind]
            return {key: _own_global(self.kind, group, st, units, aux, float(world) if inverse else 1.0 / world)
                    .view_as(st[key]).to(st[key].dtype)}
        r = _tracked_ratio(self.kind, group, aux, world)
        if self.kind == "adamax":
            key, factor = "exp_inf", r
        elif st.get("variance") is not None:
            key, factor = "variance", r * r
        else:
            key, factor = "col_var", (r * r).mean()
        t = st.get(key)
        if t is None:
            return {}
        if inverse:
            factor = factor.reciprocal()
        return {key: t.float().mul(factor if factor.dim() == 0 else factor.view_as(t)).to(t.dtype)}

    @torch.no_grad()
    def to_global(self, params: Iterable[torch.Tensor], world: int) -> Iterable[Tuple[torch.Tensor, torch.Tensor]]:
        """:func:`to_global` for the optimizers whose rescaling keeps state here."""
        params = list(params)
        for p in params:
            aux, st = self._aux.get(id(p)), self.optimizer.state.get(p)
            extra = aux.pop("momentum_buffer", None) if aux else None
            if extra is not None and st and st.get("momentum_buffer") is not None:
                st["momentum_buffer"].add_(extra.view_as(st["momentum_buffer"]))
        groups = groups_of(self.optimizer)
        converted = {id(p): self._converted(p, groups[id(p)], world, inverse=False) for p in params}
        for name, p, t in state_tensors(self.optimizer, params, per_element=False):
            yield converted[id(p)].get(name, t), t

    @torch.no_grad()
    def to_own(self, params: Iterable[torch.Tensor], world: int) -> None:
        """:func:`to_own` for the optimizers whose rescaling keeps state here (the inverse of :meth:`to_global`)."""
        groups = groups_of(self.optimizer)
        for p in params:
            for key, own in self._converted(p, groups[id(p)], world, inverse=True).items():
                self.optimizer.state[p][key].copy_(own)

    def state_dict(self) -> Dict[str, Any]:
        """Each parameter's entry by its position in the optimizer's parameter groups (tensors on the CPU)."""
        if not self._aux:
            return {}
        order = [p for g in self.optimizer.param_groups for p in g["params"]]
        return {i: {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v) for k, v in self._aux[id(p)].items()}
                for i, p in enumerate(order) if self._aux.get(id(p))}

    def load_state_dict(self, state: Optional[Dict[str, Any]]) -> None:
        order = [p for g in self.optimizer.param_groups for p in g["params"]] if self.optimizer is not None else []
        self._aux = {}
        for i, entry in (state or {}).items():
            i = int(i)
            if not 0 <= i < len(order):
                raise ValueError(f"load_state_dict: the checkpoint's mean gradient is for parameter #{i}, the "
                                 f"optimizer has {len(order)}")
            p = order[i]
            for key in ("mean", "squared_mean"):
                t = entry.get(key)
                if t is not None and t.numel() != p.numel():
                    raise ValueError(f"load_state_dict: parameter #{i} has {p.numel()} elements, its {key} in the "
                                     f"checkpoint {t.numel()}")
            self._aux[id(p)] = {k: (v.to(p.device) if torch.is_tensor(v) else v) for k, v in entry.items()}
