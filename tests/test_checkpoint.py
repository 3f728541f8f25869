import os
import random
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.distributed as dist

from gradshare import checkpoint
from gradshare.workers import WorkerError, run_local


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def _draws():
    return (torch.rand(5).tolist(), np.random.rand(5).tolist(), [random.random() for _ in range(5)])


def test_round_trip_restores_model_optimizer_and_plain_values(tmp_path):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    path = checkpoint.save(str(tmp_path), 7, {"model": model, "optimizer": opt, "epoch": 2,
                                               "data_position": (2, 13), "totals": {"steps": 7}})
    assert path == checkpoint.checkpoint_path(str(tmp_path), 7)

    other = _model(seed=1)
    other_opt = torch.optim.Adam(other.parameters(), lr=0.1)
    ck = checkpoint.load(path)
    ck.restore(0, objects={"model": other, "optimizer": other_opt})
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)
    assert other_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    assert torch.equal(other_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert (ck.step, ck.world_size, ck.state["epoch"], ck.state["data_position"], ck.state["totals"]) == \
        (7, 1, 2, (2, 13), {"steps": 7})


def test_rng_round_trip_repeats_the_same_draws(tmp_path):
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    _draws()  # advance away from the seeded state
    path = checkpoint.save(str(tmp_path), 1)
    expected = _draws()
    torch.manual_seed(99), np.random.seed(99), random.seed(99)
    assert _draws() != expected
    checkpoint.load(path).restore(0)
    assert _draws() == expected


def test_keep_last_k(tmp_path):
    for step in range(0, 60, 10):
        checkpoint.save(str(tmp_path), step, {"step": step}, keep_last=2)
    names = [os.path.basename(p) for p in checkpoint.list_checkpoints(str(tmp_path))]
    assert names == ["ckpt-000000040.pt", "ckpt-000000050.pt"]
    assert checkpoint.load(checkpoint.latest(str(tmp_path))).state["step"] == 50
    checkpoint.save(str(tmp_path), 60, keep_last=0)
    assert len(checkpoint.list_checkpoints(str(tmp_path))) == 3


def test_resuming_from_an_older_checkpoint_drops_the_abandoned_newer_ones(tmp_path):
    for step in (10, 20, 30):
        checkpoint.save(str(tmp_path), step, keep_last=5)
    checkpoint.save(str(tmp_path), 15, keep_last=5)  # a run that resumed from step 10
    assert checkpoint.latest(str(tmp_path)) == checkpoint.checkpoint_path(str(tmp_path), 15)


def test_latest_skips_partial_and_unreadable_files(tmp_path):
    d = str(tmp_path)
    assert checkpoint.latest(d) is None
    assert checkpoint.latest(str(tmp_path / "missing")) is None
    good = checkpoint.save(d, 5, {"x": 1})
    with open(checkpoint.checkpoint_path(d, 6), "wb") as f:  # e.g. copied in by a non-atomic tool and cut off
        f.write(open(good, "rb").read()[:100])
    torch.save({"not": "a checkpoint"}, checkpoint.checkpoint_path(d, 7))
    with open(os.path.join(d, ".tmp-ckpt-leftover.pt"), "wb") as f:
        f.write(b"partial")
    assert checkpoint.latest(d) == good
    assert checkpoint.load_latest(d).state == {"x": 1}
    with pytest.raises(ValueError, match="not a readable checkpoint"):
        checkpoint.load(checkpoint.checkpoint_path(d, 6))


def test_failed_replace_leaves_previous_checkpoint_and_no_temporary(tmp_path, monkeypatch):
    d = str(tmp_path)
    checkpoint.save(d, 1, {"v": 1})

    def broken_replace(src, dst):
        raise OSError("disk gone")

    monkeypatch.setattr(checkpoint.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk gone"):
        checkpoint.save(d, 2, {"v": 2})
    monkeypatch.undo()
    assert sorted(os.listdir(d)) == ["ckpt-000000001.pt"]
    assert checkpoint.load_latest(d).state == {"v": 1}


_KILLED_WRITER = textwrap.dedent("""
    import os, signal, sys, torch
    from gradshare import checkpoint
    d = sys.argv[1]
    checkpoint.save(d, 1, {"weights": torch.full((1000,), 1.0)})
    real_save = torch.save
    def dying_save(obj, f):
        # Write half of the real bytes, make sure they reach the file, then die without any cleanup.
        import io
        buf = io.BytesIO(); real_save(obj, buf)
        data = buf.getvalue()
        f.write(data[: len(data) // 2]); f.flush(); os.fsync(f.fileno())
        print("dying", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    torch.save = dying_save
    checkpoint.save(d, 2, {"weights": torch.full((1000,), 2.0)})
    print("unreachable", flush=True)
""")


def test_sigkill_during_save_leaves_previous_checkpoint_loadable(tmp_path):
    d = str(tmp_path)
    proc = subprocess.run([sys.executable, "-c", _KILLED_WRITER, d], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert "dying" in proc.stdout and "unreachable" not in proc.stdout
    leftovers = [n for n in os.listdir(d) if n.startswith(".tmp-ckpt-")]
    assert len(leftovers) == 1 and os.path.getsize(os.path.join(d, leftovers[0])) > 0
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(d)] == ["ckpt-000000001.pt"]
    ck = checkpoint.load_latest(d)
    assert ck.step == 1 and torch.equal(ck.state["weights"], torch.full((1000,), 1.0))
    checkpoint.save(d, 2, {"weights": torch.full((1000,), 2.0)})  # the next save cleans up the leftover
    assert not [n for n in os.listdir(d) if n.startswith(".tmp-ckpt-")]
    assert checkpoint.load_latest(d).step == 2


def _save_per_rank(directory):
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)
    residual = torch.full((3,), float(rank))
    path = checkpoint.save(directory, 4, {"shared": torch.arange(3.0)}, {"residual": residual, "rank": rank})
    expected = torch.rand(2).tolist()
    torch.manual_seed(0)
    ck = checkpoint.load(path)
    ck.restore(rank)
    mine = ck.rank_state(rank)
    return path, ck.world_size, mine["rank"], mine["residual"].tolist(), torch.rand(2).tolist() == expected


def _save_into_a_file(path):
    checkpoint.save(path, 1, {"x": 1})


@pytest.mark.slow
def test_collective_save_gathers_every_ranks_state(tmp_path):
    d = str(tmp_path)
    out = run_local(_save_per_rank, 2, (d,), timeout=120, collective_timeout=60)
    assert out[0][0] == out[1][0] == checkpoint.checkpoint_path(d, 4)
    assert [o[1:] for o in out] == [(2, 0, [0.0] * 3, True), (2, 1, [1.0] * 3, True)]
    ck = checkpoint.load(out[0][0])
    assert torch.equal(ck.state["shared"], torch.arange(3.0))
    with pytest.raises(ValueError, match="world size 2"):
        ck.rank_state(2)


@pytest.mark.slow
def test_write_failure_on_rank_0_raises_on_every_rank(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(WorkerError, match="was not written") as info:
        run_local(_save_into_a_file, 2, (str(blocker),), timeout=120, collective_timeout=60)
    assert "Error" in info.value.detail
