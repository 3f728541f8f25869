"""One contender's training run on one rank (started by torchrun; bench/e2e.py drives it).

Every contender trains the same model from the same seed on the same data order, batch size, optimizer and
steps; only the exchange differs. The MNIST workloads (``mnist_cnn``, ``mlp``) train with SGD + momentum
(``--lr``, ``--momentum``) for ``--epochs`` over gradshare.data.train_shard and are judged by test accuracy;
``char_lm`` is bench/workloads.py's recipe as bench/quality.py runs it (AdamW lr 3e-3, cosine decay over 300
steps, 16 windows per rank, its own batches) and is judged by validation loss (lower is better: the target
is a loss to get down to). Contenders with local steps take the averaging period from ``--period`` or from
a suffix: ``gradshare_diloco_h50`` averages every 50 steps. Measured per rank:

* wall time of training only (evaluation pauses the clock), each step's (``step_times``), and the metric at
  every evaluation (rank 0 evaluates the held-out data, with the threads of the ranks that wait for it at a
  broadcast);
* bytes sent: the interface's kernel tx counter (``/sys/class/net/<if>/statistics/tx_bytes``) summed over
  training segments only (GRADSHARE_NETNS_IFNAME, set by bench/netns.py), plus what the contender's own
  accounting says (gradshare's ``stats.bytes_sent``, ``ParameterAveraging.bytes_sent``);
* compute: median of a few local forward/backward/optimizer steps on a copy of the model, no exchange;
  encode: time spent inside the comm hook call before it returns its future (compression and launching
  the collective; work in the future's callbacks -- decompression, PowerSGD's second half, gradshare's
  decode -- counts as communicate); communicate: step time - compute - encode.

Writes one JSON file per rank (``--out`` with ``{rank}`` in it).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

os.environ.setdefault("RUST_LOG", "warn")   # torchft's Rust servers log every quorum at info (read at its import)

# contender name -> what it runs
CONTENDERS: Dict[str, str] = {
    "ddp_allreduce": "DDP, default float32 allreduce",
    "gradshare_auto": "DDP + gradshare threshold_hook with ThresholdState(optimizer=opt): the defaults (link-aware: "
                      "DDP's all-reduce where the link makes it faster, else the SGD's updates shared, the top 5% as "
                      "signs, what a step does not send waiting in each rank's model)",
    "gradshare_optimizer_auto": "gradshare SharedOptimizer(opt): the defaults (link-aware)",
    "gradshare_compressed": "DDP + gradshare threshold_hook with ThresholdState(optimizer=opt, link=None): the defaults' "
                            "compression at every step, whatever the link",
    "gradshare_buffer_auto": "gradshare_auto with error_feedback=\"buffer\": what a step does not send waits in "
                             "gradshare's residual (every rank's model the mean result at every point; top-k with 8-bit values "
                             "for SGD)",
    "gradshare_buffer_optimizer_auto": "gradshare_optimizer_auto with error_feedback=\"buffer\"",
    "gradshare_buffer_compressed": "gradshare_compressed with error_feedback=\"buffer\"",
    "gradshare_signs": "gradshare_buffer_compressed with the top entries sent as signs (compression=TopK(values=\"sign\")): "
                       "each +-its chunk's mean, positions Elias-Fano coded, ~8.6 bits an entry at 2% where 8-bit "
                       "values take 24",
    "gradshare_model": "DDP + gradshare threshold_hook with ThresholdState(optimizer=opt, error_feedback=\"model\", "
                       "compression=TopK(0.01, values=\"sign\")): what a step does not send waits in each rank's "
                       "model, the top 1% as signs (a fifth of the defaults' message); link-aware",
    "gradshare_model_compressed": "gradshare_model compressing every step (link=None)",
    "gradshare_delayed": "gradshare_compressed one step late (delay=1): each step's mean update applied at the end of "
                         "the next, its exchange overlapping that step; evaluated as it trains",
    "ddp_python_hook": "DDP + torch's own allreduce_hook (a Python comm hook doing DDP's float32 all-reduce)",
    "ddp_fp16": "DDP + fp16_compress_hook",
    "ddp_powersgd": "DDP + powerSGD_hook (rank 2, start_powerSGD_iter = 10% of steps)",
    "torch_averaging": "local SGD + PostLocalSGDOptimizer(PeriodicModelAverager(period))",
    "gradshare_hook": "DDP + gradshare threshold_hook (Adaptive, ResidualClipping)",
    "gradshare_optimizer": "gradshare SharedOptimizer (Adaptive, ResidualClipping)",
    "gradshare_averaging": "gradshare ParameterAveraging(frequency=period): parameters and optimizer state averaged",
    "gradshare_diloco": "gradshare ParameterAveraging as `gradshare train --mode diloco` sets it up: the mean change "
                        "every period steps through the outer optimizer (lr 1, no momentum), inner state local",
    "gradshare_sparse_local": "gradshare ParameterAveraging as `gradshare train --mode sparse_local` sets it up: every "
                              "period steps the change's top 4% as signs, what is not sent kept in each worker's model",
    "gradshare_ternary_local": "gradshare ParameterAveraging(compression=Ternary(), residual_decay=0.9): every period "
                               "steps the change ternary-coded (2 bits an element) with error feedback",
    "gradshare_streaming": "gradshare_diloco with streaming rounds (`--fragments 4 --overlap period/4`): a quarter of "
                           "the model every period/4 steps, each exchange travelling while the next period/4 steps train",
    "gradshare_ternary_model": "gradshare ParameterAveraging(compression=Ternary(), error_feedback=\"model\"): every "
                               "period steps the change ternary-coded, what is not sent kept in each worker's model",
    "gradshare_ternary_streaming": "gradshare_ternary_local whose exchange travels while the next step trains "
                                   "(overlap=1)",
    "gradshare_hook_dgc": "DDP + gradshare threshold_hook with momentum correction (momentum moved into the hook, "
                          "plain SGD), Adaptive(initial=dgc_initial_tau, decay=dgc_decay, warmup_steps=dgc_warmup_steps)",
    "gradshare_optimizer_dgc": "gradshare SharedOptimizer(plain SGD, momentum=momentum), "
                               "Adaptive(initial=dgc_initial_tau, decay=dgc_decay, warmup_steps=dgc_warmup_steps)",
    "torchft_diloco": "torchft DiLoCo (each rank a replica group, lighthouse on rank 0, torchft's gloo group): the "
                      "mean change every period steps through SGD(lr 0.7, momentum 0.9, Nesterov), inner state local",
}
WORKLOADS = ("mnist_cnn", "mlp", "char_lm")
LOSS_WORKLOADS = ("char_lm",)       # judged by validation loss, trained with bench/workloads.py's recipe
# contenders that talk once every `period` steps: the period can be given as a suffix, NAME_hPERIOD
PERIODIC = ("torch_averaging", "gradshare_averaging", "gradshare_diloco", "gradshare_sparse_local",
            "gradshare_ternary_local", "gradshare_ternary_model", "gradshare_streaming", "gradshare_ternary_streaming",
            "torchft_diloco")


def metric_of(workload: str) -> str:
    """What a workload is judged by: "accuracy" (higher is better) or "loss" (lower is better)."""
    return "loss" if workload in LOSS_WORKLOADS else "accuracy"


def reached(value: float, target: float, metric: str) -> bool:
    return value <= target if metric == "loss" else value >= target


def split_period(contender: str) -> Tuple[str, Optional[int]]:
    """``gradshare_diloco_h50`` -> ("gradshare_diloco", 50); a name without a period suffix -> (name, None)."""
    base, sep, h = contender.rpartition("_h")
    if sep and h.isdigit() and int(h) > 0 and base in PERIODIC:
        return base, int(h)
    return contender, None


def describe(contender: str) -> str:
    base, period = split_period(contender)
    return CONTENDERS[base] + (f", period {period}" if period else "")


def missing_reason(contender: str) -> Optional[str]:
    """Why a contender cannot run in this environment (its gradshare module is absent), else None."""
    contender = split_period(contender)[0]
    need = {"gradshare_auto": ("gradshare.hooks", ("ThresholdState", "threshold_hook")),
            "gradshare_buffer_auto": ("gradshare.hooks", ("ThresholdState", "threshold_hook")),
            "gradshare_buffer_compressed": ("gradshare.hooks", ("ThresholdState", "threshold_hook")),
            "gradshare_buffer_optimizer_auto": ("gradshare.optim", ("SharedOptimizer",)),
            "gradshare_compressed": ("gradshare.hooks", ("ThresholdState", "threshold_hook")),
            "gradshare_signs": ("gradshare.hooks", ("ThresholdState", "threshold_hook")),
            "gradshare_delayed": ("gradshare.hooks", ("ThresholdState", "threshold_hook")),
            "gradshare_model": ("gradshare.hooks", ("ThresholdState", "threshold_hook")),
            "gradshare_model_compressed": ("gradshare.hooks", ("ThresholdState", "threshold_hook")),
            "gradshare_optimizer_auto": ("gradshare.optim", ("SharedOptimizer",)),
            "gradshare_hook": ("gradshare.hooks", ("ThresholdState", "threshold_hook")),
            "gradshare_optimizer": ("gradshare.optim", ("SharedOptimizer",)),
            "gradshare_hook_dgc": ("gradshare.hooks", ("ThresholdState", "threshold_hook")),
            "gradshare_optimizer_dgc": ("gradshare.optim", ("SharedOptimizer",)),
            "gradshare_averaging": ("gradshare.averaging", ("ParameterAveraging",)),
            "gradshare_diloco": ("gradshare.train", ("local_steps_options",)),
            "gradshare_sparse_local": ("gradshare.train", ("local_steps_options",)),
            "gradshare_ternary_local": ("gradshare.averaging", ("ParameterAveraging",)),
            "gradshare_ternary_model": ("gradshare.averaging", ("ParameterAveraging",)),
            "gradshare_streaming": ("gradshare.train", ("local_steps_options",)),
            "gradshare_ternary_streaming": ("gradshare.averaging", ("ParameterAveraging",)),
            "torchft_diloco": ("torchft.local_sgd", ("DiLoCo",))}.get(contender)
    if contender not in CONTENDERS:
        return f"unknown contender {contender!r}"
    if need is None:
        return None
    import importlib

    try:
        mod = importlib.import_module(need[0])
    except ImportError as exc:
        return f"{need[0]} not importable ({exc})"
    absent = [n for n in need[1] if not hasattr(mod, n)]
    return f"{need[0]} lacks {', '.join(absent)}" if absent else None


# ------------------------------------------------------------------------------------------------ workloads
def build_model(workload: str) -> nn.Module:
    if workload == "mnist_cnn":
        from gradshare.models import SmallCNN

        return SmallCNN(in_channels=1, num_classes=10, image_size=28)
    if workload == "mlp":
        from workloads import MLP

        return MLP()
    if workload in LOSS_WORKLOADS:
        import workloads

        return workloads.WORKLOADS[workload].model()
    raise ValueError(f"unknown workload {workload!r} (use {', '.join(WORKLOADS)})")


def load_data(data_dir: str, train_subset: int, test_subset: int, seed: int):
    from gradshare.data import load_mnist

    train, test = load_mnist(data_dir)
    g = torch.Generator().manual_seed(seed)
    xtr, ytr = train.tensors
    xte, yte = test.tensors
    if 0 < train_subset < len(ytr):
        idx = torch.randperm(len(ytr), generator=g)[:train_subset]
        xtr, ytr = xtr[idx], ytr[idx]
    if 0 < test_subset < len(yte):
        xte, yte = xte[:test_subset], yte[:test_subset]
    return (xtr, ytr), (xte, yte)


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 1000) -> float:
    was = model.training
    model.eval()
    correct = 0
    for i in range(0, len(y), batch):
        correct += int((model(x[i:i + batch]).argmax(1) == y[i:i + batch]).sum())
    model.train(was)
    return correct / max(1, len(y))


class Task:
    """One workload as every contender trains it: its batches in order, optimizer, lr schedule, loss and metric.

    MNIST workloads: SGD (--lr, --momentum) at a constant lr, --epochs over gradshare.data.train_shard, test
    accuracy. Loss workloads: bench/workloads.py's recipe exactly as bench/quality.py trains it (its optimizer,
    batch, steps, cosine decay to zero and batches), validation loss."""

    def __init__(self, args, rank: int, world: int):
        self.workload, self.metric, self.rank, self.world = args.workload, metric_of(args.workload), rank, world
        self.seed, self.epochs = args.seed, args.epochs
        self.optimizers: list = []                  # every inner optimizer made (the schedule drives them)
        if self.metric == "loss":
            import workloads

            self.recipe = workloads.WORKLOADS[args.workload]
            self.data = workloads.Data(args.workload, args.seed)
            self.batch_size, self.total_steps = self.recipe.batch, self.recipe.steps
            self.steps_per_epoch = self.total_steps
            self._make = self.recipe.optimizer
        else:
            (self.xtr, self.ytr), (self.xte, self.yte) = load_data(args.data_dir, args.train_subset,
                                                                   args.test_subset, args.seed)
            self.batch_size = args.batch_size
            per_rank = -(-len(self.ytr) // world)
            self.steps_per_epoch = -(-per_rank // args.batch_size)
            self.total_steps = self.steps_per_epoch * args.epochs
            self._make = lambda ps: torch.optim.SGD(ps, lr=args.lr, momentum=args.momentum)

    def optimizer(self, params) -> torch.optim.Optimizer:
        opt = self._make(params)
        self.optimizers.append(opt)
        return opt

    def schedulers(self) -> list:
        """The lr schedule on the inner optimizer the contender made (quality.py's: cosine to zero), if any."""
        if self.metric != "loss":
            return []
        return [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=self.total_steps) for o in self.optimizers[-1:]]

    def batches(self):
        """(inputs, targets) of every training step, in order."""
        if self.metric == "loss":
            for step in range(self.total_steps):
                yield self.data.batch(step, self.rank, self.world, self.batch_size)
            return
        from gradshare.data import train_shard

        for epoch in range(self.epochs):
            order = train_shard(len(self.ytr), self.rank, self.world, seed=self.seed, epoch=epoch)
            for i in range(0, len(order), self.batch_size):
                idx = order[i:i + self.batch_size]
                yield self.xtr[idx], self.ytr[idx]

    @staticmethod
    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))

    def evaluate(self, model: nn.Module) -> float:
        return self.data.evaluate(model) if self.metric == "loss" else evaluate(model, self.xte, self.yte)


# ------------------------------------------------------------------------------------------------ bytes
def tx_bytes() -> int:
    ifname = os.environ.get("GRADSHARE_NETNS_IFNAME", "lo")
    try:
        with open(f"/sys/class/net/{ifname}/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return -1


# ------------------------------------------------------------------------------------------------ contenders
class Timer:
    def __init__(self):
        self.seconds = 0.0

    def wrap(self, hook: Callable) -> Callable:
        def timed_hook(state, bucket):  # the parameter must be named "bucket" (DDP checks it)
            t0 = time.perf_counter()
            fut = hook(state, bucket)
            self.seconds += time.perf_counter() - t0
            return fut

        return timed_hook


def setup_contender(contender: str, model: nn.Module, args, task: Task, timer: Timer):
    """Returns (module to call, optimizer-like with zero_grad/step, info dict, accounting callable)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    name, period = split_period(contender)
    period = period or args.period
    total_steps = task.total_steps
    sgd = task.optimizer                    # the workload's optimizer (SGD + momentum on MNIST, AdamW on the LM)
    info: dict = {}
    account = lambda: None  # noqa: E731  (library's own byte accounting, where it has one)

    def plain_sgd(params):                  # momentum correction: the momentum moves into gradshare
        if task.metric == "loss":
            raise ValueError(f"{name}: momentum correction needs an SGD workload, not {task.workload}")
        return task.optimizer([{"params": list(params), "momentum": 0.0}])

    def dgc_config():
        from gradshare.thresholds import Adaptive, ResidualClipping

        info.update(momentum_correction=args.momentum, initial_tau=args.dgc_initial_tau, decay=args.dgc_decay,
                    warmup_steps=args.dgc_warmup_steps, residual_clipping=args.dgc_clipping)
        th = Adaptive(initial=args.dgc_initial_tau, decay=args.dgc_decay, warmup_steps=args.dgc_warmup_steps)
        return th, (ResidualClipping() if args.dgc_clipping else None)

    if name in ("ddp_allreduce", "ddp_python_hook", "ddp_fp16", "ddp_powersgd", "gradshare_auto", "gradshare_compressed",
                "gradshare_signs", "gradshare_delayed", "gradshare_model", "gradshare_model_compressed",
                "gradshare_buffer_auto", "gradshare_buffer_compressed", "gradshare_hook", "gradshare_hook_dgc"):
        if name == "ddp_powersgd":
            # One bucket: on gloo, powerSGD_hook issues its Q allreduce from the P allreduce's callback, which
            # races with the next bucket's hook, so ranks can order collectives differently and gloo aborts
            # ("Received data size doesn't match expected size"). A single bucket has one P-then-Q chain.
            cap = math.ceil(4 * sum(p.numel() for p in model.parameters()) / 2**20) + 1
            ddp = DDP(model, bucket_cap_mb=cap)
            info["bucket_cap_mb"] = cap
        else:
            ddp = DDP(model)
        if name in ("ddp_fp16", "ddp_python_hook"):
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            hook = default_hooks.fp16_compress_hook if name == "ddp_fp16" else default_hooks.allreduce_hook
            ddp.register_comm_hook(None, timer.wrap(hook))
        elif name == "ddp_powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

            start = max(2, int(round(0.1 * total_steps)))
            state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=args.powersgd_rank,
                                     start_powerSGD_iter=start, min_compression_rate=2, use_error_feedback=True,
                                     warm_start=True, random_seed=args.seed)
            ddp.register_comm_hook(state, timer.wrap(ps.powerSGD_hook))
            info.update(start_powerSGD_iter=start, matrix_approximation_rank=args.powersgd_rank)
        elif name in ("gradshare_auto", "gradshare_compressed", "gradshare_signs", "gradshare_delayed",
                      "gradshare_model", "gradshare_model_compressed", "gradshare_buffer_auto",
                      "gradshare_buffer_compressed"):
            from gradshare.compression import TopK
            from gradshare.hooks import ThresholdState, threshold_hook

            opt = sgd(ddp.parameters())
            kwargs = {"gradshare_auto": {}, "gradshare_compressed": {"link": None},
                      "gradshare_signs": {"link": None, "compression": TopK(values="sign"), "error_feedback": "buffer"},
                      "gradshare_delayed": {"link": None, "delay": 1},
                      "gradshare_model": {"error_feedback": "model", "compression": TopK(0.01, values="sign")},
                      "gradshare_model_compressed": {"link": None, "error_feedback": "model",
                                                     "compression": TopK(0.01, values="sign")},
                      "gradshare_buffer_auto": {"error_feedback": "buffer"},
                      "gradshare_buffer_compressed": {"link": None, "error_feedback": "buffer"}}[name]
            state = ThresholdState(optimizer=opt, **kwargs)
            ddp.register_comm_hook(state, timer.wrap(threshold_hook))
            info["compression"] = repr(state.sharing.compression)
            account = lambda: {"bytes_sent": state.stats.bytes_sent, "dense_bytes": state.stats.dense_bytes,  # noqa
                               "summary": _jsonable(state.stats.summary()), "link": _link(state.sharing)}
            return ddp, opt, info, account
        elif name == "gradshare_hook":
            from gradshare.hooks import ThresholdState, threshold_hook
            from gradshare.thresholds import Adaptive, ResidualClipping

            state = ThresholdState(process_group=None, compression=Adaptive(initial=args.initial_tau),
                                   clipping=ResidualClipping())
            ddp.register_comm_hook(state, timer.wrap(threshold_hook))
            info["initial_tau"] = args.initial_tau
            account = lambda: {"bytes_sent": state.stats.bytes_sent, "dense_bytes": state.stats.dense_bytes,  # noqa
                               "summary": _jsonable(state.stats.summary())}
        elif name == "gradshare_hook_dgc":
            from gradshare.hooks import ThresholdState, threshold_hook

            th, clipping = dgc_config()
            state = ThresholdState(process_group=None, compression=th, clipping=clipping, momentum=args.momentum)
            ddp.register_comm_hook(state, timer.wrap(threshold_hook))
            account = lambda: {"bytes_sent": state.stats.bytes_sent, "dense_bytes": state.stats.dense_bytes,  # noqa
                               "summary": _jsonable(state.stats.summary())}
            return ddp, plain_sgd(ddp.parameters()), info, account
        return ddp, sgd(ddp.parameters()), info, account
    if name == "torch_averaging":
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        from torch.distributed.optim import PostLocalSGDOptimizer

        opt = PostLocalSGDOptimizer(sgd(model.parameters()), PeriodicModelAverager(period=period, warmup_steps=0))
        info["period"] = period
        return model, opt, info, account
    if name in ("gradshare_optimizer_auto", "gradshare_buffer_optimizer_auto"):
        from gradshare.optim import SharedOptimizer

        opt = SharedOptimizer(sgd(model.parameters()),
                              **({"error_feedback": "buffer"} if name == "gradshare_buffer_optimizer_auto" else {}))
        info["compression"] = repr(opt.compression)
        account = lambda: {"bytes_sent": opt.stats.bytes_sent, "dense_bytes": opt.stats.dense_bytes,  # noqa: E731
                           "summary": _jsonable(opt.stats.summary()), "link": _link(opt.sharing)}
        return model, opt, info, account
    if name == "gradshare_optimizer":
        from gradshare.optim import SharedOptimizer
        from gradshare.thresholds import Adaptive, ResidualClipping

        opt = SharedOptimizer(sgd(model.parameters()), mode="gradients", compression=Adaptive(initial=args.initial_tau),
                              clipping=ResidualClipping())
        info["initial_tau"] = args.initial_tau
        account = lambda: {"bytes_sent": opt.stats.bytes_sent, "dense_bytes": opt.stats.dense_bytes,  # noqa: E731
                           "summary": _jsonable(opt.stats.summary())}
        return model, opt, info, account
    if name == "gradshare_optimizer_dgc":
        from gradshare.optim import SharedOptimizer

        th, clipping = dgc_config()
        opt = SharedOptimizer(plain_sgd(model.parameters()), mode="gradients", compression=th, clipping=clipping,
                              momentum=args.momentum)
        account = lambda: {"bytes_sent": opt.stats.bytes_sent, "dense_bytes": opt.stats.dense_bytes,  # noqa: E731
                           "summary": _jsonable(opt.stats.summary())}
        return model, opt, info, account
    if name == "gradshare_averaging":
        from gradshare.averaging import ParameterAveraging

        opt = ParameterAveraging(model, sgd(model.parameters()), frequency=period)
        info["period"] = period
        account = lambda: {"bytes_sent": opt.bytes_sent, "dense_bytes": opt.dense_bytes}  # noqa: E731
        return model, opt, info, account
    if name in ("gradshare_diloco", "gradshare_sparse_local", "gradshare_ternary_local", "gradshare_ternary_model",
                "gradshare_streaming", "gradshare_ternary_streaming"):
        from gradshare.averaging import ParameterAveraging
        from gradshare.compression import Ternary
        from gradshare.train import local_steps_options

        if name in ("gradshare_ternary_local", "gradshare_ternary_streaming"):
            kwargs = {"compression": Ternary(), "residual_decay": 0.9,
                      "overlap": int(name == "gradshare_ternary_streaming")}
        elif name == "gradshare_ternary_model":
            kwargs = {"compression": Ternary(), "residual_decay": 1.0, "error_feedback": "model"}
        else:                               # what `gradshare train --mode diloco / sparse_local` sets up
            streaming = {"fragments": 4, "overlap": period // 4} if name == "gradshare_streaming" else {}
            o = local_steps_options({"mode": "sparse_local" if name == "gradshare_sparse_local" else "diloco",
                                     **streaming})
            outer = o["outer_optimizer"]
            kwargs = {"compression": o["compression"], "residual_decay": o["residual_decay"],
                      "fragments": o["fragments"], "overlap": o["overlap"], "error_feedback": o["error_feedback"],
                      "outer_optimizer": None if outer is None else (lambda ps, c=outer: c[0](ps, **c[1]))}
            info["outer_optimizer"] = None if outer is None else f"{outer[0].__name__}({outer[1]})"
        opt = ParameterAveraging(model, sgd(model.parameters()), frequency=period, **kwargs)
        info.update(period=period, compression=repr(kwargs["compression"]), residual_decay=kwargs["residual_decay"])
        account = lambda: {"bytes_sent": opt.bytes_sent, "dense_bytes": opt.dense_bytes}  # noqa: E731
        return model, opt, info, account
    if name == "torchft_diloco":            # one replica group per rank, as torchft's DiLoCo tests set it up
        import contextlib
        import importlib.metadata
        import socket
        from datetime import timedelta
        from types import SimpleNamespace

        from gradshare.costmodel import ring_allreduce_bytes
        from torchft.coordination import LighthouseServer
        from torchft.local_sgd import DiLoCo
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        rank, world = dist.get_rank(), dist.get_world_size()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:   # this rank's address on the way to rank 0
            s.connect((os.environ["MASTER_ADDR"], 9))
            host = s.getsockname()[0]
        stack, lighthouse = contextlib.ExitStack(), [None]
        if rank == 0:
            server = LighthouseServer(bind="0.0.0.0:0", min_replicas=world)
            stack.callback(server.shutdown)
            lighthouse[0] = f"http://{host}:{server.address().rsplit(':', 1)[1]}"
        dist.broadcast_object_list(lighthouse, 0)
        stack.callback(dist.barrier)            # the lighthouse goes last
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)   # the replica group's own store
        timeout = timedelta(seconds=300)
        manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None,
                          min_replica_size=world, use_async_quorum=False, init_sync=False,  # same seed, same start
                          replica_id=str(rank), rank=0, world_size=1, store_addr=host, store_port=store.port,
                          lighthouse_addr=lighthouse[0], hostname=host, timeout=timeout, quorum_timeout=timeout)
        stack.callback(manager.shutdown)
        sent, allreduce = [0], manager.allreduce

        def counted_allreduce(t, *a, **k):
            sent[0] += ring_allreduce_bytes(world, t.numel(), t.element_size())
            return allreduce(t, *a, **k)

        manager.allreduce = counted_allreduce
        inner = sgd(model.parameters())
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        stack.enter_context(DiLoCo(manager, [model], inner, outer, sync_every=period))
        info.update(period=period, outer_optimizer="SGD(lr=0.7, momentum=0.9, nesterov=True)",
                    torchft=importlib.metadata.version("torchft"))
        account = lambda: {"bytes_sent": sent[0], "dense_bytes": sent[0]}  # noqa: E731
        opt = SimpleNamespace(zero_grad=inner.zero_grad, step=lambda: inner.step(), close=stack.close, store=store)
        return model, opt, info, account
    raise ValueError(f"unknown contender {name!r}")


def _link(sharing) -> Optional[dict]:
    """The link-aware choice and the step times it was made from (None without one)."""
    link = getattr(sharing, "link", None)
    return None if link is None else _jsonable(link.summary())


def _jsonable(x):
    return json.loads(json.dumps(x, default=lambda o: str(o)))


def calibrate_compute(model: nn.Module, task: Task, x: torch.Tensor, y: torch.Tensor, steps: int = 4) -> float:
    """Median seconds of a local forward/backward/optimizer step on a copy of the model (no exchange)."""
    m = copy.deepcopy(model)
    opt = task._make(m.parameters())
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        task.loss(m(x), y).backward()
        opt.step()
        if i:
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


# ------------------------------------------------------------------------------------------------ main
def run(args) -> dict:
    from gradshare.cluster import _init_process_group   # the torchrun environment, as the cluster trainer joins it
    from gradshare import process_group

    torch.set_num_threads(1)
    _init_process_group("gloo", collective_timeout=300.0)
    rank, world = dist.get_rank(), dist.get_world_size()
    task = Task(args, rank, world)
    torch.manual_seed(args.seed)
    model = build_model(args.workload)
    params = sum(p.numel() for p in model.parameters())
    shapes = [list(p.shape) for p in model.parameters()]
    compute = calibrate_compute(model, task, *next(iter(task.batches())))
    timer = Timer()
    net, opt, info, account = setup_contender(args.contender, model, args, task, timer)
    schedulers = task.schedulers()
    dist.barrier()

    history, train_time, step, steps_timed, step_times = [], 0.0, 0, 0, []
    sent, stop = 0, False
    time_to_target = None

    def checkpoint(final: bool = False) -> bool:
        """Pauses the clock, evaluates on rank 0, broadcasts whether to stop (time budget)."""
        nonlocal time_to_target
        if rank == 0:
            # off the clock, and the other ranks wait at the broadcast below: let rank 0 use their cores
            threads = torch.get_num_threads()
            torch.set_num_threads(max(threads, min(world, os.cpu_count() or 1)))
            value = task.evaluate(model)
            torch.set_num_threads(threads)
            history.append({"time": train_time, "step": step, "value": value})
            if time_to_target is None and reached(value, args.target, task.metric):
                time_to_target = train_time
        flag = torch.tensor([1 if (rank == 0 and args.max_train_seconds and train_time >= args.max_train_seconds)
                             else 0])
        dist.broadcast(flag, 0)
        return bool(flag.item()) and not final

    checkpoint()
    for x, y in task.batches():
        tx0 = tx_bytes()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = task.loss(net(x), y)
        loss.backward()
        opt.step()
        for sched in schedulers:
            sched.step()
        step_times.append(time.perf_counter() - t0)
        train_time += step_times[-1]
        sent += tx_bytes() - tx0
        step += 1
        steps_timed += 1
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"{args.contender}: non-finite loss at step {step}")
        if step % args.eval_every == 0 and checkpoint():
            stop = True
            break
    if step % args.eval_every != 0:          # the same decision on every rank (a collective follows)
        checkpoint(final=True)
    step_time = train_time / max(1, steps_timed)
    encode = timer.seconds / max(1, steps_timed)
    out = {
        "contender": args.contender, "workload": args.workload, "metric": task.metric, "rank": rank,
        "world_size": world, "params": params, "shapes": shapes, "steps": step,
        "steps_per_epoch": task.steps_per_epoch, "epochs_planned": args.epochs, "stopped_by_time_budget": stop,
        "batch_size": task.batch_size, "train_time": train_time, "step_time": step_time, "step_times": step_times,
        "compute": compute,
        "encode": encode, "communicate": max(0.0, step_time - compute - encode),
        "tx_bytes_train": sent, "tx_bytes_per_step": sent / max(1, steps_timed),
        "history": history, "time_to_target": time_to_target, "target": args.target,
        "final_metric": history[-1]["value"] if history else None, "info": info,
        "library_accounting": account(), "ifname": os.environ.get("GRADSHARE_NETNS_IFNAME", "lo"),
    }
    path = args.out.format(rank=rank)
    with open(path, "w") as f:
        json.dump(out, f)
    dist.barrier()
    if hasattr(opt, "close"):               # torchft_diloco: its manager and lighthouse
        opt.close()
    process_group.destroy_process_group()
    return out


def contender_name(text: str) -> str:
    """argparse type: a contender, or a periodic one with its period (``gradshare_diloco_h50``)."""
    if split_period(text)[0] not in CONTENDERS:
        raise argparse.ArgumentTypeError(f"unknown contender {text!r} (choose from {', '.join(sorted(CONTENDERS))}; "
                                         f"{', '.join(PERIODIC)} take a period suffix such as _h20)")
    return text


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--contender", required=True, type=contender_name)
    ap.add_argument("--workload", default="mnist_cnn", choices=WORKLOADS)
    ap.add_argument("--data-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data", "mnist"))
    ap.add_argument("--train-subset", type=int, default=0, help="0: all 60k")
    ap.add_argument("--test-subset", type=int, default=0, help="0: all 10k")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=32, help="per worker (MNIST workloads; char_lm: its recipe's)")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=25, help="steps between test evaluations")
    ap.add_argument("--target", type=float, default=0.95,
                    help="time to target: the test accuracy to reach, or for char_lm the validation loss to get down to")
    ap.add_argument("--max-train-seconds", type=float, default=0.0, help="stop at an evaluation past this (0: none)")
    ap.add_argument("--period", type=int, default=5, help="averaging period (steps) of periodic contenders without a _hN suffix")
    ap.add_argument("--powersgd-rank", type=int, default=2)
    ap.add_argument("--initial-tau", type=float, default=1e-3, help="gradshare Adaptive initial threshold")
    ap.add_argument("--dgc-initial-tau", type=float, default=0.01,
                    help="*_dgc contenders: Adaptive initial threshold (velocities are ~1/(1-momentum) x gradients)")
    ap.add_argument("--dgc-decay", type=float, default=0.8, help="*_dgc contenders: Adaptive decay per step")
    ap.add_argument("--dgc-warmup-steps", type=int, default=0, help="*_dgc contenders: Adaptive density warm-up")
    ap.add_argument("--dgc-clipping", type=int, default=0, help="*_dgc contenders: 1 = ResidualClipping()")
    ap.add_argument("--out", required=True, help="JSON path per rank, with {rank}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    a = p.parse_args()
    reason = missing_reason(a.contender)
    if reason:
        print(f"SKIP {a.contender}: {reason}", flush=True)
        sys.exit(3)
    run(a)
