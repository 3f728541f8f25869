import copy
import os
import shutil

import pytest
import torch
import torch.distributed as dist

from gradshare import cluster
from gradshare.checkpoint import list_checkpoints
from gradshare.data import load_digits
from gradshare.loop import TrainConfig, train_rank
from gradshare.models import SmallCNN
from gradshare.train import train_job
from gradshare.workers import run_local

pytestmark = pytest.mark.slow


def _config(mode, **kw):
    torch.manual_seed(0)
    tr, te = load_digits(seed=0)
    sub = torch.utils.data.TensorDataset(*(t[:400] for t in tr.tensors))
    return TrainConfig(model=SmallCNN(), optimizer=(torch.optim.Adam, {"lr": 3e-3}), train_data=sub,
                       validation_data=te, epochs=2, batch_size=32, mode=mode, progress=False, **kw)


def _flat(model_state):
    return torch.cat([v.reshape(-1).float() for v in model_state.values()])


def _resume_matches_uninterrupted(mode, stop_at):
    """Train 2 epochs while snapshotting at step `stop_at` (mid-epoch 2), then resume from the snapshot."""
    snaps = {}

    def on_step(ts):
        if ts.step == stop_at:
            snaps["state"] = copy.deepcopy(ts.state_dict())

    # link=None: compressed at every step, so that a resumed run repeats an uninterrupted one bit for bit (at
    # step 10 of 14 the link-aware default may still be measuring, and its measurements follow timings)
    full = train_rank(_config(mode, on_step=on_step, link=None))
    resumed = train_rank(_config(mode, resume=snaps["state"], link=None))
    same_hist = [h["loss"] for h in full["history"]] == [h["loss"] for h in resumed["history"]]
    model_equal = None
    if dist.get_rank() == 0:
        model_equal = torch.equal(_flat(full["state"]), _flat(resumed["state"]))
    return snaps["state"]["epoch"], snaps["state"]["batch"], same_hist, model_equal, len(resumed["steps"])


def _both_modes(stop_at):
    return {m: _resume_matches_uninterrupted(m, stop_at) for m in ("shared_gradients", "averaging")}


@pytest.fixture(scope="module")
def resumed_runs():
    # 400 samples, 2 ranks, batch 32: 7 steps per epoch; step 10 is batch 3 of epoch 2
    return run_local(_both_modes, 2, (10,), timeout=300)


@pytest.mark.parametrize("mode", ["shared_gradients", "averaging"])
def test_resume_mid_epoch_reproduces_the_uninterrupted_run(resumed_runs, mode):
    out = [r[mode] for r in resumed_runs]
    for epoch, batch, same_hist, model_equal, resumed_steps in out:
        assert (epoch, batch) == (1, 3)
        assert same_hist
        assert resumed_steps == 14 - 10
    assert out[0][3] is True


def _cluster_job(ckdir, opts):
    return cluster.run(train_job, opts, checkpoint_dir=ckdir, checkpoint_every=10)


def _resumed_exactly(tmp_path, opts, at=40, steps=46):
    full = run_local(_cluster_job, 2, (str(tmp_path / "full"), opts), timeout=300)[0]
    shutil.copytree(tmp_path / "full", tmp_path / "resume")
    kept = list_checkpoints(str(tmp_path / "resume"))
    assert os.path.basename(kept[-1]) == f"ckpt-{at:09d}.pt"
    for p in kept[:-1]:
        os.remove(p)                                                           # keep that one only
    again = run_local(_cluster_job, 2, (str(tmp_path / "resume"), opts), timeout=300)[0]
    assert len(again["steps"]) == steps - at
    assert [h["loss"] for h in again["history"]] == [h["loss"] for h in full["history"]]
    assert again["history"][-1]["val_accuracy"] == full["history"][-1]["val_accuracy"]
    return full


def test_shared_updates_held_back_in_each_model_resume_exactly(tmp_path):
    # --error-feedback model: the ranks' models differ inside a step by what each holds back; the checkpoint keeps
    # each one's state
    opts = {"epochs": 2, "progress": False, "mode": "shared_gradients", "error_feedback": "model",
            "compression": "topk_sign:0.05", "link": "off"}
    full = _resumed_exactly(tmp_path, opts)
    assert 0 < full["history"][-1]["bytes_sent"] < full["history"][-1]["dense_bytes"] / 10


@pytest.mark.parametrize("mode, streaming", [("diloco", {}), ("sparse_local", {}),
                                             ("diloco", {"fragments": 2, "overlap": 1}),
                                             ("sparse_local", {"fragments": 2, "overlap": 1})],
                         ids=["diloco", "sparse_local", "diloco_streaming", "sparse_local_streaming"])
def test_local_steps_resume_from_a_mid_round_checkpoint_exactly(tmp_path, mode, streaming):
    # a round every 3 steps (and at each epoch's end: 23 steps): the step-40 checkpoint is mid-round (streaming:
    # fragment 1's round, sent after step 40, still travels)
    opts = {"epochs": 2, "progress": False, "mode": mode, "frequency": 3, **streaming}
    full = run_local(_cluster_job, 2, (str(tmp_path / "full"), opts), timeout=300)[0]
    shutil.copytree(tmp_path / "full", tmp_path / "resume")
    kept = list_checkpoints(str(tmp_path / "resume"))
    assert os.path.basename(kept[-1]) == "ckpt-000000040.pt"
    for p in kept[:-1]:
        os.remove(p)                                                           # keep step 40 only
    again = run_local(_cluster_job, 2, (str(tmp_path / "resume"), opts), timeout=300)[0]
    assert len(again["steps"]) == 46 - 40
    assert [h["loss"] for h in again["history"]] == [h["loss"] for h in full["history"]]
    assert again["history"][-1]["val_accuracy"] == full["history"][-1]["val_accuracy"]
    assert full["history"][-1]["bytes_sent"] > 0 and full["history"][-1]["density"] is not None


def test_train_job_under_cluster_run_checkpoints_and_resumes(tmp_path):
    opts = {"epochs": 2, "progress": False}
    first = run_local(_cluster_job, 2, (str(tmp_path), opts), timeout=300)[0]
    ckpts = list_checkpoints(str(tmp_path))
    assert [os.path.basename(p) for p in ckpts][-1] == "ckpt-000000040.pt"     # 46 steps, every 10
    again = run_local(_cluster_job, 2, (str(tmp_path), opts), timeout=300)[0]
    assert len(again["steps"]) == 46 - 40                                      # only the rest was trained
    assert again["history"][0] == first["history"][0]                          # the first epoch's, restored
    # The defaults are link-aware: after the restart the link's measurements under way are timed afresh, so the
    # steps' paths (the density, the all-reduce's precision) may differ from the run that went on; a run that
    # repeats bit for bit compresses every step (test_shared_updates_held_back_in_each_model_resume_exactly).
    assert again["history"][-1]["loss"] == pytest.approx(first["history"][-1]["loss"], rel=0.02)
    assert abs(again["history"][-1]["val_accuracy"] - first["history"][-1]["val_accuracy"]) < 0.02
