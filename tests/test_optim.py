import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from gradshare import Adaptive, Fixed, NonFiniteStepError, SharedOptimizer, verify_replicas
from gradshare.replicas import ReplicaMismatchError
from gradshare.workers import run_local
from tiny_model import batch as _batch, flat as _flat, net as _net, restore, snapshot




def _make(model, mode, nonfinite="raise"):
    inner = torch.optim.Adam(model.parameters(), lr=1e-2) if mode == "updates" else \
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    th = Adaptive(initial=1e-3) if mode == "updates" else Adaptive(initial=2e-2)
    # A small bucket cap gives several buckets (one per ~1000 parameters).
    return SharedOptimizer(inner, mode=mode, threshold=th, nonfinite=nonfinite, bucket_cap_mb=0.004)


def _train(mode, steps, start=0, ckpts=None, save_at=None, nonfinite="raise", bad=None):
    warnings.simplefilter("ignore")
    r = dist.get_rank()
    model = _net()
    opt = _make(model, mode, nonfinite)
    if ckpts is not None:
        restore(ckpts[r], model, opt)
    saved, info = None, {}
    for step in range(start, steps):
        if step == save_at:
            saved = snapshot(model, opt)
        x, y = _batch(r, step)
        if bad is not None and step == bad[0] and r == bad[1]:
            x[0, 0] = float("inf")
        before = _flat(model)
        res_before = [b.residual.clone() for b in opt._buckets]
        opt_before = {k: {kk: vv.clone() if torch.is_tensor(vv) else vv for kk, vv in v.items()}
                      for k, v in opt.state.items()}
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if opt.step_skipped:
            info["skipped_step"] = step
            info["params_unchanged"] = np.array_equal(before, _flat(model))
            info["residuals_unchanged"] = all(torch.equal(a, b.residual) for a, b in zip(res_before, opt._buckets))
            info["opt_state_unchanged"] = all(
                torch.equal(opt_before[p][k], opt.state[p][k]) for p in opt_before for k in opt_before[p]
                if torch.is_tensor(opt_before[p][k]))
    verify_replicas(model)
    return {"params": _flat(model), "saved": saved, "step": opt.step_count, "buckets": len(opt._buckets),
            "stats": opt.stats.state_dict(), "init": _flat(_net()), **info}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_both_modes_keep_replicas_bitwise_identical(world):
    res = run_local(_both_modes, world, (50,), timeout=300)
    for i, mode in enumerate(("gradients", "updates")):
        runs = [r[i] for r in res]
        for r in runs:
            assert np.array_equal(r["params"], runs[0]["params"]), mode
            assert r["step"] == 50 and r["buckets"] >= 2
        assert not np.array_equal(runs[0]["params"], runs[0]["init"])
        assert runs[0]["stats"]["bytes_sent"] < runs[0]["stats"]["dense_bytes"]


def _both_modes(steps):
    return _train("gradients", steps), _train("updates", steps)


def _save_both(steps, save_at):
    return _train("gradients", steps, save_at=save_at), _train("updates", steps, save_at=save_at)


def _resume_both(steps, start, ckpts):
    return (_train("gradients", steps, start=start, ckpts=ckpts[0]),
            _train("updates", steps, start=start, ckpts=ckpts[1]))


@pytest.mark.slow
def test_checkpoint_restore_continues_exactly_in_both_modes():
    full = run_local(_save_both, 2, (60, 25), timeout=300)
    ckpts = [[r[i]["saved"] for r in full] for i in range(2)]
    resumed = run_local(_resume_both, 2, (60, 25, ckpts), timeout=300)
    for a, b in zip(full, resumed):
        for i in range(2):
            assert np.array_equal(a[i]["params"], b[i]["params"])
            assert b[i]["step"] == 60 and a[i]["stats"] == b[i]["stats"]


def _nonfinite_runs(mode):
    out = {}
    try:
        _train(mode, 8, bad=(3, 1))
        out["raise"] = None
    except NonFiniteStepError as e:
        out["raise"] = str(e)
    out["skip"] = _train(mode, 10, nonfinite="skip", bad=(4, 0))
    return out


def _nonfinite_both():
    return _nonfinite_runs("gradients"), _nonfinite_runs("updates")


@pytest.mark.slow
def test_nonfinite_raise_everywhere_and_skip_consistently():
    res = run_local(_nonfinite_both, 2, timeout=300, collective_timeout=60)
    for i in range(2):
        for r in (x[i] for x in res):
            assert r["raise"] is not None and "step 3" in r["raise"] and "rank 1" in r["raise"]
            s = r["skip"]
            assert s["skipped_step"] == 4
            assert s["params_unchanged"] and s["residuals_unchanged"] and s["opt_state_unchanged"]
            assert s["step"] == 9
            assert np.array_equal(s["params"], res[0][i]["skip"]["params"])


def _updates_mean_equals_sgd():
    """Fixed tiny tau + dense fallback: 'updates' with plain SGD equals averaged-gradient SGD."""
    warnings.simplefilter("ignore")
    r = dist.get_rank()
    model = _net()
    opt = SharedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), mode="updates", threshold=Fixed(1e-3),
                          clipping=None, fallback="always")
    ref = _net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x, y = _batch(r, step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        for p in ref.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        ref_opt.step()
    # Replica check that must fail: perturb rank 1 only.
    mismatch = None
    with torch.no_grad():
        if r == 1:
            model[2].bias[0] += 1.0
    try:
        verify_replicas(model)
    except ReplicaMismatchError as e:
        mismatch = (e.name, e.ranks)
    return np.abs(_flat(model) - _flat(ref)).max() if r == 0 else None, mismatch


@pytest.mark.slow
def test_updates_mode_averages_and_verify_replicas_names_the_parameter():
    res = run_local(_updates_mean_equals_sgd, 2, timeout=120)
    assert res[0][0] < 1e-5
    assert res[0][1] == ("2.bias", [1]) and res[1][1] == ("2.bias", [1])


# -- momentum correction (Deep Gradient Compression) -----------------------------------------------------
def _make_dgc(model, nonfinite="raise"):
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    th = Adaptive(initial=2e-2, warmup_steps=10)
    return SharedOptimizer(inner, threshold=th, nonfinite=nonfinite, bucket_cap_mb=0.004, momentum=0.9)


def _train_dgc(steps, start=0, ckpt=None, save_at=None):
    warnings.simplefilter("ignore")
    r = dist.get_rank()
    model = _net()
    opt = _make_dgc(model)
    if ckpt is not None:
        restore(ckpt[r], model, opt)
    saved = None
    for step in range(start, steps):
        if step == save_at:
            saved = snapshot(model, opt)
        x, y = _batch(r, step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    verify_replicas(model)
    return {"params": _flat(model), "saved": saved, "buckets": len(opt._buckets), "init": _flat(_net()),
            "velocities": [b.velocity.numpy().copy() for b in opt._buckets],       # numpy: crosses processes
            "residuals": [b.residual.numpy().copy() for b in opt._buckets], "stats": opt.stats.state_dict()}


@pytest.mark.slow
def test_momentum_correction_keeps_replicas_identical_and_restores_exactly():
    full = run_local(_train_dgc, 2, (40, 0, None, 15), timeout=300)
    a, b = full
    assert np.array_equal(a["params"], b["params"]) and a["buckets"] >= 2
    assert not np.array_equal(a["params"], a["init"])
    # velocities are local: they differ between ranks and are not all zero
    assert any(np.abs(v).sum() > 0 for v in a["velocities"])
    assert any(not np.array_equal(u, v) for u, v in zip(a["velocities"], b["velocities"]))
    ckpt = [r["saved"] for r in full]
    resumed = run_local(_train_dgc, 2, (40, 15, ckpt), timeout=300)
    for x, y in zip(full, resumed):
        assert np.array_equal(x["params"], y["params"])
        assert all(np.array_equal(u, v) for u, v in zip(x["velocities"], y["velocities"]))
        assert all(np.array_equal(u, v) for u, v in zip(x["residuals"], y["residuals"]))
        assert x["stats"] == y["stats"]


def _masking_case():
    """One 4-element parameter, Fixed tau 0.375, m 0.5, rank 0's gradient g, rank 1's zero, SGD lr 1."""
    r = dist.get_rank()
    w = nn.Parameter(torch.zeros(4))
    opt = SharedOptimizer(torch.optim.SGD([w], lr=1.0), threshold=Fixed(0.375), clipping=None, momentum=0.5,
                          fallback="never")
    g = torch.tensor([1.0, 0.125, 0.0, -0.5]) if r == 0 else torch.zeros(4)
    out = []
    for _ in range(2):
        before = w.detach().clone()
        w.grad = g.clone()
        opt.step()
        b = opt._buckets[0]
        out.append({"applied": (before - w.detach()).tolist(), "velocity": b.velocity.tolist(),
                    "residual": b.residual.tolist()})
    return out


@pytest.mark.slow
def test_momentum_correction_masks_sent_elements():
    r0, r1 = run_local(_masking_case, 2, (), timeout=120)
    # step 1: u = g; residual = g; elements 0 and 3 reach tau and are sent (+-tau), their velocity is zeroed
    assert r0[0] == {"applied": [0.1875, 0.0, 0.0, -0.1875], "velocity": [0.0, 0.125, 0.0, 0.0],
                     "residual": [0.625, 0.125, 0.0, -0.125]}
    # step 2: u = 0.5 * u + g = [1, 0.1875, 0, -0.5]; residual + u = [1.625, 0.3125, 0, -0.625]
    assert r0[1] == {"applied": [0.1875, 0.0, 0.0, -0.1875], "velocity": [0.0, 0.1875, 0.0, 0.0],
                     "residual": [1.25, 0.3125, 0.0, -0.25]}
    assert r1[1] == {"applied": [0.1875, 0.0, 0.0, -0.1875], "velocity": [0.0] * 4, "residual": [0.0] * 4}


def test_momentum_correction_rejects_inner_momentum_and_updates_mode():
    w = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="inner optimizer has momentum"):
        SharedOptimizer(torch.optim.SGD([w], lr=0.1, momentum=0.9), momentum=0.9)
    with pytest.raises(ValueError, match="gradients"):
        SharedOptimizer(torch.optim.SGD([w], lr=0.1), mode="updates", momentum=0.9)
    with pytest.raises(ValueError, match="momentum"):
        SharedOptimizer(torch.optim.SGD([w], lr=0.1), momentum=1.0)
