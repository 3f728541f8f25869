"""The sharing core through both front ends: the DDP hook (ThresholdState) and SharedOptimizer, each sharing
updates (the optimizer is known) or gradients.

Every property is checked on every (front end, mode): replicas stay bitwise identical, a checkpoint restores
training exactly, a non-finite value stops every rank ("raise") or drops the step everywhere with all state
unchanged ("skip"), and with one rank nothing is encoded.
"""
import copy
import gc
import pickle
import time
import warnings
import weakref

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import gradshare
from gradshare import (Adaptive, Fixed, SharedOptimizer, Ternary, ThresholdState, TopK,
                       threshold_hook, verify_replicas)
from gradshare.replicas import ReplicaMismatchError
from gradshare.workers import run_local
from tiny_model import (OwnStepScaler, batch as _batch, flat as _flat, grad_scaler, net as _net, restore, scaled_steps,
                        snapshot, step_with)

SETUPS = [("hook", "updates"), ("hook", "gradients"), ("optimizer", "updates"), ("optimizer", "gradients")]
IDS = [f"{f}-{m}" for f, m in SETUPS]


class Run:
    """One rank's training setup: model, the object that steps it, and gradshare's state."""

    def __init__(self, front, mode, nonfinite="raise", compression=None, cap_mb=0.004, momentum=None):
        self.front, self.mode = front, mode
        self.model = _net()
        sgd_momentum = 0.0 if momentum is not None else 0.9
        inner = (torch.optim.Adam(self.model.parameters(), lr=1e-2) if mode == "updates" else
                 torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=sgd_momentum))
        if compression is None and mode == "gradients":
            compression = TopK(0.05)
        if front == "hook":
            # A small bucket cap: DDP starts with one bucket and rebuilds into several after iteration 0.
            self.net = DDP(self.model, bucket_cap_mb=cap_mb)
            kwargs = dict(compression=compression, nonfinite=nonfinite, momentum=momentum)
            if mode == "updates":   # compression at every step (link=None): what these tests are about
                kwargs.update(optimizer=inner, bucket_cap_mb=cap_mb, link=None)
            self.state = ThresholdState(**kwargs)
            self.net.register_comm_hook(self.state, threshold_hook)
            self.opt = inner
            self.objects = (self.model, self.opt, self.state)
        else:
            self.net = self.model
            self.state = self.opt = SharedOptimizer(inner, mode=mode, compression=compression, nonfinite=nonfinite,
                                                    bucket_cap_mb=cap_mb, momentum=momentum, link=None)
            self.objects = (self.model, self.opt)

    @property
    def sharing(self):
        return self.state.sharing

    def residuals(self):
        """Every residual, in a fixed order (a copy)."""
        if self.front == "hook" and self.mode == "gradients":
            res = self.state.state_dict()["residuals"]
            return [res[k].clone() for k in sorted(res)]
        return [b.residual.clone() for b in self.sharing.buckets]

    def step(self, x, y):
        loss = F.cross_entropy(self.net(x), y)
        self.opt.zero_grad()
        loss.backward()
        if self.front == "hook" and self.mode == "gradients":
            if self.state.should_step():
                self.opt.step()
        else:
            self.opt.step()


def _train(front, mode, steps, start=0, ckpts=None, save_at=None, nonfinite="raise", bad=None, **kw):
    warnings.simplefilter("ignore")
    r = dist.get_rank()
    run = Run(front, mode, nonfinite, **kw)
    if ckpts is not None:
        restore(ckpts[r], *run.objects)
    saved, info = None, {}
    for step in range(start, steps):
        if step == save_at:
            saved = snapshot(*run.objects)
        x, y = _batch(r, step)
        if bad is not None and step == bad[0] and r == bad[1]:
            x[0, 0] = float("nan")
        before, res_before = _flat(run.model), run.residuals()
        opt_before = {id(p): {k: v.clone() for k, v in st.items() if torch.is_tensor(v)}
                      for p, st in run.opt.state.items()}
        run.step(x, y)
        if run.sharing.step_skipped:
            info["skipped_step"] = step
            info["params_unchanged"] = np.array_equal(before, _flat(run.model))
            info["residuals_unchanged"] = all(torch.equal(a, b) for a, b in zip(res_before, run.residuals()))
            info["opt_state_unchanged"] = all(torch.equal(v, run.opt.state[p][k]) for p in run.opt.state
                                              for k, v in opt_before.get(id(p), {}).items())
    verify_replicas(run.model)
    return {"params": _flat(run.model), "saved": saved, "steps": run.sharing.step,
            "buckets": len(run.sharing.buckets) if front == "optimizer" or mode == "updates" else len(run.state._buckets),
            "stats": run.sharing.stats.state_dict(), "init": _flat(_net()),
            "residuals": [t.numpy() for t in run.residuals()], **info}


def _all_setups(steps):
    return [_train(f, m, steps) for f, m in SETUPS]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_replicas_stay_bitwise_identical(world):
    res = run_local(_all_setups, world, (40,), timeout=400)
    for i, name in enumerate(IDS):
        runs = [r[i] for r in res]
        for r in runs:
            assert np.array_equal(r["params"], runs[0]["params"]), name
            assert r["steps"] == 40 and r["buckets"] >= 2, name
        assert not np.array_equal(runs[0]["params"], runs[0]["init"]), name
        assert 0 < runs[0]["stats"]["bytes_sent"] < runs[0]["stats"]["dense_bytes"], name
        assert any(np.abs(x).sum() > 0 for x in runs[0]["residuals"]), name     # error feedback holds something


def _resume_cap(front, mode):
    # After a restart DDP's first iteration uses its initial bucket layout, so in gradients mode the chunks of
    # that step cover other elements than before the save unless the model is one bucket (gradshare/hooks.py).
    # Updates mode uses the optimizer's buckets and restores exactly whatever their size.
    return 25.0 if (front, mode) == ("hook", "gradients") else 0.004


def _save_all(steps, save_at):
    return [_train(f, m, steps, save_at=save_at, cap_mb=_resume_cap(f, m)) for f, m in SETUPS]


def _resume_all(steps, start, ckpts):
    return [_train(f, m, steps, start=start, ckpts=ckpts[i], cap_mb=_resume_cap(f, m))
            for i, (f, m) in enumerate(SETUPS)]


@pytest.mark.slow
def test_checkpoint_restores_training_exactly():
    full = run_local(_save_all, 2, (40, 15), timeout=400)
    ckpts = [[r[i]["saved"] for r in full] for i in range(len(SETUPS))]
    resumed = run_local(_resume_all, 2, (40, 15, ckpts), timeout=400)
    for a, b in zip(full, resumed):
        for i, name in enumerate(IDS):
            assert np.array_equal(a[i]["params"], b[i]["params"]), name
            assert b[i]["steps"] == 40 and a[i]["stats"] == b[i]["stats"], name
            assert a[i]["buckets"] >= (1 if _resume_cap(*SETUPS[i]) > 1 else 2), name
            assert all(np.array_equal(u, v) for u, v in zip(a[i]["residuals"], b[i]["residuals"])), name


def _nonfinite(front, mode):
    out = {}
    try:
        _train(front, mode, 8, bad=(3, 1))
        out["raise"] = None
    except Exception as e:  # NonFiniteStepError; DDP re-raises a hook's error from backward as RuntimeError
        out["raise"] = f"{type(e).__name__}: {e}"
    out["skip"] = _train(front, mode, 10, nonfinite="skip", bad=(4, 0))
    return out


def _nonfinite_all():
    return [_nonfinite(f, m) for f, m in SETUPS]


@pytest.mark.slow
def test_nonfinite_raises_everywhere_or_skips_with_state_unchanged():
    res = run_local(_nonfinite_all, 2, timeout=400, collective_timeout=60)
    for i, name in enumerate(IDS):
        for r in (x[i] for x in res):
            assert r["raise"] is not None and "step 3" in r["raise"] and "rank 1" in r["raise"], (name, r["raise"])
            s = r["skip"]
            assert s["skipped_step"] == 4, name
            assert s["params_unchanged"] and s["residuals_unchanged"], name
            if not (SETUPS[i] == ("hook", "gradients")):       # there the hook cannot keep opt.step() from running
                assert s["opt_state_unchanged"], name
            assert s["steps"] == 9, name
            assert np.array_equal(s["params"], res[0][i]["skip"]["params"]), name


def _one_cycle(opt):
    # OneCycleLR moves the learning rate and the momentum every step: the optimizer reads both itself.
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=8, cycle_momentum=True)


def _uncompressed_updates_equal_sgd(front):
    """Sharing updates with nothing held back (dense allreduce) is synchronous data-parallel SGD, with the
    user's momentum, Nesterov, weight decay and a scheduler that changes lr and momentum every step."""
    warnings.simplefilter("ignore")
    r = dist.get_rank()
    model = _net()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)
    if front == "hook":
        net = DDP(model)
        net.register_comm_hook(ThresholdState(optimizer=inner, fallback="always"), threshold_hook)
        opt = inner
    else:
        net, opt = model, SharedOptimizer(inner, fallback="always")
    sched = _one_cycle(inner)
    ref = _net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)
    ref_sched = _one_cycle(ref_opt)
    lrs = []
    for step in range(8):
        x, y = _batch(r, step)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
        sched.step()
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        for p in ref.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        ref_opt.step()
        ref_sched.step()
        lrs.append((inner.param_groups[0]["lr"], inner.param_groups[0]["momentum"]) ==
                   (ref_opt.param_groups[0]["lr"], ref_opt.param_groups[0]["momentum"]))
    assert all(lrs)
    return float(np.abs(_flat(model) - _flat(ref)).max())


def _both_fronts_uncompressed():
    return _uncompressed_updates_equal_sgd("hook"), _uncompressed_updates_equal_sgd("optimizer")


@pytest.mark.slow
def test_updates_without_compression_are_synchronous_sgd_with_momentum_and_scheduler():
    for diffs in run_local(_both_fronts_uncompressed, 2, timeout=120):
        assert max(diffs) < 1e-6


def _default_front(front):
    """(model, module to call, what to step) with gradshare's defaults for an SGD with momentum, compressing
    every step (link=None: a link-aware choice follows measured times; tests/test_link.py covers it)."""
    model = _net()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if front == "hook":
        net = DDP(model)
        net.register_comm_hook(ThresholdState(optimizer=inner, link=None), threshold_hook)
        return model, net, inner
    return model, model, SharedOptimizer(inner, link=None)


def _with_grad_scaler(front, bad_at=None):
    """Updates mode under a GradScaler: returns the parameters and the scale after each step."""
    warnings.simplefilter("ignore")
    return scaled_steps(*_default_front(front), bad_at=bad_at)


def _scaled_and_plain():
    out = {}
    for front in ("hook", "optimizer"):
        r = dist.get_rank()
        model, net, opt = _default_front(front)
        for step in range(6):
            x, y = _batch(r, step)
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
        out[front] = (_flat(model), _with_grad_scaler(front)[0])
    out["hook_inf"] = _with_grad_scaler("hook", bad_at=3)
    out["optimizer_inf"] = _with_grad_scaler("optimizer", bad_at=3)
    return out


@pytest.mark.slow
def test_grad_scaler_changes_nothing_and_an_inf_skips_everywhere():
    res = run_local(_scaled_and_plain, 2, timeout=180)
    for r in res:
        for front in ("hook", "optimizer"):
            plain, scaled = r[front]
            assert np.array_equal(plain, scaled), front    # what is shared is in unscaled units
        params, scales = r["hook_inf"]
        assert scales[3] == scales[2] / 2                  # rank 1's inf: every rank's scaler backs off
        assert np.array_equal(params, res[0]["hook_inf"][0])
        # SharedOptimizer: every rank skips that step together (the replicas stay equal); each rank's scaler
        # backs off for its own overflow only, which changes nothing shared (gradients are unscaled first).
        params, scales = r["optimizer_inf"]
        assert np.array_equal(params, res[0]["optimizer_inf"][0])
    assert res[1]["optimizer_inf"][1][3] == res[1]["optimizer_inf"][1][2] / 2
    assert res[0]["optimizer_inf"][1][3] == res[0]["optimizer_inf"][1][2]
    assert not np.array_equal(res[0]["optimizer_inf"][0], res[0]["optimizer"][1])   # steps after the skip ran


def _freed_when_dropped():
    """Whether a hooked DDP and its optimizer that the script drops after a few steps are freed, for a plain
    script, one under a GradScaler and one whose scaler subclass overrides ``step``."""
    freed = {}
    for name, scaler in (("plain", None), ("scaler", grad_scaler()), ("subclass", OwnStepScaler("cpu"))):
        model, net, opt = _default_front("hook")
        scaled_steps(model, net, opt, scaler=scaler, steps=3) if scaler is not None else _plain_steps(net, opt)
        refs = (weakref.ref(net), weakref.ref(opt))
        model = net = opt = None             # the script moves on (a sweep's next run, or `del model`)
        # A collective that ended still holds its callbacks (and through them the state) until the backend's
        # thread lets go of it, which on a loaded machine can come after this line: wait for that, bounded. A
        # reference the script's frame kept would hold them for good.
        deadline = time.monotonic() + 20
        gc.collect()
        while any(r() is not None for r in refs) and time.monotonic() < deadline:
            time.sleep(0.05)
            gc.collect()
        freed[name] = all(r() is None for r in refs)
    return freed


def _plain_steps(net, opt, steps=3):
    for step in range(steps):
        x, y = _batch(dist.get_rank(), step)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()


def test_a_dropped_model_is_freed():
    """The hook looks for a GradScaler among its callers by their code, never by reading the caller's local
    variables: reading them leaves a snapshot on the script's frame that would keep a model it drops alive."""
    for r in run_local(_freed_when_dropped, 2, timeout=120):
        assert r == {"plain": True, "scaler": True, "subclass": True}


def _collectives_per_step(front, scaler):
    """Collectives per compressed step in steps 2-5 (one bucket, TopK: a fixed-size message), under ``scaler``
    (None: a plain script)."""
    model, net, opt = _default_front(front)
    calls = []
    originals = {name: getattr(dist, name) for name in ("all_gather_into_tensor", "all_gather_single",
                                                        "all_reduce", "broadcast") if hasattr(dist, name)}
    for name, fn in originals.items():
        def counted(*a, _f=fn, **k):
            calls.append(1)
            return _f(*a, **k)
        setattr(dist, name, counted)
    try:
        for step in range(6):
            if step == 2:
                calls.clear()
            x, y = _batch(dist.get_rank(), step)
            opt.zero_grad()
            step_with(opt, F.cross_entropy(net(x), y), scaler)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return len(calls) / 4


def _collectives_of_each_front():
    from tiny_model import grad_scaler
    warnings.simplefilter("ignore")
    return {(front, scaled): _collectives_per_step(front, grad_scaler(enabled=scaled) if scaled is not None else None)
            for front in ("hook", "optimizer") for scaled in (None, False, True)}


def test_a_compressed_step_without_a_grad_scaler_is_one_collective():
    # The hook gathers the ranks' non-finite flags in backward only where a GradScaler could skip a rank's step
    # alone: a plain script (or a disabled scaler) pays one round trip per step, as SharedOptimizer does.
    for r in run_local(_collectives_of_each_front, 2, timeout=120):
        for front in ("hook", "optimizer"):
            assert r[(front, None)] == 1 and r[(front, False)] == 1, (front, r)
            assert r[(front, True)] == 2, (front, r)       # the flags, then the payload


def _one_rank():
    """World size 1: the hook returns DDP's own result and SharedOptimizer steps the inner optimizer."""
    warnings.simplefilter("ignore")
    out = {}
    for front in ("hook", "optimizer"):
        model, ref = _net(), _net()
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if front == "hook":
            net = DDP(model)
            state = ThresholdState(optimizer=inner)
            net.register_comm_hook(state, threshold_hook)
            opt = inner
        else:
            net, opt = model, SharedOptimizer(inner)
            state = opt
        ref_net, ref_opt = DDP(ref), torch.optim.AdamW(ref.parameters(), lr=1e-2)
        for step in range(5):
            for n_, o_ in ((net, opt), (ref_net, ref_opt)):
                x, y = _batch(0, step)
                o_.zero_grad()
                F.cross_entropy(n_(x), y).backward()
                o_.step()
        out[front] = (np.array_equal(_flat(model), _flat(ref)), state.stats.exchanges)
    return out


def test_one_rank_is_exactly_ddp_without_encoding():
    out = run_local(_one_rank, 1, timeout=120)[0]
    for front, (same, exchanges) in out.items():
        assert same and exchanges == 0, front


def test_hook_state_pickles_without_group_and_optimizer():
    st = ThresholdState(compression=Adaptive(initial=0.5))
    clone = pickle.loads(pickle.dumps(st))
    assert clone.process_group is None and clone.mode == "gradients" and repr(clone.sharing.compression) == \
        repr(st.sharing.compression)


# -- defaults per optimizer --------------------------------------------------------------------------------
def _is_top_signs(c) -> bool:
    return isinstance(c, TopK) and c.density == 0.05 and c.values == "sign"


def test_what_waits_is_kept_in_each_rank_model_where_updates_are_shared_at_once():
    w = nn.Parameter(torch.zeros(3))
    for sharing in (SharedOptimizer(torch.optim.SGD([w], lr=0.1, momentum=0.9)).sharing,
                    ThresholdState(optimizer=torch.optim.AdamW([w])).sharing):
        assert sharing.error_feedback == "model" and sharing.own_models and sharing.show_mean
        assert _is_top_signs(sharing.compression) and sharing.masking is None and sharing.link is not None
    # where the model cannot hold it: gradients shared (the optimizer steps on their mean), a step applied late
    for sharing in (ThresholdState().sharing, SharedOptimizer(torch.optim.SGD([w], lr=0.1), mode="gradients").sharing,
                    SharedOptimizer(torch.optim.SGD([w], lr=0.1), delay=1).sharing,
                    ThresholdState(optimizer=torch.optim.Adam([w]), delay=1).sharing):
        assert sharing.error_feedback == "buffer" and not sharing.own_models
    assert gradshare.sharing.default_error_feedback("updates") == "model"
    assert gradshare.sharing.default_error_feedback("updates", delay=1) == "buffer"
    assert gradshare.sharing.default_error_feedback("gradients") == "buffer"
    # and parameters of a half type, which round away what waits below their last bit
    for dtype in (torch.bfloat16, torch.float16):
        h = nn.Parameter(torch.zeros(3, dtype=dtype))
        for sharing in (SharedOptimizer(torch.optim.AdamW([h])).sharing,
                        ThresholdState(optimizer=torch.optim.SGD([w, h], lr=0.1)).sharing):
            assert sharing.error_feedback == "buffer" and not sharing.own_models
    wide = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    assert SharedOptimizer(torch.optim.SGD([wide], lr=0.1)).sharing.own_models
    with pytest.raises(ValueError, match="expected None, 'buffer' or 'model'"):
        SharedOptimizer(torch.optim.SGD([w], lr=0.1), error_feedback="residual")


def test_default_compression_follows_the_optimizer():
    w = nn.Parameter(torch.zeros(3))
    # what waits in each rank's model (the default): the top 5% as signs, whatever the optimizer
    for opt in (torch.optim.SGD([w], lr=0.1, momentum=0.9), torch.optim.AdamW([w], lr=0.1),
                torch.optim.Rprop([w]), torch.optim.Adagrad([w])):
        assert _is_top_signs(SharedOptimizer(opt).compression)
        assert _is_top_signs(ThresholdState(optimizer=opt).sharing.compression)
    # what waits in the residual: chosen for the optimizer
    buffer = dict(error_feedback="buffer")
    assert isinstance(SharedOptimizer(torch.optim.SGD([w], lr=0.1, momentum=0.9), **buffer).compression, TopK)
    assert isinstance(SharedOptimizer(torch.optim.AdamW([w], lr=0.1), **buffer).compression, Ternary)
    assert isinstance(ThresholdState(optimizer=torch.optim.Adam([w]), **buffer).sharing.compression, Ternary)
    assert isinstance(ThresholdState().sharing.compression, TopK)

    class Mine(torch.optim.SGD):      # a subclass of a known optimizer is known
        pass

    assert isinstance(SharedOptimizer(Mine([w], lr=0.1), **buffer).compression, TopK)

    class Unknown(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

        def step(self, closure=None):
            pass

    for front, kind, assumed in (
            (lambda: SharedOptimizer(Unknown([w]), **buffer).compression, Ternary, "ternary-coded"),
            (lambda: ThresholdState(optimizer=Unknown([w]), **buffer).sharing.compression, Ternary, "ternary-coded"),
            (lambda: SharedOptimizer(Unknown([w])).compression, TopK, "not rescaled"),
            (lambda: ThresholdState(optimizer=Unknown([w])).sharing.compression, TopK, "not rescaled")):
        gradshare.compression._warned.discard("Unknown")
        with pytest.warns(UserWarning, match="Unknown is not an optimizer gradshare knows") as caught:
            assert isinstance(front(), kind)
        assert caught[0].filename == __file__       # the warning names the user's line, not gradshare's
        assert assumed in str(caught[0].message)    # and says what was assumed
    # Rprop's steps span decades (TopK); Adafactor divides by a second moment (Ternary, no warning)
    assert isinstance(SharedOptimizer(torch.optim.Rprop([w]), **buffer).compression, TopK)
    if hasattr(torch.optim, "Adafactor"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert isinstance(SharedOptimizer(torch.optim.Adafactor([w]), **buffer).compression, Ternary)
            assert _is_top_signs(SharedOptimizer(torch.optim.Adafactor([w])).compression)
    if hasattr(torch.optim, "Muon"):                 # orthogonalized steps: entries of similar size (Ternary)
        m = nn.Parameter(torch.zeros(3, 4))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert isinstance(SharedOptimizer(torch.optim.Muon([m]), **buffer).compression, Ternary)


def test_explicit_compression_and_legacy_names():
    w = nn.Parameter(torch.zeros(3))
    assert isinstance(SharedOptimizer(torch.optim.SGD([w], lr=0.1), compression=Ternary()).compression, Ternary)
    tk = SharedOptimizer(torch.optim.SGD([w], lr=0.1), compression=gradshare.TargetSparsity(target=0.002)).compression
    assert isinstance(tk, TopK) and tk.density == 0.002
    strom = SharedOptimizer(torch.optim.SGD([w], lr=0.1), compression=Fixed(0.1)).compression
    assert isinstance(strom, gradshare.Strom) and strom.tau == pytest.approx(0.1)
    with pytest.warns(DeprecationWarning, match="compression"):
        old = SharedOptimizer(torch.optim.SGD([w], lr=0.1), threshold=Adaptive())
    assert isinstance(old.compression, gradshare.Strom)
    with pytest.raises(TypeError, match="compression"):
        SharedOptimizer(torch.optim.SGD([w], lr=0.1), compression="nonsense")
    dense = SharedOptimizer(torch.optim.SGD([w], lr=0.1), compression="dense").compression
    assert isinstance(dense, gradshare.Dense) and dense.words(10, 0) > 10     # always the all-reduce path
    with pytest.raises(ValueError, match="all-reduce"):
        dense.encode(torch.zeros(3), torch.zeros(3), 0)
    with pytest.raises(ValueError, match="momentum"):
        ThresholdState(optimizer=torch.optim.SGD([w], lr=0.1), momentum=0.9)


# -- momentum correction in gradshare (gradients mode) -----------------------------------------------------
def _dgc(front, steps, start=0, ckpts=None, save_at=None):
    return _train(front, "gradients", steps, start=start, ckpts=ckpts, save_at=save_at, momentum=0.9,
                  compression=Adaptive(initial=2e-2, warmup_steps=10))


def _dgc_save(steps, save_at):
    return [_dgc(f, steps, save_at=save_at) for f in ("hook", "optimizer")]


def _dgc_resume(steps, start, ckpts):
    return [_dgc(f, steps, start=start, ckpts=ckpts[i]) for i, f in enumerate(("hook", "optimizer"))]


@pytest.mark.slow
def test_momentum_correction_keeps_replicas_identical_and_restores_exactly():
    full = run_local(_dgc_save, 2, (40, 15), timeout=300)
    ckpts = [[r[i]["saved"] for r in full] for i in range(2)]
    resumed = run_local(_dgc_resume, 2, (40, 15, ckpts), timeout=300)
    for i in range(2):
        a, b = full[0][i], full[1][i]
        assert np.array_equal(a["params"], b["params"]) and a["buckets"] >= 2
        assert not np.array_equal(a["params"], a["init"])
        for x, y in zip(full, resumed):
            assert np.array_equal(x[i]["params"], y[i]["params"])
            assert all(np.array_equal(u, v) for u, v in zip(x[i]["residuals"], y[i]["residuals"]))
            if i == 1:   # the hook's resumed first iteration runs in DDP's initial single bucket: one exchange less
                assert x[i]["stats"] == y[i]["stats"]


class _Dot(nn.Module):
    """loss = w . x: the gradient of w is exactly x."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4))

    def forward(self, x):
        return (self.w * x).sum()


def _masking_case(front):
    """One 4-element parameter, Fixed tau 0.375, m 0.5, rank 0's gradient g, rank 1's zero, SGD lr 1."""
    r = dist.get_rank()
    model = _Dot()
    kwargs = dict(compression=Fixed(0.375), clipping=None, momentum=0.5, fallback="never")
    if front == "hook":
        net = DDP(model)
        state = ThresholdState(**kwargs)
        net.register_comm_hook(state, threshold_hook)
        opt = torch.optim.SGD(net.parameters(), lr=1.0)
    else:
        net = model
        state = opt = SharedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), mode="gradients", **kwargs)
    g = torch.tensor([1.0, 0.125, 0.0, -0.5]) if r == 0 else torch.zeros(4)
    out = []
    for _ in range(2):
        before = model.w.detach().clone()
        opt.zero_grad()
        net(g).backward()
        opt.step()
        b = next(iter(state._buckets.values())) if front == "hook" else state.sharing.buckets[0]
        out.append({"applied": (before - model.w.detach()).tolist(), "velocity": b.velocity.tolist(),
                    "residual": b.residual.tolist()})
    return out


def _masking_both():
    return _masking_case("hook"), _masking_case("optimizer")


@pytest.mark.slow
def test_momentum_correction_masks_sent_elements():
    for i in range(2):
        r0, r1 = [x[i] for x in run_local(_masking_both, 2, (), timeout=120)]
        # step 1: u = g; elements 0 and 3 reach tau = 0.375 and are sent; their velocity is zeroed
        assert r0[0] == {"applied": [0.1875, 0.0, 0.0, -0.1875], "velocity": [0.0, 0.125, 0.0, 0.0],
                         "residual": [0.625, 0.125, 0.0, -0.125]}
        # step 2: u = 0.5 * u + g = [1, 0.1875, 0, -0.5]; residual + u = [1.625, 0.3125, 0, -0.625]
        assert r0[1] == {"applied": [0.1875, 0.0, 0.0, -0.1875], "velocity": [0.0, 0.1875, 0.0, 0.0],
                         "residual": [1.25, 0.3125, 0.0, -0.25]}
        assert r1[1] == {"applied": [0.1875, 0.0, 0.0, -0.1875], "velocity": [0.0] * 4, "residual": [0.0] * 4}


def test_momentum_correction_is_checked():
    w = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="inner optimizer has momentum"):
        SharedOptimizer(torch.optim.SGD([w], lr=0.1, momentum=0.9), mode="gradients", momentum=0.9)
    with pytest.raises(ValueError, match="gradients"):
        SharedOptimizer(torch.optim.SGD([w], lr=0.1), mode="updates", momentum=0.9)
    with pytest.raises(ValueError, match="momentum"):
        SharedOptimizer(torch.optim.SGD([w], lr=0.1), mode="gradients", momentum=1.0)


def _replica_check():
    r = dist.get_rank()
    model = _net()
    with torch.no_grad():
        if r == 1:
            model[2].bias[0] += 1.0
    try:
        verify_replicas(model)
    except ReplicaMismatchError as e:
        return e.name, e.ranks
    return None


@pytest.mark.slow
def test_verify_replicas_names_the_parameter_that_differs():
    assert run_local(_replica_check, 2, timeout=60) == [("2.bias", [1])] * 2


# ------------------------------------------------------- error_feedback="model": what waits, in each rank's model
def _own_model_run(front, steps, start=0, ckpt=None, save_at=None, bad=None, nonfinite="raise", show_mean=True):
    """Adam's updates shared every step as signs of the top 5%, what waits kept in each rank's parameters
    (``show_mean=False``: shown between steps too, as the core does for local steps)."""
    warnings.simplefilter("ignore")
    r = dist.get_rank()
    model = _net()
    inner = torch.optim.Adam(model.parameters(), lr=1e-2)
    kw = dict(compression=TopK(0.05, values="sign"), link=None, bucket_cap_mb=0.004, error_feedback="model",
              nonfinite=nonfinite)
    if front == "hook":
        net = DDP(model, bucket_cap_mb=0.004)
        state = ThresholdState(optimizer=inner, **kw)
        net.register_comm_hook(state, threshold_hook)
        opt, objects = inner, (model, inner, state)
    else:
        net, state = model, SharedOptimizer(inner, **kw)
        opt, objects = state, (model, state)
    state.sharing.show_mean = show_mean
    if ckpt is not None:
        restore(ckpt[r], *objects)
    out = {"skipped": [], "between steps": []}
    for step in range(start, steps):
        if step == save_at:
            out["saved"] = snapshot(*objects)
        x, y = _batch(r, step)
        if bad == (step, r):
            x[0, 0] = float("nan")
        before = (_flat(model), [b.residual.clone() for b in state.sharing.buckets])
        loss = F.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if state.step_skipped:
            out["skipped"].append((step, np.array_equal(before[0], _flat(model)),
                                   all(torch.equal(a, b.residual) for a, b in zip(before[1], state.sharing.buckets))))
        # between steps: the mean result (show_mean), or each rank's own model
        mean = torch.cat([b.snapshot for b in state.sharing.buckets]).numpy()
        out["between steps"].append(np.array_equal(_flat(model), mean))
    bs = state.sharing.buckets
    out["params"] = _flat(model)
    with torch.no_grad():
        net(_batch(r, 0)[0])                 # a forward that does not train keeps the mean result on
    out["kept by a forward without gradients"] = np.array_equal(_flat(model), out["params"])
    state.sharing.wear_own()                 # what the next step's forward puts on: the rank's own model
    out["own"] = _flat(model)
    out["mean result"] = torch.cat([b.snapshot for b in bs]).numpy().copy()
    out["own is mean minus residual"] = all(
        torch.equal(torch.cat([p.detach().reshape(-1) for p in b.params]), b.snapshot - b.residual) for b in bs)
    out["held back"] = float(sum(b.residual.abs().sum() for b in bs))
    out["residuals"] = [b.residual.clone().numpy() for b in bs]
    out["ratio"] = state.sharing.stats.bytes_sent / state.sharing.stats.dense_bytes
    with state.mean_result():                # the mean result in place, without a collective
        out["inside mean_result"] = _flat(model)
        verify_replicas(model)
    out["own after mean_result"] = np.array_equal(_flat(model), out["own"])
    state.merge()
    verify_replicas(model)                   # raises where the ranks' parameters differ
    out["merged"] = _flat(model)
    out["held back after merge"] = float(sum(b.residual.abs().sum() for b in bs))
    return out


def _own_model_fronts(steps):
    return [_own_model_run(front, steps, show_mean=show) for show in (True, False) for front in ("hook", "optimizer")]


@pytest.mark.slow
def test_model_feedback_holds_back_in_each_model_and_merge_makes_replicas_identical():
    res = run_local(_own_model_fronts, 2, (30,), timeout=300)
    for i in range(4):
        a, b = res[0][i], res[1][i]
        assert not np.array_equal(a["own"], b["own"])              # each rank holds its own unsent part
        assert np.array_equal(a["mean result"], b["mean result"])  # the mean result is the same everywhere
        assert np.array_equal(a["inside mean_result"], a["mean result"]) and a["own after mean_result"]
        assert b["own after mean_result"]
        assert a["own is mean minus residual"] and b["own is mean minus residual"]
        assert a["held back"] > 0 and a["ratio"] < 0.5
        assert np.array_equal(a["merged"], b["merged"]) and a["held back after merge"] == 0.0
        assert not np.array_equal(a["merged"], a["mean result"])   # merge applied what was held back
    for i in range(2):
        shown, own = res[0][i], res[0][i + 2]
        # the DDP hook and SharedOptimizer show the mean result between steps: identical replicas at every step
        for r in (0, 1):
            assert all(res[r][i]["between steps"]) and res[r][i]["kept by a forward without gradients"]
            assert np.array_equal(res[r][i]["params"], res[r][i]["mean result"])
            assert not any(res[r][i + 2]["between steps"])   # shown as they are: each rank's own model
        # and train the same bits as each rank's own model shown between steps
        assert np.array_equal(shown["own"], own["params"]) and np.array_equal(shown["mean result"], own["mean result"])
    # the DDP hook and SharedOptimizer are one core: the same bits
    assert np.array_equal(res[0][0]["own"], res[0][1]["own"])
    assert np.array_equal(res[0][0]["merged"], res[0][1]["merged"])


def _own_model_write_between_steps():
    """A script's write to the parameters between steps (a clamp, the same on every rank) is kept: it becomes the
    mean result that the next step's own model is taken from, as DDP keeps it."""
    warnings.simplefilter("ignore")
    r = dist.get_rank()
    model = _net()
    net = DDP(model)
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = ThresholdState(optimizer=inner, compression=TopK(0.05, values="sign"), link=None, error_feedback="model")
    net.register_comm_hook(state, threshold_hook)
    for step in range(3):
        x, y = _batch(r, step)
        inner.zero_grad()
        F.cross_entropy(net(x), y).backward()
        inner.step()
    with torch.no_grad():
        for p in model.parameters():
            p.clamp_(-0.01, 0.01)
    clamped = _flat(model)
    with state.mean_result():                # reads the mean result as shown, the write included
        inside = _flat(model)
    x, y = _batch(r, 3)
    loss = F.cross_entropy(net(x), y)        # a forward that trains: the own model goes back on
    bs = state.sharing.buckets
    out = {"clamped": clamped, "inside": inside, "mean result": torch.cat([b.snapshot for b in bs]).numpy().copy(),
           "residual": torch.cat([b.residual for b in bs]).numpy().copy(),
           "own is mean minus residual": all(torch.equal(torch.cat([p.detach().reshape(-1) for p in b.params]),
                                                         b.snapshot - b.residual) for b in bs)}
    inner.zero_grad()
    loss.backward()
    inner.step()
    with torch.no_grad():
        for p in model.parameters():
            p.clamp_(-0.005, 0.005)
    out["clamped again"] = _flat(model)
    out["saved"] = torch.cat(state.state_dict()["sharing"]["starts"]).numpy()     # a checkpoint taken here
    return out


@pytest.mark.slow
def test_model_feedback_keeps_what_a_script_writes_between_steps():
    for out in run_local(_own_model_write_between_steps, 2, timeout=300):
        assert np.abs(out["clamped"]).max() <= 0.01
        assert np.array_equal(out["mean result"], out["clamped"]) and np.array_equal(out["inside"], out["clamped"])
        assert np.array_equal(out["saved"], out["clamped again"])
        assert out["own is mean minus residual"] and np.abs(out["residual"]).max() > 0


def _two_models_in_one_process():
    """Two models trained side by side in one process (a GAN's generator and discriminator), each shared with
    what waits in its own model: one's forward puts on only its own model, the other keeps showing its mean."""
    warnings.simplefilter("ignore")
    r = dist.get_rank()
    kw = dict(compression=TopK(0.05, values="sign"), link=None, error_feedback="model")
    models = [_net(), _net()]
    opts = [SharedOptimizer(torch.optim.Adam(m.parameters(), lr=1e-2), **kw) for m in models]
    for step in range(4):
        for m, o in zip(models, opts):
            x, y = _batch(r, step)
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()

    def shows(i, what):
        bs = opts[i].sharing.buckets
        want = torch.cat([b.snapshot if what == "mean" else b.snapshot - b.residual for b in bs])
        return torch.equal(torch.cat([p.detach().reshape(-1) for p in models[i].parameters()]), want)

    out = {"both show the mean": shows(0, "mean") and shows(1, "mean")}
    loss = F.cross_entropy(models[0](_batch(r, 9)[0]), _batch(r, 9)[1])     # the first model's forward
    out["first own, second mean"] = shows(0, "own") and shows(1, "mean")
    verify_replicas(models[1])                   # the second model's parameters are the same on every rank
    out["held back"] = float(sum(b.residual.abs().sum() for o in opts for b in o.sharing.buckets))
    models[1](_batch(r, 9)[0])
    out["then both own"] = shows(0, "own") and shows(1, "own")
    loss.backward()
    opts[0].step()                               # the mean result shown again, until the next forward
    opts[0].add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
    out["waits after add_param_group"] = opts[0].sharing in gradshare.sharing._WAITING
    return out


@pytest.mark.slow
def test_model_feedback_wears_each_model_at_its_own_forward():
    for out in run_local(_two_models_in_one_process, 2, timeout=300):
        assert out["held back"] > 0
        assert out["both show the mean"] and out["first own, second mean"] and out["then both own"]
        assert out["waits after add_param_group"]    # a group added to a core is not a new core


def _own_model_resume(steps, save_at):
    return [_own_model_run(front, steps, save_at=save_at) for front in ("hook", "optimizer")]


def _own_model_resumed(steps, start, ckpts):
    return [_own_model_run(front, steps, start=start, ckpt=ckpts[i]) for i, front in enumerate(("hook", "optimizer"))]


@pytest.mark.slow
def test_model_feedback_resumes_exactly():
    full = run_local(_own_model_resume, 2, (30, 12), timeout=300)
    ckpts = [[r[i]["saved"] for r in full] for i in range(2)]
    resumed = run_local(_own_model_resumed, 2, (30, 12, ckpts), timeout=300)
    for a, b in zip(full, resumed):
        for i in range(2):
            assert np.array_equal(a[i]["params"], b[i]["params"])
            assert np.array_equal(a[i]["mean result"], b[i]["mean result"])
            assert all(np.array_equal(u, v) for u, v in zip(a[i]["residuals"], b[i]["residuals"]))


def _own_model_skip():
    return [_own_model_run(front, 10, bad=(4, 1), nonfinite="skip") for front in ("hook", "optimizer")]


@pytest.mark.slow
def test_model_feedback_skips_a_nonfinite_step_with_state_unchanged():
    for rank in run_local(_own_model_skip, 2, timeout=300):
        for r in rank:
            assert r["skipped"] == [(4, True, True)]
            assert r["own is mean minus residual"]


def test_model_feedback_is_checked():
    w = nn.Parameter(torch.zeros(3))
    adam = torch.optim.Adam([w], lr=0.1)
    with pytest.raises(ValueError, match="updates shared"):
        SharedOptimizer(torch.optim.SGD([w], lr=0.1), mode="gradients", error_feedback="model")
    with pytest.raises(ValueError, match="updates shared"):
        ThresholdState(error_feedback="model")
    with pytest.raises(ValueError, match="delay=0"):
        SharedOptimizer(adam, error_feedback="model", delay=1)
    with pytest.raises(ValueError, match="'buffer' or 'model'"):
        SharedOptimizer(adam, error_feedback="params")
    own = SharedOptimizer(adam, error_feedback="model")
    assert own.sharing.link is not None and own.sharing.masking is None    # link-aware; no momentum masking
    assert isinstance(own.compression, TopK) and (own.compression.density, own.compression.values) == (0.05, "sign")
    sgd_own = SharedOptimizer(torch.optim.SGD([w], lr=0.1, momentum=0.9), error_feedback="model")
    assert sgd_own.compression.values == "sign" and sgd_own.sharing.masking is None
    assert SharedOptimizer(adam, error_feedback="model", compression=TopK(0.01)).sharing.masking is None
    assert SharedOptimizer(adam, compression=TopK(0.01), error_feedback="buffer").sharing.masking is not None
    with torch.no_grad():
        w.fill_(0.5)
    with SharedOptimizer(adam, compression=TopK(0.01)).mean_result():   # the buffer's: nothing to put in place
        assert torch.equal(w, torch.full((3,), 0.5))
    with own.mean_result():                                              # no step yet: no mean result held
        assert torch.equal(w, torch.full((3,), 0.5))


def test_bucket_copies_and_cached_slices_follow_the_buffers():
    from gradshare.compression import Dense
    from gradshare.sharing import Bucket
    a, b = nn.Parameter(torch.zeros(2, 3)), nn.Parameter(torch.zeros(4))
    bucket = Bucket(0, [a, b], Dense())
    bucket.residual.copy_(torch.arange(10.0))
    first = [v for _, v in bucket.views(bucket.residual)]
    assert torch.equal(first[0], torch.arange(6.0).view(2, 3)) and torch.equal(first[1], torch.arange(6.0, 10.0))
    assert all(x is y for x, (_, y) in zip(first, bucket.views(bucket.residual)))     # kept, not re-sliced
    bucket.residual = torch.full((10,), -1.0)          # replaced, as a checkpoint load does
    assert all(torch.equal(v, torch.full_like(v, -1.0)) for _, v in bucket.views(bucket.residual))
    bucket.residual[7] = 5.0
    assert dict(bucket.views(bucket.residual))[b][1] == 5.0
    foreign = torch.arange(10.0, 20.0)                 # not the bucket's own: sliced afresh, never kept
    assert torch.equal(dict(bucket.views(foreign))[b], torch.arange(16.0, 20.0))
    assert all(e[0] is not foreign for e in bucket._slice_cache.values())

    bucket.set_params(torch.arange(10.0))
    assert torch.equal(a.detach(), torch.arange(6.0).view(2, 3)) and torch.equal(b.detach(), torch.arange(6.0, 10.0))
    assert torch.equal(bucket.gather_params(torch.empty(10)), torch.arange(10.0))
    b.grad = torch.ones(4)                             # a has no gradient: its slice is zero
    assert torch.equal(bucket.gather_grads(torch.full((10,), 9.0)), torch.tensor([0.0] * 6 + [1.0] * 4))
    a.grad = torch.zeros(2, 3)
    bucket.set_grads(torch.arange(10.0))               # every gradient present: one multi-tensor copy
    assert torch.equal(a.grad, torch.arange(6.0).view(2, 3)) and torch.equal(b.grad, torch.arange(6.0, 10.0))
    a.grad = None
    bucket.set_grads(torch.arange(10.0) + 1, present=[False, True])
    assert a.grad is None and torch.equal(b.grad, torch.arange(7.0, 11.0))
    bucket.set_grads(torch.arange(10.0) + 2, present=[True, True])
    assert torch.equal(a.grad, torch.arange(2.0, 8.0).view(2, 3))

    bucket.snapshot = torch.linspace(-1.0, 1.0, 10)                  # the own model: snapshot - residual
    bucket.residual = torch.randn(10) * 1e-3
    bucket.set_params_own()
    slow = [p.detach().clone() for p in bucket.params]
    bucket.set_params(bucket.snapshot)                # the parameters show the mean result
    bucket.gather_params(bucket.snapshot)             # what wear_own reads first
    bucket.set_params_own(read=True)                  # float32: the residual taken off in place, the same bits
    assert all(torch.equal(p.detach(), q) for p, q in zip(bucket.params, slow))

    h = nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))           # a bfloat16 bucket, float32 buffers
    half = Bucket(1, [h], Dense())
    half.set_params(torch.tensor([1.5, 2.0, -3.0]))
    assert h.dtype == torch.bfloat16 and torch.equal(h.detach().float(), torch.tensor([1.5, 2.0, -3.0]))


def test_the_automatic_bucket_size_is_a_quarter_of_the_model_between_8_and_25_mib():
    from gradshare.sharing import auto_bucket_cap_mb, group_parameters

    def params(*numels):
        return [torch.zeros(n, requires_grad=True) for n in numels]

    assert auto_bucket_cap_mb(params(1000)) == 8.0                          # small: one bucket
    assert auto_bucket_cap_mb(params(40 * 2**20 // 4)) == 10.0              # 40 MiB: a quarter
    assert auto_bucket_cap_mb(params(400 * 2**20 // 4)) == 25.0             # large: DDP's
    frozen = torch.zeros(400 * 2**20 // 4)                                  # needs no gradient: not counted
    assert auto_bucket_cap_mb([frozen] + params(1000)) == 8.0
    # bench/e2e's MLP (3.7M parameters, 14 MiB): its two matrices apart, so that one is encoded while the other travels
    mlp = params(784 * 2048, 2048, 2048 * 1024, 1024, 1024 * 10, 10)
    assert [len(b) for b in group_parameters(mlp, None)] == [2, 1, 3]
    assert [len(b) for b in group_parameters(mlp, 25.0)] == [6]


def _resume_in_other_buckets(error_feedback):
    """Trains 4 steps in one bucket, saves, then goes on 4 steps from the checkpoint in one bucket and, from the
    same checkpoint, in one bucket per parameter (a checkpoint of another bucket size: the earlier default's)."""
    def make(cap):
        model = _net()
        return model, SharedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                      compression=Fixed(2e-3), link=None, bucket_cap_mb=cap, fallback="never",
                                      error_feedback=error_feedback)

    def train(model, opt, steps, start):
        for s in range(start, start + steps):
            x, y = _batch(dist.get_rank(), s)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()

    model, opt = make(25.0)
    train(model, opt, 4, 0)
    saved_model, saved = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    out = {}
    for cap in (25.0, 1e-6):
        model, opt = make(cap)
        model.load_state_dict(saved_model)
        opt.load_state_dict(copy.deepcopy(saved))
        out[cap] = {"buckets": len(opt.sharing.buckets),
                    "residual": torch.cat([b.residual for b in opt.sharing.buckets]).clone()}
        train(model, opt, 4, 4)
        out[cap]["params"] = torch.from_numpy(_flat(model))
    return out


@pytest.mark.parametrize("error_feedback", ["buffer", "model"])
def test_a_checkpoint_loads_into_other_bucket_sizes_and_resumes_alike(error_feedback):
    """An elementwise threshold decides each element alone (and no bucket falls back to a dense all-reduce), so
    going on in other buckets sends what one bucket would have: the same parameters bit for bit (and the same on
    both ranks)."""
    a, b = run_local(_resume_in_other_buckets, 2, args=(error_feedback,), timeout=120)
    for r in (a, b):
        assert r[25.0]["buckets"] == 1 and r[1e-6]["buckets"] == 6
        assert torch.equal(r[25.0]["residual"], r[1e-6]["residual"])
        assert r[25.0]["residual"].abs().sum() > 0                      # the checkpoint held something
        assert torch.equal(r[25.0]["params"], r[1e-6]["params"])
    assert torch.equal(a[1e-6]["params"], b[1e-6]["params"])


def test_a_checkpoint_of_other_parameters_is_refused_in_other_buckets():
    from gradshare.sharing import _rebucket

    saved = [{"n": 3, "residual": torch.zeros(3), "compression": {}}]
    with pytest.raises(ValueError, match="hold 3 elements in 1 buckets, this one's 4 in 2"):
        _rebucket(saved, None, [2, 2])
    with pytest.raises(ValueError, match="velocity should be a tensor of 3 elements"):
        _rebucket([dict(saved[0], velocity=torch.zeros(2))], None, [1, 2])
    with pytest.raises(ValueError, match="mean result of some buckets and not of others"):
        _rebucket(saved + [dict(saved[0])], [torch.zeros(3), None], [2, 4])
    with pytest.raises(ValueError, match="bucket 1's mean result should be a tensor of 3 elements"):
        _rebucket(saved + [dict(saved[0])], [torch.zeros(3), torch.zeros(2)], [2, 4])
    out, starts = _rebucket([{"n": 3, "residual": torch.arange(3.0), "compression": {"a": 1}},
                             {"n": 2, "residual": torch.arange(3.0, 5.0), "compression": {"a": 2}}],
                            [torch.zeros(3), torch.ones(2)], [2, 3])
    assert [o["residual"].tolist() for o in out] == [[0.0, 1.0], [2.0, 3.0, 4.0]]
    assert [o["compression"] for o in out] == [{"a": 1}, {"a": 1}]          # the saved bucket of its first element
    assert [s.tolist() for s in starts] == [[0.0, 0.0], [0.0, 1.0, 1.0]]
    assert out[0]["velocity"] is None and out[0]["last sent"] is None
