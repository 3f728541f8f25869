"""What rescaling a rank's step to the global batch's second moment costs, against the optimizer's own step.

Sharing an adaptive optimizer's updates (gradshare.second_moment) adds, after every local step, the
rescaling's elementwise passes over the parameters. For each optimizer, one float32 parameter of ``--numel``
elements with a fresh random gradient per step, one thread (torch's and gradshare's): the median of
``--repeat`` timings of ``optimizer.step()`` and of ``GlobalBatchStep.apply`` (W = 2) on the step's change
right after it, as the sharing core calls it, and their ratio (measured in the same run). It runs as one
native kernel (gradshare.ops.global_batch_step for Adam, AdamW and NAdam, global_batch_step_tracked for the
others); the last column is the same rescaling in torch ops (gradshare.reference, the same bits; it takes
its square roots in float64 to round them as the kernels do), timed in the same steps.

    python bench/rescale.py                         # 3.7M elements (the MLP of bench/workloads.py)
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
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
    from gradshare import reference, second_moment

    rows = 1024
    p = torch.nn.Parameter(torch.randn(rows, numel // rows))
    opt = OPTIMIZERS[name]([p])
    group = opt.param_groups[0]
    rescale = second_moment.GlobalBatchStep(opt)
    adam = rescale.kind in second_moment.ADAM_FAMILY
    steps, applied, torch_ops = [], [], []
    for i in range(repeat + 1):
        p.grad = torch.randn_like(p)
        before = p.detach().clone()
        t0 = time.perf_counter()
        opt.step()
        t1 = time.perf_counter()
        change = before.sub_(p.detach())
        copy = change.clone()
        aux = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in rescale._aux.get(id(p), {}).items()}
        t2 = time.perf_counter()
        rescale.apply(p, group, 2, change, change=change)
        t3 = time.perf_counter()
        if i > 0 and torch.equal(change, copy):      # (Adagrad's first step is its own batch's: nothing to do)
            raise RuntimeError(f"{name}: nothing rescaled")
        # the same rescaling in torch ops, from the same state, checked against the kernel's bits
        if adam:
            args = second_moment._adam_family_args(p, opt.state[p], group, 2, rescale.kind, copy.view(-1), aux)
            t4 = time.perf_counter()
            reference.global_batch_step(target=copy.view(-1), **args)
        else:
            args = second_moment._tracked_args(p, opt.state[p], group, 2, rescale.kind, aux)
            t4 = time.perf_counter()
            reference.global_batch_step_tracked(change=copy.view(-1), target=copy.view(-1), **args)
        torch_ops.append(time.perf_counter() - t4)
        if not torch.equal(copy, change):
            raise RuntimeError(f"{name}: the kernel and its torch reference disagree")
        steps.append(t1 - t0)
        applied.append(t3 - t2)
    med = lambda xs: statistics.median(xs[1:])     # the first step allocates the state
    return med(steps), med(applied), med(torch_ops)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=3_716_096)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    a = ap.parse_args(argv)
    import gradshare

    torch.set_num_threads(1)
    gradshare.set_num_threads(1)
    print(f"torch {torch.__version__}, {a.numel:,} float32 elements, 1 thread, median of {a.repeat}\n")
    print("| optimizer | optimizer.step() ms | rescaling ms | rescaling / step | torch ops ms (native speed-up) |")
    print("|---|---:|---:|---:|---:|")
    for name in a.optimizers.split(","):
        step, extra, ops_time = measure(name, a.numel, a.repeat)
        ref = f"{1e3 * ops_time:.1f} ({ops_time / extra:.1f}x)"
        print(f"| {name} | {1e3 * step:.1f} | {1e3 * extra:.1f} | {extra / step:.2f}x | {ref} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
