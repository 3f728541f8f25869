import io
import os
import random
import signal
import subprocess
import sys
import textwrap
import warnings

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


def test_pruning_never_deletes_a_newer_checkpoint(tmp_path):
    # A run that resumed from step 10 (say 20 and 30 could not be read for a moment) saves 15: pruning keeps
    # the newest two up to 15 and leaves 20 and 30 alone, so a later restart can still read them.
    for step in (5, 10, 20, 30):
        checkpoint.save(str(tmp_path), step, keep_last=5)
    checkpoint.save(str(tmp_path), 15, keep_last=2)
    names = [os.path.basename(p) for p in checkpoint.list_checkpoints(str(tmp_path))]
    assert names == ["ckpt-000000010.pt", "ckpt-000000015.pt", "ckpt-000000020.pt", "ckpt-000000030.pt"]
    assert checkpoint.latest(str(tmp_path)) == checkpoint.checkpoint_path(str(tmp_path), 30)


def test_transient_read_error_deletes_no_good_checkpoint(tmp_path, monkeypatch):
    d = str(tmp_path)
    for step in (10, 20):
        checkpoint.save(d, step, {"step": step}, keep_last=1)
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(d)] == ["ckpt-000000020.pt"]
    newest = checkpoint.checkpoint_path(d, 20)
    checkpoint.save(d, 10, {"step": 10}, keep_last=1)       # (re)written by a run that could not read 20
    real_open = open

    def flaky_open(path, *a, **k):
        if os.path.abspath(str(path)) == os.path.abspath(newest):
            raise OSError(5, "Input/output error")
        return real_open(path, *a, **k)

    monkeypatch.setattr("builtins.open", flaky_open)
    assert checkpoint.load_latest(d).step == 10              # falls back while 20 cannot be read...
    checkpoint.save(d, 11, {"step": 11}, keep_last=1)          # ...and the next save's pruning...
    monkeypatch.undo()
    assert os.path.exists(newest)                              # ...leaves the newer, good file alone
    assert checkpoint.load_latest(d).state == {"step": 20}


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
    with pytest.raises(ValueError, match="not a gradshare checkpoint"):
        checkpoint.load(checkpoint.checkpoint_path(d, 6))
    with pytest.raises(checkpoint.CheckpointError, match="not a gradshare checkpoint"):
        checkpoint.load(checkpoint.checkpoint_path(d, 7))


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
    real_fsync = os.fsync
    def dying_fsync(fd):
        # The new file's bytes are written: make them durable, then die before the rename, without cleanup.
        real_fsync(fd)
        print("dying", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    os.fsync = dying_fsync
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


# -------------------------------------------------------------------------------------------- hostile files
_PAYLOAD = textwrap.dedent("""
    import os, pickle, sys

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + sys.argv[2],))

    data = pickle.dumps({"state": Evil(), "ranks": []})
    sys.stdout.buffer.write(data)
""")


def _evil_pickle(marker: str) -> bytes:
    return subprocess.run([sys.executable, "-c", _PAYLOAD, "x", marker], capture_output=True, check=True,
                          timeout=60).stdout


def _with_header(payload: bytes, step: int = 9) -> bytes:
    """A valid header and checksum over any payload (what an attacker who read the format would write)."""
    import json

    fields = {"format": checkpoint.FORMAT, "version": checkpoint.VERSION, "step": step, "world_size": 1,
              "bytes": len(payload)}
    return json.dumps(dict(fields, sha256=checkpoint._digest(fields, payload))).encode() + b"\n" + payload


def test_a_code_payload_is_never_executed(tmp_path):
    d, marker = tmp_path / "ckpt", tmp_path / "executed"
    d.mkdir()
    checkpoint.save(str(d), 3, {"x": 1})
    evil = _evil_pickle(str(marker))
    (d / "ckpt-000000008.pt").write_bytes(evil)                      # a raw pickle dropped into the folder
    (d / "ckpt-000000009.pt").write_bytes(_with_header(evil))         # one behind a valid header and checksum
    for path in ("ckpt-000000008.pt", "ckpt-000000009.pt"):
        with pytest.raises(checkpoint.CheckpointError):
            checkpoint.load(str(d / path))
    assert checkpoint.latest(str(d)) == str(d / "ckpt-000000009.pt")   # checksum fine: nothing unpickled yet
    assert checkpoint.load_latest(str(d)).state == {"x": 1}           # the payload is refused, the good one loads
    assert not marker.exists()


def test_flipped_byte_missing_key_and_foreign_files_are_refused_in_one_line(tmp_path):
    d = str(tmp_path)
    path = checkpoint.save(d, 4, {"weights": torch.arange(64.0)})
    data = bytearray(open(path, "rb").read())
    data[-40] ^= 0x10                                                 # inside the tensor bytes
    open(path, "wb").write(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match="does not match its checksum") as info:
        checkpoint.load(path)
    assert "\n" not in str(info.value)
    import io as _io
    buf = _io.BytesIO()
    torch.save({"state": {}}, buf)                                     # no per-rank state
    open(path, "wb").write(_with_header(buf.getvalue()))
    with pytest.raises(checkpoint.CheckpointError, match="lacks"):
        checkpoint.load(path)
    with pytest.raises(checkpoint.CheckpointError, match="not a gradshare checkpoint"):
        open(path, "wb").write(b"PK\x03\x04 a zip file")
        checkpoint.load(path)


def test_unsaveable_values_are_refused_when_saving(tmp_path):
    with pytest.raises(TypeError, match=r"\['bad'\] has type object"):
        checkpoint.save(str(tmp_path), 1, {"bad": object()})
    assert checkpoint.list_checkpoints(str(tmp_path)) == []
    path = checkpoint.save(str(tmp_path), 2, {"np": np.arange(3), "scalar": np.float32(1.5), "t": (1, "a", None)})
    st = checkpoint.load(path).state
    assert torch.equal(st["np"], torch.arange(3)) and st["scalar"] == 1.5 and st["t"] == (1, "a", None)


def test_files_are_created_with_their_final_mode(tmp_path, monkeypatch):
    modes = []
    real = os.open

    def spy(path, flags, mode=0o777, *a, **k):
        if os.path.basename(str(path)).startswith(".tmp-ckpt-"):
            modes.append(mode)
        return real(path, flags, mode, *a, **k)

    monkeypatch.setattr(checkpoint.os, "open", spy)
    old = os.umask(0o027)
    try:
        path = checkpoint.save(str(tmp_path), 1, {"x": 1})
    finally:
        os.umask(old)
    assert modes == [0o666]
    assert os.stat(path).st_mode & 0o777 == 0o640


def test_fuzzed_checkpoint_files_are_refused_or_load_identically(tmp_path):
    """10,000 damaged files: random bytes, truncations, bit flips and pickles are refused with one line; a valid
    header over a damaged payload is refused or loads as plain data; nothing crashes or runs."""
    rng = np.random.default_rng(7)
    good = checkpoint.save(str(tmp_path), 1, {"w": torch.arange(16.0), "n": 3, "s": "x"})
    original = open(good, "rb").read()
    head_len = original.index(b"\n") + 1
    payload = original[head_len:]
    import pickle
    pickles = [pickle.dumps(x) for x in ({"state": {}, "ranks": []}, [1, 2], "text", None)]
    path = str(tmp_path / "ckpt-000000002.pt")
    outcomes = {"refused": 0, "identical": 0, "intact": 0}
    for i in range(10_000):
        kind = i % 5
        if kind == 0:
            data = rng.bytes(int(rng.integers(0, 400)))
        elif kind == 1:
            data = original[:int(rng.integers(0, len(original)))]
        elif kind == 2:
            data = bytearray(original)
            for _ in range(int(rng.integers(1, 4))):
                j = int(rng.integers(0, len(data)))
                data[j] ^= 1 << int(rng.integers(0, 8))
            data = bytes(data)
        elif kind == 3:
            data = pickles[i % len(pickles)]
        else:
            bad = bytearray(payload)
            j = int(rng.integers(0, len(bad)))
            bad[j] ^= 0xFF
            data = _with_header(bytes(bad))                       # checksum right, payload damaged
        with open(path, "wb") as f:
            f.write(data)
        outcomes["intact"] += kind < 4 and data == original
        try:
            ck = checkpoint.load(path)
        except checkpoint.CheckpointError as e:
            assert "\n" not in str(e)
            outcomes["refused"] += 1
            continue
        if kind < 4:        # damage the checksum does not cover: only the intact file loads, bit-identical
            assert data == original, i
            assert ck.step == 1 and torch.equal(ck.state["w"], torch.arange(16.0)) and ck.state["n"] == 3
        else:               # a payload behind a valid checksum loads as exactly what it holds: plain data
            import io as _io
            with open(path, "rb") as f:
                f.readline()
                payload_read = f.read()
            # read as checkpoint.load reads it (CPU, torch's protocol warning silenced), whatever warning
            # filters the tests that ran before left in this process
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                again = torch.load(_io.BytesIO(payload_read), map_location="cpu", weights_only=True)
            assert ck.state.keys() == again["state"].keys() and ck.step == 9
        outcomes["identical"] += 1
    # every damaged file without a matching checksum was refused (kinds 0-3: 8,000 files, a few left intact)
    assert outcomes["refused"] >= 8000 - outcomes["intact"]


def _central_entries(payload: bytes):
    """(offset, name) of every central-directory entry of a zip archive."""
    import struct

    out, off = [], payload.index(b"PK\x01\x02")
    while payload[off:off + 4] == b"PK\x01\x02":
        name_len, extra_len, comment_len = struct.unpack("<HHH", payload[off + 28:off + 34])
        out.append((off, payload[off + 46:off + 46 + name_len].decode()))
        off += 46 + name_len + extra_len + comment_len
    return out


@pytest.mark.parametrize("field,offset,value", [
    ("directory bit", 38, 0x10),        # external attributes: torch's reader "extracts" a directory as nothing
    ("stored size 0", 20, None),        # compressed size: a record with no stored bytes is read as nothing too
    ("deflated", 10, 8),                # compression method
    ("encrypted", 8, 0x1),              # general-purpose flags
])
def test_a_record_torch_would_read_as_nothing_is_refused(tmp_path, field, offset, value):
    """A central-directory entry that Python's zip reader accepts but torch's reads without filling its buffer
    (torch then unpickles whatever memory held: a different result from one load to the next) is refused."""
    import struct

    good = checkpoint.save(str(tmp_path), 1, {"w": torch.arange(16.0)})
    original = open(good, "rb").read()
    payload = bytearray(original[original.index(b"\n") + 1:])
    for at, name in _central_entries(bytes(payload)):
        if name.endswith("data.pkl"):
            if value is None:
                payload[at + offset:at + offset + 4] = struct.pack("<I", 0)
            else:
                payload[at + offset] |= value
    path = tmp_path / "ckpt-000000009.pt"
    path.write_bytes(_with_header(bytes(payload)))
    with pytest.raises(checkpoint.CheckpointError, match="not a sound zip archive") as info:
        checkpoint.load(str(path))
    assert "\n" not in str(info.value)


def test_every_damaged_central_directory_byte_is_refused_or_loads_the_same_twice(tmp_path):
    """Each byte of the archive's directory flipped in turn (the part no CRC covers): a load either refuses the
    file or returns exactly what was saved, the same from one load to the next whatever ran in between."""
    good = checkpoint.save(str(tmp_path), 1, {"w": torch.arange(16.0), "n": 3}, rng=False)
    original = open(good, "rb").read()
    payload = original[original.index(b"\n") + 1:]
    path = tmp_path / "ckpt-000000009.pt"
    loaded = 0
    for j in range(_central_entries(payload)[0][0], len(payload)):
        for mask in (0xFF, 0x10, 0x01):
            bad = bytearray(payload)
            bad[j] ^= mask
            path.write_bytes(_with_header(bytes(bad)))
            results = []
            for before in (good, None):
                if before:      # an intact load first leaves a valid pickle in memory torch's reader may reuse
                    checkpoint.load(before)
                else:
                    torch.save({"noise": torch.randn(1024)}, io.BytesIO())
                try:
                    ck = checkpoint.load(str(path))
                    results.append(("ok", sorted(ck.state), [torch.equal(ck.state[k], v) if torch.is_tensor(v)
                                                            else ck.state[k] == v for k, v in
                                                            (("w", torch.arange(16.0)), ("n", 3)) if k in ck.state]))
                except checkpoint.CheckpointError:
                    results.append(("refused",))
            assert results[0] == results[1], (j, hex(mask), results)
            if results[0][0] == "ok":    # the records are intact: what loads is what was saved
                assert results[0][1] == ["n", "w"] and all(results[0][2]), (j, hex(mask), results)
                loaded += 1
    assert loaded > 0          # fields nothing reads (times, versions) may change and still load


def _resume_point(config, ctx):
    return ctx.start_step


def test_cluster_resume_never_runs_a_dropped_in_payload(tmp_path, world_of_one):
    from gradshare import cluster

    d, marker = tmp_path / "ckpt", tmp_path / "executed"
    d.mkdir()
    checkpoint.save(str(d), 20, {"x": 1})
    evil = _evil_pickle(str(marker))
    (d / "ckpt-000000030.pt").write_bytes(evil)
    (d / "ckpt-000000040.pt").write_bytes(_with_header(evil, step=40))
    assert cluster.run(_resume_point, None, checkpoint_dir=str(d), collective_timeout=30) == 20
    assert not marker.exists()
