"""The one-line drop-in with every optimizer torch ships: final quality against DDP, bytes, replicas.

A small classifier (a 32-128-128-10 MLP with a LayerNorm, 22,282 parameters) learns a fixed random teacher
(8,192 training rows with 5% label noise, 2,048 held out) on 2 ranks over gloo, 300 steps of a global batch of
128 (64 per rank) under a cosine schedule, once per optimizer and contender:

    ddp        DistributedDataParallel, nothing else
    gradshare  the same with ``ThresholdState(optimizer=opt, link=None)`` as its comm hook: the defaults with
               compression forced on every step (the link-aware default would pick DDP's all-reduce here)

``muon_adamw`` trains with two optimizers, Muon for the weight matrices and AdamW for the rest (Muon takes only
2-D parameters), both given to the hook (``optimizer=[muon, adamw]``).

Reported per optimizer: held-out accuracy and full training loss at the end for both, the gaps, the bytes
ratio (gradshare's bytes over DDP's), the compression the defaults chose, and whether the ranks' parameters
are bitwise identical at the end.

    python bench/optimizers.py                          # every optimizer (about 3 minutes on 2 cores)
    python bench/optimizers.py --optimizers nadam,radam --json out.json
    python bench/optimizers.py --optimizers radam --compression dense --seed 1

``--compression dense`` shares every step's update uncompressed (``compression="dense"``): what sharing the
optimizer's steps costs by itself, with no compression. ``--seed`` changes the order of the batches.
By default what a step does not send waits in each rank's model (``error_feedback="model"``, the top 5% as
signs); what is judged is what a script reads after the last step, the round's mean result that the hook shows
in every rank's parameters between steps, and the replicas column checks it is the same on every rank.
``--error-feedback buffer`` keeps what waits in gradshare's residual instead (every rank's model the mean result
at every point: Adam's kin ternary-coded, SGD's kin top-k with 8-bit values).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable, Dict, List, Optional

import torch

STEPS, GLOBAL_BATCH = 300, 128


def optimizers() -> Dict[str, Callable[[Any], torch.optim.Optimizer]]:
    """Each optimizer at a learning rate that trains this task under DDP."""
    O = torch.optim
    out = {
        "sgd": lambda p: O.SGD(p, lr=0.1),
        "sgd_momentum": lambda p: O.SGD(p, lr=0.05, momentum=0.9),
        "sgd_nesterov_wd": lambda p: O.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4),
        "asgd": lambda p: O.ASGD(p, lr=0.05),
        "adam": lambda p: O.Adam(p, lr=3e-3),
        "adamw": lambda p: O.AdamW(p, lr=3e-3, weight_decay=0.01),
        "adam_amsgrad": lambda p: O.Adam(p, lr=3e-3, amsgrad=True),
        "nadam": lambda p: O.NAdam(p, lr=3e-3),
        "radam": lambda p: O.RAdam(p, lr=3e-3),
        # its rectification lets the steps grow as the second moment's window fills: a shorter window
        "radam_beta2_0.99": lambda p: O.RAdam(p, lr=3e-3, betas=(0.9, 0.99)),
        "adamax": lambda p: O.Adamax(p, lr=5e-3),
        "adagrad": lambda p: O.Adagrad(p, lr=5e-2),
        "adadelta": lambda p: O.Adadelta(p, lr=1.0),
        "rmsprop": lambda p: O.RMSprop(p, lr=1e-3),
        "rmsprop_momentum": lambda p: O.RMSprop(p, lr=3e-4, momentum=0.9),
        "rprop": lambda p: O.Rprop(p, lr=1e-3),
    }
    if hasattr(O, "Adafactor"):
        out["adafactor"] = lambda p: O.Adafactor(p, lr=1e-2)
    if hasattr(O, "Muon"):
        out["muon_adamw"] = _muon
    return out


def _muon(params):
    """Muon for the weight matrices, AdamW for the rest (Muon takes only 2-D parameters): two optimizers on
    one DDP model, the hook given both."""
    params = list(params)
    return (torch.optim.Muon([p for p in params if p.ndim == 2], lr=MUON_LR, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW([p for p in params if p.ndim != 2], lr=3e-3))


MUON_LR = 1e-2                     # of 1e-3, 3e-3, 1e-2, 3e-2 the best under DDP here


def _data():
    g = torch.Generator().manual_seed(1234)
    w1, w2 = torch.randn(32, 64, generator=g) * 0.1, torch.randn(64, 10, generator=g)

    def label(x):
        return (torch.tanh(x @ w1) @ w2).argmax(1)

    xtr, xte = torch.randn(8192, 32, generator=g), torch.randn(2048, 32, generator=g)
    ytr, yte = label(xtr), label(xte)
    noisy = torch.rand(8192, generator=g) < 0.05
    return xtr, torch.where(noisy, torch.randint(0, 10, (8192,), generator=g), ytr), xte, yte


def _model():
    torch.manual_seed(0)
    nn = torch.nn
    return nn.Sequential(nn.Linear(32, 128), nn.LayerNorm(128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, 10))


def _rank(name: str, contender: str, compression: str = "default", seed: int = 0,
          error_feedback: Optional[str] = None) -> Dict[str, Any]:
    """One rank's run (inside gradshare.workers.run_local)."""
    import torch.distributed as dist

    import gradshare

    rank, world = dist.get_rank(), dist.get_world_size()
    xtr, ytr, xte, yte = _data()
    model = _model()
    net = torch.nn.parallel.DistributedDataParallel(model)
    made = optimizers()[name](net.parameters())
    opts = made if isinstance(made, tuple) else (made,)
    opt = opts[0]
    state = None
    if contender == "gradshare":
        kwargs = {"compression": "dense"} if compression == "dense" else {}
        if error_feedback is not None:
            kwargs["error_feedback"] = error_feedback
        state = gradshare.ThresholdState(optimizer=list(opts) if len(opts) > 1 else opt, link=None, **kwargs)
        net.register_comm_hook(state, gradshare.threshold_hook)
    scheds = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=STEPS) for o in opts]
    g, half = torch.Generator().manual_seed(99 + seed), GLOBAL_BATCH // world
    for _ in range(STEPS):
        idx = torch.randint(0, xtr.shape[0], (GLOBAL_BATCH,), generator=g)[rank * half:(rank + 1) * half]
        for o in opts:
            o.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(net(xtr[idx]), ytr[idx]).backward()
        for o, sched in zip(opts, scheds):
            o.step()
            sched.step()
    # What a script reads between steps: with what waits in each rank's model (the default), the round's mean
    # result, which the hook shows in every rank's parameters (gradshare.sharing, show_mean).
    with torch.no_grad():
        out = {"loss": torch.nn.functional.cross_entropy(model(xtr), ytr).item(),
               "accuracy": (model(xte).argmax(1) == yte).float().mean().item()}
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(every, flat)
    out["replicas_identical"] = all(torch.equal(every[0], e) for e in every[1:])
    if state is not None:
        out["bytes_ratio"] = state.bytes_sent / state.dense_bytes
        out["compression"] = type(state.compression).__name__
        out["error_feedback"] = state.sharing.error_feedback
    return out


def run(names: List[str], compression: str = "default", seed: int = 0,
        error_feedback: Optional[str] = None) -> List[Dict[str, Any]]:
    from gradshare.workers import run_local

    rows = []
    for name in names:
        ddp = run_local(_rank, 2, (name, "ddp", compression, seed), threads=1, timeout=300)[0]
        gs = run_local(_rank, 2, (name, "gradshare", compression, seed, error_feedback), threads=1, timeout=300)[0]
        rows.append({"optimizer": name, "seed": seed, "error_feedback": gs["error_feedback"], "ddp": ddp,
                     "gradshare": gs,
                     "accuracy_gap_points": 100 * (gs["accuracy"] - ddp["accuracy"]),
                     "loss_gap": gs["loss"] / ddp["loss"] - 1})
        print(f"{name}: DDP {100 * ddp['accuracy']:.2f}%, gradshare {100 * gs['accuracy']:.2f}%", file=sys.stderr)
    return rows


def markdown(rows: List[Dict[str, Any]]) -> str:
    lines = ["| optimizer | compression | DDP accuracy | gradshare accuracy | Δ (pt) | DDP loss | gradshare loss | "
             "Δ loss | bytes vs DDP | replicas identical |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        d, g = r["ddp"], r["gradshare"]
        lines.append(f"| {r['optimizer']} | {g['compression']} | {100 * d['accuracy']:.2f} | "
                     f"{100 * g['accuracy']:.2f} | {r['accuracy_gap_points']:+.2f} | {d['loss']:.4f} | "
                     f"{g['loss']:.4f} | {100 * r['loss_gap']:+.1f}% | {1 / g['bytes_ratio']:.1f}x | "
                     f"{'yes' if g['replicas_identical'] and d['replicas_identical'] else 'NO'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--optimizers", default=None, help="comma-separated names (default: all; see optimizers())")
    p.add_argument("--json", default=None, help="also write every row as JSON here")
    p.add_argument("--compression", choices=("default", "dense"), default="default",
                   help="default: what gradshare picks for the optimizer; dense: every update uncompressed")
    p.add_argument("--seed", type=int, default=0, help="the order of the batches (the model starts the same)")
    p.add_argument("--error-feedback", choices=("buffer", "model"), default=None,
                   help="where what a step does not send waits (ThresholdState's error_feedback; default: its "
                        "default, model)")
    a = p.parse_args(argv)
    known = optimizers()
    names = a.optimizers.split(",") if a.optimizers else list(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        p.error(f"unknown optimizers {unknown}; known: {', '.join(known)}")
    rows = run(names, a.compression, a.seed, a.error_feedback)
    print(f"torch {torch.__version__}, 2 ranks (gloo, 1 thread each), {STEPS} steps, global batch {GLOBAL_BATCH}, "
          f"compression {a.compression}, error feedback {rows[0]['error_feedback'] if rows else '-'}, seed {a.seed}\n")
    print(markdown(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"torch": torch.__version__, "steps": STEPS, "compression": a.compression, "seed": a.seed,
                       "error_feedback": rows[0]["error_feedback"] if rows else None, "rows": rows}, f, indent=1)
    return 0 if all(r["gradshare"]["replicas_identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
