"""bench/quality.py's command line: the contenders it is given are the ones it runs."""
import os
import sys

import pytest

# After the installed packages: bench/kernels.py must not hide Hugging Face's `kernels`, which transformers imports.
sys.path.append(os.path.join(os.path.dirname(__file__), "..", "bench"))
quality = pytest.importorskip("quality")


def test_contenders_split_on_commas_outside_brackets_or_on_semicolons():
    one = 'gs:{"optimizer":opt,"compression":TopK(0.01,chunk=4096,warmup_steps=0),"link":None}'
    assert quality.split_contenders(one) == [one]                 # the README's example: one contender
    assert quality.split_contenders(f"ddp,{one},gradshare") == ["ddp", one, "gradshare"]
    assert quality.split_contenders("ddp;la:{'frequency':4}") == ["ddp", "la:{'frequency':4}"]
    assert quality.split_contenders("ddp,,gradshare") == ["ddp", "gradshare"]


def test_the_regression_workload_is_judged_by_squared_error_to_noiseless_targets():
    import torch

    workloads = pytest.importorskip("workloads")
    data = workloads.Data("regression", seed=0)
    x0, y0 = data.batch(5, rank=0, world=2, size=32)
    x1, _ = data.batch(5, rank=1, world=2, size=32)
    assert x0.shape == (32, 16) and y0.shape == (32, 4)
    assert not torch.equal(x0, x1)                                   # each rank its own samples
    assert torch.equal(data.batch(5, 0, 2, 32)[0], x0)               # the same on every run
    assert not torch.equal(workloads.Data("regression", seed=1).batch(5, 0, 2, 32)[0], x0)
    noise = y0 - x0 @ data.map
    assert 0.05 < float(noise.std()) < 0.2                           # targets carry noise 0.1
    assert float(data.loss(x0 @ data.map, y0)) == pytest.approx(float((noise ** 2).mean()))

    class Exact(torch.nn.Module):                                    # the map itself: no error left to judge
        def forward(self, x):
            return x @ data.map

    class Zero(torch.nn.Module):
        def forward(self, x):
            return torch.zeros(len(x), 4)

    assert data.evaluate(Exact()) < 1e-10
    assert data.evaluate(Zero()) == pytest.approx(float((data.valid[1] ** 2).mean()))
    model = workloads.WORKLOADS["regression"].model()
    assert sum(p.numel() for p in model.parameters()) == 16 * 256 + 256 + 256 * 256 + 256 + 256 * 4 + 4


def test_the_copy_workload_asks_for_the_previous_token_and_judges_held_out_sequences():
    import torch

    workloads = pytest.importorskip("workloads")
    data = workloads.Data("copy_lstm", seed=0)
    x0, y0 = data.batch(3, rank=0, world=2, size=16)
    x1, _ = data.batch(3, rank=1, world=2, size=16)
    assert x0.shape == y0.shape == (16, workloads.COPY_LENGTH)
    assert torch.equal(y0[:, 1:], x0[:, :-1]) and not y0[:, 0].any()   # each target the token before
    assert not torch.equal(x0, x1) and torch.equal(data.batch(3, 0, 2, 16)[0], x0)
    assert not torch.equal(workloads.Data("copy_lstm", seed=1).batch(3, 0, 2, 16)[0], x0)
    assert torch.equal(workloads.Data("copy_lstm", seed=1).valid[0], data.valid[0])   # one held-out set

    class Oracle(torch.nn.Module):                                       # the exact answer: no loss left
        def forward(self, x):
            prev = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], 1)
            return 100.0 * torch.nn.functional.one_hot(prev, workloads.COPY_VOCAB).float()

    assert data.evaluate(Oracle()) < 1e-6
    model = workloads.WORKLOADS["copy_lstm"].model()
    assert model(x0).shape == (16, workloads.COPY_LENGTH, workloads.COPY_VOCAB)
    assert model.head.weight is model.emb.weight                         # tied


def test_the_vision_transformer_recipe_warms_up_then_decays_and_spares_norms_from_weight_decay():
    import torch

    workloads = pytest.importorskip("workloads")
    wl = workloads.WORKLOADS["vit_mnist"]
    model = wl.model()
    assert model(torch.randn(5, 1, 28, 28)).shape == (5, 10)
    opt = wl.optimizer(model.parameters())
    decayed, spared = opt.param_groups
    assert decayed["weight_decay"] == 0.05 and spared["weight_decay"] == 0.0
    assert {id(p) for p in decayed["params"]} == {id(p) for p in model.parameters() if p.ndim == 2}
    assert any(p is model.cls for p in spared["params"]) and any(p is model.pos for p in spared["params"])
    lr0 = decayed["lr"]
    sched = quality._cosine(opt, wl.steps, wl.warmup)
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(wl.steps - 1):
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs[0] == pytest.approx(lr0 / wl.warmup)                            # from ~0 ...
    assert lrs[wl.warmup - 1] == pytest.approx(lr0)                            # ... up to the peak over the warm-up
    assert all(a < b for a, b in zip(lrs[:wl.warmup - 1], lrs[1:wl.warmup]))
    assert all(a >= b for a, b in zip(lrs[wl.warmup:], lrs[wl.warmup + 1:]))  # then down along the cosine
    assert lrs[-1] < 1e-3 * lr0
    assert quality._cosine(opt, 10).__class__ is torch.optim.lr_scheduler.CosineAnnealingLR   # no warm-up: as before
    # label smoothing in the training loss only: a confident right answer still costs something
    data = workloads.Data.__new__(workloads.Data)
    data.workload = "vit_mnist"
    sure = torch.full((1, 10), -30.0)
    sure[0, 3] = 30.0
    assert float(data.loss(sure, torch.tensor([3]))) > 0.1


def test_the_recommender_draws_pairs_by_popularity_and_is_judged_by_squared_error_to_noiseless_ratings():
    import torch

    workloads = pytest.importorskip("workloads")
    wl = workloads.WORKLOADS["recommender"]
    model = wl.model()
    assert sum(p.numel() for p in model.parameters()) == 99_000
    data = workloads.Data("recommender", seed=0)
    x0, y0 = data.batch(5, 0, 2, wl.batch)
    x1, _ = data.batch(5, 1, 2, wl.batch)
    assert x0.shape == (wl.batch, 2) and y0.shape == (wl.batch,)
    assert torch.equal(x0, workloads.Data("recommender", seed=0).batch(5, 0, 2, wl.batch)[0])   # reproducible
    assert not torch.equal(x0, x1)                                                           # ranks differ
    assert not torch.equal(x0, workloads.Data("recommender", seed=1).batch(5, 0, 2, wl.batch)[0])
    # Popular items far more often than rare ones: a step's gradient touches few rows of the tables
    items = torch.cat([data.batch(s, 0, 1, wl.batch)[0][:, 1] for s in range(200)])
    counts = torch.bincount(items, minlength=1000)
    assert counts[:10].float().mean() > 30 * counts[-100:].float().mean()   # about 100x by the weights
    assert len(torch.unique(x0[:, 0])) < 0.05 * 2000
    # judged by squared error to the noiseless ratings: the hidden model itself scores 0, the zero model their variance
    x, y = data.valid
    with torch.no_grad():
        assert data.evaluate(model) == pytest.approx(float(((model(x) - y) ** 2).mean()), rel=1e-6)
    with torch.no_grad():
        for e in (model.user, model.item, model.user_bias, model.item_bias):
            e.weight.zero_()
    assert data.evaluate(model) == pytest.approx(float((y ** 2).mean()), rel=1e-6)
    assert float(data.loss(y, y)) == 0.0
