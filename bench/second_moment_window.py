"""How well the global-batch second moment is estimated: DDP's Adam against every rank's own Adam step, rescaled.

One process simulates W ranks exactly (no collectives): every step each rank copies the shared model, takes its
own optimizer's step on its share of the batch, and the mean of the ranks' changes is applied to the shared
model, as sharing updates uncompressed does (gradshare.sharing). Three ways to take a step:

    ddp        one optimizer on the mean gradient of the global batch (what DDP does)
    this_step  each rank's step rescaled with the squared mean s = m^2 of this step alone (and k, the share of
               the gradient's noise in it, this step's): gradshare.second_moment.step_excess without its state
    gradshare  each rank's step rescaled by gradshare.second_moment.GlobalBatchStep, which averages m^2 (and
               k) over v's own window with beta2: what the sharing core does

Both take v_global = s + (v - s) * max(0, (1/W - k) / (1 - k)) (gradshare.second_moment).

The model, data and schedule are bench/optimizers.py's (a 22k-parameter MLP learning a fixed random teacher, 300
steps of a global batch of 128 under a cosine schedule), so the ``ddp`` rows repeat that benchmark's DDP figures.
With ``--workloads`` they are bench/quality.py's instead (its Adam-family workloads, their batches, steps, metric
and cosine schedule; a clipping workload clips each rank's own gradient, as a script changed by one line does,
and DDP's mean one), so the ``ddp`` rows repeat that table's DDP runs and ``gradshare`` is its row with nothing
compressed: how much of a workload's gap to DDP is the rescaling's, not the compression's.

    python bench/second_moment_window.py                            # radam, adam, nadam; seeds 0 and 1
    python bench/second_moment_window.py --optimizers radam --seeds 0,1,2
    python bench/second_moment_window.py --optimizers radam --seeds 0 --modes ddp --lr-scale 0.7
    python bench/second_moment_window.py --workloads copy_lstm,char_lm --seeds 0,1,2

Why the window matters: with m over ~10 steps and v over up to 1/(1 - beta2) steps, v - m^2 holds the drift of
the gradient's mean over v's window as well as its noise. Where the mean has grown (RAdam's early steps hold the
model back), this step's m^2 puts v_global above DDP's and the shared steps fall short of DDP's.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Tuple

import torch

# After the installed packages: bench/kernels.py must not hide Hugging Face's `kernels`, which transformers imports.
sys.path.append(os.path.dirname(os.path.abspath(__file__)))
import optimizers as bench_optimizers  # noqa: E402  (bench/optimizers.py: the model, data and learning rates)
import workloads as bench_workloads  # noqa: E402  (bench/quality.py's workloads)

from gradshare import second_moment  # noqa: E402

F = torch.nn.functional
STEPS, GLOBAL_BATCH = bench_optimizers.STEPS, bench_optimizers.GLOBAL_BATCH
MODES = ("ddp", "this_step", "gradshare")


def simulate(make_model, make_opt, batch, loss_fn, steps: int, mode: str, world: int, clip: float = 0.0):
    """The shared model after ``steps`` steps of ``mode`` (MODES) with ``world`` simulated ranks: ``batch(step,
    rank)`` -> (inputs, targets) of a rank's share (rank 0 of 1 for DDP's whole batch), a cosine schedule."""
    model = make_model()
    if mode == "ddp":
        opt = make_opt(model.parameters())
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
        for step in range(steps):
            opt.zero_grad()
            loss_fn(model, *batch(step, 0)).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            sched.step()
        return model
    ranks = [make_model() for _ in range(world)]
    opts = [make_opt(r.parameters()) for r in ranks]
    scheds = [torch.optim.lr_scheduler.CosineAnnealingLR(o, steps) for o in opts]
    rescales = [second_moment.GlobalBatchStep(o) for o in opts]
    for step in range(steps):
        mean = [torch.zeros_like(p) for p in model.parameters()]
        for r, (net, opt_r) in enumerate(zip(ranks, opts)):
            with torch.no_grad():
                for mine, shared in zip(net.parameters(), model.parameters()):
                    mine.copy_(shared)
            opt_r.zero_grad()
            loss_fn(net, *batch(step, r)).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
            before = [p.detach().clone() for p in net.parameters()]
            opt_r.step()
            for i, (p, b) in enumerate(zip(net.parameters(), before)):
                change = b - p.detach()
                if mode == "this_step":
                    excess = second_moment.step_excess(p, opt_r.state[p], opt_r.param_groups[0], world,
                                                       second_moment.kind(opt_r), change=change)
                    if excess is not None:
                        change = change + excess
                else:
                    rescales[r].apply(p, opt_r.param_groups[0], world, change, change=change)
                mean[i] += change / world
            scheds[r].step()
        with torch.no_grad():
            for p, d in zip(model.parameters(), mean):
                p.sub_(d)
    return model


def run(name: str, mode: str, seed: int = 0, world: int = 2, lr_scale: float = 1.0) -> Tuple[float, float]:
    """bench/optimizers.py's model with optimizer ``name``: (training loss, held-out accuracy) after the run."""
    xtr, ytr, xte, yte = bench_optimizers._data()

    def make(params):
        opt = bench_optimizers.optimizers()[name](params)
        for group in opt.param_groups:
            group["lr"] *= lr_scale
        return opt

    g, part = torch.Generator().manual_seed(99 + seed), GLOBAL_BATCH // world
    draws = [torch.randint(0, xtr.shape[0], (GLOBAL_BATCH,), generator=g) for _ in range(STEPS)]

    def batch(step, rank):
        idx = draws[step] if mode == "ddp" else draws[step][rank * part:(rank + 1) * part]
        return xtr[idx], ytr[idx]

    model = simulate(bench_optimizers._model, make, batch, lambda net, x, y: F.cross_entropy(net(x), y), STEPS,
                     mode, world)
    with torch.no_grad():
        return (F.cross_entropy(model(xtr), ytr).item(), (model(xte).argmax(1) == yte).float().mean().item())


def adam_workloads() -> List[str]:
    """bench/quality.py's workloads whose one optimizer the rescaling serves."""
    out = []
    for name, wl in bench_workloads.WORKLOADS.items():
        try:
            made = wl.optimizer([torch.zeros(1, requires_grad=True)])
        except ValueError:                 # one that splits a model's parameters among optimizers (Muon's)
            continue
        if not isinstance(made, tuple) and second_moment.applies(made):
            out.append(name)
    return out


def run_workload(workload: str, mode: str, seed: int = 0, world: int = 2, steps: int = 0) -> float:
    """bench/quality.py's ``workload`` (its steps, or ``steps``) with ``world`` ranks: the metric its table
    judges (DDP: the whole global batch on one optimizer, as bench/quality.py's ddp)."""
    wl = bench_workloads.WORKLOADS[workload]
    data = bench_workloads.Data(workload, seed)

    def batch(step, rank):
        if mode == "ddp":
            parts = [data.batch(step, r, world, wl.batch) for r in range(world)]
            return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])
        return data.batch(step, rank, world, wl.batch)

    def make_model():
        torch.manual_seed(seed)            # every rank and DDP start from bench/quality.py's model
        return wl.model()

    model = simulate(make_model, wl.optimizer, batch, lambda net, x, y: data.loss(net(x), y), steps or wl.steps,
                     mode, world, wl.clip)
    return data.evaluate(model)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--optimizers", default="radam,adam,nadam")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--lr-scale", type=float, default=1.0, help="every learning rate times this (DDP's sensitivity)")
    p.add_argument("--modes", default=",".join(MODES), help=f"which of {MODES} to run (ddp is the reference)")
    p.add_argument("--workloads", default="", help="bench/quality.py's Adam-family workloads instead of "
                   f"--optimizers: {', '.join(adam_workloads())}")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    modes = a.modes.split(",")
    if set(modes) - set(MODES):
        p.error(f"--modes: {sorted(set(modes) - set(MODES))} are not among {MODES}")
    if a.workloads:
        return _workload_rows(p, a.workloads.split(","), [int(x) for x in a.seeds.split(",")], modes)
    names = a.optimizers.split(",")
    family = [n for n, make in bench_optimizers.optimizers().items() if n != "muon_adamw" and
              second_moment.kind(make([torch.zeros(1, requires_grad=True)])) in second_moment.ADAM_FAMILY]
    bad = [n for n in names if n not in family]
    if bad:
        p.error(f"--optimizers: {bad}; known here: {', '.join(family)}")
    rows: List[str] = ["| optimizer | seed | DDP loss / acc | this step's m^2: loss / acc | Δ loss | "
                       "gradshare (m^2 over v's window): loss / acc | Δ loss |", "|---|---:|---|---|---:|---|---:|"]
    for name in names:
        for seed in (int(s) for s in a.seeds.split(",")):
            res = {mode: run(name, mode, seed, lr_scale=a.lr_scale) if mode in modes else None for mode in MODES}
            d = res["ddp"]
            cells = [f"{res[m][0]:.4f} / {100 * res[m][1]:.2f}" if res[m] else "-" for m in MODES]
            gaps = [f"{100 * (res[m][0] / d[0] - 1):+.1f}%" if res[m] and d else "-" for m in ("this_step", "gradshare")]
            rows.append(f"| {name} | {seed} | {cells[0]} | {cells[1]} | {gaps[0]} | {cells[2]} | {gaps[1]} |")
            print(rows[-1], file=sys.stderr, flush=True)
    print("\n".join(rows))
    return 0


def _workload_rows(p: argparse.ArgumentParser, names: List[str], seeds: List[int], modes: List[str]) -> int:
    known = adam_workloads()
    bad = [n for n in names if n not in known]
    if bad:
        p.error(f"--workloads: {bad}; known here: {', '.join(known)}")
    rows = ["| workload | seed | DDP | this step's m^2 | Δ vs DDP | gradshare (m^2 over v's window) | Δ vs DDP |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for name in names:
        loss = bench_workloads.WORKLOADS[name].metric == "loss"
        for seed in seeds:
            res = {mode: run_workload(name, mode, seed) if mode in modes else None for mode in MODES}
            d = res["ddp"]

            def gap(x):
                if x is None or d is None:
                    return "-"
                return f"{100 * (x / d - 1):+.1f}%" if loss else f"{100 * (x - d):+.2f} pt"

            cells = [f"{res[m]:.4f}" if res[m] is not None else "-" for m in MODES]
            rows.append(f"| {name} | {seed} | {cells[0]} | {cells[1]} | {gap(res['this_step'])} | {cells[2]} | "
                        f"{gap(res['gradshare'])} |")
            print(rows[-1], file=sys.stderr, flush=True)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
