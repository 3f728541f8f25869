"""One contender's training run on one rank (started by torchrun; bench/e2e.py drives it).

Every contender trains the same model from the same seed on the same data order (gradshare.data.train_shard),
batch size, optimizer (SGD + momentum) and epochs; only the exchange differs. Measured per rank:

* wall time of training only (evaluation pauses the clock), and test accuracy at every evaluation
  (rank 0 evaluates the full test subset, with the threads of the ranks that wait for it at a broadcast);
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
from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

# contender name -> what it runs
CONTENDERS: Dict[str, str] = {
    "ddp_allreduce": "DDP, default float32 allreduce",
    "gradshare_auto": "DDP + gradshare threshold_hook with ThresholdState(optimizer=opt): the defaults (link-aware: "
                      "DDP's all-reduce where the link makes it faster, else the SGD's updates shared, top-k)",
    "gradshare_optimizer_auto": "gradshare SharedOptimizer(opt): the defaults (link-aware)",
    "gradshare_compressed": "DDP + gradshare threshold_hook with ThresholdState(optimizer=opt, link=None): the defaults' "
                            "compression at every step, whatever the link",
    "ddp_fp16": "DDP + fp16_compress_hook",
    "ddp_powersgd": "DDP + powerSGD_hook (rank 2, start_powerSGD_iter = 10% of steps)",
    "torch_averaging": "local SGD + PostLocalSGDOptimizer(PeriodicModelAverager(period))",
    "gradshare_hook": "DDP + gradshare threshold_hook (Adaptive, ResidualClipping)",
    "gradshare_optimizer": "gradshare SharedOptimizer (Adaptive, ResidualClipping)",
    "gradshare_averaging": "gradshare ParameterAveraging(frequency=period)",
    "gradshare_hook_dgc": "DDP + gradshare threshold_hook with momentum correction (momentum moved into the hook, "
                          "plain SGD), Adaptive(initial=dgc_initial_tau, decay=dgc_decay, warmup_steps=dgc_warmup_steps)",
    "gradshare_optimizer_dgc": "gradshare SharedOptimizer(plain SGD, momentum=momentum), "
                               "Adaptive(initial=dgc_initial_tau, decay=dgc_decay, warmup_steps=dgc_warmup_steps)",
}
WORKLOADS = ("mnist_cnn", "mlp")


def missing_reason(contender: str) -> Optional[str]:
    """Why a contender cannot run in this environment (its gradshare module is absent), else None."""
    need = {"gradshare_auto": ("gradshare.hooks", ("ThresholdState", "threshold_hook")),
            "gradshare_compressed": ("gradshare.hooks", ("ThresholdState", "threshold_hook")),
            "gradshare_optimizer_auto": ("gradshare.optim", ("SharedOptimizer",)),
            "gradshare_hook": ("gradshare.hooks", ("ThresholdState", "threshold_hook")),
            "gradshare_optimizer": ("gradshare.optim", ("SharedOptimizer",)),
            "gradshare_hook_dgc": ("gradshare.hooks", ("ThresholdState", "threshold_hook")),
            "gradshare_optimizer_dgc": ("gradshare.optim", ("SharedOptimizer",)),
            "gradshare_averaging": ("gradshare.averaging", ("ParameterAveraging",))}.get(contender)
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


# ------------------------------------------------------------------------------------------------ models
def build_model(workload: str) -> nn.Module:
    if workload == "mnist_cnn":
        from gradshare.models import SmallCNN

        return SmallCNN(in_channels=1, num_classes=10, image_size=28)
    if workload == "mlp":
        from workloads import MLP

        return MLP()
    raise ValueError(f"unknown workload {workload!r} (use {', '.join(WORKLOADS)})")


# ------------------------------------------------------------------------------------------------ data
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


def setup_contender(name: str, model: nn.Module, args, total_steps: int, timer: Timer):
    """Returns (module to call, optimizer-like with zero_grad/step, info dict, accounting callable)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    sgd = lambda params: torch.optim.SGD(params, lr=args.lr, momentum=args.momentum)  # noqa: E731
    info: dict = {}
    account = lambda: None  # noqa: E731  (library's own byte accounting, where it has one)
    plain_sgd = lambda params: torch.optim.SGD(params, lr=args.lr)  # noqa: E731  (momentum correction)

    def dgc_config():
        from gradshare.thresholds import Adaptive, ResidualClipping

        info.update(momentum_correction=args.momentum, initial_tau=args.dgc_initial_tau, decay=args.dgc_decay,
                    warmup_steps=args.dgc_warmup_steps, residual_clipping=args.dgc_clipping)
        th = Adaptive(initial=args.dgc_initial_tau, decay=args.dgc_decay, warmup_steps=args.dgc_warmup_steps)
        return th, (ResidualClipping() if args.dgc_clipping else None)

    if name in ("ddp_allreduce", "ddp_fp16", "ddp_powersgd", "gradshare_auto", "gradshare_compressed", "gradshare_hook",
                "gradshare_hook_dgc"):
        if name == "ddp_powersgd":
            # One bucket: on gloo, powerSGD_hook issues its Q allreduce from the P allreduce's callback, which
            # races with the next bucket's hook, so ranks can order collectives differently and gloo aborts
            # ("Received data size doesn't match expected size"). A single bucket has one P-then-Q chain.
            cap = math.ceil(4 * sum(p.numel() for p in model.parameters()) / 2**20) + 1
            ddp = DDP(model, bucket_cap_mb=cap)
            info["bucket_cap_mb"] = cap
        else:
            ddp = DDP(model)
        if name == "ddp_fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(None, timer.wrap(default_hooks.fp16_compress_hook))
        elif name == "ddp_powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

            start = max(2, int(round(0.1 * total_steps)))
            state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=args.powersgd_rank,
                                     start_powerSGD_iter=start, min_compression_rate=2, use_error_feedback=True,
                                     warm_start=True, random_seed=args.seed)
            ddp.register_comm_hook(state, timer.wrap(ps.powerSGD_hook))
            info.update(start_powerSGD_iter=start, matrix_approximation_rank=args.powersgd_rank)
        elif name in ("gradshare_auto", "gradshare_compressed"):
            from gradshare.hooks import ThresholdState, threshold_hook

            opt = sgd(ddp.parameters())
            state = ThresholdState(optimizer=opt) if name == "gradshare_auto" else ThresholdState(optimizer=opt, link=None)
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

        opt = PostLocalSGDOptimizer(sgd(model.parameters()), PeriodicModelAverager(period=args.period, warmup_steps=0))
        info["period"] = args.period
        return model, opt, info, account
    if name == "gradshare_optimizer_auto":
        from gradshare.optim import SharedOptimizer

        opt = SharedOptimizer(sgd(model.parameters()))
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

        opt = ParameterAveraging(model, sgd(model.parameters()), frequency=args.period)
        info["period"] = args.period
        account = lambda: {"bytes_sent": opt.bytes_sent, "dense_bytes": opt.dense_bytes}  # noqa: E731
        return model, opt, info, account
    raise ValueError(f"unknown contender {name!r}")


def _link(sharing) -> Optional[dict]:
    """The link-aware choice and the step times it was made from (None without one)."""
    link = getattr(sharing, "link", None)
    return None if link is None else _jsonable(link.summary())


def _jsonable(x):
    return json.loads(json.dumps(x, default=lambda o: str(o)))


def calibrate_compute(model: nn.Module, x: torch.Tensor, y: torch.Tensor, args, steps: int = 4) -> float:
    """Median seconds of a local forward/backward/SGD step on a copy of the model (no exchange)."""
    m = copy.deepcopy(model)
    opt = torch.optim.SGD(m.parameters(), lr=args.lr, momentum=args.momentum)
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(m(x), y).backward()
        opt.step()
        if i:
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


# ------------------------------------------------------------------------------------------------ main
def run(args) -> dict:
    from gradshare.cluster import _init_process_group   # the torchrun environment, as the cluster trainer joins it
    from gradshare import process_group
    from gradshare.data import train_shard

    torch.set_num_threads(1)
    _init_process_group("gloo", collective_timeout=300.0)
    rank, world = dist.get_rank(), dist.get_world_size()
    (xtr, ytr), (xte, yte) = load_data(args.data_dir, args.train_subset, args.test_subset, args.seed)
    torch.manual_seed(args.seed)
    model = build_model(args.workload)
    params = sum(p.numel() for p in model.parameters())
    shapes = [list(p.shape) for p in model.parameters()]
    per_rank = -(-len(ytr) // world)
    steps_per_epoch = -(-per_rank // args.batch_size)
    total_steps = steps_per_epoch * args.epochs
    first = train_shard(len(ytr), rank, world, seed=args.seed, epoch=0)[: args.batch_size]
    compute = calibrate_compute(model, xtr[first], ytr[first], args)
    timer = Timer()
    net, opt, info, account = setup_contender(args.contender, model, args, total_steps, timer)
    dist.barrier()

    history, train_time, step, steps_timed = [], 0.0, 0, 0
    sent, stop = 0, False
    time_to_target = None

    def checkpoint(final: bool = False) -> bool:
        """Pauses the clock, evaluates on rank 0, broadcasts whether to stop (time budget)."""
        nonlocal time_to_target
        if rank == 0:
            # off the clock, and the other ranks wait at the broadcast below: let rank 0 use their cores
            threads = torch.get_num_threads()
            torch.set_num_threads(max(threads, min(world, os.cpu_count() or 1)))
            acc = evaluate(model, xte, yte)
            torch.set_num_threads(threads)
        else:
            acc = float("nan")
        if rank == 0:
            history.append({"time": train_time, "step": step, "accuracy": acc})
            if time_to_target is None and acc >= args.target:
                time_to_target = train_time
        flag = torch.tensor([1 if (rank == 0 and args.max_train_seconds and train_time >= args.max_train_seconds)
                             else 0])
        dist.broadcast(flag, 0)
        return bool(flag.item()) and not final

    checkpoint()
    for epoch in range(args.epochs):
        order = train_shard(len(ytr), rank, world, seed=args.seed, epoch=epoch)
        for i in range(0, len(order), args.batch_size):
            idx = order[i:i + args.batch_size]
            tx0 = tx_bytes()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(net(xtr[idx]), ytr[idx])
            loss.backward()
            opt.step()
            train_time += time.perf_counter() - t0
            sent += tx_bytes() - tx0
            step += 1
            steps_timed += 1
            if not math.isfinite(loss.item()):
                raise FloatingPointError(f"{args.contender}: non-finite loss at step {step}")
            if step % args.eval_every == 0 and checkpoint():
                stop = True
                break
        if stop:
            break
    if step % args.eval_every != 0:          # the same decision on every rank (a collective follows)
        checkpoint(final=True)
    step_time = train_time / max(1, steps_timed)
    encode = timer.seconds / max(1, steps_timed)
    out = {
        "contender": args.contender, "workload": args.workload, "rank": rank, "world_size": world,
        "params": params, "shapes": shapes, "steps": step, "steps_per_epoch": steps_per_epoch,
        "epochs_planned": args.epochs, "stopped_by_time_budget": stop, "batch_size": args.batch_size,
        "train_time": train_time, "step_time": step_time, "compute": compute, "encode": encode,
        "communicate": max(0.0, step_time - compute - encode),
        "tx_bytes_train": sent, "tx_bytes_per_step": sent / max(1, steps_timed),
        "history": history, "time_to_target": time_to_target, "target": args.target,
        "final_accuracy": history[-1]["accuracy"] if history else None, "info": info,
        "library_accounting": account(), "ifname": os.environ.get("GRADSHARE_NETNS_IFNAME", "lo"),
    }
    path = args.out.format(rank=rank)
    with open(path, "w") as f:
        json.dump(out, f)
    dist.barrier()
    process_group.destroy_process_group()
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--contender", required=True, choices=sorted(CONTENDERS))
    ap.add_argument("--workload", default="mnist_cnn", choices=WORKLOADS)
    ap.add_argument("--data-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data", "mnist"))
    ap.add_argument("--train-subset", type=int, default=0, help="0: all 60k")
    ap.add_argument("--test-subset", type=int, default=0, help="0: all 10k")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=32, help="per worker")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=25, help="steps between test evaluations")
    ap.add_argument("--target", type=float, default=0.95, help="test accuracy for time-to-target")
    ap.add_argument("--max-train-seconds", type=float, default=0.0, help="stop at an evaluation past this (0: none)")
    ap.add_argument("--period", type=int, default=5, help="averaging period (steps)")
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
