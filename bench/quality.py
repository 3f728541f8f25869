"""Training quality at equal steps: does sharing train as well as DDP, and for how many bytes?

Every contender trains the same workload (bench/workloads.py) from the same seed, on the same batches,
for the same number of steps, with the same optimizer and learning-rate schedule (cosine annealing to 0;
``--schedule constant``: none); only the exchange differs. Each run is a real
job of ``--workers`` processes over gloo on loopback (gradshare.workers.run_local). Reported per
workload and contender: the final metric (test accuracy, or validation loss for the language models, the copy task and
the regression) as
mean [min, max] over the seeds, its difference from DDP paired by seed, and the bytes over the whole run
against DDP's. Bytes are counted the same way for every contender: the ring-model bytes of every
collective a rank issues during training steps (an allreduce of B bytes sends 2(W-1)/W*B, an all-gather
of B bytes per rank (W-1)*B), DDP included (it runs torch's allreduce hook so that its collectives are
seen).

    python bench/quality.py                                   # every workload and contender, seeds 0,1,2
    python bench/quality.py --workloads mnist_cnn --contenders ddp,gradshare --seeds 0
    python bench/quality.py --report bench/results/quality    # re-render the tables of a run

A workload may train with several optimizers (``char_lm_muon``: Muon and AdamW); the gradshare contenders are
given all of them (``ThresholdState(optimizer=[...])``; ``opt`` in a ``gs:`` expression is the first).

Contenders: ``ddp`` (DDP allreduce), ``powersgd`` (torch's PowerSGD hook, rank 2, dense for the first 10%
of steps as its docs advise), ``gradshare`` (DDP + ``ThresholdState(optimizer=opt, link=None)``: the
defaults with compression on at every step: what a step does not send waits in each rank's model, the top 5% as
signs; what rank 0's parameters show after the last step is judged, the mean result, identical on every rank, as
the DDP hook shows it between steps), ``gradshare_auto`` (``ThresholdState(optimizer=opt)`` as is:
link-aware, so on this loopback link mostly DDP's all-reduce; gradshare.link),
``gradshare_1e-2`` / ``gradshare_1e-3`` (forced densities, ``compression=TargetSparsity(d)``), and for
the record of how the residual buffer's defaults were chosen: ``gradshare_ternary`` /
``gradshare_topk`` (the two codecs on every workload), ``gradshare_gradients`` (the hook without ``optimizer=``: gradients shared),
``gradshare_strom`` (DL4J's +-tau with an Adaptive threshold, gradients shared: gradshare's former default),
``gradshare_own_moment`` (``gradshare_buffer`` with each rank's adaptive step left as its own, not rescaled to the global
batch's second moment: gradshare.second_moment), ``gradshare_delayed`` (``gradshare`` one step late:
``delay=1``, each step's mean update applied at the end of the next, ``flush()`` before evaluating),
``gradshare_model`` (``gradshare`` at the top 1% as signs: ``error_feedback="model",
compression=TopK(0.01, values="sign")``; with what waits in each rank's model, results.json and results.md also
give the mean result every rank holds and the model after ``merge()``), ``gradshare_model_1e-3`` (the same at
0.1% with 8-bit values: ``TargetSparsity(target=0.001)``), ``gradshare_buffer``, ``gradshare_buffer_1e-2`` and
``gradshare_buffer_1e-3`` (``gradshare`` and the two forced densities with ``error_feedback="buffer"``: what waits
in gradshare's residual, every rank's model the mean result, with the compression chosen for it: Adam's kin
ternary-coded, top-k with 8-bit values for SGD) and ``single`` (one process alone, same batch per step: what sharing must beat). Any contender with
``@bf16`` appended trains under CPU bf16 autocast, with ``@fp16`` under fp16 autocast and a
torch.amp.GradScaler (``scaler.step`` on the optimizer, as in a user's AMP script).

Local steps (gradshare.averaging.ParameterAveraging, no DDP; the model talks once every H steps):
``avg_h5`` / ``avg_h20`` (parameters and optimizer state averaged), ``diloco_h20`` / ``diloco_h50``
(pseudo-gradient averaged by all-reduce, outer Nesterov SGD lr 0.7 momentum 0.9, inner state local;
``diloco_h20_m0``: outer lr 1 without momentum, i.e. parameters averaged, inner state local),
``sparse_h20`` / ``sparse_h50`` (SparseLoCo-like: the pseudo-gradient's top 2% per chunk at 3 bytes an
entry, decayed error feedback 0.9, the mean change applied as is), ``ternary_h4`` (every 4 steps the
pseudo-gradient ternary-coded, 2 bits an element, decayed error feedback 0.9: 64x fewer bytes than DDP),
streaming rounds ``fragments_h20`` (``diloco_h20_m0`` in 4 fragments synced in turn), ``streaming_h20`` (the same,
each exchange travelling 5 steps) and
``ternary_h4_overlap`` (``ternary_h4``, each exchange travelling 1 step); what a round does not send kept in
each rank's own model (``error_feedback="model"``, no decay): ``sparse_h20_model``, ``ternary_h4_model``,
``ternary_h64_model``, and ``sparse_h20_model_average`` (``sparse_h20_model`` ended by ``average()``, a float32
round of the whole change that leaves identical replicas, its bytes counted; the others judge rank 0's own
model, as every local-steps contender does); and ``la:EXPR`` (exploration: EXPR a
ParameterAveraging keyword dict over gradshare's and torch's names, ``average_at_end=True`` for ``average()``
after the last step).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import sys
import time
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
# After the installed packages: bench/kernels.py must not hide Hugging Face's `kernels`, which transformers imports.
sys.path.append(HERE)

LOCAL_STEPS = {
    "avg_h5": "dict(frequency=5)",
    "avg_h20": "dict(frequency=20)",
    "diloco_h20": "dict(frequency=20, outer_optimizer=nesterov(0.7, 0.9))",
    "diloco_h50": "dict(frequency=50, outer_optimizer=nesterov(0.7, 0.9))",
    "diloco_h20_m0": "dict(frequency=20, outer_optimizer=nesterov(1.0, 0.0))",
    "sparse_h20": "dict(frequency=20, compression=TopK(0.02, warmup_steps=0), residual_decay=0.9)",
    "sparse_h50": "dict(frequency=50, compression=TopK(0.02, warmup_steps=0), residual_decay=0.9)",
    "ternary_h4": "dict(frequency=4, compression=Ternary(), residual_decay=0.9)",
    "fragments_h20": "dict(frequency=20, outer_optimizer=nesterov(1.0, 0.0), fragments=4)",
    "streaming_h20": "dict(frequency=20, outer_optimizer=nesterov(1.0, 0.0), fragments=4, overlap=5)",
    "ternary_h4_overlap": "dict(frequency=4, compression=Ternary(), residual_decay=0.9, overlap=1)",
    "sparse_h20_model": "dict(frequency=20, compression=TopK(0.02, warmup_steps=0), error_feedback='model')",
    "sparse_h20_model_average": "dict(frequency=20, compression=TopK(0.02, warmup_steps=0), error_feedback='model', "
                                "average_at_end=True)",
    "ternary_h4_model": "dict(frequency=4, compression=Ternary(), error_feedback='model')",
    "ternary_h64_model": "dict(frequency=64, compression=Ternary(), error_feedback='model')",
}
CONTENDERS = ("ddp", "powersgd", "gradshare", "gradshare_auto", "gradshare_1e-2", "gradshare_1e-3", "gradshare_ternary",
              "gradshare_topk", "gradshare_gradients", "gradshare_strom", "gradshare_own_moment", "gradshare_delayed",
              "gradshare_model", "gradshare_model_1e-3", "gradshare_buffer", "gradshare_buffer_1e-2",
              "gradshare_buffer_1e-3", "single",
              *LOCAL_STEPS)


def nesterov(lr: float, momentum: float):
    """An outer optimizer factory: Nesterov SGD (DiLoCo's)."""
    import torch

    return lambda ps: torch.optim.SGD(ps, lr=lr, momentum=momentum, nesterov=momentum > 0)
DEFAULT_CONTENDERS = ("ddp", "powersgd", "gradshare", "gradshare_1e-2", "gradshare_1e-3", "single")


# ------------------------------------------------------------------------------------ collective bytes
class ByteCounter:
    """Counts the ring-model bytes of the collectives this process issues while ``on``."""

    def __init__(self, world: int):
        import torch.distributed as dist

        self.world, self.bytes, self.on = world, 0, False
        w = world

        def wrap(name, cost):
            fn = getattr(dist, name, None)
            if fn is None:
                return

            def counted(*args, **kwargs):
                if self.on:
                    self.bytes += int(cost(*args, **kwargs))
                return fn(*args, **kwargs)

            setattr(dist, name, counted)

        def nbytes(t):
            return t.numel() * t.element_size()

        wrap("all_reduce", lambda t, *a, **k: 2 * (w - 1) * nbytes(t) // w)
        wrap("all_gather_into_tensor", lambda out, inp, *a, **k: (w - 1) * nbytes(inp))
        wrap("all_gather_single", lambda out, inp, *a, **k: (w - 1) * nbytes(inp))
        wrap("all_gather", lambda outs, inp, *a, **k: (w - 1) * nbytes(inp))
        wrap("broadcast", lambda t, *a, **k: (w - 1) * nbytes(t) // w)


# ------------------------------------------------------------------------------------ one rank
def _cosine(opt, steps: int, warmup: int = 0):
    """The learning rate decayed to 0 along a cosine over ``steps``; with ``warmup``, first raised linearly from
    ~0 over that many steps (the cosine then over the rest)."""
    import torch

    if not warmup:
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / (steps - warmup))))


def rank_main(cfg: Dict) -> Dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import workloads

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    wl = workloads.WORKLOADS[cfg["workload"]]
    name, _, precision = cfg["contender"].partition("@")   # NAME@bf16: bf16 autocast; NAME@fp16: + GradScaler
    if precision not in ("", "bf16", "fp16"):
        raise ValueError(f"contender {cfg['contender']!r}: precision must be bf16 or fp16")
    data = workloads.Data(cfg["workload"], cfg["seed"], cfg["data_dir"])
    counter = ByteCounter(world)
    torch.manual_seed(cfg["seed"])
    model = wl.model()
    n = sum(p.numel() for p in model.parameters())
    local = name in LOCAL_STEPS or name.startswith("la:")
    if local:
        net = model
    else:
        net = DDP(model, bucket_cap_mb=math.ceil(4 * n / 2**20) + 1) if name == "powersgd" else DDP(model)
    made = wl.optimizer(net.parameters())
    opt, *others = made if isinstance(made, tuple) else (made,)   # several: the first is the one shared
    stepper = opt
    state = None
    average_at_end = False
    if local:
        import gradshare

        expr = LOCAL_STEPS.get(name, name[3:])
        kwargs = dict(eval(expr, dict(vars(gradshare), torch=torch, nesterov=nesterov)))
        average_at_end = kwargs.pop("average_at_end", False)
        stepper = state = gradshare.ParameterAveraging(model, opt, **kwargs)
    elif name == "ddp":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        net.register_comm_hook(None, default_hooks.allreduce_hook)
    elif name == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

        # One bucket: on gloo, powerSGD_hook launches its second allreduce from the first one's callback,
        # which races with the next bucket's hook; a single bucket keeps every rank's collectives in order.
        ps_state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                    start_powerSGD_iter=max(2, wl.steps // 10), min_compression_rate=2,
                                    use_error_feedback=True, warm_start=True, random_seed=cfg["seed"])
        net.register_comm_hook(ps_state, ps.powerSGD_hook)
    elif name.startswith("gradshare") or name.startswith("gs:"):
        import gradshare

        kwargs = {"optimizer": [opt] + others if others else opt}
        if name == "gradshare":
            kwargs["link"] = None          # the compression itself, at every step, whatever the link
        elif name == "gradshare_1e-2":
            kwargs["compression"] = gradshare.TargetSparsity(target=0.01)
        elif name == "gradshare_1e-3":
            kwargs["compression"] = gradshare.TargetSparsity(target=0.001)
        elif name == "gradshare_ternary":
            kwargs.update(compression=gradshare.Ternary(), error_feedback="buffer")
        elif name == "gradshare_topk":
            kwargs.update(compression=gradshare.TopK(), error_feedback="buffer")
        elif name == "gradshare_own_moment":
            kwargs.update(link=None, error_feedback="buffer")
        elif name == "gradshare_delayed":
            kwargs.update(link=None, delay=1)
        elif name == "gradshare_model":        # what waits in each rank's model, the top 1% as signs
            kwargs.update(link=None, error_feedback="model", compression=gradshare.TopK(0.01, values="sign"))
        elif name.startswith("gradshare_buffer"):   # what waits in gradshare's residual
            kwargs["error_feedback"] = "buffer"
            density = name[len("gradshare_buffer_"):]
            if density:
                kwargs["compression"] = gradshare.TargetSparsity(target=float(density))
            else:
                kwargs["link"] = None
        elif name == "gradshare_model_1e-3":
            kwargs.update(error_feedback="model", compression=gradshare.TargetSparsity(target=0.001))
        elif name == "gradshare_gradients":
            kwargs = {}
        elif name == "gradshare_strom":
            kwargs = {"compression": gradshare.Adaptive(), "clipping": gradshare.ResidualClipping()}
        elif name.startswith("gs:"):       # exploration: gs:EXPR (EXPR a ThresholdState keyword dict over gradshare's names)
            kwargs = dict(eval(name[3:], dict(vars(gradshare), opt=opt)))
        state = gradshare.ThresholdState(**kwargs)
        if name == "gradshare_own_moment":
            state.sharing.global_second_moment = False
        net.register_comm_hook(state, gradshare.threshold_hook)
    scheds = ([_cosine(o, wl.steps, wl.warmup) for o in [opt] + others]
              if cfg.get("schedule", "cosine") == "cosine" else [])          # "constant": the optimizer's lr
    losses, t0 = [], time.perf_counter()
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    half = torch.bfloat16 if precision == "bf16" else torch.float16
    for step in range(wl.steps):
        x, y = data.batch(step, rank if name != "single" else 0, world if name != "single" else 1, wl.batch)
        counter.on = True
        for o in [opt] + others:
            o.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=half, enabled=bool(precision)):
            loss = data.loss(net(x), y)
        scaler.scale(loss).backward()
        if wl.clip:                        # as the user's script does: unscaled, then clipped, then stepped
            for o in [opt] + others:
                scaler.unscale_(o)
            torch.nn.utils.clip_grad_norm_(net.parameters(), wl.clip)
        for o in [stepper] + others:
            scaler.step(o)
        scaler.update()
        for sched in scheds:
            sched.step()
        counter.on = False
        losses.append(float(loss.detach()))
    seconds = time.perf_counter() - t0
    if getattr(state, "flush", None) is not None:
        state.flush()                      # delay=1: the last step's update is applied before evaluating
    if local and average_at_end:
        counter.on = True                  # its bytes count
        state.average()
        counter.on = False
    metric = data.evaluate(model) if rank == 0 else None
    out = {}
    cores = [c for c in (getattr(state, "sharings", None) or [getattr(state, "sharing", None)]) if c is not None]
    if any(getattr(c, "own_models", False) for c in cores):
        # What waits kept in each rank's model: the table judges what rank 0's parameters show between steps (the
        # round's mean result: Sharing.show_mean); here also that mean result through state.mean_result() (the
        # buckets' snapshot, checked identical on every rank) and the model after merge().
        from gradshare.replicas import ReplicaMismatchError, verify_replicas
        with state.mean_result():                  # every parameter set to the mean result, then back
            out["snapshot_metric"] = data.evaluate(model) if rank == 0 else None
            try:
                verify_replicas(model)
                out["snapshot_identical"] = True
            except ReplicaMismatchError:
                out["snapshot_identical"] = False
        state.merge()
        out["merged_metric"] = data.evaluate(model) if rank == 0 else None
    out.update({"rank": rank, "world": world, "params": n, "steps": wl.steps, "metric": metric,
                "train_loss": statistics.fmean(losses[-50:]), "bytes": counter.bytes,
                "dense_bytes": wl.steps * 2 * (world - 1) * 4 * n // world if world > 1 else 0, "seconds": seconds})
    if state is not None:
        out["library_bytes"] = state.bytes_sent               # gradshare.stats.ReportsTraffic
        if state.stats is not None:
            out["formats"] = dict(state.stats.format_counts)
    return out


def _single(cfg: Dict) -> Dict:
    return rank_main(cfg)


def run_one(workload: str, contender: str, seed: int, workers: int, data_dir: str, schedule: str = "cosine") -> Dict:
    from gradshare.workers import run_local

    cfg = {"workload": workload, "contender": contender, "seed": seed, "data_dir": data_dir, "schedule": schedule}
    world = 1 if contender.partition("@")[0] == "single" else workers
    t0 = time.perf_counter()
    outs = run_local(rank_main, world, (cfg,), threads=1, timeout=3600, collective_timeout=600)
    r0 = outs[0]
    ddp_bytes = r0["steps"] * 2 * (workers - 1) * 4 * r0["params"] // workers
    return {"workload": workload, "contender": contender, "seed": seed, "workers": world, "schedule": schedule,
            "metric": r0["metric"],
            "train_loss": r0["train_loss"], "bytes": max(o["bytes"] for o in outs), "ddp_bytes": ddp_bytes,
            "library_bytes": r0.get("library_bytes"), "formats": r0.get("formats"), "params": r0["params"],
            "steps": r0["steps"], "train_seconds": r0["seconds"], "wall_seconds": time.perf_counter() - t0,
            **{k: r0[k] for k in ("snapshot_metric", "snapshot_identical", "merged_metric") if k in r0}}


# ------------------------------------------------------------------------------------ tables
def summarize(results: List[Dict]) -> str:
    import workloads

    lines = []
    for wl in dict.fromkeys(r["workload"] for r in results):
        rows = [r for r in results if r["workload"] == wl and r.get("metric") is not None]
        metric = workloads.WORKLOADS[wl].metric
        ddp = {r["seed"]: r["metric"] for r in rows if r["contender"] == "ddp"}
        first = rows[0] if rows else None
        if first is None:
            continue
        lines.append(f"*{wl}* ({first['params']:,} parameters, {first['steps']} steps, "
                     f"{'test accuracy' if metric == 'accuracy' else 'validation loss'})\n")
        gap = "Δ vs DDP (pt)" if metric == "accuracy" else "Δ vs DDP"
        lines.append(f"| contender | final {metric} | {gap} | bytes vs DDP | seeds |")
        lines.append("|---|---|---:|---:|---:|")
        for c in dict.fromkeys(r["contender"] for r in rows):
            rs = [r for r in rows if r["contender"] == c]
            vals = [r["metric"] for r in rs]
            mean = statistics.fmean(vals)
            spread = f" [{min(vals):.4f}, {max(vals):.4f}]" if len(vals) > 1 else ""
            paired = [r["metric"] - ddp[r["seed"]] for r in rs if r["seed"] in ddp]
            if paired and metric == "accuracy":
                d = f"{100 * statistics.fmean(paired):+.2f}"
            elif paired:
                d = f"{100 * statistics.fmean(p / ddp[r['seed']] for p, r in zip(paired, rs)):+.1f}%"
            else:
                d = "n/a"
            sent = sum(r["bytes"] for r in rs)
            ratio = "n/a (1 process)" if c == "single" else (f"{sum(r['ddp_bytes'] for r in rs) / sent:.1f}x"
                                                             if sent else "n/a")
            lines.append(f"| {c} | {mean:.4f}{spread} | {d} | {ratio} | {len(rs)} |")
        lines.append("")
        own = [c for c in dict.fromkeys(r["contender"] for r in rows)
               if all(r.get("snapshot_metric") is not None for r in rows if r["contender"] == c)]
        if own:
            lines.append("What waits kept in each rank's model, judged three ways (mean over seeds): what rank 0's "
                         "parameters show after the last step (above; the mean result, where the DDP hook and "
                         "SharedOptimizer show it between steps), the mean result every rank holds "
                         "(`state.mean_result()`), and the model after `merge()`.\n")
            lines.append("| contender | shown | mean result | identical on every rank | after merge() | seeds |")
            lines.append("|---|---:|---:|---|---:|---:|")
            for c in own:
                rs = [r for r in rows if r["contender"] == c]
                mean = lambda k: statistics.fmean(r[k] for r in rs)  # noqa: E731
                same = "yes" if all(r["snapshot_identical"] for r in rs) else "NO"
                lines.append(f"| {c} | {mean('metric'):.4f} | {mean('snapshot_metric'):.4f} | {same} "
                             f"| {mean('merged_metric'):.4f} | {len(rs)} |")
            lines.append("")
    return "\n".join(lines)


def split_contenders(text: str) -> List[str]:
    """Contender names separated by ";" or by commas outside brackets (gs:EXPR and la:EXPR hold commas)."""
    if ";" in text:
        return [c for c in text.split(";") if c]
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return [c for c in out + [cur] if c]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="mnist_cnn,mlp,bn_cnn,char_lm")
    p.add_argument("--contenders", default=",".join(DEFAULT_CONTENDERS),
                   help=f"comma-separated, from {', '.join(CONTENDERS)}")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--data-dir", default=None, help="MNIST idx files (default: ../shared/data/mnist)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "quality"))
    p.add_argument("--report", metavar="DIR", help="re-render DIR/results.json and exit")
    p.add_argument("--schedule", choices=("cosine", "constant"), default="cosine",
                   help="the learning rate over the run: cosine annealing to 0 (default), or the optimizer's "
                        "own, constant (where what waits in error feedback has not drained at the end)")
    args = p.parse_args(argv)
    if args.report:
        results = json.load(open(os.path.join(args.report, "results.json")))
        print(summarize(results))
        return 0
    import workloads

    data_dir = args.data_dir or workloads.MNIST_DIR
    contenders = split_contenders(args.contenders)
    unknown = [c for c in contenders if c.partition("@")[0] not in CONTENDERS and not c.startswith(("gs:", "la:"))]
    if unknown:
        p.error(f"unknown contender(s) {unknown}; choose from {', '.join(CONTENDERS)}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "results.json")
    results = json.load(open(path)) if os.path.exists(path) else []
    done = {(r["workload"], r["contender"], r["seed"]) for r in results}
    schedules = {r.get("schedule", "cosine") for r in results} | {args.schedule}
    if len(schedules) > 1:
        p.error(f"{path} holds runs with another --schedule; use a folder of its own")
    for seed in [int(s) for s in args.seeds.split(",")]:
        for wl in args.workloads.split(","):
            for c in contenders:
                if (wl, c, seed) in done:
                    continue
                r = run_one(wl, c, seed, args.workers, data_dir, args.schedule)
                results.append(r)
                print(json.dumps({k: r[k] for k in ("workload", "contender", "seed", "metric", "bytes",
                                                    "ddp_bytes", "wall_seconds")}), flush=True)
                with open(path + ".tmp", "w") as f:
                    json.dump(results, f, indent=1)
                os.replace(path + ".tmp", path)
    table = summarize(results)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(f"`python bench/quality.py {shlex.join(argv or sys.argv[1:])}`, {args.workers} workers\n\n{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
