"""What rescaling a rank's step to the global batch's second moment costs, against the optimizer's own step.

Sharing an adaptive optimizer's updates (gradshare.second_moment) adds, after every local step, the
rescaling's elementwise passes over the parameters (in torch ops: memory-bound). For each optimizer, one
float32 parameter of ``--numel`` elements with a fresh random gradient per step, one torch thread: the median
of ``--repeat`` timings of ``optimizer.step()`` and of ``GlobalBatchStep.excess`` (W = 2) right after it, and
their ratio (measured in the same run).

    python bench/rescale.py                         # 3.7M elements (the MLP of bench/workloads.py)
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-3),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
    "rmsprop_momentum": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.9),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "adadelta": lambda ps: torch.optim.Adadelta(ps, lr=1.0),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-3),
}
if hasattr(torch.optim, "Adafactor"):
    OPTIMIZERS["adafactor"] = lambda ps: torch.optim.Adafactor(ps, lr=1e-2)


def measure(name: str, numel: int, repeat: int):
    from gradshare import second_moment

    rows = 1024
    p = torch.nn.Parameter(torch.randn(rows, numel // rows))
    opt = OPTIMIZERS[name]([p])
    rescale = second_moment.GlobalBatchStep(opt)
    steps, excess = [], []
    for _ in range(repeat + 1):
        p.grad = torch.randn_like(p)
        before = p.detach().clone()
        t0 = time.perf_counter()
        opt.step()
        t1 = time.perf_counter()
        out = rescale.excess(p, opt.param_groups[0], 2, before - p.detach())
        t2 = time.perf_counter()
        if out is None:
            raise RuntimeError(f"{name}: nothing rescaled")
        steps.append(t1 - t0)
        excess.append(t2 - t1)
    return statistics.median(steps[1:]), statistics.median(excess[1:])     # the first allocates the state


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=3_716_096)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {a.numel:,} float32 elements, 1 thread, median of {a.repeat}\n")
    print("| optimizer | optimizer.step() ms | rescaling ms | rescaling / step |")
    print("|---|---:|---:|---:|")
    for name in a.optimizers.split(","):
        step, extra = measure(name, a.numel, a.repeat)
        print(f"| {name} | {1e3 * step:.1f} | {1e3 * extra:.1f} | {extra / step:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
