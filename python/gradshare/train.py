"""Train a small CNN data-parallel with threshold gradient sharing or parameter averaging, then report
the test accuracy, the wall time and the bytes sent against what dense all-reduce would have sent.

With no options, 2 local workers share their optimizer's updates to train a small CNN on scikit-learn's
bundled handwritten digits; --data mnist:PATH reads the MNIST idx files in PATH instead.

--launcher picks what starts the workers. Each worker runs the same per-rank function
(gradshare.train.train_job), so a run with the same options and seed gives the same model whichever starts it:
- local (the default): --workers processes on this machine.
- torchrun: python -m torch.distributed.run --nproc_per_node=WORKERS, either --standalone or one node of a
  multi-host job (--nnodes, --node-rank, --rdzv-endpoint). --print-command shows the command; running it
  on each host, with --nnodes, --node_rank and --rdzv_* added, is the same job launched by hand.
- spark: Spark's TorchDistributor (needs pip install gradshare[spark]).

--checkpoint-every N saves a checkpoint every N steps into --checkpoint-dir (by default a temporary
folder, removed after a successful run). With --max-restarts K, torchrun restarts all workers after a
failure and Spark reruns the job, up to K times; both resume from the newest complete checkpoint.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shlex
import shutil
import sys
import tempfile
import time
from typing import Any, Dict, List

import torch

from gradshare import argtypes, loop
from gradshare.launchers import LAUNCHERS, LaunchError, torchrun_command
from gradshare.loop import TrainConfig, train_rank  # noqa: F401  (train_rank: the per-rank loop)

# ------------------------------------------------------------------------------------------ options
LOCAL_STEPS = ("diloco", "sparse_local")          # the averaging mode with a pseudo-gradient
MODES = loop.MODES + LOCAL_STEPS
# Outer lr and momentum of --mode diloco: the mean change applied as it is. DiLoCo's paper uses Nesterov 0.7 / 0.9 at
# hundreds of inner steps; at 20 inner steps they cost the MNIST CNN 3.4 points and the char LM 8.5% of loss
# (README, "Local steps"), where 1 / 0 stayed within 0.1 points and 2.3%.
DILOCO_OUTER = (1.0, 0.0)
# --mode sparse_local's default: the change's top 4% as signs (TopK(values="sign"), ~7.6 bits an entry). On the AdamW
# LM every 10 steps it ended +1.9% at 1054x and every 20 steps +2.7% at 2108x (3 seeds), where the top 2% with 8-bit
# values (24 bits an entry) ended +3.1% at 1330x; the MNIST CNNs the same either way (README, "Local steps").
SPARSE_LOCAL_DENSITY, SPARSE_LOCAL_VALUES, SPARSE_LOCAL_DECAY = 0.04, "sign", 0.9
SPARSE_LOCAL_ERROR_FEEDBACK = "model"           # --error-feedback's default (ParameterAveraging's error_feedback)
# --mode sparse_local's outer lr with --error-feedback model (no momentum): a round applies 1.15 times the mean of what
# the ranks sent. An entry that only some ranks sent arrives at a fraction of its size (the rest waits in the others'
# models), so the round's result trails the ranks' progress along the largest entries; 1.15 moved the AdamW LM from
# +2.0% to +1.4% (DiLoCo's loss at the same period) with the top 10% every 20 steps, and gained 0.2-0.3% at 4%,
# 3 seeds each; the MNIST CNNs the same or better (README, "Local steps"). Dense rounds gain nothing from it.
SPARSE_LOCAL_OUTER_LR = 1.15


def parse_compression(spec: str):
    """What sharing sends, from the command line: "auto" (None: chosen for the optimizer), "topk[:DENSITY]",
    "topk_sign[:DENSITY]" (TopK with values="sign"), "ternary[:FRACTION]", "target:DENSITY" (TopK), "fixed:TAU"
    or "adaptive[:INITIAL_TAU]" (DL4J's +-tau)."""
    from gradshare.compression import Ternary, TopK
    from gradshare.thresholds import Adaptive, Fixed

    name, _, value = spec.partition(":")
    try:
        if name == "auto" and not value:
            return None
        if name == "topk":
            return TopK(float(value)) if value else TopK()
        if name == "topk_sign":
            return TopK(float(value), values="sign") if value else TopK(values="sign")
        if name == "ternary":
            return Ternary(float(value)) if value else Ternary()
        if name == "target" and value:
            return TopK(float(value))
        if name == "adaptive":
            return Adaptive(initial=float(value)) if value else Adaptive()
        if name == "fixed" and value:
            return Fixed(float(value))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--compression {spec}: {exc}") from None
    raise argparse.ArgumentTypeError("--compression: expected auto, topk[:DENSITY], topk_sign[:DENSITY], "
                                     f"ternary[:FRACTION], target:DENSITY, fixed:TAU or adaptive[:TAU], got {spec!r}")


def _compression_arg(spec: str) -> str:
    parse_compression(spec)  # validate early, keep the string (JSON-able options)
    return spec


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=argtypes.integer(1), default=2, metavar="N", help="worker processes")
    p.add_argument("--mode", choices=MODES, default="shared_gradients",
                   help="shared_gradients: every step shares compressed updates\n"
                        "averaging: parameters and optimizer state averaged every --frequency steps\n"
                        "diloco: local steps, each rank's optimizer state its own, the averaged change applied "
                        "by an outer optimizer (--outer-lr, --outer-momentum)\n"
                        "sparse_local: local steps, the change's top entries shared with error feedback (the top 4%% "
                        "as signs unless --compression says otherwise)")
    p.add_argument("--epochs", type=argtypes.integer(1), default=12, metavar="N", help="passes over the training set")
    p.add_argument("--batch-size", type=argtypes.integer(1), default=32, metavar="N",
                   help="samples per worker per step")
    p.add_argument("--lr", type=argtypes.number(0, low_open=True), default=3e-3, help="learning rate")
    p.add_argument("--optimizer", choices=["adam", "sgd"], default="adam",
                   help="inner optimizer (sgd: momentum 0.9)")
    p.add_argument("--share", choices=["updates", "gradients"], default="updates",
                   help="what sharing encodes: the optimizer's updates (each rank's optimizer state stays local) or "
                        "the gradients (optimizer state identical everywhere)")
    p.add_argument("--compression", type=_compression_arg, default="auto", metavar="SPEC",
                   help="what sharing sends, one of:\n"
                        "auto: chosen for the optimizer\n"
                        "topk[:DENSITY], ternary[:FRACTION], target:DENSITY\n"
                        "topk_sign[:DENSITY]: top-k sent as signs and a scale (local steps' change)\n"
                        "fixed:TAU, adaptive[:INITIAL_TAU]: DL4J's +-tau thresholds")
    p.add_argument("--threshold", dest="compression", type=_compression_arg, action=argtypes.FormerName,
                   new="--compression")
    p.add_argument("--link", choices=["auto", "off"], default="auto",
                   help="shared_gradients with --compression auto: auto measures the link and steps by an all-reduce "
                        "(float32, or bfloat16 where that is faster) where compressing is slower; off compresses every "
                        "step (runs repeat bit for bit)")
    p.add_argument("--frequency", type=argtypes.integer(1), default=5, metavar="STEPS",
                   help="steps between averaging rounds (averaging, diloco, sparse_local)")
    p.add_argument("--averaging-frequency", dest="frequency", type=argtypes.integer(1), action=argtypes.FormerName,
                   new="--frequency")
    p.add_argument("--outer-lr", type=argtypes.number(0, low_open=True), metavar="LR",
                   help=f"diloco, sparse_local: the outer optimizer's learning rate (default: {DILOCO_OUTER[0]} for "
                        f"diloco; {SPARSE_LOCAL_OUTER_LR} for sparse_local with --error-feedback model, none with "
                        "buffer, which applies the mean change as it is)")
    p.add_argument("--outer-momentum", type=argtypes.number(0, 1, high_open=True), metavar="M",
                   help="diloco, sparse_local: the outer optimizer's Nesterov momentum "
                        f"(default: {DILOCO_OUTER[1]} for diloco, 0 for sparse_local)")
    p.add_argument("--residual-decay", type=argtypes.number(0, 1, low_open=True), metavar="BETA",
                   help=f"sparse_local: the error-feedback decay (default: {SPARSE_LOCAL_DECAY} with --error-feedback "
                        "buffer, 1 with model)")
    p.add_argument("--error-feedback", choices=["buffer", "model"],
                   help="sparse_local, shared_gradients (--share updates): where what a round or step does not send "
                        "waits: in an error-feedback buffer, every model set to the mean, or in each worker's own "
                        f"model (default: {SPARSE_LOCAL_ERROR_FEEDBACK} for sparse_local; for shared_gradients, SharedOptimizer's: "
                        "model, the buffer for half-precision parameters)")
    p.add_argument("--fragments", type=argtypes.integer(1), metavar="F",
                   help="diloco, sparse_local: rounds of F fragments of the model, staggered over the period "
                        "(streaming; default 1)")
    p.add_argument("--overlap", type=argtypes.integer(0), metavar="STEPS",
                   help="diloco, sparse_local: steps a round's exchange travels while training goes on "
                        "(at most --frequency / --fragments; default 0)")
    p.add_argument("--data", type=argtypes.data_spec, default="digits", metavar="DATA",
                   help="digits, or mnist:PATH (a folder of MNIST idx files, .gz or not)")
    p.add_argument("--seed", type=argtypes.integer(0), default=0, help="model initialisation, data split and order")
    p.add_argument("--metrics", metavar="CSV", help="write per-step statistics (rank 0) to this CSV file")
    p.add_argument("--plot", metavar="PNG", help="plot loss, accuracy and bytes per step (needs matplotlib)")
    p.add_argument("--launcher", choices=sorted(LAUNCHERS), default="local",
                   help="how the workers are started: local processes, torchrun, or Spark (TorchDistributor)")
    g = p.add_argument_group("checkpoints and restarts (all launchers)")
    g.add_argument("--checkpoint-dir", metavar="DIR",
                   help="where rank 0 keeps checkpoints; an existing checkpoint there is resumed "
                        "(default: a temporary folder, removed after a successful run)")
    g.add_argument("--checkpoint-every", type=argtypes.integer(0), metavar="STEPS",
                   help="steps between checkpoints (default: 0, none; 100 with --max-restarts)")
    g.add_argument("--max-restarts", type=argtypes.integer(0), default=0, metavar="K",
                   help="torchrun: restart all workers up to K times after a failure; spark: rerun the job up "
                        "to K times; both resume from the newest checkpoint")
    g.add_argument("--timeout", type=argtypes.number(0, low_open=True), default=86400.0, metavar="SECONDS",
                   help="local and torchrun: stop the run after this long (default: 86400, one day)")
    g.add_argument("--collective-timeout", type=argtypes.number(0, low_open=True), default=300.0, metavar="SECONDS",
                   help="torchrun and spark: a collective waiting on a dead or stuck peer fails after this long")
    g = p.add_argument_group("torchrun launcher")
    g.add_argument("--nnodes", default="1", metavar="N",
                   help="torchrun nodes (hosts), N or MIN:MAX; more than 1 needs --rdzv-endpoint")
    g.add_argument("--node-rank", type=argtypes.integer(0), default=0, metavar="RANK", help="this host's node rank")
    g.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                   help="rendezvous address (on the first host); without it, --standalone on this host")
    g.add_argument("--rdzv-backend", default="c10d", metavar="NAME",
                   help="torchrun rendezvous backend (with --rdzv-endpoint)")
    g.add_argument("--rdzv-id", default="gradshare-train", metavar="ID", help="job id shared by all nodes")
    g.add_argument("--torchrun-arg", action="append", default=[], metavar="ARG",
                   help="extra torchrun option, e.g. --torchrun-arg=--local_addr=10.0.0.2 (repeatable)")
    g.add_argument("--print-command", action="store_true",
                   help="print the torchrun command this host would run, and exit")
    g = p.add_argument_group("spark launcher")
    g.add_argument("--spark-master", metavar="URL",
                   help="Spark master, e.g. spark://host:7077 or local-cluster[2,1,1024] (default: local[WORKERS])")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def options_from_args(args: argparse.Namespace) -> Dict[str, Any]:
    """The run's options as a JSON-able dict (what a cluster launcher hands to :func:`train_job`)."""
    return {"workers": args.workers, "mode": args.mode, "epochs": args.epochs,
            "batch_size": args.batch_size, "lr": args.lr, "optimizer": args.optimizer, "share": args.share,
            "compression": args.compression, "link": args.link, "frequency": args.frequency,
            "data": args.data,
            "seed": args.seed, "progress": not args.no_progress, "outer_lr": args.outer_lr,
            "outer_momentum": args.outer_momentum, "residual_decay": args.residual_decay,
            "error_feedback": args.error_feedback, "fragments": args.fragments, "overlap": args.overlap}


def local_steps_options(opts: Dict[str, Any]) -> Dict[str, Any]:
    """TrainConfig fields for --mode diloco / sparse_local (the averaging mode with a pseudo-gradient)."""
    from gradshare.compression import TopK

    mode = opts.get("mode")
    compression = parse_compression(opts.get("compression", "auto"))
    if mode == "sparse_local":
        compression = compression or TopK(SPARSE_LOCAL_DENSITY, values=SPARSE_LOCAL_VALUES)
    if isinstance(compression, TopK):     # a round is many steps: no per-step warm-up of the density
        compression = TopK(compression.density, chunk=compression.chunk, warmup_steps=0, values=compression.values)
    decay = opts.get("residual_decay")
    feedback = opts.get("error_feedback") or (SPARSE_LOCAL_ERROR_FEEDBACK if compression is not None else "buffer")
    lr, momentum = opts.get("outer_lr"), opts.get("outer_momentum")
    if mode == "diloco":
        lr = DILOCO_OUTER[0] if lr is None else lr
        momentum = DILOCO_OUTER[1] if momentum is None else momentum
    else:
        in_model = mode == "sparse_local" and feedback == "model"    # an outer lr by default (SPARSE_LOCAL_OUTER_LR)
        if in_model or lr is not None or momentum is not None:
            lr = (SPARSE_LOCAL_OUTER_LR if in_model else 1.0) if lr is None else lr
            momentum = 0.0 if momentum is None else momentum
    return {"mode": "averaging", "compression": compression, "fragments": int(opts.get("fragments") or 1),
            "overlap": int(opts.get("overlap") or 0), "error_feedback": feedback,
            "residual_decay": float(decay if decay is not None else SPARSE_LOCAL_DECAY
                                    if mode == "sparse_local" and feedback == "buffer" else 1.0),
            "outer_optimizer": None if lr is None else
            (torch.optim.SGD, {"lr": float(lr), "momentum": float(momentum), "nesterov": float(momentum) > 0})}


def build_config(opts: Dict[str, Any]) -> TrainConfig:
    """TrainConfig for the options (missing ones take the command's defaults): SmallCNN sized for the
    data, Adam or SGD (momentum 0.9). The keys' former names (averaging_frequency, threshold) are read too:
    options written by an earlier version still run."""
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
    extra: Dict[str, Any] = {"mode": mode}
    if mode in LOCAL_STEPS:
        extra = local_steps_options(opts)
    elif mode == "shared_gradients":
        extra["compression"] = parse_compression(opts.get("compression", opts.get("threshold", "auto")))
        extra["link"] = None if opts.get("link", "auto") == "off" else "auto"
        extra["error_feedback"] = opts.get("error_feedback")
    return TrainConfig(model=model, optimizer=optimizer, train_data=data, validation_data=data,
                       epochs=int(opts.get("epochs", 12)), batch_size=int(opts.get("batch_size", 32)),
                       shared=opts.get("share", "updates"),
                       frequency=int(opts.get("frequency", opts.get("averaging_frequency", 5))),
                       metrics=("loss", "accuracy"), seed=int(opts.get("seed", 0)),
                       progress=bool(opts.get("progress", True)), **extra)


def train_job(opts: Dict[str, Any], ctx: Any = None) -> Dict[str, Any]:
    """Per-rank entry for cluster launchers (gradshare.cluster.run): trains with :func:`train_rank` and
    returns a JSON-able summary (history, per-step records, seconds)."""
    out = train_rank(build_config(opts), ctx)
    return {"history": out["history"], "steps": out["steps"], "seconds": out["seconds"]}


def launch_options(args: argparse.Namespace) -> Dict[str, Any]:
    """The launcher's options (checkpoints, restarts, torchrun rendezvous, Spark master) as a dict."""
    every = args.checkpoint_every
    if every is None:
        every = 100 if args.max_restarts > 0 else 0
    return {"checkpoint_dir": args.checkpoint_dir, "checkpoint_every": every, "max_restarts": args.max_restarts,
            "timeout": args.timeout, "nnodes": args.nnodes, "node_rank": args.node_rank,
            "rdzv_endpoint": args.rdzv_endpoint, "rdzv_backend": args.rdzv_backend, "rdzv_id": args.rdzv_id,
            "torchrun_args": list(args.torchrun_arg), "spark_master": args.spark_master,
            "collective_timeout": args.collective_timeout}


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
    if args.launcher != "torchrun" and (args.rdzv_endpoint or args.nnodes != "1" or args.torchrun_arg
                                        or args.print_command):
        print("--nnodes, --rdzv-endpoint, --torchrun-arg and --print-command need --launcher torchrun",
              file=sys.stderr)
        return 2
    if args.nnodes != "1" and not args.rdzv_endpoint:
        print("--nnodes: a multi-host job needs --rdzv-endpoint HOST:PORT (a port on the first host)",
              file=sys.stderr)
        return 2
    if args.max_restarts and args.launcher == "local":
        print("--max-restarts needs --launcher torchrun or spark", file=sys.stderr)
        return 2
    if args.mode not in LOCAL_STEPS and (args.outer_lr is not None or args.outer_momentum is not None
                                         or args.residual_decay is not None or args.fragments is not None
                                         or args.overlap is not None):
        print("--outer-lr, --outer-momentum, --residual-decay, --fragments and --overlap need "
              "--mode diloco or sparse_local", file=sys.stderr)
        return 2
    if args.error_feedback is not None and args.mode not in LOCAL_STEPS and not (
            args.mode == "shared_gradients" and args.share == "updates"):
        print("--error-feedback needs --mode diloco, sparse_local, or shared_gradients with --share updates",
              file=sys.stderr)
        return 2
    if args.error_feedback == "model" and args.mode == "diloco" and args.compression == "auto":
        print("--error-feedback model: needs a compressed round (--mode sparse_local, or diloco with --compression)",
              file=sys.stderr)
        return 2
    if args.mode in LOCAL_STEPS and ((args.fragments or 1) > args.frequency
                                     or (args.overlap or 0) > args.frequency // (args.fragments or 1)):
        print(f"--fragments: at most --frequency ({args.frequency}); --overlap: at most --frequency / --fragments",
              file=sys.stderr)
        return 2
    opts = options_from_args(args)
    launch = launch_options(args)
    if args.print_command:
        print(shlex.join(torchrun_command(opts, launch, json.dumps(opts), python="python")))
        return 0
    work = tempfile.mkdtemp(prefix="gradshare-train-")
    if launch["checkpoint_every"] and not launch["checkpoint_dir"]:
        launch["checkpoint_dir"] = os.path.join(work, "checkpoints")
    launch["work_dir"] = work
    try:
        code = _run_and_report(args, opts, launch)
    except BaseException as exc:
        kept = launch["checkpoint_dir"] if launch["checkpoint_dir"] and launch["checkpoint_dir"].startswith(work) \
            and os.path.isdir(launch["checkpoint_dir"]) and os.listdir(launch["checkpoint_dir"]) else None
        if not kept:
            shutil.rmtree(work, ignore_errors=True)
        if isinstance(exc, LaunchError):
            print(f"gradshare train: {exc}", file=sys.stderr)
            if kept:
                print(f"checkpoints kept in {kept}: rerun with --checkpoint-dir {kept} to resume", file=sys.stderr)
            return 1
        raise
    shutil.rmtree(work, ignore_errors=True)
    return code


def _local_steps_text(opts: Dict[str, Any]) -> str:
    if opts["mode"] not in LOCAL_STEPS:
        return ""
    o = local_steps_options(opts)
    outer = o["outer_optimizer"]
    text = f", {o['compression'] or 'dense'}"
    if o["compression"] is not None:
        text += f", residual decay {o['residual_decay']:g}, error feedback in the {o['error_feedback']}"
    if o["fragments"] > 1 or o["overlap"]:
        text += f", {o['fragments']} fragments, overlap {o['overlap']} step" + ("" if o['overlap'] == 1 else "s")
    if not outer:
        return text
    kind = "Nesterov" if outer[1]["nesterov"] else "SGD"
    return text + f", outer {kind} lr {outer[1]['lr']:g} momentum {outer[1]['momentum']:g}"


def _run_and_report(args: argparse.Namespace, opts: Dict[str, Any], launch: Dict[str, Any]) -> int:
    print(f"gradshare train: SmallCNN on {opts['data']}, {opts['workers']} {args.launcher} workers, "
          f"{opts['mode']}" + (f" ({opts['share']}, compression {opts['compression']}"
                               + (", error feedback in the model" if opts.get("error_feedback") == "model" else "")
                               + ")"
                               if opts["mode"] == "shared_gradients"
                               else f" (every {opts['frequency']} steps{_local_steps_text(opts)})")
          + f", {opts['optimizer']} lr {opts['lr']:g}, {opts['epochs']} epochs, batch {opts['batch_size']} per worker",
          flush=True)
    t0 = time.perf_counter()
    result = LAUNCHERS[args.launcher](opts, launch)
    wall = time.perf_counter() - t0
    if result is None:
        print("this node's workers finished; rank 0 ran on another node, whose gradshare train reports the run")
        return 0
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
    ratio = f", {loop.vs_dense(sent, dense)}" if sent else ""
    print(f"bytes sent (all workers): {_fmt_bytes(sent)}; dense allreduce would have sent {_fmt_bytes(dense)}"
          f"{ratio}")
    densities = [h["density"] for h in history if h.get("density") is not None]
    if densities:
        print(f"entries sent per exchange: {100 * sum(densities) / len(densities):.2f}% (mean over epochs)")
    formats = [s.get("format") for s in steps if s.get("format")]
    if opts["mode"] == "shared_gradients" and opts.get("link", "auto") == "auto" and formats:
        n, half = sum(f == "allreduce" for f in formats), sum(f == "allreduce_bf16" for f in formats)
        print(f"link-aware: {n} of {len(formats)} steps by float32 all-reduce, "
              + (f"{half} by bfloat16 all-reduce, " if half else "")
              + f"{len(formats) - n - half} compressed (chosen from measured step times; --link off compresses "
              "every step)")
    if args.checkpoint_dir:
        print(f"checkpoints: {args.checkpoint_dir}")
    if args.metrics:
        write_csv(args.metrics, steps)
        print(f"per-step statistics: {args.metrics}")
    if args.plot:
        write_plot(args.plot, steps, history, f"{opts['mode']} x{opts['workers']} on {opts['data']}")
        print(f"plot: {args.plot}")
    return 0
