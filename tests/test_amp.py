"""Mixed precision through every front end: a GradScaler with the hook sharing gradients (``scaler=``), and
bf16 autocast with the hook and SharedOptimizer in both modes. (The hook and SharedOptimizer sharing updates
under a GradScaler: tests/test_sharing.py and tests/test_link.py.)"""
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from gradshare import SharedOptimizer, ThresholdState, TopK, threshold_hook, verify_replicas
from gradshare.workers import run_local
from tiny_model import OwnStepScaler, batch, flat, grad_scaler, net, scaled_steps, step_with


def _gradients_hook(scaler=None):
    """The hook sharing gradients (TopK 5%, no optimizer=), the optimizer SGD with momentum."""
    model = net()
    ddp = DDP(model)
    state = ThresholdState(compression=TopK(0.05, warmup_steps=0), scaler=scaler)
    ddp.register_comm_hook(state, threshold_hook)
    return model, ddp, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9), state


def _gradients_hook_scaled():
    warnings.simplefilter("ignore")
    out = {}
    model, ddp, opt, _ = _gradients_hook()
    out["plain"] = scaled_steps(model, ddp, opt, enabled=False)[0]
    scaler = grad_scaler()
    model, ddp, opt, _ = _gradients_hook(scaler)
    out["scaled"] = scaled_steps(model, ddp, opt, scaler=scaler)[0]
    scaler = grad_scaler()
    model, ddp, opt, state = _gradients_hook(scaler)
    out["inf"] = scaled_steps(model, ddp, opt, bad_at=3, scaler=scaler)
    out["inf_steps"] = state.step_count
    return out


@pytest.mark.slow
def test_gradient_sharing_hook_under_a_grad_scaler():
    res = run_local(_gradients_hook_scaled, 2, timeout=180)
    for r in res:
        # encoded in unscaled units: the loss scale changes nothing that is sent, bit for bit
        assert np.array_equal(r["plain"], r["scaled"])
        params, scales = r["inf"]
        assert scales[3] == scales[2] / 2             # rank 1's overflow: every rank's scaler backs off
        assert np.array_equal(params, res[0]["inf"][0])   # and skipped the step with the others
        assert r["inf_steps"] == 5                    # the dropped step is not counted
    assert not np.array_equal(res[0]["inf"][0], res[0]["scaled"])


def test_scaler_must_be_a_grad_scaler():
    with pytest.raises(TypeError, match="GradScaler"):
        ThresholdState(scaler=object())


def _bf16(front):
    """Twelve steps under CPU bf16 autocast (compression at every step): the loss before and after, and the
    parameters."""
    warnings.simplefilter("ignore")
    r = dist.get_rank()
    model = net()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if front == "hook_updates":
        fwd = DDP(model)
        fwd.register_comm_hook(ThresholdState(optimizer=inner, link=None), threshold_hook)
        opt = inner
    elif front == "hook_gradients":
        fwd = DDP(model)
        fwd.register_comm_hook(ThresholdState(compression=TopK(0.1, warmup_steps=0)), threshold_hook)
        opt = inner
    else:
        fwd, opt = model, SharedOptimizer(inner, mode=front.split("_")[1], link=None,
                                          compression=TopK(0.1, warmup_steps=0) if front.endswith("gradients") else None)
    losses = []
    for step in range(12):
        x, y = batch(r, step % 3)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(fwd(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    verify_replicas(model)
    return losses, flat(model)


@pytest.mark.slow
@pytest.mark.parametrize("front", ["hook_updates", "hook_gradients", "optimizer_updates", "optimizer_gradients"])
def test_bf16_autocast_trains_with_identical_replicas(front):
    res = run_local(_bf16, 2, (front,), timeout=180)
    for losses, params in res:
        assert np.isfinite(losses).all() and losses[-1] < 0.8 * losses[0], losses
        assert np.array_equal(params, res[0][1])


class _Recording(torch.optim.SGD):
    """Records, at each step, whether the hook's check finds a GradScaler calling it."""

    def step(self, closure=None):
        from gradshare.hooks import _called_by_grad_scaler
        self.seen.append(_called_by_grad_scaler())
        return super().step(closure)


@pytest.mark.parametrize("how", ["plain", "scaler", "subclass", "disabled"])
def test_a_grad_scaler_is_found_among_the_callers(how):
    """Updates mode gathers every rank's non-finite flag when a GradScaler may skip a rank's step: the check
    finds one by its ``step``'s code, a subclass's override included; a disabled one steps every rank."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = _Recording([p], lr=0.1)
    opt.seen = []
    scaler = {"plain": None, "scaler": torch.amp.GradScaler("cpu"), "subclass": OwnStepScaler("cpu"),
              "disabled": torch.amp.GradScaler("cpu", enabled=False)}[how]
    step_with(opt, (2 * p).sum(), scaler, update=False)
    assert opt.seen == [how in ("scaler", "subclass")]
