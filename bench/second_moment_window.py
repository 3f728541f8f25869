"""How well the global-batch second moment is estimated: DDP's Adam against every rank's own Adam step, rescaled.

One process simulates W ranks exactly (no collectives): every step each rank copies the shared model, takes its
own optimizer's step on its share of the batch, and the mean of the ranks' changes is applied to the shared
model, as sharing updates uncompressed does (gradshare.sharing). Three ways to take a step:

    ddp        one optimizer on the mean gradient of the global batch (what DDP does)
    this_step  each rank's step rescaled with v_global = m^2 + (v - m^2) / W, m^2 this step's squared first
               moment (gradshare.second_moment.step_excess without its state; what gradshare did before)
    gradshare  each rank's step rescaled by gradshare.second_moment.GlobalBatchStep, which takes the squared
               mean over v's own window (an average of m^2 with beta2): what the sharing core does

The model, data and schedule are bench/optimizers.py's (a 22k-parameter MLP learning a fixed random teacher, 300
steps of a global batch of 128 under a cosine schedule), so the ``ddp`` rows repeat that benchmark's DDP figures.

    python bench/second_moment_window.py                            # radam, adam, nadam; seeds 0 and 1
    python bench/second_moment_window.py --optimizers radam --seeds 0,1,2
    python bench/second_moment_window.py --optimizers radam --seeds 0 --modes ddp --lr-scale 0.7

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

from gradshare import second_moment  # noqa: E402

F = torch.nn.functional
STEPS, GLOBAL_BATCH = bench_optimizers.STEPS, bench_optimizers.GLOBAL_BATCH
MODES = ("ddp", "this_step", "gradshare")


def run(name: str, mode: str, seed: int = 0, world: int = 2, lr_scale: float = 1.0) -> Tuple[float, float]:
    """(training loss, held-out accuracy) after the run."""
    xtr, ytr, xte, yte = bench_optimizers._data()

    def make(params):
        opt = bench_optimizers.optimizers()[name](params)
        for group in opt.param_groups:
            group["lr"] *= lr_scale
        return opt

    model = bench_optimizers._model()
    g, part = torch.Generator().manual_seed(99 + seed), GLOBAL_BATCH // world
    if mode == "ddp":
        opt = make(model.parameters())
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, STEPS)
    else:
        ranks = [bench_optimizers._model() for _ in range(world)]
        opts = [make(r.parameters()) for r in ranks]
        scheds = [torch.optim.lr_scheduler.CosineAnnealingLR(o, STEPS) for o in opts]
        rescales = [second_moment.GlobalBatchStep(o) for o in opts]
    for _ in range(STEPS):
        idx = torch.randint(0, xtr.shape[0], (GLOBAL_BATCH,), generator=g)
        if mode == "ddp":
            opt.zero_grad()
            F.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
            opt.step()
            sched.step()
            continue
        mean = [torch.zeros_like(p) for p in model.parameters()]
        for r, (net, opt_r) in enumerate(zip(ranks, opts)):
            with torch.no_grad():
                for mine, shared in zip(net.parameters(), model.parameters()):
                    mine.copy_(shared)
            opt_r.zero_grad()
            mine_idx = idx[r * part:(r + 1) * part]
            F.cross_entropy(net(xtr[mine_idx]), ytr[mine_idx]).backward()
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
    with torch.no_grad():
        return (F.cross_entropy(model(xtr), ytr).item(), (model(xte).argmax(1) == yte).float().mean().item())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--optimizers", default="radam,adam,nadam")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--lr-scale", type=float, default=1.0, help="every learning rate times this (DDP's sensitivity)")
    p.add_argument("--modes", default=",".join(MODES), help=f"which of {MODES} to run (ddp is the reference)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    names = a.optimizers.split(",")
    modes = a.modes.split(",")
    if set(modes) - set(MODES):
        p.error(f"--modes: {sorted(set(modes) - set(MODES))} are not among {MODES}")
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


if __name__ == "__main__":
    sys.exit(main())
