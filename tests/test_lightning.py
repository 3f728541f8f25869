"""gradshare.integrations.lightning.GradshareStrategy: Lightning's Trainer with gradshare's DDP hook, on CPU (gloo),
training the MNIST CNN (tiny_model.cnn: MNIST where this machine has it, else the bundled digits)."""
import glob
import os
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

L = pytest.importorskip("lightning")

import gradshare.integrations.lightning  # noqa: E402  (needs lightning)
from gradshare import ThresholdState, TopK, verify_replicas  # noqa: E402
from gradshare.integrations.lightning import CHECKPOINT_KEY, GradshareStrategy  # noqa: E402
from gradshare.workers import run_local  # noqa: E402
from tiny_model import (both_paths_link, check_one_line_run, cnn, count_hook_calls, first_moment, flat, image_batch,  # noqa: E402
                        net, one_line_result, residual_of)

BATCHES = 6                  # per epoch and rank


class _Module(L.LightningModule):
    def __init__(self, bad_step=None):
        super().__init__()
        self.net = cnn()
        self.bad_step = bad_step

    def training_step(self, batch, i):
        x, y = batch
        if self.global_step == self.bad_step and dist.get_rank() == 1:
            x = x.clone()
            x[0, 0] = float("inf")
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class _StartState(L.Callback):
    """This rank's sharing state when training starts (after Lightning restored any checkpoint)."""

    def on_train_start(self, trainer, module):
        self.state = trainer.strategy.state.state_dict()


def _loader():
    # Different data on every rank, the same on every run: no shuffling, no distributed sampler.
    parts = [image_batch(dist.get_rank(), i) for i in range(BATCHES)]
    x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


def _trainer(strategy, max_steps, callbacks=(), checkpointing=False, root=None):
    return L.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, max_steps=max_steps,
                     callbacks=list(callbacks), enable_checkpointing=checkpointing, default_root_dir=root,
                     logger=False, enable_progress_bar=False, enable_model_summary=False,
                     use_distributed_sampler=False)


# --------------------------------------------------------------------------------------------------
# Constructing the strategy
# --------------------------------------------------------------------------------------------------

def test_keywords_go_to_the_sharing_state_or_to_ddp():
    topk = TopK(0.05)
    s = GradshareStrategy(compression=topk, link=None, nonfinite="skip", find_unused_parameters=True)
    assert s.state_kwargs == {"compression": topk, "link": None, "nonfinite": "skip"}
    assert s._ddp_kwargs == {"find_unused_parameters": True}
    assert s.state is None                     # built when fit sets up
    with pytest.raises(TypeError, match="ddp_comm_hook"):
        GradshareStrategy(ddp_comm_hook=lambda state, bucket: None)


def test_resuming_with_another_number_of_ranks_is_refused():
    strategy = GradshareStrategy(link=None)
    opt = torch.optim.AdamW(net().parameters())
    strategy.state = ThresholdState(optimizer=opt, link=None)
    entry = {"sharing": strategy.state.state_dict(), "optimizer": opt.state_dict()}
    ckpt = {"optimizer_states": [opt.state_dict()], CHECKPOINT_KEY: {"world_size": 2, "ranks": [entry, entry]}}
    with pytest.raises(ValueError, match="state of 2 ranks, this run has 1"):
        strategy.load_optimizer_state_dict(ckpt)


def test_resuming_with_other_optimizers_is_refused():
    strategy = GradshareStrategy(link=None)
    opt = torch.optim.AdamW(net().parameters())
    strategy.state = ThresholdState(optimizer=opt, link=None)
    strategy.optimizers = [opt]
    entry = {"sharing": strategy.state.state_dict(), "optimizers": [opt.state_dict(), opt.state_dict()]}
    ckpt = {"optimizer_states": [opt.state_dict(), opt.state_dict()],
            CHECKPOINT_KEY: {"world_size": 1, "ranks": [entry]}}
    with pytest.raises(ValueError, match="state of 2 optimizer.s. per rank, this run shares 1"):
        strategy.load_optimizer_state_dict(ckpt)


# --------------------------------------------------------------------------------------------------
# Training under Lightning, 2 ranks
# --------------------------------------------------------------------------------------------------

def _fit(state_kwargs, bad_step):
    warnings.simplefilter("ignore")
    calls = count_hook_calls(gradshare.integrations.lightning)    # the strategy registers its threshold_hook
    module = _Module(bad_step)
    strategy = GradshareStrategy(**state_kwargs)
    _trainer(strategy, 3 * BATCHES).fit(module, _loader())
    verify_replicas(module.net)
    return one_line_result(strategy.state, calls, module.net)


@pytest.mark.slow
def test_the_one_line_trains_in_updates_mode_with_identical_replicas():
    res = run_local(_fit, 2, ({"link": both_paths_link()}, None), timeout=120)
    check_one_line_run(res, 3 * BATCHES, initial=cnn)


@pytest.mark.slow
def test_a_nonfinite_gradient_in_the_closure_skips_that_step_everywhere():
    # Lightning runs backward inside optimizer.step(closure): gradshare must see this step's non-finite flag
    # before the optimizer steps, or rank 1's AdamW state takes the Inf and its parameters turn NaN.
    res = run_local(_fit, 2, ({"nonfinite": "skip", "link": None}, 4), timeout=120)
    for r in res:
        assert r["step_count"] == 3 * BATCHES - 1          # Lightning's 18 steps, one of them dropped
        assert np.isfinite(r["params"]).all()
        assert np.array_equal(r["params"], res[0]["params"])


def _fit_model_feedback():
    warnings.simplefilter("ignore")
    module = _Module()
    strategy = GradshareStrategy(link=None, error_feedback="model")
    _trainer(strategy, 3 * BATCHES).fit(module, _loader())
    verify_replicas(module.net)             # between steps every rank shows the mean result
    sh = strategy.state.sharing
    return {"held": float(sum(b.residual.abs().sum() for b in sh.buckets)), "steps": sh.step}


@pytest.mark.slow
def test_what_waits_in_each_model_trains_under_lightning_with_identical_replicas_between_steps():
    for r in run_local(_fit_model_feedback, 2, timeout=120):
        assert r["steps"] == 3 * BATCHES and r["held"] > 0


def _resume(root):
    warnings.simplefilter("ignore")
    from lightning.pytorch.callbacks import ModelCheckpoint

    steps, at = 3 * BATCHES, 2 * BATCHES    # the checkpoint ends an epoch: Lightning resumes at the next one
    # link=None: the link-aware choice times steps, so two runs could take different paths.
    full = _Module()
    first = GradshareStrategy(link=None)
    _trainer(first, steps, [ModelCheckpoint(dirpath=root, every_n_train_steps=at, save_top_k=-1)],
             checkpointing=True, root=root).fit(full, _loader())
    (path,) = glob.glob(os.path.join(root, "*.ckpt"))
    saved = torch.load(path, weights_only=True)           # plain data: Lightning's default load reads it
    again = _Module()
    second = GradshareStrategy(link=None)
    start = _StartState()
    _trainer(second, steps, [start], root=root).fit(again, _loader(), ckpt_path=path)
    verify_replicas(again.net)
    ranks = saved[CHECKPOINT_KEY]["ranks"]
    # numpy, not tensors: tensors would come back through shared memory that ends with this process
    return {"global_step": saved["global_step"], "world_size": saved[CHECKPOINT_KEY]["world_size"],
            "saved": [residual_of(e["sharing"]) for e in ranks],
            "moments": [first_moment(e["optimizer"]) for e in ranks],
            "start": residual_of(start.state), "start_step": start.state["sharing"]["step"],
            "full": (flat(full.net), residual_of(first.state.state_dict()), first.state.step_count),
            "resumed": (flat(again.net), residual_of(second.state.state_dict()), second.state.step_count),
            "rank": dist.get_rank()}


@pytest.mark.slow
def test_fit_from_a_lightning_checkpoint_continues_bit_for_bit(tmp_path):
    res = run_local(_resume, 2, (str(tmp_path),), timeout=150)
    saved = res[0]["saved"]
    assert res[0]["global_step"] == 2 * BATCHES and res[0]["world_size"] == 2
    # What makes per-rank entries necessary: residuals and AdamW moments differ between the ranks.
    assert not np.array_equal(saved[0], saved[1]) and np.abs(saved[1]).sum() > 0
    assert not np.array_equal(*res[0]["moments"])
    for r in res:
        assert np.array_equal(r["start"], saved[r["rank"]])   # each rank restored its own residuals
        assert r["start_step"] == 2 * BATCHES
        params, residual, step_count = r["full"]
        assert step_count == r["resumed"][2] == 3 * BATCHES
        assert np.array_equal(r["resumed"][0], params)       # bitwise, on every rank
        assert np.array_equal(r["resumed"][1], residual)
        assert np.array_equal(params, res[0]["full"][0])


# --------------------------------------------------------------------------------------------------
# Several optimizers (manual optimization): each one's updates shared, every rank's states checkpointed
# --------------------------------------------------------------------------------------------------
class _TwoOptimizers(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = cnn()
        self.automatic_optimization = False

    def training_step(self, batch, i):
        x, y = batch
        features, classifier = self.optimizers()
        features.zero_grad(), classifier.zero_grad()
        loss = F.cross_entropy(self.net(x), y)
        self.manual_backward(loss)
        features.step(), classifier.step()

    def configure_optimizers(self):
        return (torch.optim.SGD(self.net.features.parameters(), lr=0.05, momentum=0.9),
                torch.optim.AdamW(self.net.classifier.parameters(), lr=3e-3))


def _two_resume(root):
    warnings.simplefilter("ignore")
    from lightning.pytorch.callbacks import ModelCheckpoint

    def trainer(strategy, epochs, callbacks=(), checkpointing=False):
        return L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=epochs,
                         callbacks=list(callbacks), enable_checkpointing=checkpointing, default_root_dir=root,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False)

    full, first = _TwoOptimizers(), GradshareStrategy(link=None)
    trainer(first, 3, [ModelCheckpoint(dirpath=root, save_top_k=-1)], checkpointing=True).fit(full, _loader())
    verify_replicas(full.net)
    path = sorted(glob.glob(os.path.join(root, "*.ckpt")))[1]           # after the second epoch
    saved = torch.load(path, weights_only=True)
    again, second = _TwoOptimizers(), GradshareStrategy(link=None)
    trainer(second, 3).fit(again, _loader(), ckpt_path=path)
    verify_replicas(again.net)
    ranks = saved[CHECKPOINT_KEY]["ranks"]
    return {"cores": [type(sh.compression).__name__ for sh in first.state.sharings],
            "steps": ([sh.step for sh in first.state.sharings], [sh.step for sh in second.state.sharings]),
            "uncovered": sum(r.n for r in first.state.stats.history if r.bucket == -1),
            "saved_states": [len(e["optimizers"]) for e in ranks],
            "moments_differ": not np.array_equal(*[first_moment(e["optimizers"][1]) for e in ranks]),
            "full": flat(full.net), "resumed": flat(again.net)}


@pytest.mark.slow
def test_several_optimizers_are_all_shared_and_resume_bit_for_bit(tmp_path):
    res = run_local(_two_resume, 2, (str(tmp_path),), timeout=200)
    for r in res:
        assert r["cores"] == ["TopK", "TopK"]                          # the defaults: the top 5% as signs, each
        assert r["steps"] == ([3 * BATCHES] * 2, [3 * BATCHES] * 2)
        assert r["uncovered"] == 0                                      # every parameter shared compressed
        assert r["saved_states"] == [2, 2]                              # each rank's states of both
        assert r["moments_differ"]                                      # ... which differ between the ranks
        assert np.array_equal(r["resumed"], r["full"])                  # bitwise, on every rank
        assert np.array_equal(r["full"], res[0]["full"])
