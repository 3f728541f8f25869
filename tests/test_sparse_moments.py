"""The second moment of mostly-zero gradients' parameters averaged over the ranks (gradshare.sparse_moments)."""
import copy
import math

import numpy as np
import pytest
import torch

from gradshare import sparse_moments
from gradshare.workers import run_local

ROWS, STEPS = 64, 120


def _rows(step, rank, world, per_rank=4):
    """Rows of an embedding drawn by popularity (the first rows far more often), different on every rank."""
    g = torch.Generator().manual_seed(1009 * step + 17)
    popularity = 1.0 / (torch.arange(ROWS) + 3.0)
    idx = torch.multinomial(popularity, world * per_rank, replacement=True, generator=g)
    target = torch.linspace(-1, 1, ROWS)[idx] + 0.5 * torch.randn(world * per_rank, generator=g)
    return idx.view(world, per_rank)[rank], target.view(world, per_rank)[rank]


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(ROWS, 1)      # a row gets a gradient only when its batch holds it
        self.scale = torch.nn.Linear(1, 1)          # every step's gradient touches it
        torch.nn.init.zeros_(self.emb.weight)
        with torch.no_grad():
            self.scale.weight.fill_(1.0)
            self.scale.bias.zero_()

    def forward(self, idx):
        return self.scale(self.emb(idx))[:, 0]


def _train(how, every=5, steps=STEPS):
    """Final embedding: "global" (one process, Adam on every rank's batch: DDP's step) or, on 2 ranks,
    SharedOptimizer sharing Adam's updates uncompressed with the sparse moments averaged every ``every`` steps
    ("on") or never ("off")."""
    import torch.distributed as dist

    import gradshare

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = _Model()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    if how != "global":
        opt = gradshare.SharedOptimizer(opt, compression=gradshare.Dense(), link=None)
        opt.sharing.sparse_moments.every = every if how == "on" else 0
    for step in range(steps):
        if how == "global":
            parts = [_rows(step, r, 2) for r in range(2)]
            idx, y = torch.cat([a for a, _ in parts]), torch.cat([b for _, b in parts])
        else:
            idx, y = _rows(step, rank, world)
        opt.zero_grad()
        ((model(idx) - y) ** 2).mean().backward()
        opt.step()
    out = {"emb": model.emb.weight.detach().reshape(-1).numpy().copy()}
    if how != "global":
        sm = opt.sharing.sparse_moments
        out.update(sparse=sm.sparse, averaged=sm.averaged, bytes=opt.bytes_sent)
    return out


def test_a_ranks_adam_on_a_sparse_embedding_tracks_the_global_batch_with_its_second_moment_averaged():
    target = _train("global")["emb"]
    on = run_local(_train, 2, ("on",), threads=1, timeout=300)
    off = run_local(_train, 2, ("off",), threads=1, timeout=300)
    # Replicas stay identical either way; the embedding is found sparse, the dense layer not
    assert np.array_equal(on[0]["emb"], on[1]["emb"]) and np.array_equal(off[0]["emb"], off[1]["emb"])
    assert on[0]["sparse"] == on[1]["sparse"] == [True, False, False]
    assert on[0]["averaged"] == len([s for s in range(sparse_moments.DETECT_STEPS + 1, STEPS + 1) if s % 5 == 0])
    assert off[0]["averaged"] == 0 and off[0]["sparse"] is None
    assert on[0]["bytes"] > off[0]["bytes"]                  # the averagings are counted
    d_on = float(np.linalg.norm(on[0]["emb"] - target))
    d_off = float(np.linalg.norm(off[0]["emb"] - target))
    assert math.isfinite(d_on) and d_off > 0.05 * float(np.linalg.norm(target)), (d_off, target)
    assert d_on < 0.7 * d_off, (d_on, d_off)


def _averaged_rank():
    """One step of each rank's own Adam on its own rows, then the average: each rank's second moment of the
    embedding and what the ranks held before, gathered."""
    import torch.distributed as dist

    import gradshare

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _Model()
    inner = torch.optim.Adam(model.parameters(), lr=0.05, amsgrad=True)
    opt = gradshare.SharedOptimizer(inner, compression=gradshare.Dense(), link=None)
    sm = opt.sharing.sparse_moments
    sm.every = 10**6                                           # only the explicit average below
    for step in range(sparse_moments.DETECT_STEPS):
        idx, y = _rows(step, rank, world)
        opt.zero_grad()
        ((model(idx) - y) ** 2).mean().backward()
        opt.step()
    st = inner.state[model.emb.weight]
    before = [torch.empty_like(st[k]) for k in ("exp_avg_sq", "max_exp_avg_sq") for _ in range(world)]
    for i, k in enumerate(("exp_avg_sq", "max_exp_avg_sq")):
        dist.all_gather(before[i * world:(i + 1) * world], st[k].clone())
    dense_before = inner.state[model.scale.weight]["exp_avg_sq"].clone()
    params = [p for b in opt.sharing.buckets for p in b.params]
    sent = sm.average(params, world)
    return {"sparse": sm.sparse, "sent": sent, "before": [t.numpy() for t in before],
            "after": [st[k].numpy().copy() for k in ("exp_avg_sq", "max_exp_avg_sq")],
            "dense same": bool(torch.equal(dense_before, inner.state[model.scale.weight]["exp_avg_sq"]))}


def test_the_average_is_the_ranks_mean_in_bfloat16_for_each_second_moment_and_only_the_sparse_ones():
    out = run_local(_averaged_rank, 2, (), threads=1, timeout=300)
    r0, r1 = out
    assert r0["sparse"] == [True, False, False]
    for i in range(2):                                         # exp_avg_sq, amsgrad's running maximum
        a, b = r0["before"][2 * i], r0["before"][2 * i + 1]
        assert not np.array_equal(a, b)                        # the ranks saw different rows
        expected = ((torch.from_numpy(a) / 2).bfloat16() + (torch.from_numpy(b) / 2).bfloat16()).float().numpy()
        np.testing.assert_allclose(r0["after"][i], expected, rtol=1e-2, atol=0)
        assert np.array_equal(r0["after"][i], r1["after"][i])  # the same on every rank
    assert r0["dense same"] and r1["dense same"]               # the dense layer's is each rank's own
    assert r0["sent"] == 2 * (2 - 1) * (2 * ROWS) * 2 // 2  # a ring all-reduce of 2 x ROWS bfloat16 values, 2 ranks


def _checkpoint_rank():
    import torch.distributed as dist

    import gradshare

    rank, world = dist.get_rank(), dist.get_world_size()

    def make():
        torch.manual_seed(0)
        model = _Model()
        return model, gradshare.SharedOptimizer(torch.optim.Adam(model.parameters(), lr=0.05),
                                                compression=gradshare.Dense(), link=None)

    def steps(model, opt, start, stop):
        for step in range(start, stop):
            idx, y = _rows(step, rank, world)
            opt.zero_grad()
            ((model(idx) - y) ** 2).mean().backward()
            opt.step()

    model, opt = make()
    opt.sharing.sparse_moments.every = 7
    steps(model, opt, 0, 15)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})   # as torch.save would hold it
    steps(model, opt, 15, 40)
    straight = model.emb.weight.detach().clone()
    model2, opt2 = make()
    opt2.sharing.sparse_moments.every = 7
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    decided = opt2.sharing.sparse_moments.sparse
    steps(model2, opt2, 15, 40)
    return {"same": bool(torch.equal(straight, model2.emb.weight.detach())), "decided": decided,
            "averaged": opt2.sharing.sparse_moments.averaged}


def test_a_checkpoint_carries_the_decision_and_resumes_bit_for_bit():
    out = run_local(_checkpoint_rank, 2, (), threads=1, timeout=300)
    for r in out:
        assert r["decided"] == [True, False, False]
        assert r["same"]
        # counted over the whole run: the averagings before the checkpoint come with it
        assert r["averaged"] == len([s for s in range(sparse_moments.DETECT_STEPS + 1, 41) if s % 7 == 0])


def test_a_checkpoint_for_other_parameters_is_refused():
    sm = sparse_moments.SparseMoments(torch.optim.Adam([torch.nn.Parameter(torch.zeros(3))]))
    with pytest.raises(ValueError, match="sparse second moments are for 2 parameters, this state holds 3"):
        sm.load_state_dict({"sparse": [True, False], "observed": 10}, 3)
    sm.load_state_dict(None, 3)                                # a checkpoint from before: detected again
    assert sm.sparse is None and sm.observed == 0


@pytest.mark.parametrize("every", [-1, 1.5, True, "50"])
def test_a_bad_period_is_refused(every):
    with pytest.raises(ValueError, match="sparse_moments: expected None or an int >= 0"):
        sparse_moments.SparseMoments(None, every)


def test_only_optimizers_that_divide_by_their_own_mean_square_are_covered():
    p = torch.nn.Parameter(torch.zeros(3))
    for cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop,
                torch.optim.Adagrad, torch.optim.Adadelta):
        assert sparse_moments.SparseMoments(cls([p])).active, cls
    for opt in (torch.optim.SGD([p], lr=0.1), torch.optim.Adamax([p]), None):
        assert not sparse_moments.SparseMoments(opt).active, opt


def test_the_fronts_take_the_period_and_a_pickled_state_keeps_it():
    import pickle

    import gradshare

    p = torch.nn.Parameter(torch.zeros(3))
    assert not gradshare.SharedOptimizer(torch.optim.Adam([p]), sparse_moments=0).sharing.sparse_moments.active
    assert gradshare.SharedOptimizer(torch.optim.Adam([p])).sharing.sparse_moments.every == sparse_moments.EVERY
    state = gradshare.ThresholdState(optimizer=torch.optim.Adam([p]), sparse_moments=7)
    assert state.sharing.sparse_moments.every == 7
    assert pickle.loads(pickle.dumps(state))._config["sparse_moments"] == 7   # (the optimizer is not pickled)
    muon_adamw = [torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1), torch.optim.Adam([p])]
    several = gradshare.ThresholdState(optimizer=muon_adamw, sparse_moments=9)
    assert [sh.sparse_moments.every for sh in several.sharings] == [0, 9]   # SGD keeps no second moment
    with pytest.raises(ValueError, match="sparse_moments"):
        gradshare.SharedOptimizer(torch.optim.Adam([p]), sparse_moments=-3)


def _added_group_rank():
    """A parameter group added after the decision (SharedOptimizer's add_param_group): detected again over all."""
    import torch.distributed as dist

    import gradshare

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _Model()
    extra = torch.nn.Embedding(ROWS, 1)
    torch.nn.init.zeros_(extra.weight)
    opt = gradshare.SharedOptimizer(torch.optim.Adam(model.parameters(), lr=0.05), compression=gradshare.Dense(),
                                    link=None)
    sm = opt.sharing.sparse_moments
    decisions = []
    for step in range(3 * sparse_moments.DETECT_STEPS):
        if step == sparse_moments.DETECT_STEPS + 2:
            opt.add_param_group({"params": [extra.weight]})
        idx, y = _rows(step, rank, world)
        opt.zero_grad()
        out = model(idx) + (extra(idx)[:, 0] if step >= sparse_moments.DETECT_STEPS + 2 else 0)
        ((out - y) ** 2).mean().backward()
        opt.step()
        decisions.append(None if sm.sparse is None else list(sm.sparse))
    return decisions


def test_parameters_added_later_are_detected_again_with_the_others():
    out = run_local(_added_group_rank, 2, (), threads=1, timeout=300)
    assert out[0] == out[1]
    d = out[0]
    detect = sparse_moments.DETECT_STEPS
    assert d[detect - 1] == [True, False, False]
    assert d[detect + 2] is None                             # the added group's first step: counting again
    assert d[2 * detect + 1] == [True, False, False, True]   # ten steps later, the new embedding found sparse too


def _delayed_rank():
    """delay=1: the averaging runs while the step's exchange travels; replicas stay identical after flush()."""
    import torch.distributed as dist

    import gradshare
    from gradshare.replicas import verify_replicas

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _Model()
    opt = gradshare.SharedOptimizer(torch.optim.Adam(model.parameters(), lr=0.05), compression=gradshare.Dense(),
                                    link=None, delay=1, sparse_moments=5)
    for step in range(31):
        idx, y = _rows(step, rank, world)
        opt.zero_grad()
        ((model(idx) - y) ** 2).mean().backward()
        opt.step()
    opt.flush()
    verify_replicas(model)
    st = opt.optimizer.state[model.emb.weight]["exp_avg_sq"]
    return opt.sharing.sparse_moments.sparse, opt.sharing.sparse_moments.averaged, st.numpy().copy()


def test_the_averaging_runs_beside_a_delayed_exchange():
    out = run_local(_delayed_rank, 2, (), threads=1, timeout=300)
    (s0, n0, v0), (s1, n1, v1) = out
    assert s0 == s1 == [True, False, False]
    # With delay=1 a step counts once its exchange has landed: the k-th step() sees k - 1 steps done, so the
    # decision comes at the 10th call (9 done) and averagings at 10, 15, ..., 30 done, the last in the 31st call
    assert n0 == n1 == len([s for s in range(sparse_moments.DETECT_STEPS, 31) if s % 5 == 0])
    assert np.array_equal(v0, v1)            # averaged in the last step(): the same on both ranks
