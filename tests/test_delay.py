"""Sharing one step late (delay=1): each step's mean update is applied at the end of the next step.

Checked over two ranks through both front ends: with nothing compressed it is data-parallel SGD whose
gradients are one update stale (against a reference computed here), replicas stay bitwise identical,
``flush()`` applies what is still travelling, and a checkpoint taken with an update in flight resumes
bit for bit without changing the run that took it. Bad combinations are refused.
"""
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from gradshare import LinkAware, SharedOptimizer, ThresholdState, threshold_hook, verify_replicas
from gradshare.workers import run_local
from tiny_model import batch, flat, net, restore, snapshot


def _front(front, inner, model, **kw):
    """(module to call, optimizer to step, the object with flush()) for one front end, sharing one step late."""
    if front == "hook":
        ddp = DDP(model)
        state = ThresholdState(optimizer=inner, link=None, delay=1, **kw)
        ddp.register_comm_hook(state, threshold_hook)
        return ddp, inner, state
    opt = SharedOptimizer(inner, link=None, delay=1, **kw)
    return model, opt, opt


def _stale_sgd(front):
    """Plain SGD, nothing compressed: the delayed run against theta_{t+1} = theta_t - lr * mean gradient of step
    t-1 (each gradient taken at the parameters of its own step), before and after flush()."""
    warnings.simplefilter("ignore")
    r, world, lr = dist.get_rank(), dist.get_world_size(), 0.1
    model = net()
    fwd, opt, holder = _front(front, torch.optim.SGD(model.parameters(), lr=lr), model, fallback="always")
    ref, pending = net(), None
    for step in range(8):
        x, y = batch(r, step)
        opt.zero_grad()
        F.cross_entropy(fwd(x), y).backward()
        opt.step()
        verify_replicas(model)
        ref.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        grads = [p.grad.clone() for p in ref.parameters()]
        for g in grads:
            dist.all_reduce(g)
            g /= world
        with torch.no_grad():
            if pending is not None:
                for p, g in zip(ref.parameters(), pending):
                    p.sub_(lr * g)
        pending = grads
    before_flush = float(np.abs(flat(model) - flat(ref)).max())
    holder.flush()
    verify_replicas(model)
    with torch.no_grad():
        for p, g in zip(ref.parameters(), pending):
            p.sub_(lr * g)
    return before_flush, float(np.abs(flat(model) - flat(ref)).max()), float(np.abs(flat(model) - flat(net())).max())


def _both_stale():
    return _stale_sgd("hook"), _stale_sgd("optimizer")


@pytest.mark.slow
def test_uncompressed_delayed_updates_are_sgd_on_one_step_stale_gradients():
    for rank in run_local(_both_stale, 2, timeout=180):
        for before_flush, after_flush, moved in rank:
            assert before_flush < 1e-6 and after_flush < 1e-6
            assert moved > 1e-3


def _train(front, steps, start=0, ckpts=None, save_at=None):
    """SGD with momentum at the default compression (TopK), one step late; a snapshot at ``save_at``."""
    warnings.simplefilter("ignore")
    r = dist.get_rank()
    model = net()
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    fwd, opt, holder = _front(front, inner, model, bucket_cap_mb=0.004)
    objects = (model, inner, holder) if front == "hook" else (model, opt)
    if ckpts is not None:
        restore(ckpts[r], *objects)
    saved = None
    for step in range(start, steps):
        if step == save_at:
            saved = snapshot(*objects)
        x, y = batch(r, step)
        opt.zero_grad()
        F.cross_entropy(fwd(x), y).backward()
        opt.step()
    verify_replicas(model)
    sharing = holder.sharing
    return {"params": flat(model), "saved": saved, "steps": sharing.step, "buckets": len(sharing.buckets),
            "residuals": [b.residual.numpy().copy() for b in sharing.buckets]}


def _runs(steps, save_at):
    return [(_train(f, steps), _train(f, steps, save_at=save_at)) for f in ("hook", "optimizer")]


def _resumed(steps, start, ckpts):
    return [_train(f, steps, start=start, ckpts=ckpts[i]) for i, f in enumerate(("hook", "optimizer"))]


@pytest.mark.slow
def test_a_checkpoint_with_an_update_in_flight_resumes_exactly_and_changes_nothing():
    full = run_local(_runs, 2, (16, 7), timeout=300)
    ckpts = [[rank[i][1]["saved"] for rank in full] for i in range(2)]
    resumed = run_local(_resumed, 2, (16, 7, ckpts), timeout=300)
    for rank_full, rank_resumed in zip(full, resumed):
        for (plain, saving), back in zip(rank_full, rank_resumed):
            assert plain["buckets"] >= 2
            # taking the checkpoint waited for the update in flight but applied nothing early
            assert np.array_equal(plain["params"], saving["params"])
            assert np.array_equal(plain["params"], back["params"])
            assert all(np.array_equal(u, v) for u, v in zip(plain["residuals"], back["residuals"]))
            # 16 steps taken, 15 landed: the last one is still in flight
            assert plain["steps"] == back["steps"] == 15
            assert not np.array_equal(plain["params"], flat(net()))


def test_delay_is_checked():
    model = net()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    for bad in (2, -1, True, 0.5):
        with pytest.raises(ValueError, match="delay: expected 0 or 1"):
            SharedOptimizer(sgd, delay=bad)
    with pytest.raises(ValueError, match='needs mode="updates"'):
        SharedOptimizer(sgd, mode="gradients", delay=1)
    with pytest.raises(ValueError, match='needs mode="updates"'):
        ThresholdState(delay=1)
    with pytest.raises(ValueError, match="cannot be combined with a LinkAware"):
        SharedOptimizer(sgd, delay=1, link=LinkAware())
    late = SharedOptimizer(sgd, delay=1)
    assert late.sharing.link is None                       # compresses every step
    assert late.flush() is True                            # nothing in flight
    on_time = SharedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="written with delay=0, this state has delay=1"):
        late.load_state_dict(on_time.state_dict())
