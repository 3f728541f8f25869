"""A step is all or nothing, and ranks agree on their configuration (gradshare.sharing).

A fault is injected at each stage of a step's exchange: a rank's encoder raises (on one rank only), the
collective fails, a gathered message is rejected by the decoder, an update is not finite. Every rank must
raise (none may hang), and every piece of sharing state (parameters, residuals, policies, step counter and
statistics) must be bitwise what it was before the step; the next step then trains as usual and replicas
stay identical. Ranks whose configurations differ must all stop at the first exchange, naming what differs.
"""
import contextlib
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import gradshare
from gradshare import ConfigurationMismatchError, Fixed, SharedOptimizer, TopK, verify_replicas
from gradshare import comm
from gradshare.compression import Strom, Ternary
from gradshare.workers import run_local
from test_sharing import IDS, SETUPS, Run
from tiny_model import batch as _batch, flat as _flat

STAGES = ("encode", "collective", "decode", "nonfinite")
EXPECT = {"encode": "rank 1 could not encode", "collective": "injected collective failure",
          "decode": "magic", "nonfinite": "non-finite"}


@contextlib.contextmanager
def _patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextlib.contextmanager
def _fault(stage, rank):
    if stage == "encode":              # one rank's encoder raises; the others must not wait for its message
        def broken(self, update, residual, step):
            raise RuntimeError("injected encoder failure")
        with contextlib.ExitStack() as stack:
            if rank == 1:
                for cls in (TopK, Ternary, Strom):
                    stack.enter_context(_patched(cls, "encode", broken))
            yield
    elif stage == "collective":
        def failing(*args, **kwargs):
            raise RuntimeError("injected collective failure")
        with _patched(comm, "all_gather_fn", lambda: failing):
            yield
    elif stage == "decode":            # the gathered rows arrive with a bad magic word in rank 0's message
        real = comm._Exchange.finish

        def corrupt(self):
            if not self.dense:
                self.rows[0] = 0
            return real(self)
        with _patched(comm._Exchange, "finish", corrupt):
            yield
    else:
        yield


def _state(run):
    sh = run.sharing
    buckets = sh.buckets if run.front == "optimizer" or run.mode == "updates" else list(run.state._buckets.values())
    return {"params": _flat(run.model), "residuals": [r.numpy().copy() for r in run.residuals()],
            "policies": [repr(b.compression.state_dict()) for b in buckets], "step": sh.step,
            "stats": repr(sh.stats.state_dict())}


def _one_setup(front, mode, stage, compression):
    warnings.simplefilter("ignore")
    r = dist.get_rank()
    run = Run(front, mode, compression=compression)
    for step in range(3):
        run.step(*_batch(r, step))
    before = _state(run)
    x, y = _batch(r, 3)
    if stage == "nonfinite" and r == 1:
        x[0, 0] = float("nan")
    error = None
    with _fault(stage, r):
        try:
            run.step(x, y)
        except Exception as e:  # noqa: BLE001  (DDP re-raises a hook's error from backward as RuntimeError)
            error = f"{type(e).__name__}: {e}"
    after = _state(run)
    unchanged = {k: (np.array_equal(before[k], after[k]) if k == "params" else
                     all(np.array_equal(a, b) for a, b in zip(before[k], after[k])) if k == "residuals" else
                     before[k] == after[k]) for k in before}
    # The same step again, fault-free: training goes on. Not after an error inside DDP's backward (every
    # fault of the gradients hook; the collective fault of the updates hook, whose non-finite flags are
    # gathered in backward): DDP's reducer cannot start another iteration after any hook error.
    resumable = front == "optimizer" or (mode == "updates" and stage != "collective")
    if resumable:
        run.step(*_batch(r, 3))
    verify_replicas(run.model)
    return {"error": error, "unchanged": unchanged, "steps": run.sharing.step, "resumable": resumable}


def _all_faults():
    return {(i, stage, c): _one_setup(f, m, stage, None if c == "default" else Fixed(1e-3))
            for i, (f, m) in enumerate(SETUPS) for stage in STAGES for c in ("default", "strom")}


@pytest.mark.slow
def test_a_fault_at_any_stage_stops_every_rank_and_changes_nothing():
    res = run_local(_all_faults, 2, timeout=600, collective_timeout=60)
    for key, r0 in res[0].items():
        name = f"{IDS[key[0]]}, {key[1]}, {key[2]}"
        for r in (x[key] for x in res):
            assert r["error"] is not None and EXPECT[key[1]] in r["error"], (name, r["error"])
            assert all(r["unchanged"].values()), (name, r["unchanged"])
            assert r["steps"] == (4 if r["resumable"] else 3), name


# ------------------------------------------------------------------------------------------- agreement
def _mismatch(case):
    warnings.simplefilter("ignore")
    r = dist.get_rank()
    out = {}
    for i, (front, mode) in enumerate(SETUPS):
        if case == "compression":
            run = Run(front, mode, compression=TopK(0.05 if r == 0 else 0.1))
            x, y = _batch(r, 0)
            try:
                run.step(x, y)
                out[IDS[i]] = None
            except Exception as e:  # noqa: BLE001
                out[IDS[i]] = f"{type(e).__name__}: {e}"
    if case == "layout":               # equal sizes (30 elements), different shapes: DDP would refuse itself
        torch.manual_seed(0)
        model = nn.Linear(4, 6) if r == 0 else nn.Linear(5, 5)
        opt = SharedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        model(torch.randn(2, model.in_features)).sum().backward()
        try:
            opt.step()
            out["optimizer"] = None
        except ConfigurationMismatchError as e:
            out["optimizer"] = str(e)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", ["compression", "layout"])
def test_ranks_with_different_configurations_all_stop_naming_the_difference(case):
    res = run_local(_mismatch, 2, (case,), timeout=300, collective_timeout=60)
    assert res[0].keys() == res[1].keys() and res[0]
    for out in res:
        for name, err in out.items():
            assert err is not None and "different configurations" in err, (name, err)
            if case == "compression":
                assert "compression" in err and "0.05" in err and "0.1" in err, (name, err)
            else:
                assert "bucket layout" in err and "(6, 4)" in err and "(5, 5)" in err, err
