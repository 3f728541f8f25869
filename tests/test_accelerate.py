"""gradshare.integrations.accelerate.share: Accelerate's DDP with gradshare's hook, on CPU (gloo), training the MNIST
CNN (tiny_model.cnn: MNIST where this machine has it, else the bundled digits)."""
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

accelerate = pytest.importorskip("accelerate")

import gradshare.integrations.accelerate as ga  # noqa: E402  (needs accelerate)
from gradshare import verify_replicas  # noqa: E402
from gradshare.checkpoint import load, write_atomic  # noqa: E402
from gradshare.workers import run_local  # noqa: E402
from tiny_model import (both_paths_link, check_one_line_run, cnn, count_hook_calls,  # noqa: E402
                        first_moment, image_batch, net, one_line_result, residual_of)

STEPS = 18


def test_one_process_shares_nothing():
    accelerator = accelerate.Accelerator(cpu=True)
    model, opt = accelerator.prepare(net(), torch.optim.AdamW(net().parameters()))
    assert ga.share(accelerator, model, opt) is None


def test_the_accelerator_comes_first():
    with pytest.raises(TypeError, match="expected an accelerate.Accelerator"):
        ga.share(net(), net(), None)


def test_a_folder_saved_by_another_number_of_processes_is_refused(tmp_path):
    path = ga.state_file(str(tmp_path), 0)
    write_atomic({"state": {"rank": 0}, "ranks": [{"sharing": {}, "optimizer": {}}]}, path, world_size=2)
    assert ga.read_state(path, 2) == {"sharing": {}, "optimizer": {}}
    with pytest.raises(ValueError, match="state of 2 ranks, this run has 3"):
        ga.read_state(path, 3)


def _train(root, steps, save_at=None, resume=False, calls=None, two=False, **state_kwargs):
    """Trains the MNIST CNN (tiny_model.cnn) for ``steps`` steps on rank-specific batches; save_state(root) after ``save_at`` steps, or
    (resume) load_state(root) first and continue from the step it was saved at."""
    warnings.simplefilter("ignore")
    rank = dist.get_rank()
    accelerator = accelerate.Accelerator(cpu=True)
    model = cnn()
    if two:      # AdamW for the classifier, SGD for the features: both shared
        model, opt, sgd = accelerator.prepare(model, torch.optim.AdamW(model.classifier.parameters(), lr=3e-3),
                                              torch.optim.SGD(model.features.parameters(), lr=0.05, momentum=0.9))
        opts = [opt, sgd]
    else:
        model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
        opts = [opt]
    state = ga.share(accelerator, model, opts if two else opt, **state_kwargs)
    out = {"rank": rank}
    start = 0
    if resume:
        accelerator.load_state(root)
        start = state.step_count
        out["start"] = (residual_of(state.state_dict()), first_moment(opt.state_dict()))
    for step in range(start, steps):
        x, y = image_batch(rank, step)
        for o in opts:
            o.zero_grad()
        accelerator.backward(F.cross_entropy(model(x), y))
        for o in opts:
            o.step()
        if step + 1 == save_at:
            accelerator.save_state(root)
    verify_replicas(model.module)
    out.update(one_line_result(state, calls or [], model.module), residual=residual_of(state.state_dict()))
    return out


def _train_counted(root, steps):
    # share() registers ga.threshold_hook
    return _train(root, steps, calls=count_hook_calls(ga), link=both_paths_link())


@pytest.mark.slow
def test_the_one_line_trains_in_updates_mode_with_identical_replicas(tmp_path):
    res = run_local(_train_counted, 2, (str(tmp_path), STEPS), timeout=120)
    check_one_line_run(res, STEPS, initial=cnn)


def _resume(root, two=False, error_feedback="buffer"):
    # link=None: the link-aware choice times steps, so two runs could take different paths.
    full = _train(root, STEPS, save_at=STEPS // 2, link=None, two=two, error_feedback=error_feedback)
    rank = dist.get_rank()
    saved = load(ga.state_file(root, rank))
    dist.barrier()                   # both ranks have read the folder before the second run loads it
    resumed = _train(root, STEPS, resume=True, link=None, two=two, error_feedback=error_feedback)
    entry = saved.ranks[0]
    return {"full": full, "resumed": resumed, "saved": residual_of(entry["sharing"]),
            "moment": first_moment(entry["optimizers"][0] if two else entry["optimizer"]),
            "world_size": saved.world_size, "saved_step": saved.step}


@pytest.mark.slow
@pytest.mark.parametrize("two, error_feedback", [(False, "buffer"), (True, "buffer"), (False, "model")],
                         ids=["one optimizer", "two optimizers", "what waits in each model"])
def test_load_state_continues_bit_for_bit_with_every_ranks_state(tmp_path, two, error_feedback):
    res = run_local(_resume, 2, (str(tmp_path), two, error_feedback), timeout=150)
    # What makes per-rank files necessary: residuals and AdamW moments differ between the ranks.
    assert not np.array_equal(res[0]["saved"], res[1]["saved"]) and np.abs(res[1]["saved"]).sum() > 0
    assert not np.array_equal(res[0]["moment"], res[1]["moment"])
    for r in res:
        assert r["world_size"] == 2 and r["saved_step"] == STEPS // 2
        residual, moment = r["resumed"]["start"]
        assert np.array_equal(residual, r["saved"])         # each rank restored its own residuals
        assert np.array_equal(moment, r["moment"])          # and its own optimizer state, not rank 0's
        assert r["full"]["step_count"] == r["resumed"]["step_count"] == STEPS
        assert np.array_equal(r["resumed"]["params"], r["full"]["params"])    # bitwise, on every rank
        assert np.array_equal(r["resumed"]["residual"], r["full"]["residual"])
        assert np.array_equal(r["full"]["params"], res[0]["full"]["params"])
