"""SharedOptimizer and ParameterAveraging are torch optimizers: schedulers, add_param_group, torch-shaped
state dicts, torch.distributed.checkpoint, parameters without a gradient left alone, and AdamW's fused and
foreach implementations shared as its for-loop is."""
import copy
import pickle
from collections import deque

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from gradshare import LinkAware, ParameterAveraging, SharedOptimizer, TopK, optimizer_state
from gradshare.workers import run_local
from tiny_model import batch, flat, net


def _schedulers():
    return {
        "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=20),
        "CosineAnnealingLR": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=7, eta_min=1e-4),
    }


def _wrappers():
    return {
        "SharedOptimizer": lambda m, o: SharedOptimizer(o),
        "SharedOptimizer model": lambda m, o: SharedOptimizer(o, error_feedback="model", link=None),
        "ParameterAveraging": lambda m, o: ParameterAveraging(m, o, frequency=3),
        "ParameterAveraging DiLoCo": lambda m, o: ParameterAveraging(
            m, o, frequency=3, outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)),
    }


@pytest.mark.parametrize("wrapper", sorted(_wrappers()))
def test_wrappers_are_torch_optimizers_over_the_inner_groups(wrapper):
    model = net()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = _wrappers()[wrapper](model, inner)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state and opt.defaults is inner.defaults
    opt.param_groups[0]["lr"] = 0.05
    assert inner.param_groups[0]["lr"] == 0.05
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        _wrappers()[wrapper](model, [p for p in model.parameters()])
    with pytest.raises(TypeError, match="wraps an optimizer already"):
        _wrappers()[wrapper](model, opt)


def _inner_stepped_directly(wrapper):
    model = net()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = _wrappers()[wrapper](model, inner)
    rank = dist.get_rank() if dist.is_initialized() else 0
    for i in range(2):
        x, y = batch(rank, i)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    before = flat(model)
    x, y = batch(rank, 2)
    F.cross_entropy(model(x), y).backward()
    try:
        inner.step()                             # a script that steps the inner optimizer by mistake
        said = None
    except RuntimeError as e:
        said = str(e)
    return said, bool((before == flat(model)).all())


@pytest.mark.parametrize("wrapper", sorted(_wrappers()))
def test_the_inner_optimizer_stepped_directly_is_refused_while_its_wrapper_shares(wrapper):
    # Two ranks: nothing would be shared, each rank stepping on its own gradient; refused before it steps.
    for said, unchanged in run_local(_inner_stepped_directly, 2, (wrapper,), threads=1, timeout=120):
        assert said is not None and f"AdamW.step() was called directly, but a {wrapper.split()[0]} wraps it" in said
        assert unchanged
    # One process: nothing to share, so the inner optimizer may step on its own.
    said, unchanged = _inner_stepped_directly(wrapper)
    assert said is None and not unchanged


def _copy_stepped_directly(how):
    model = net()
    opt = ParameterAveraging(model, torch.optim.AdamW(model.parameters(), lr=1e-2), frequency=3)
    c = {"deepcopy": copy.deepcopy, "copy": copy.copy, "pickle": lambda o: pickle.loads(pickle.dumps(o))}[how](opt)
    rank = dist.get_rank()
    said = []
    for i, w in enumerate([opt, c, c, opt, c, opt]):       # a round every 3 steps of each wrapper
        x, y = batch(rank, i)
        F.cross_entropy(w.model(x), y).backward()
        w.step()                                          # through a wrapper: allowed
        w.zero_grad()
        F.cross_entropy(w.model(x), y).backward()
        try:
            w.optimizer.step()                            # the inner optimizer directly: refused
            said.append(None)
        except RuntimeError as e:
            said.append(str(e))
        w.zero_grad()
    return said, c.optimizer is opt.optimizer


@pytest.mark.parametrize("how", ["deepcopy", "copy", "pickle"])
def test_a_copied_wrapper_keeps_its_inner_optimizer_guarded(how):
    # torch's Optimizer.__getstate__ keeps no hooks: a deep copy's inner optimizer is guarded afresh; a shallow
    # copy shares the inner optimizer, whose guard lets either wrapper step it
    for said, shared in run_local(_copy_stepped_directly, 2, (how,), threads=1, timeout=120):
        assert shared == (how == "copy")
        assert all(s is not None and "AdamW.step() was called directly" in s for s in said), said


def test_a_shared_optimizer_refuses_to_be_copied_with_a_clear_error():
    opt = SharedOptimizer(torch.optim.SGD(net().parameters(), lr=0.1))
    for copy_it in (copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="SharedOptimizer cannot be copied or pickled.*state_dict"):
            copy_it(opt)


@pytest.mark.parametrize("wrapper", sorted(_wrappers()))
@pytest.mark.parametrize("scheduler", sorted(_schedulers()))
def test_scheduler_on_the_wrapper_gives_the_plain_optimizers_lr_sequence(wrapper, scheduler):
    """OneCycleLR also cycles momentum: the inner optimizer's groups see it at every step."""
    def run(wrap):
        model = net()
        inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        opt = _wrappers()[wrapper](model, inner) if wrap else inner
        sched = _schedulers()[scheduler](opt)
        seq = []
        for step in range(12):
            x, y = batch(0, step)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            sched.step()
            seq.append((inner.param_groups[0]["lr"], inner.param_groups[0]["momentum"], sched.get_last_lr()[0]))
        return seq, flat(model)

    (plain, p_plain), (wrapped, p_wrapped) = run(False), run(True)
    assert wrapped == plain
    if wrapper == "SharedOptimizer":          # one rank: the inner step exactly
        assert (p_plain == p_wrapped).all()


def test_state_dict_is_torch_shaped_and_loads_into_the_plain_optimizer():
    model = net()
    opt = SharedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    for step in range(2):
        x, y = batch(0, step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    sd = opt.state_dict()
    assert set(sd) == {"state", "param_groups", "gradshare"}
    plain = torch.optim.AdamW(net().parameters(), lr=1e-3)
    plain.load_state_dict(sd)                                  # torch ignores gradshare's entry
    assert torch.equal(plain.state_dict()["state"][0]["exp_avg"], sd["state"][0]["exp_avg"])
    other = SharedOptimizer(torch.optim.AdamW(net().parameters(), lr=1e-3))
    other.load_state_dict({k: v for k, v in sd.items() if k != "gradshare"})   # inner only
    assert other.sharing.step == 0 and torch.equal(other.state_dict()["state"][0]["exp_avg"], sd["state"][0]["exp_avg"])
    sd["gradshare"]["sharing"]["step"] = 7                    # one rank shares nothing: mark it
    other.load_state_dict(sd)
    assert other.sharing.step == 7
    legacy = {"optimizer": {k: v for k, v in sd.items() if k != "gradshare"},
              "gradshare": dict(sd["gradshare"]["sharing"], mode="updates")}     # the 0.x layout
    third = SharedOptimizer(torch.optim.AdamW(net().parameters(), lr=1e-3))
    third.load_state_dict(legacy)
    assert third.sharing.step == 7
    with pytest.raises(ValueError, match="not an optimizer state_dict"):
        third.load_state_dict({"model": {}})


# ------------------------------------------------------------------------------------ two ranks


class _WithUnused(nn.Module):
    """A net with a layer no rank uses and one only rank 0 uses."""

    def __init__(self):
        super().__init__()
        self.body = net()
        self.unused = nn.Linear(4, 4)
        self.rank0_only = nn.Linear(4, 4)

    def forward(self, x, rank):
        out = self.body(x)
        return self.rank0_only(out) if rank == 0 else out


def _no_grad_params(kw, plan=None):
    r = dist.get_rank()
    model = _WithUnused()
    before = model.unused.weight.detach().clone()
    opt = SharedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), **kw)
    if plan is not None:      # the link-aware choice scripted: "a" all-reduce, "c" compressed, step by step
        opt.sharing.link.plan = deque("allreduce" if c == "a" else "compressed" for c in plan)
    for step in range(6 if plan is None else len(plan)):
        x, y = batch(r, step)
        opt.zero_grad()
        F.cross_entropy(model(x, r), y).backward()
        opt.step()
    return {"unused equal": torch.equal(model.unused.weight, before), "unused grad": model.unused.weight.grad,
            "unused state": len(opt.state.get(model.unused.weight, {})),
            "rank0_only moved": not torch.equal(model.rank0_only.weight, _WithUnused().rank0_only.weight),
            "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()])}


@pytest.mark.slow
@pytest.mark.parametrize("kw", [{}, {"link": None}, {"mode": "gradients", "compression": TopK(0.1)}],
                         ids=["link-aware all-reduce steps", "compressed updates", "compressed gradients"])
def test_parameters_no_rank_has_a_gradient_for_are_not_touched(kw):
    res = run_local(_no_grad_params, 2, args=(kw,), timeout=120)
    for r in res:
        assert r["unused equal"] and r["unused grad"] is None and r["unused state"] == 0
        assert r["rank0_only moved"]
    assert torch.equal(res[0]["params"], res[1]["params"])


@pytest.mark.slow
def test_switching_to_allreduce_after_steps_only_one_rank_took_keeps_replicas_identical():
    # rank0_only is stepped by rank 0 alone on compressed steps: its Adam step counter runs ahead there, and
    # the all-reduce steps after the switch must start from the same counter on every rank.
    res = run_local(_no_grad_params, 2, args=({}, "aacccaaccca"), timeout=120)
    assert torch.equal(res[0]["params"], res[1]["params"])
    assert res[0]["rank0_only moved"] and res[0]["unused equal"]


def _adam_state_differs():
    r = dist.get_rank()
    model = _WithUnused()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3 + 2 * r):       # rank 1 steps more; rank0_only has state on rank 0 only
        x, y = batch(r, step)
        opt.zero_grad()
        F.cross_entropy(model(x, r), y).backward()
        opt.step()
    optimizer_state.agree(opt, model.parameters())
    st = opt.state[model.rank0_only.weight]
    return {"keys": sorted(st), "step": float(st["step"]), "body step": float(opt.state[model.body[0].weight]["step"]),
            "exp_avg zero": bool((st["exp_avg"] == 0).all()), "unused": len(opt.state.get(model.unused.weight, {}))}


def test_optimizer_state_agree_creates_missing_entries_and_takes_the_counters_of_the_rank_that_stepped_most():
    a, b = run_local(_adam_state_differs, 2, timeout=120)
    assert a["keys"] == b["keys"] == ["exp_avg", "exp_avg_sq", "step"]
    assert a["step"] == b["step"] == 3.0                     # only rank 0 stepped it, 3 times
    assert not a["exp_avg zero"] and b["exp_avg zero"]       # created as zeros where it was missing
    assert a["body step"] == b["body step"] == 5.0           # rank 1 stepped the body more
    assert a["unused"] == b["unused"] == 0                   # no rank has state: none created


def _averaging_with_rank0_only():
    r = dist.get_rank()
    model = _WithUnused()
    opt = ParameterAveraging(model, torch.optim.AdamW(model.parameters(), lr=1e-2), frequency=2)
    for step in range(4):
        x, y = batch(r, step)
        opt.zero_grad()
        F.cross_entropy(model(x, r), y).backward()
        opt.step()
    st = opt.optimizer.state[model.rank0_only.weight]
    return {"params": flat(model), "exp_avg": st["exp_avg"].clone(), "step": float(st["step"])}


@pytest.mark.slow
def test_averaging_rounds_average_state_only_some_ranks_have():
    a, b = run_local(_averaging_with_rank0_only, 2, timeout=120)
    assert (a["params"] == b["params"]).all()
    assert torch.equal(a["exp_avg"], b["exp_avg"]) and a["exp_avg"].abs().sum() > 0
    assert a["step"] == b["step"] == 4.0


def _add_group():
    r = dist.get_rank()
    torch.manual_seed(0)
    model = net()
    head = nn.Linear(4, 4)
    opt = SharedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), link=None)
    n_before = len(opt.sharing.buckets)
    before = head.weight.detach().clone()
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5)
    for step in range(5):
        if step == 2:
            opt.add_param_group({"params": head.parameters(), "lr": 0.1})
        x, y = batch(r, step)
        opt.zero_grad()
        F.cross_entropy(head(model(x)), y).backward()
        opt.step()
        sched.step()
    try:
        opt.add_param_group({"params": [head.weight]})
        again = None
    except ValueError as e:
        again = str(e)
    return {"buckets": (n_before, len(opt.sharing.buckets)), "head moved": not torch.equal(head.weight, before),
            "lrs": [g["lr"] for g in opt.param_groups], "again": again,
            "params": torch.cat([p.detach().reshape(-1) for p in list(model.parameters()) + list(head.parameters())])}


@pytest.mark.slow
def test_add_param_group_is_shared_and_scheduled():
    res = run_local(_add_group, 2, timeout=120)
    assert res[0]["buckets"][1] == res[0]["buckets"][0] + 1
    assert res[0]["head moved"] and len(res[0]["lrs"]) == 2 and res[0]["lrs"][1] < 0.1
    assert "some parameters appear in more than one parameter group" in res[0]["again"]
    assert torch.equal(res[0]["params"], res[1]["params"])


def _dcp_round_trip():
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    r = dist.get_rank()

    def make():
        m = net()
        return m, SharedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-2), link=None)

    def steps(m, o, start, n):
        for step in range(start, start + n):
            x, y = batch(r, step)
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()

    model, opt = make()
    steps(model, opt, 0, 3)
    msd, osd = copy.deepcopy(get_state_dict(model, opt))       # (its tensors are the live ones)
    own = copy.deepcopy(opt.state_dict()["gradshare"])         # per rank: saved next to the DCP checkpoint
    steps(model, opt, 3, 3)
    model2, opt2 = make()
    set_state_dict(model2, opt2, model_state_dict=msd, optim_state_dict=osd)
    opt2.load_state_dict(dict(opt2.optimizer.state_dict(), gradshare=own))
    steps(model2, opt2, 3, 3)
    return {"same": torch.equal(torch.from_numpy(flat(model)), torch.from_numpy(flat(model2))),
            "keys": sorted(osd)}


@pytest.mark.slow
def test_distributed_checkpoint_round_trip_resumes_exactly():
    for r in run_local(_dcp_round_trip, 2, timeout=120):
        assert r["same"] and r["keys"] == ["param_groups", "state"]


def _adamw_implementations(front):
    """AdamW's three implementations as users' scripts pick them (the for-loop, foreach=True, fused=True), each
    shared from the same start with its gradients' norm clipped before each step (a transformer script's loop)."""
    from gradshare import ThresholdState, threshold_hook

    out = {}
    for impl in ({"foreach": False}, {"foreach": True}, {"fused": True}):
        model = net()
        if front == "hook":
            fwd = torch.nn.parallel.DistributedDataParallel(model)
            opt = stepper = torch.optim.AdamW(model.parameters(), lr=3e-3, **impl)
            fwd.register_comm_hook(ThresholdState(optimizer=opt, link=None), threshold_hook)
        else:
            fwd, stepper = model, SharedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3, **impl), link=None)
        losses = []
        for step in range(60):
            x, y = batch(dist.get_rank(), step)
            stepper.zero_grad()
            loss = F.cross_entropy(fwd(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            stepper.step()
            losses.append(loss.item())
        out[str(impl)] = (torch.from_numpy(flat(model)), losses[0], sum(losses[-5:]) / 5)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("front", ["hook", "optimizer"])
def test_fused_and_foreach_adamw_share_as_the_for_loop_does(front):
    a, b = run_local(_adamw_implementations, 2, args=(front,), timeout=120)
    loop = a["{'foreach': False}"][2]
    for impl, (params, first, last) in a.items():
        assert torch.equal(params, b[impl][0]), impl            # replicas identical
        assert last < 0.7 * first, impl                         # it learns ...
        assert abs(last - loop) < 0.02 * loop, (impl, last, loop)   # ... as the for-loop AdamW does
