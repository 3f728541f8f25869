import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

import cluster_job
from conftest import MNIST_DIR, have_mnist
from gradshare import checkpoint, cluster
from gradshare.workers import run_local

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "cluster_job.py")
DATA = "mnist:" + MNIST_DIR if have_mnist() else "synthetic"
# 2048 rows, global batch 32: 64 steps an epoch. The run crosses an epoch; the kill (step 75) is mid-epoch.
FAULT_CONFIG = {"data": DATA, "steps": 100, "batch": 16, "lr": 0.05, "seed": 1}

needs_torchrun = pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")


def _torchrun(tmp_path, config, *, max_restarts, checkpoint_every=10, timeout=120, extra=()):
    result = tmp_path / "result.json"
    cmd = ["torchrun", "--standalone", "--nproc_per_node=2", f"--max-restarts={max_restarts}",
           "-m", "gradshare.cluster", f"{JOB}:train", "--config", json.dumps(config),
           "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", str(checkpoint_every),
           "--result", str(result), *extra]
    proc = run_bounded(cmd, timeout, cwd=HERE)
    out = json.loads(result.read_text()) if proc.returncode == 0 else None
    return proc, out


def run_bounded(cmd, timeout, **kwargs):
    """subprocess.run in a session of its own; on timeout the whole process group is killed (no orphans)."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                          **kwargs) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            pytest.fail(f"{cmd[0]} did not finish within {timeout} s (a hang):\n{err[-4000:]}")
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


@pytest.fixture(scope="module")
def reference():
    return cluster_job.reference(FAULT_CONFIG)


def test_load_function_accepts_modules_and_files():
    assert cluster.load_function("gradshare.checkpoint:latest") is checkpoint.latest
    assert cluster.load_function(f"{JOB}:train").__name__ == "train"
    with pytest.raises(ValueError, match="MODULE:FUNCTION"):
        cluster.load_function("no_colon")


def test_should_save_every_n_steps_but_not_the_resumed_one():
    resumed = checkpoint.Checkpoint(path="x", step=20, world_size=1, state={})
    ctx = cluster.Context(rank=0, world_size=1, local_rank=0, restart_count=1, checkpoint_dir="d",
                          checkpoint_every=10, keep_last=3, resumed=resumed)
    assert [s for s in range(0, 41) if ctx.should_save(s)] == [10, 30, 40]
    assert ctx.start_step == 20
    ctx.checkpoint_dir = None
    assert not any(ctx.should_save(s) for s in range(41))


def test_without_a_launcher_runs_as_a_world_of_one(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    cmd = [sys.executable, "-m", "gradshare.cluster", f"{JOB}:train", "--config", json.dumps({"steps": 12}),
           "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "5", "--result",
           str(tmp_path / "r.json")]
    proc = run_bounded(cmd, 60, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((tmp_path / "r.json").read_text())
    assert out["world_size"] == 1 and out["stats"]["steps"] == 12
    assert checkpoint.load_latest(str(tmp_path / "ckpt")).step == 10


def _rank_and_config(config, ctx):
    return {"rank": ctx.rank, "config": config}


@pytest.mark.slow
def test_every_rank_returns_rank_0s_result():
    out = run_local(cluster.run, 2, (_rank_and_config, {"a": 1}), timeout=60, collective_timeout=30)
    assert out == [{"rank": 0, "config": {"a": 1}}] * 2


def _restore_into_fresh_model(config, ctx):
    import torch
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.zero_()
    with pytest.warns(UserWarning, match="written by 2 ranks, this run has 1"):
        restored = ctx.restore(objects={"model": model}, rank_objects={"residual": torch.nn.Linear(2, 1)})
    return restored, ctx.start_step, ctx.rank_state(), model.weight.tolist()


def test_world_size_change_restores_shared_state_only(tmp_path, world_of_one):
    import torch
    source = torch.nn.Linear(2, 1)
    checkpoint.write_atomic({"state": {"model": source.state_dict()}, "ranks": [{"residual": None}, {"residual": None}]},
                            checkpoint.checkpoint_path(str(tmp_path), 30), step=30, world_size=2)
    restored, start, mine, weight = cluster.run(_restore_into_fresh_model, None, checkpoint_dir=str(tmp_path),
                                                collective_timeout=30)
    assert (restored, start, mine) == (True, 30, None)
    assert weight == source.weight.tolist()


@pytest.mark.slow
def test_resume_continues_exactly(tmp_path, reference):
    """30 steps, stop, then a new run to 100 from the step-30 checkpoint equals the uninterrupted run."""
    run = functools.partial(cluster.run, checkpoint_dir=str(tmp_path), checkpoint_every=10)
    first = run_local(run, 2, (cluster_job.train, dict(FAULT_CONFIG, steps=30)), timeout=120)[0]
    assert first["resumed_from"] is None
    second = run_local(run, 2, (cluster_job.train, FAULT_CONFIG), timeout=120)[0]
    assert second["resumed_from"] == 30
    assert second["params"] == reference["params"]
    assert second["stats"] == reference["stats"]


@pytest.mark.slow
@needs_torchrun
def test_torchrun_restart_after_sigkill_resumes_from_checkpoint(tmp_path, reference):
    log = tmp_path / "attempts.log"
    config = dict(FAULT_CONFIG, kill_at_step=75, kill_rank=1, attempt_log=str(log))
    proc, out = _torchrun(tmp_path, config, max_restarts=2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "exitcode  : -9" in proc.stderr or "exitcode: -9" in proc.stderr  # the worker really was SIGKILLed
    assert out["restart_count"] == 1 and out["resumed_from"] == 70
    # Steps 70..74 ran twice (before the kill and after the restart) but are counted once.
    lines = log.read_text().split()
    assert "step=74" in lines and lines.count("step=74") == 4  # 2 ranks x 2 attempts
    assert out["stats"]["steps_seen"] == list(range(100))
    assert out["stats"]["steps"] == 100 and out["stats"]["samples"] == 100 * 32
    assert out["params"] == reference["params"]  # bitwise: model, momentum, dropout RNG and data order restored
    assert abs(out["accuracy"] - reference["accuracy"]) <= 0.005
    kept = [os.path.basename(p) for p in checkpoint.list_checkpoints(str(tmp_path / "ckpt"))]
    assert kept == ["ckpt-000000080.pt", "ckpt-000000090.pt", "ckpt-000000100.pt"]


# Local steps (DiLoCo outer Nesterov on a top-k error-feedback pseudo-gradient): a round every 4 steps, so the
# step-70 checkpoint is taken mid-round, while the replicas differ.
LOCAL_CONFIG = dict(FAULT_CONFIG, local={"frequency": 4, "outer_lr": 0.7, "outer_momentum": 0.9, "density": 0.25,
                                         "residual_decay": 0.9})


# Streaming: two fragments, fragment 1's round sent after step 70 (2 + 4k) still travels at the checkpoint.
STREAMING_CONFIG = dict(FAULT_CONFIG, local=dict(LOCAL_CONFIG["local"], fragments=2, overlap=1))
# What a round does not send kept in each rank's own model (no outer optimizer, no decay): the replicas differ
# at every step, by what each holds back.
MODEL_FEEDBACK_CONFIG = dict(FAULT_CONFIG, local={"frequency": 4, "density": 0.25, "error_feedback": "model"})


@pytest.mark.slow
@needs_torchrun
@pytest.mark.parametrize("config", [LOCAL_CONFIG, STREAMING_CONFIG, MODEL_FEEDBACK_CONFIG],
                         ids=["rounds", "streaming", "error_feedback_model"])
def test_torchrun_restart_after_sigkill_resumes_local_steps_exactly(tmp_path, config):
    ref = cluster_job.reference(config)
    proc, out = _torchrun(tmp_path, dict(config, kill_at_step=75, kill_rank=1), max_restarts=2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "exitcode  : -9" in proc.stderr or "exitcode: -9" in proc.stderr
    assert out["restart_count"] == 1 and out["resumed_from"] == 70
    assert out["stats"]["steps_seen"] == list(range(100))
    # bitwise: each rank's own model, inner momentum, residual, round start and outer momentum restored
    assert out["params"] == ref["params"]


@pytest.mark.slow
@needs_torchrun
def test_torchrun_dead_peer_without_restarts_fails_fast(tmp_path):
    t0 = time.monotonic()
    proc, _ = _torchrun(tmp_path, dict(FAULT_CONFIG, steps=40, kill_at_step=5), max_restarts=0, timeout=90)
    assert proc.returncode != 0
    # Fast: far inside the 300 s collective timeout. Whichever comes first names the fault: the survivor's
    # gloo error for the closed connection, or torchrun's report of the killed worker (it then stops the rest).
    assert time.monotonic() - t0 < 60
    assert any(s in proc.stderr for s in ("Connection closed by peer", "Connection reset by peer",
                                          "Signal 9 (SIGKILL) received")), proc.stderr[-3000:]


@pytest.mark.slow
@needs_torchrun
def test_torchrun_stuck_peer_ends_with_a_timeout_not_a_hang(tmp_path):
    proc, _ = _torchrun(tmp_path, dict(FAULT_CONFIG, steps=40, hang_at_step=5), max_restarts=0, timeout=90,
                        extra=("--collective-timeout", "10"))
    assert proc.returncode != 0
    assert "timed out" in proc.stderr.lower() or "timeout" in proc.stderr.lower(), proc.stderr[-3000:]
