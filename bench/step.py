"""Step time of each way to share a step, against DDP allreduce measured in the same run (loopback, CPU).

Each contender trains the 3.7M-parameter MLP of bench/workloads.py on fixed random batches over ``--workers``
gloo ranks on this machine (torch threads 1 each; no link shaping: what is left is the work gradshare adds
to a step, not the time it saves on a slow link, which bench/e2e.py measures). Every step starts at a
barrier; the median over ``--steps`` steps after ``--warmup`` is reported, with its ratio to DDP's median
from the same run. The defaults are link-aware (gradshare.link: on this loopback link they settle on DDP's
all-reduce; the compressed probes they run from time to time fall outside the median);
``--compression compressed`` turns that off (link=None) to time the compressed step. ``--compression topk`` gives every gradshare contender TopK(0.01, 4096-element chunks,
bf16 values, no warm-up), a policy every gradshare version has, so that two versions can be compared: run the script once
per version (``PYTHONPATH=<its python dir>``) and compare the ratios.

``--rounds R`` times the contenders in turns, R rounds of ``--steps`` steps each (every contender built and warmed
up first), so that a machine whose speed drifts during the run moves them alike; the ratio is then the median of
the rounds' ratios. ``--workload mnist_cnn`` times gradshare.models.SmallCNN (106k parameters), whose step is
short enough that what gradshare adds per step in Python shows (``ddp_python_hook``, torch's own all-reduce hook in
Python, shows what any comm hook's all-reduce costs against DDP's built-in one); ``--workload char_lm`` the 503k-parameter
transformer LM with AdamW (about 50 tensors: what gradshare does once per parameter shows).

    python bench/step.py --repeat 3
    python bench/step.py --workload mnist_cnn --workers 4 --rounds 6 --steps 40 --contenders ddp,gradshare,gradshare_optimizer
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
# After the installed packages: bench/kernels.py must not hide Hugging Face's `kernels`, which transformers imports.
sys.path.append(HERE)

CONTENDERS = ("ddp", "ddp_python_hook", "gradshare", "gradshare_optimizer", "gradshare_hook_gradients",
              "gradshare_hook_momentum", "gradshare_unmasked")
DESCRIPTIONS = {
    "ddp": "DDP allreduce",
    "ddp_python_hook": "DDP + torch's own allreduce_hook (a comm hook in Python: what any Python hook's all-reduce costs)",
    "gradshare": "DDP + threshold_hook, ThresholdState(optimizer=opt) (updates shared; the README's one line)",
    "gradshare_optimizer": "SharedOptimizer(opt) (updates shared)",
    "gradshare_hook_gradients": "DDP + threshold_hook, ThresholdState() (gradients shared)",
    "gradshare_hook_momentum": "DDP + threshold_hook, ThresholdState(momentum=0.9), SGD without momentum "
                               "(gradients shared; Deep Gradient Compression's momentum correction)",
    "gradshare_unmasked": "DDP + threshold_hook, ThresholdState(optimizer=opt, momentum_masking=False) (what "
                          "gradshare.momentum_masking costs a step)",
}


def _rank(rank: int, world: int, port: int, args, queue) -> None:
    from gradshare import process_group

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # gradshare's join and leave: a raw init_process_group with DDP pins the group, and its gloo threads then
    # end in std::terminate at interpreter shutdown (gradshare.process_group)
    process_group.init_process_group("gloo", rank=rank, world_size=world,
                                     timeout=__import__("datetime").timedelta(seconds=120))
    torch.set_num_threads(1)
    import gradshare as gs
    import workloads
    from gradshare.compression import TopK

    def sharing_kwargs():
        if args.compression == "topk":
            return {"compression": TopK(0.01, chunk=4096, values="bf16", warmup_steps=0)}
        return {"link": None} if args.compression == "compressed" else {}

    g = torch.Generator().manual_seed(rank)
    if args.workload == "char_lm":       # token windows; the loss over every position's next token
        batches = [(torch.randint(0, 256, (16, workloads.CONTEXT), generator=g),
                    torch.randint(0, 256, (16 * workloads.CONTEXT,), generator=g)) for _ in range(8)]
    else:
        batches = [(torch.randn(32, 1, 28, 28, generator=g), torch.randint(0, 10, (32,), generator=g))
                   for _ in range(8)]

    def make_optimizer(params, momentum=0.9):
        if args.workload == "char_lm":
            return workloads.WORKLOADS["char_lm"].optimizer(params)
        return torch.optim.SGD(params, lr=0.05, momentum=momentum)

    def setup(name):
        torch.manual_seed(0)
        if args.workload == "mnist_cnn":
            from gradshare.models import SmallCNN
            model = SmallCNN(in_channels=1, num_classes=10, image_size=28)
        elif args.workload == "char_lm":
            model = workloads.CharLM()
        else:
            model = workloads.MLP()
        if name == "gradshare_optimizer":
            opt = gs.SharedOptimizer(make_optimizer(model.parameters()), **sharing_kwargs())
            fronts[name] = opt
            return model, opt
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = make_optimizer(ddp.parameters(), momentum=0.0 if name == "gradshare_hook_momentum" else 0.9)
        state = None
        if name == "gradshare":
            state = gs.ThresholdState(optimizer=opt, **sharing_kwargs())
        elif name == "gradshare_unmasked":
            state = gs.ThresholdState(optimizer=opt, momentum_masking=False, **sharing_kwargs())
        elif name == "gradshare_hook_gradients":
            state = gs.ThresholdState(**sharing_kwargs())
        elif name == "gradshare_hook_momentum":
            state = gs.ThresholdState(momentum=0.9, **sharing_kwargs())
        if state is not None:
            ddp.register_comm_hook(state, gs.threshold_hook)
            fronts[name] = state
        elif name == "ddp_python_hook":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        return ddp, opt

    fronts = {}                          # each gradshare contender's sharing front: its statistics

    # what SGD's momentum masking (gradshare.momentum_masking) takes of a step, timed where it runs: its share
    # of a compressed step is smaller than the step times' spread between runs here
    from gradshare.momentum_masking import MomentumMasking
    masking_times = []
    after = MomentumMasking.after

    def timed_after(self, *a):
        t = time.perf_counter()
        after(self, *a)
        masking_times.append(time.perf_counter() - t)

    MomentumMasking.after = timed_after
    def formats(name):
        """How a contender's exchanges went so far (gradshare.stats formats: allreduce, allreduce_bf16, topk ...)."""
        stats = fronts[name].stats if name in fronts else None
        return dict(stats.format_counts) if stats is not None else {}

    def timed(fwd, opt, steps):
        """``steps`` steps of one contender: their times and momentum masking's in them (s)."""
        times = []
        del masking_times[:]
        for i in range(steps):
            x, y = batches[i % len(batches)]
            dist.barrier()
            t = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(fwd(x).reshape(len(y), -1), y).backward()
            opt.step()
            times.append(time.perf_counter() - t)
        return times, list(masking_times) if len(masking_times) == len(times) else None

    medians = {}
    names = args.contenders.split(",")
    if args.rounds:                    # every contender built and warmed up, then timed in turns
        built = {name: setup(name) for name in names}
        for name in names:
            timed(*built[name], args.warmup)
        before = {name: formats(name) for name in names}
        for r in range(args.rounds):
            for name in names:
                times, _ = timed(*built[name], args.steps)
                medians[f"{name} round {r}"] = statistics.median(times) * 1e3
        for name in names:               # the timed exchanges' formats: the path the policy took on them
            counts = {f: n - before[name].get(f, 0) for f, n in formats(name).items()}
            medians[f"{name} formats"] = {f: n for f, n in counts.items() if n}
        del built
    else:
        for name in names:
            fwd, opt = setup(name)
            times, masked = timed(fwd, opt, args.warmup + args.steps)
            medians[name] = statistics.median(times[args.warmup:]) * 1e3
            if masked is not None:
                medians[name + " masking"] = statistics.median(masked[args.warmup:]) * 1e3
            del fwd, opt
    if rank == 0:
        queue.put(medians)
    process_group.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--warmup", type=int, default=60, help="steps not timed (the default policies warm up in 50)")
    p.add_argument("--repeat", type=int, default=1, help="whole runs, each with its own DDP baseline")
    p.add_argument("--compression", choices=("default", "compressed", "topk"), default="default",
                   help="default: gradshare's defaults (link-aware); compressed: the defaults with link=None "
                        "(compression at every step); topk: TopK(0.01, 4096-element chunks, bf16 values, "
                        "no warm-up)")
    p.add_argument("--rounds", type=int, default=0,
                   help="> 0: time the contenders in turns, this many rounds of --steps steps each (module docstring)")
    p.add_argument("--workload", choices=("mlp", "mnist_cnn", "char_lm"), default="mlp")
    p.add_argument("--port", type=int, default=29811)
    p.add_argument("--json", help="write every run's medians here")
    args = p.parse_args(argv)
    unknown = [c for c in args.contenders.split(",") if c not in CONTENDERS]
    if unknown or "ddp" not in args.contenders.split(","):
        p.error(f"--contenders: from {', '.join(CONTENDERS)}, ddp included (the baseline); got {args.contenders}")
    import torch.multiprocessing as mp

    runs = []
    for r in range(args.repeat):
        queue = mp.get_context("spawn").SimpleQueue()
        mp.spawn(_rank, args=(args.workers, args.port + r, args, queue), nprocs=args.workers)
        runs.append(queue.get())
    if args.rounds:
        return _report_rounds(args, runs)
    print(f"median step (ms) over {args.steps} steps, {args.workers} workers, compression {args.compression}; "
          f"ratio to DDP in the same run")
    print("| contender | " + " | ".join(f"run {i + 1}" for i in range(len(runs))) + " | median ratio |")
    print("|---|" + "---:|" * (len(runs) + 1))
    for name in args.contenders.split(","):
        ratios = [run[name] / run["ddp"] for run in runs]
        cells = " | ".join(f"{run[name]:.1f} ({run[name] / run['ddp']:.2f}x)" for run in runs)
        print(f"| {name} | {cells} | {statistics.median(ratios):.2f}x |")
    for name in args.contenders.split(","):
        if name + " masking" in runs[0]:
            print(f"{name}: momentum masking takes " + ", ".join(f"{run[name + ' masking']:.2f}" for run in runs)
                  + " ms of its step (median over the timed steps, per run)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs}, f, indent=1)
    return 0


def _report_rounds(args, runs) -> int:
    """The table of a run in turns: each contender's median step per round, and the median of the rounds' ratios
    to DDP's (every run's rounds together)."""
    names = args.contenders.split(",")
    cells = [(run, r) for run in runs for r in range(args.rounds)]
    print(f"{args.workload}: median step (ms) of each round of {args.steps} steps, {args.workers} workers, contenders "
          f"in turns, compression {args.compression}; ratio to DDP's step in the same round")
    print("| contender | " + " | ".join(f"run {i + 1} round {r + 1}" for i in range(len(runs))
                                       for r in range(args.rounds)) + " | median ratio |")
    print("|---|" + "---:|" * (len(cells) + 1))
    for name in names:
        ratios = [run[f"{name} round {r}"] / run[f"ddp round {r}"] for run, r in cells]
        row = " | ".join(f"{run[f'{name} round {r}']:.1f}" for run, r in cells)
        print(f"| {name} | {row} | {statistics.median(ratios):.2f}x |")
    for name in names:
        paths = [run.get(f"{name} formats") for run in runs]
        if any(paths):
            print(f"{name}: exchanges of the timed steps by format (bucket-steps), per run: "
                  + "; ".join(", ".join(f"{f} {n}" for f, n in sorted(p.items())) for p in paths))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
