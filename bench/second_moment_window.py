"""How well the global-batch second moment is estimated: DDP's Adam against every rank's own Adam step, rescaled.

One process simulates W ranks exactly (no collectives): every step each rank copies the shared model, takes its
own optimizer's step on its share of the batch, and the mean of the ranks' changes is applied to the shared
model, as sharing updates uncompressed does (gradshare.sharing). Three ways to take a rank's step:

    ddp        one optimizer on the mean gradient of the global batch (what DDP does)
    shared     each rank's step rescaled by gradshare.second_moment.step_excess: v_global = m^2 + (v - m^2) / W
               with m the optimizer's first moment (Adam's beta1: a window of about 10 steps)
    window     the same with the squared mean taken over v's own window: s = EMA_beta2(m^2), v_global =
               s + (v - s) / W (a candidate: not what gradshare does yet)

The model, data and schedule are bench/optimizers.py's (a 22k-parameter MLP learning a fixed random teacher, 300
steps of a global batch of 128 under a cosine schedule), so the ``ddp`` and ``shared`` rows repeat that
benchmark's DDP and uncompressed gradshare figures exactly.

    python bench/second_moment_window.py                            # radam, adam, nadam; seeds 0 and 1
    python bench/second_moment_window.py --optimizers radam --seeds 0,1,2
    python bench/second_moment_window.py --optimizers radam --seeds 0 --modes ddp --lr-scale 0.7

Why the window matters: with m over ~10 steps and v over up to 1/(1 - beta2) steps, v - m^2 holds the drift of
the gradient's mean over v's window as well as its noise. Where the mean has grown (RAdam's early steps hold the
model back), the estimate puts v_global above DDP's and the shared steps fall short of DDP's.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import optimizers as bench_optimizers  # noqa: E402  (bench/optimizers.py: the model, data and learning rates)

from gradshare import second_moment  # noqa: E402

F = torch.nn.functional
STEPS, GLOBAL_BATCH = bench_optimizers.STEPS, bench_optimizers.GLOBAL_BATCH
MODES = ("ddp", "shared", "window")
EXACT = ("adam", "nadam", "radam", "radam_beta2_0.99")   # bench/optimizers.py entries without weight decay


def _window_step(opt: torch.optim.Optimizer, p: torch.Tensor, change: torch.Tensor, signal: torch.Tensor,
                 world: int) -> torch.Tensor:
    """A rank's change rescaled with the squared mean over v's window (``signal``, updated here)."""
    st, group = opt.state[p], opt.param_groups[0]
    t = float(st["step"])
    b1, b2 = group["betas"]
    bias1, bias2 = 1 - b1 ** t, 1 - b2 ** t
    m, v = st["exp_avg"] / bias1, st["exp_avg_sq"] / bias2
    signal.mul_(b2).addcmul_(m, m, value=1 - b2)
    s = (signal / bias2).clamp(max=v)
    eps = float(group["eps"])
    if isinstance(opt, torch.optim.RAdam):
        rho_inf = 2 / (1 - b2) - 1
        if rho_inf - 2 * t * b2 ** t / bias2 <= 5:         # not rectified yet: its step divides by nothing
            return change
        eps = eps / bias2 ** 0.5
    return change * (v.sqrt() + eps) / ((s + (v - s) / world).sqrt() + eps)


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
        signals: Dict[Tuple[int, int], torch.Tensor] = {}
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
                if mode == "shared":
                    excess = second_moment.step_excess(p, opt_r.state[p], opt_r.param_groups[0], world,
                                                       second_moment.kind(opt_r), change=change)
                    if excess is not None:
                        change = change + excess
                else:
                    signal = signals.setdefault((r, i), torch.zeros_like(p))
                    change = _window_step(opt_r, p, change, signal, world)
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
    bad = [n for n in names if n not in EXACT]
    if bad:
        p.error(f"--optimizers: {bad}; known here: {', '.join(EXACT)} (no weight decay or amsgrad: the window "
                "row rescales a rank's whole change)")
    rows: List[str] = ["| optimizer | seed | DDP loss / acc | shared (m's window) loss / acc | Δ loss | "
                       "shared (v's window) loss / acc | Δ loss |", "|---|---:|---|---|---:|---|---:|"]
    for name in names:
        for seed in (int(s) for s in a.seeds.split(",")):
            res = {mode: run(name, mode, seed, lr_scale=a.lr_scale) if mode in modes else None for mode in MODES}
            d = res["ddp"]
            cells = [f"{res[m][0]:.4f} / {100 * res[m][1]:.2f}" if res[m] else "-" for m in MODES]
            gaps = [f"{100 * (res[m][0] / d[0] - 1):+.1f}%" if res[m] and d else "-" for m in ("shared", "window")]
            rows.append(f"| {name} | {seed} | {cells[0]} | {cells[1]} | {gaps[0]} | {cells[2]} | {gaps[1]} |")
            print(rows[-1], file=sys.stderr, flush=True)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
