"""gradshare.integrations.transformers: the Hugging Face Trainer with gradshare's DDP hook, on CPU (gloo), training
the MNIST CNN (tiny_model.cnn: MNIST where this machine has it, else the bundled digits)."""
import io
import os
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import gradshare.integrations.transformers as gt  # noqa: E402  (needs transformers)
from gradshare import verify_replicas  # noqa: E402
from gradshare.workers import run_local  # noqa: E402
from tiny_model import (both_paths_link, check_one_line_run, cnn, count_hook_calls, first_moment, flat, images,  # noqa: E402
                        one_line_result, residual_of)

BATCH = 16
STEPS_PER_EPOCH = 6            # per rank: the Trainer's sampler gives each rank its own share of the data


class _Model(nn.Module):
    """The MNIST CNN (tiny_model.cnn) returning what the Trainer reads: a dict with the loss."""

    def __init__(self):
        super().__init__()
        self.net = cnn()

    def forward(self, x, labels):
        logits = self.net(x)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


class _Data(torch.utils.data.Dataset):
    def __init__(self, n):
        x, y = images()
        self.x, self.y = x[:n], y[:n]

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class _StartState(transformers.TrainerCallback):
    """This rank's sharing and optimizer state when training begins (after gradshare restored its own)."""

    def __init__(self, gradshare_callback):
        self.gs = gradshare_callback

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        self.residual = residual_of(self.gs.state.state_dict())
        self.sharing_step = self.gs.state.step_count
        self.moment = first_moment(optimizer.state_dict())


def _trainer(root, max_steps, save_steps=None, **state_kwargs):
    world = dist.get_world_size() if dist.is_initialized() else 1
    args = transformers.TrainingArguments(
        output_dir=root, use_cpu=True, ddp_backend="gloo" if world > 1 else None, report_to=[], max_steps=max_steps,
        per_device_train_batch_size=BATCH, learning_rate=3e-3, lr_scheduler_type="constant", warmup_steps=0,
        optim="adamw_torch", save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        logging_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0)
    trainer = transformers.Trainer(model=_Model(), args=args,
                                   train_dataset=_Data(BATCH * STEPS_PER_EPOCH * world))
    return trainer, gt.share(trainer, **state_kwargs)


def test_the_callback_needs_the_trainer_and_sharing_options(tmp_path):
    with pytest.raises(TypeError, match="expected the transformers.Trainer"):
        gt.GradshareCallback(None)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    trainer = transformers.Trainer(model=_Model(), args=args)
    with pytest.raises(TypeError, match="bucket_cap not ThresholdState options"):
        gt.share(trainer, bucket_cap=1)
    cb = gt.share(trainer, link=None)
    assert cb in trainer.callback_handler.callbacks and cb.state is None   # built when training begins


def test_one_process_trains_without_sharing(tmp_path):
    trainer, cb = _trainer(str(tmp_path), 2)
    trainer.train()
    assert cb.state is None and not np.array_equal(flat(trainer.model.net), flat(cnn()))


def test_resuming_with_another_number_of_processes_is_refused(tmp_path):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    cb = gt.GradshareCallback(transformers.Trainer(model=_Model(), args=args))
    with pytest.raises(ValueError, match="state of 2 ranks, this run has 3"):
        cb._restore({"world_size": 2, "step": 1, "ranks": [b"", b""]}, 3, 0)


def _train(root):
    warnings.simplefilter("ignore")
    calls = count_hook_calls(gt)          # the callback registers gt.threshold_hook
    trainer, cb = _trainer(root, 3 * STEPS_PER_EPOCH, link=both_paths_link())
    trainer.train()
    verify_replicas(trainer.model.net)
    return one_line_result(cb.state, calls, trainer.model.net)


@pytest.mark.slow
def test_one_line_trains_in_updates_mode_with_identical_replicas(tmp_path):
    res = run_local(_train, 2, (str(tmp_path),), timeout=150)
    check_one_line_run(res, 3 * STEPS_PER_EPOCH, initial=cnn)


def _resume(root, at, steps):
    warnings.simplefilter("ignore")
    # link=None: the link-aware choice times steps, so two runs could take different paths.
    first, cb = _trainer(root, steps, save_steps=at, link=None)
    first.train()
    ckpt = os.path.join(root, f"checkpoint-{at}")
    saved = torch.load(os.path.join(ckpt, "optimizer.pt"), weights_only=True)   # the Trainer's own load
    entries = saved["param_groups"][0][gt.CHECKPOINT_KEY]
    mine = [torch.load(io.BytesIO(b), weights_only=True) for b in entries["ranks"]]
    dist.barrier()               # both ranks have read the checkpoint before the second run resumes from it
    second, cb2 = _trainer(root, steps, link=None)
    start = _StartState(cb2)
    second.add_callback(start)   # after gradshare's callback: sees what it restored
    second.train(resume_from_checkpoint=ckpt)
    verify_replicas(second.model.net)
    return {"rank": dist.get_rank(), "world_size": entries["world_size"], "saved_step": entries["step"],
            "saved": [residual_of(e["sharing"]) for e in mine], "moments": [first_moment(e["optimizer"]) for e in mine],
            "start": (start.residual, start.moment, start.sharing_step),
            "full": (flat(first.model.net), residual_of(cb.state.state_dict()), cb.state.step_count),
            "resumed": (flat(second.model.net), residual_of(cb2.state.state_dict()), cb2.state.step_count)}


@pytest.mark.parametrize("at", [STEPS_PER_EPOCH, STEPS_PER_EPOCH + 2], ids=["epoch_end", "mid_epoch"])
@pytest.mark.slow
def test_resume_from_checkpoint_continues_bit_for_bit(tmp_path, at):
    steps = 2 * STEPS_PER_EPOCH
    res = run_local(_resume, 2, (str(tmp_path), at, steps), timeout=150)
    saved = res[0]["saved"]
    assert res[0]["world_size"] == 2 and res[0]["saved_step"] == at
    # What makes per-rank entries necessary: residuals and AdamW moments differ between the ranks.
    assert not np.array_equal(saved[0], saved[1]) and np.abs(saved[1]).sum() > 0
    assert not np.array_equal(*res[0]["moments"])
    for r in res:
        residual, moment, sharing_step = r["start"]
        assert np.array_equal(residual, saved[r["rank"]])            # each rank restored its own residuals
        assert np.array_equal(moment, res[0]["moments"][r["rank"]])  # and its own optimizer state
        assert sharing_step == at
        params, residual, step_count = r["full"]
        assert step_count == r["resumed"][2] == steps
        assert np.array_equal(r["resumed"][0], params)             # bitwise, on every rank
        assert np.array_equal(r["resumed"][1], residual)
        assert np.array_equal(params, res[0]["full"][0])
