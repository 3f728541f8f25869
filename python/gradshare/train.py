"""Train a small CNN data-parallel with threshold gradient sharing or parameter averaging, then report
the test accuracy, the wall time and the bytes sent against what dense all-reduce would have sent.

With no options: 2 local workers share thresholded gradients to train a small CNN on scikit-learn's
bundled handwritten digits. `--data mnist:PATH` reads the MNIST idx files in PATH.
"""
from __future__ import annotations

import argparse
import csv
import math
import sys
import time
from typing import Any, Callable, Dict, List

import torch

from gradshare import loop
from gradshare.loop import TrainConfig, train_rank  # noqa: F401  (train_rank: the per-rank loop)

# ------------------------------------------------------------------------------------------ options
def parse_threshold(spec: str):
    """"adaptive" | "adaptive:INITIAL_TAU" | "fixed:TAU" | "target:SPARSITY" -> a threshold algorithm."""
    from gradshare.thresholds import Adaptive, Fixed, TargetSparsity

    name, _, value = spec.partition(":")
    try:
        if name == "adaptive":
            return Adaptive(initial=float(value)) if value else Adaptive()
        if name == "fixed" and value:
            return Fixed(float(value))
        if name == "target" and value:
            return TargetSparsity(target=float(value))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--threshold {spec}: {exc}") from None
    raise argparse.ArgumentTypeError(f"--threshold: expected fixed:TAU, adaptive or target:SPARSITY, got {spec!r}")


def _threshold_arg(spec: str) -> str:
    parse_threshold(spec)  # validate early, keep the string (JSON-able options)
    return spec


def _data_arg(spec: str) -> str:
    if spec != "digits" and not (spec.startswith("mnist:") and len(spec) > 6):
        raise argparse.ArgumentTypeError(f"expected digits or mnist:PATH, got {spec!r}")
    return spec


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=2, help="worker processes")
    p.add_argument("--mode", choices=loop.MODES, default="shared_gradients",
                   help="gradient sharing (threshold-encoded) or periodic parameter averaging")
    p.add_argument("--epochs", type=int, default=12, help="passes over the training set")
    p.add_argument("--batch-size", type=int, default=32, help="samples per worker per step")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate")
    p.add_argument("--optimizer", choices=["adam", "sgd"], default="adam",
                   help="inner optimizer (sgd: momentum 0.9)")
    p.add_argument("--share", choices=["gradients", "updates"], default="gradients",
                   help="gradient sharing: encode gradients (optimizer state identical everywhere) or the "
                        "post-optimizer updates (DL4J; optimizer state local)")
    p.add_argument("--threshold", type=_threshold_arg, default="adaptive",
                   help="gradient sharing threshold: fixed:TAU | adaptive[:INITIAL_TAU] | target:SPARSITY")
    p.add_argument("--averaging-frequency", type=int, default=5, help="steps between averaging rounds")
    p.add_argument("--data", type=_data_arg, default="digits", help="digits | mnist:PATH (idx files, .gz or not)")
    p.add_argument("--seed", type=int, default=0, help="model initialisation, data split and order")
    p.add_argument("--metrics", metavar="CSV", help="write per-step statistics (rank 0) to this CSV file")
    p.add_argument("--plot", metavar="PNG", help="plot loss, accuracy and bytes per step (needs matplotlib)")
    p.add_argument("--launcher", choices=sorted(LAUNCHERS), default="local",
                   help="how the workers are started")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def options_from_args(args: argparse.Namespace) -> Dict[str, Any]:
    """The run's options as a JSON-able dict (what a cluster launcher hands to :func:`train_job`)."""
    return {"workers": args.workers, "mode": args.mode, "epochs": args.epochs,
            "batch_size": args.batch_size, "lr": args.lr, "optimizer": args.optimizer, "share": args.share,
            "threshold": args.threshold, "averaging_frequency": args.averaging_frequency, "data": args.data,
            "seed": args.seed, "progress": not args.no_progress}


def build_config(opts: Dict[str, Any]) -> TrainConfig:
    """TrainConfig for the options (missing ones take the command's defaults): SmallCNN sized for the
    data, Adam or SGD (momentum 0.9)."""
    from gradshare.models import SmallCNN

    torch.manual_seed(int(opts.get("seed", 0)))
    data = opts.get("data", "digits")
    model = SmallCNN(in_channels=1, num_classes=10, image_size=8 if data == "digits" else 28)
    lr = float(opts.get("lr", 3e-3))
    if opts.get("optimizer", "adam") == "adam":
        optimizer = (torch.optim.Adam, {"lr": lr})
    else:
        optimizer = (torch.optim.SGD, {"lr": lr, "momentum": 0.9})
    mode = opts.get("mode", "shared_gradients")
    return TrainConfig(model=model, optimizer=optimizer, train_data=data, validation_data=data,
                       epochs=int(opts.get("epochs", 12)), batch_size=int(opts.get("batch_size", 32)), mode=mode,
                       shared=opts.get("share", "gradients"),
                       threshold=parse_threshold(opts.get("threshold", "adaptive")) if mode != "averaging" else None,
                       averaging_frequency=int(opts.get("averaging_frequency", 5)),
                       metrics=("loss", "accuracy"), seed=int(opts.get("seed", 0)),
                       progress=bool(opts.get("progress", True)))


def train_job(opts: Dict[str, Any], ctx: Any = None) -> Dict[str, Any]:
    """Per-rank entry for cluster launchers (gradshare.cluster.run): trains with :func:`train_rank` and
    returns a JSON-able summary (history, per-step records, seconds)."""
    out = train_rank(build_config(opts), ctx)
    return {"history": out["history"], "steps": out["steps"], "seconds": out["seconds"]}


# ----------------------------------------------------------------------------------------- launchers
def _launch_local(opts: Dict[str, Any]) -> Dict[str, Any]:
    from gradshare.parallel import launch_local

    return launch_local(train_job, opts, int(opts["workers"]))[0]


# launcher name -> function(options) -> rank 0's train_job summary
LAUNCHERS: Dict[str, Callable[[Dict[str, Any]], Dict[str, Any]]] = {"local": _launch_local}


# ------------------------------------------------------------------------------------------- output
def write_csv(path: str, steps: List[Dict[str, Any]]) -> None:
    """Per-step records as CSV, one row per step, columns the union of the records' keys."""
    cols: List[str] = []
    for rec in steps:
        cols += [k for k in rec if k not in cols]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for rec in steps:
            w.writerow(rec)


def write_plot(path: str, steps: List[Dict[str, Any]], history: List[Dict[str, Any]], title: str) -> None:
    """Loss per step with accuracy per epoch, and bytes per step sent vs dense all-reduce."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["step"] for r in steps]
    sent = [r["bytes_sent"] - (steps[i - 1]["bytes_sent"] if i else 0) for i, r in enumerate(steps)]
    dense = [r["dense_bytes"] - (steps[i - 1]["dense_bytes"] if i else 0) for i, r in enumerate(steps)]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    lines = a1.plot(x, [r["loss"] for r in steps], lw=0.8, label="training loss (rank 0)")
    a1.set_ylabel("loss")
    a1.set_title(title)
    if history and history[0].get("val_accuracy") is not None:
        b = a1.twinx()
        lines += b.plot([h["step"] for h in history], [h["val_accuracy"] for h in history], "o-",
                        color="tab:green", label="test accuracy")
        b.set_ylabel("test accuracy")
        b.set_ylim(0, 1)
    a1.legend(lines, [ln.get_label() for ln in lines], loc="center right")
    a2.plot(x, dense, lw=0.8, color="tab:gray", label="dense all-reduce")
    a2.plot(x, sent, lw=0.8, color="tab:red", label="sent")
    a2.set_yscale("symlog", linthresh=1000)
    a2.set_xlabel("step")
    a2.set_ylabel("bytes per step (rank 0)")
    a2.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _fmt_bytes(n: float) -> str:
    return loop.fmt_bytes(n)


def run(args: argparse.Namespace) -> int:
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("--plot needs matplotlib: pip install matplotlib (or gradshare[plot])", file=sys.stderr)
            return 2
    for name in ("workers", "epochs", "batch_size", "averaging_frequency"):
        if getattr(args, name) < 1:
            print(f"--{name.replace('_', '-')}: must be >= 1", file=sys.stderr)
            return 2
    opts = options_from_args(args)
    print(f"gradshare train: SmallCNN on {opts['data']}, {opts['workers']} {args.launcher} workers, "
          f"{opts['mode']}" + (f" ({opts['share']}, threshold {opts['threshold']})"
                               if opts["mode"] == "shared_gradients"
                               else f" (every {opts['averaging_frequency']} steps)")
          + f", {opts['optimizer']} lr {opts['lr']:g}, {opts['epochs']} epochs, batch {opts['batch_size']} per worker",
          flush=True)
    t0 = time.perf_counter()
    result = LAUNCHERS[args.launcher](opts)
    wall = time.perf_counter() - t0
    history, steps = result["history"], result["steps"]
    print(f"{'epoch':>5} {'loss':>8} {'train acc':>9} {'test acc':>8} {'sent':>10} {'dense':>10}")
    for h in history:
        print(f"{h['epoch']:>5} {h['loss']:8.4f} {h['accuracy']:9.4f} {h.get('val_accuracy', math.nan):8.4f} "
              f"{_fmt_bytes(h['bytes_sent']):>10} {_fmt_bytes(h['dense_bytes']):>10}")
    last = history[-1]
    sent = sum(h["bytes_sent"] for h in history)
    dense = sum(h["dense_bytes"] for h in history)
    print(f"final test accuracy: {100 * last['val_accuracy']:.2f}% (test loss {last['val_loss']:.4f})")
    print(f"wall time: {wall:.1f} s ({result['seconds']:.1f} s in the training loop)")
    ratio = f", {dense / sent:.1f}x less" if sent else ""
    print(f"bytes sent (all workers): {_fmt_bytes(sent)}; dense allreduce would have sent {_fmt_bytes(dense)}"
          f"{ratio}")
    if args.metrics:
        write_csv(args.metrics, steps)
        print(f"per-step statistics: {args.metrics}")
    if args.plot:
        write_plot(args.plot, steps, history, f"{opts['mode']} x{opts['workers']} on {opts['data']}")
        print(f"plot: {args.plot}")
    return 0
