import csv
import io
import json
import os
import re
import shlex
import sys
from contextlib import redirect_stdout

import pytest
import torch

from gradshare import checkpoint
from gradshare.cli import main
from gradshare.train import build_config, parse_compression

# `gradshare train` with its defaults (2 workers, gradient sharing, SmallCNN on digits, 12 epochs, Adam 3e-3)
# reached 97.5-99.7% test accuracy here over seeds 0-2; the floor leaves room for other machines' float rounding.
DEFAULT_FLOOR = 0.95


def _read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_default_command_trains_to_the_floor_and_writes_csv_and_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    csv_path, png_path = tmp_path / "run.csv", tmp_path / "run.png"
    assert main(["train", "--no-progress", "--metrics", str(csv_path), "--plot", str(png_path)]) == 0
    out = capsys.readouterr().out
    acc = float(re.search(r"final test accuracy: ([\d.]+)%", out).group(1)) / 100
    assert acc >= DEFAULT_FLOOR, out
    # Link-aware by default: on this loopback link most steps may be all-reduced, so no bytes ratio is promised
    # here (tests/test_hooks.py and tests/test_parallel.py check what compression saves).
    assert re.search(r"link-aware: \d+ of 276 steps by float32 all-reduce, (\d+ by bfloat16 all-reduce, )?\d+ compressed", out), out
    assert "wall time:" in out
    rows = _read_csv(csv_path)
    assert len(rows) == 12 * 23                  # 12 epochs of ceil(719 / 32) steps (rank 0)
    assert [int(r["step"]) for r in rows] == list(range(1, len(rows) + 1))
    for col in ("loss", "bytes_sent", "dense_bytes", "density", "tau", "format"):
        assert col in rows[0]
    # bytes counted from the first step on, never lost between steps (no ratio promised on loopback, above)
    sent, dense = [int(r["bytes_sent"]) for r in rows], [int(r["dense_bytes"]) for r in rows]
    assert sent[0] > 0 and dense[0] > 0 and sent == sorted(sent) and dense == sorted(dense)
    assert re.search(r"dense allreduce would have sent [\d.]+ [kMG]?B, [\d.]+x (less|more)", out), out
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_tiny_averaging_run_on_mnist_files(tiny_mnist, capsys):
    pytest.importorskip("matplotlib")
    csv_path, png_path = tiny_mnist / "a.csv", tiny_mnist / "a.png"
    argv = ["train", "--mode", "averaging", "--frequency", "2", "--epochs", "2", "--batch-size", "16",
            "--data", f"mnist:{tiny_mnist}", "--no-progress", "--metrics", str(csv_path), "--plot", str(png_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "final test accuracy" in out and "averaging" in out
    rows = _read_csv(csv_path)
    assert len(rows) == 2 * 3                    # 48 samples per worker, batches of 16
    assert [r["averaged"] for r in rows] == ["0.0", "1.0", "0.0", "1.0", "0.0", "1.0"]
    assert png_path.stat().st_size > 1000


def test_plot_without_matplotlib_says_so(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["train", "--plot", "x.png"]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err


def test_bad_option_combinations_are_rejected(capsys):
    # single bad values: tests/test_cli_errors.py
    assert main(["train", "--max-restarts", "1"]) == 2                    # local cannot restart workers
    assert main(["train", "--launcher", "torchrun", "--nnodes", "2"]) == 2  # multi-host needs a rendezvous
    assert main(["train", "--rdzv-endpoint", "h:1"]) == 2                  # torchrun options need torchrun
    assert main(["train", "--launcher", "torchrun", "--timeout", "0"]) == 2
    assert main(["train", "--mode", "averaging", "--outer-lr", "0.7"]) == 2     # outer options need local steps
    assert main(["train", "--mode", "averaging", "--fragments", "2"]) == 2      # streaming needs local steps too
    assert main(["train", "--mode", "diloco", "--frequency", "4", "--fragments", "5"]) == 2
    assert main(["train", "--mode", "diloco", "--frequency", "4", "--fragments", "2", "--overlap", "3"]) == 2
    assert main(["train", "--mode", "averaging", "--error-feedback", "model"]) == 2   # needs local steps
    assert main(["train", "--mode", "diloco", "--error-feedback", "model"]) == 2       # ... and a compressed round
    assert main(["train", "--share", "gradients", "--error-feedback", "model"]) == 2   # shared updates only


def test_compression_specs_and_config():
    from gradshare import Adaptive, Fixed, Ternary, TopK

    assert parse_compression("auto") is None
    assert isinstance(parse_compression("adaptive"), Adaptive)
    assert parse_compression("fixed:0.01").tau == pytest.approx(0.01)
    assert isinstance(parse_compression("fixed:1e-3"), Fixed)
    assert isinstance(parse_compression("target:0.001"), TopK) and parse_compression("target:0.001").density == 0.001
    assert parse_compression("topk:0.02").density == 0.02 and isinstance(parse_compression("topk"), TopK)
    signs = parse_compression("topk_sign:0.1")
    assert isinstance(signs, TopK) and signs.density == 0.1 and signs.values == "sign"
    assert parse_compression("topk_sign").values == "sign"
    assert parse_compression("ternary:0.75").fraction == 0.75 and isinstance(parse_compression("ternary"), Ternary)
    assert build_config({}).compression is None and build_config({}).shared == "updates"
    assert isinstance(build_config({"threshold": "adaptive"}).compression, Adaptive)   # the former option name
    cfg = build_config({"data": "mnist:/somewhere", "mode": "averaging", "optimizer": "sgd", "lr": 0.1})
    assert cfg.model.image_size == 28 and cfg.mode == "averaging" and cfg.optimizer[1]["momentum"] == 0.9
    assert build_config({}).epochs == 12
    assert build_config({}).error_feedback is None        # SharedOptimizer's default: each worker's model
    assert build_config({"error_feedback": "buffer"}).error_feedback == "buffer"
    own = build_config({"error_feedback": "model", "compression": "topk_sign:0.01"})
    assert own.mode == "shared_gradients" and own.error_feedback == "model" and own.compression.density == 0.01


def test_local_steps_modes_build_parameter_averaging_options():
    from gradshare import Adaptive, TopK

    d = build_config({"mode": "diloco", "frequency": 20})
    assert d.mode == "averaging" and d.frequency == 20 and d.compression is None
    assert build_config({"mode": "diloco", "averaging_frequency": 7}).frequency == 7   # the key's former name
    assert d.outer_optimizer == (torch.optim.SGD, {"lr": 1.0, "momentum": 0.0, "nesterov": False})   # the mean change
    paper = build_config({"mode": "diloco", "outer_lr": 0.7, "outer_momentum": 0.9})
    assert paper.outer_optimizer == (torch.optim.SGD, {"lr": 0.7, "momentum": 0.9, "nesterov": True})
    s = build_config({"mode": "sparse_local"})
    assert s.residual_decay == 1.0 and s.error_feedback == "model"   # no decay
    assert s.outer_optimizer == (torch.optim.SGD, {"lr": 1.15, "momentum": 0.0, "nesterov": False})
    pushed = build_config({"mode": "sparse_local", "outer_momentum": 0.5})
    assert pushed.outer_optimizer == (torch.optim.SGD, {"lr": 1.15, "momentum": 0.5, "nesterov": True})
    buffered = build_config({"mode": "sparse_local", "error_feedback": "buffer"})
    assert buffered.error_feedback == "buffer" and buffered.residual_decay == 0.9          # SparseLoCo's
    assert buffered.outer_optimizer is None                                                # the mean change
    assert build_config({"mode": "diloco"}).error_feedback == "buffer"
    assert isinstance(s.compression, TopK) and s.compression.density == 0.04 and s.compression.warmup_steps == 0
    assert s.compression.values == "sign"
    s = build_config({"mode": "sparse_local", "compression": "topk:0.01", "outer_lr": 1.5, "residual_decay": 1.0})
    assert s.compression.density == 0.01 and s.compression.warmup_steps == 0 and s.residual_decay == 1.0
    assert s.outer_optimizer == (torch.optim.SGD, {"lr": 1.5, "momentum": 0.0, "nesterov": False})
    assert isinstance(build_config({"mode": "diloco", "compression": "adaptive"}).compression, Adaptive)
    assert (d.fragments, d.overlap) == (1, 0)
    streamed = build_config({"mode": "diloco", "frequency": 20, "fragments": 4, "overlap": 5})
    assert (streamed.fragments, streamed.overlap) == (4, 5)
    travelling = build_config({"mode": "sparse_local", "frequency": 4, "overlap": 1})   # kept in the model, late
    assert (travelling.overlap, travelling.error_feedback) == (1, "model")
    plain = build_config({"mode": "averaging", "compression": "topk"})      # averaging ignores --compression
    assert plain.compression is None and plain.outer_optimizer is None


# ------------------------------------------------------------------------------------------- launchers
# One epoch on digits (23 steps of 2 x 32 samples): every launcher runs the same train_job per rank, with the
# same seed, data shards and one torch thread per worker, so the runs agree to the last bit.
# --link off: every launcher's run must repeat the local one bit for bit (link-aware choices follow timings)
TINY = ["train", "--epochs", "1", "--seed", "1", "--no-progress", "--link", "off"]


def _summary(out):
    """The run's result lines: per-epoch table rows, final accuracy and bytes (wall time left out)."""
    acc = re.search(r"final test accuracy: ([\d.]+)% \(test loss ([\d.]+)\)", out)
    assert acc, out
    rows = re.findall(r"^\s+1 .*$", out, flags=re.M)
    sent = re.search(r"bytes sent \(all workers\): .*", out)
    assert rows and sent, out
    return acc.groups(), rows, sent.group(0)


def _untimed(rows):
    return [{k: v for k, v in r.items() if k not in ("seconds", "elapsed")} for r in rows]


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """The default local launcher on the tiny settings: (summary, per-step CSV rows of rank 0)."""
    csv_path = tmp_path_factory.mktemp("local") / "steps.csv"
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main(TINY + ["--metrics", str(csv_path)]) == 0
    return _summary(buf.getvalue()), _read_csv(csv_path)


def test_print_command_is_the_torchrun_job_each_host_can_run():
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main(["train", "--launcher", "torchrun", "--workers", "3", "--epochs", "2", "--nnodes", "2",
                     "--node-rank", "1", "--rdzv-endpoint", "10.0.0.1:29500", "--max-restarts", "2",
                     "--checkpoint-dir", "/shared/ckpt", "--collective-timeout", "60", "--print-command"]) == 0
    cmd = shlex.split(buf.getvalue())
    assert cmd[:3] == ["python", "-m", "torch.distributed.run"]
    for flag in ("--nproc_per_node=3", "--nnodes=2", "--node_rank=1", "--rdzv_endpoint=10.0.0.1:29500",
                 "--max_restarts=2"):
        assert flag in cmd
    assert "--standalone" not in cmd
    i = cmd.index("-m", 3)
    assert cmd[i + 1:i + 3] == ["gradshare.cluster", "gradshare.train:train_job"]
    config = json.loads(cmd[cmd.index("--config") + 1])
    assert config["epochs"] == 2 and config["workers"] == 3
    assert cmd[cmd.index("--checkpoint-dir") + 1] == "/shared/ckpt"
    assert cmd[cmd.index("--checkpoint-every") + 1] == "100"  # the default once restarts are asked for
    assert cmd[cmd.index("--collective-timeout") + 1] == "60"
    # The cluster entry point accepts every option after the module name.
    from gradshare.cluster import main as cluster_main

    with pytest.raises(SystemExit) as info:
        cluster_main(cmd[i + 2:] + ["--help"])
    assert info.value.code == 0


@pytest.mark.slow
def test_torchrun_launcher_matches_local_and_checkpoints(tmp_path, capfd, local_run):
    capfd.readouterr()
    csv_path, ckpt_dir = tmp_path / "steps.csv", tmp_path / "ckpt"
    assert main(TINY + ["--launcher", "torchrun", "--metrics", str(csv_path), "--checkpoint-dir", str(ckpt_dir),
                        "--checkpoint-every", "10", "--timeout", "300"]) == 0
    out = capfd.readouterr().out
    assert "torchrun workers" in out and "wall time:" in out
    assert _summary(out) == local_run[0]
    assert _untimed(_read_csv(csv_path)) == _untimed(local_run[1])  # each step's loss, bytes, tau, format
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(str(ckpt_dir))] == \
        ["ckpt-000000010.pt", "ckpt-000000020.pt"]


@pytest.mark.slow
def test_local_launcher_with_checkpoints_matches_plain_local(tmp_path, capsys, local_run):
    ckpt_dir = tmp_path / "ckpt"
    assert main(TINY + ["--checkpoint-dir", str(ckpt_dir), "--checkpoint-every", "20"]) == 0
    assert _summary(capsys.readouterr().out) == local_run[0]
    assert checkpoint.load_latest(str(ckpt_dir)).step == 20


@pytest.mark.slow
def test_torchrun_failure_is_reported_not_hidden(tmp_path, capfd):
    # Every worker fails to read the data (files with the right names, not idx files: the command line's
    # check passes, the workers' reads fail): torchrun exits non-zero and the command says so.
    from gradshare.data import MNIST_FILES
    for stem in MNIST_FILES:
        (tmp_path / stem).write_bytes(b"not an idx file")
    assert main(TINY + ["--launcher", "torchrun", "--data", f"mnist:{tmp_path}", "--timeout", "120"]) == 1
    err = capfd.readouterr().err
    assert "torchrun failed with exit code" in err
    assert "Traceback" in err  # the worker's own traceback reached the user


def test_torchrun_timeout_stops_the_run(capfd):
    assert main(TINY + ["--launcher", "torchrun", "--timeout", "1"]) == 1
    assert "did not finish within --timeout 1 s" in capfd.readouterr().err


def test_spark_launcher_without_pyspark_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pyspark", None)
    assert main(TINY + ["--launcher", "spark"]) == 1
    assert "pip install gradshare[spark]" in capsys.readouterr().err


@pytest.mark.slow
def test_spark_launcher_matches_local(capfd, local_run):
    for name in ("pyspark", "pandas", "pyarrow"):
        pytest.importorskip(name)
    capfd.readouterr()
    assert main(TINY + ["--launcher", "spark"]) == 0   # master local[2]: TorchDistributor's torchrun on the driver
    out = capfd.readouterr().out
    assert "spark workers" in out
    assert _summary(out) == local_run[0]
