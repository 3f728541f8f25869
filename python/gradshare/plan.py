"""Advise which data-parallel scheme to use for a model, a worker count and a link.

Give the model as a parameter count (--params) or a class to load (--model pkg.module:Class), the workers,
the link bandwidth, and the compute time of one step on one worker (--step-time in ms, or --measure to time
a few real forward/backward steps). The advice comes from gradshare.costmodel:
- the expected step time of dense allreduce, fp16 allreduce, PowerSGD, gradshare sharing (at the size of
  the default message, the top 5% as signs, read from gradshare.compression) and parameter averaging;
- DL4J's rule of thumb: 100 ms or more per step scales well, around 10 ms sub-linearly, 1 ms or less is
  not worth distributing;
- what sharing should send on this link, and how often to average.

The model does not predict accuracy: compressed and averaged schemes trade some convergence per step for
fewer bytes; check with a short run.

Examples:
    gradshare plan --params 25M --workers 2 --bandwidth 100mbit --step-time 100
    gradshare plan --model torchvision.models:resnet18 --input-shape 3,224,224 \\
        --batch-size 32 --measure --json
"""
from __future__ import annotations

import importlib
import json
import math
import sys
import time
from typing import List, Optional, Sequence, Tuple

from gradshare import argtypes
from gradshare import costmodel as cm
from gradshare._deprecation import former_names, renamed_kwargs
from gradshare.compression import Compression, TopK, for_optimizer
from gradshare.message import HEADER_WORDS

# DL4J's guidance on when distributing pays (per-iteration compute time on one worker).
SCALES_WELL_S = 0.100
NOT_WORTH_S = 0.001
# Compression must win clearly to be worth its accuracy risk: within this factor of the best, plain allreduce.
ALLREDUCE_TOLERANCE = 1.05
# Distributing must beat one worker by this throughput factor to be recommended.
MIN_SPEEDUP = 1.1
# The averaging frequency and the message size are chosen so communication costs at most this share of compute.
COMM_BUDGET = 0.10
MAX_FREQUENCY = 20            # DL4J javadoc: averaging much less often than every ~20 steps hurts convergence
# Below this TopK density per-step sharing trains noticeably worse (README, Training quality: 0.1%).
MIN_TOPK_DENSITY = 1e-3
CHOICES = ("allreduce", "fp16", "powersgd", "sharing", "averaging")

__getattr__ = former_names(__name__, suggest_averaging_period="suggest_frequency",
                           MAX_AVERAGING_PERIOD="MAX_FREQUENCY")


# ------------------------------------------------------------------------------ what the defaults send
def default_compression() -> TopK:
    """What the DDP hook and SharedOptimizer send by default, for any optimizer (what waits in each rank's model:
    gradshare.compression.for_optimizer)."""
    return for_optimizer(None, own_models=True)


def message_density(compression: Compression, params: int) -> float:
    """Words of ``compression``'s message for ``params`` elements after any warm-up, header excluded, per
    element: the message size as a fraction of a float32 buffer (the cost model's density)."""
    step = int(getattr(compression, "warmup_steps", 0))
    return max(0, compression.words(max(1, params), step) - HEADER_WORDS) / max(1, params)


def topk_density_within(fraction: float, params: int, values: Optional[str] = None) -> float:
    """The largest TopK density (entries sent per element, as ``values``, default the defaults' kind; TopK's other
    settings at their defaults) whose message is at most ``fraction`` of a float32 buffer; 0 when not even one
    entry per chunk fits."""
    values = values or default_compression().values

    def fits(d: float) -> bool:
        return message_density(TopK(d, values=values), params) <= fraction
    low, high = 0.0, 1.0
    if fits(high):
        return high
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if mid > 0 and fits(mid) else (low, mid)
    return low


def _one_digit_down(x: float) -> float:
    """``x`` rounded down to one significant digit (0 stays 0): a density that still fits, written short."""
    if x <= 0:
        return 0.0
    unit = 10.0 ** math.floor(math.log10(x))
    return float(f"{math.floor(x / unit + 1e-9) * unit:.1g}")


def warmup_bytes(params: int, tk: Optional[TopK] = None) -> float:
    """Bytes a TopK's warm-up (default: the default compression's) sends on top of its steady density, per
    worker's message, once."""
    tk = tk or default_compression()
    extra = sum(tk.words(params, s) - tk.words(params, tk.warmup_steps) for s in range(tk.warmup_steps))
    return 4.0 * extra


def add_arguments(p) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", metavar="N", type=argtypes.count(1),
                     help="number of trainable parameters (25000000, 2.5e7, 25M)")
    src.add_argument("--model", metavar="MODULE:CLASS",
                     help="module:Class to instantiate and count (e.g. torchvision.models:resnet18)")
    p.add_argument("--model-kwargs", metavar="JSON", default="{}", help="JSON keyword arguments for the model class")
    p.add_argument("--workers", metavar="N", type=argtypes.integer(1), default=2, help="data-parallel workers")
    p.add_argument("--bandwidth", metavar="RATE", type=argtypes.bandwidth, default="1gbit",
                   help="per-worker link: 100mbit, 1gbit, 10gbit, 12.5MB/s ...")
    p.add_argument("--latency-ms", metavar="MS", type=argtypes.number(0), default=cm.LATENCY_SECONDS * 1e3,
                   help="per message round")
    p.add_argument("--efficiency", metavar="FRACTION", type=argtypes.number(0, 1, low_open=True),
                   default=cm.LINK_EFFICIENCY,
                   help="payload share of the link rate (TCP/IP overhead)")
    when = p.add_mutually_exclusive_group()
    when.add_argument("--step-time", metavar="MS", type=argtypes.number(0, low_open=True),
                      help="compute time of one step on one worker, ms")
    when.add_argument("--measure", action="store_true", help="time a few forward/backward steps of --model")
    p.add_argument("--input-shape", metavar="SHAPE", help="one sample's shape for --measure, e.g. 1,28,28")
    p.add_argument("--batch-size", metavar="N", type=argtypes.integer(1), default=32,
                   help="per-worker batch for --measure")
    p.add_argument("--measure-steps", metavar="N", type=argtypes.integer(1), default=5,
                   help="timed steps for --measure (after 2 warm-up)")
    p.add_argument("--threads", metavar="N", type=argtypes.integer(1), default=1,
                   help="torch threads for --measure (one core per worker)")
    tk = default_compression()
    p.add_argument("--density", metavar="FRACTION", type=argtypes.number(0, 1, low_open=True),
                   help="gradshare's message size as a fraction of a float32 buffer (default: what the hook and "
                        f"SharedOptimizer send after their warm-up, the top {100 * tk.density:g}%% of entries as signs: about "
                        f"{message_density(tk, 10**7):.3g})")
    p.add_argument("--powersgd-rank", metavar="R", type=argtypes.integer(1), default=2, help="PowerSGD's matrix rank")
    p.add_argument("--frequency", type=argtypes.integer(1), metavar="STEPS",
                   help="model averaging every STEPS steps instead of suggesting a frequency")
    p.add_argument("--averaging-period", dest="frequency", type=argtypes.integer(1), action=argtypes.FormerName,
                   new="--frequency")
    p.add_argument("--optimizer-state", metavar="BUFFERS", type=argtypes.number(0), default=0.0,
                   help="parameter-sized optimizer buffers averaged too (momentum 1, Adam 2)")
    p.add_argument("--overlap", metavar="FRACTION", type=argtypes.number(0, 1), default=0.0,
                   help="share of compute that hides a DDP allreduce (0 = none, 1 = fully overlapped)")
    p.add_argument("--encode-ns", metavar="NS", type=argtypes.number(0), default=cm.ENCODE_SECONDS_PER_ELEMENT * 1e9,
                   help="gradshare encode cost per element, ns (default: %(default)g, measured on one loaded core)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


# ------------------------------------------------------------------------------------------ model
def load_model(spec: str, kwargs: Optional[dict] = None):
    """Instantiates ``module:Class`` (or ``module:function``) with ``kwargs``."""
    if ":" not in spec:
        raise ValueError(f"--model wants module:Class, got {spec!r}")
    module_name, attr = spec.split(":", 1)
    if "" not in sys.path:
        sys.path.insert(0, "")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj(**(kwargs or {}))


def model_shapes(model) -> List[Tuple[int, ...]]:
    return [tuple(p.shape) for p in model.parameters() if p.requires_grad]


def measure_step_time(model, input_shape: Sequence[int], batch_size: int = 32, steps: int = 5,
                      warmup: int = 2, threads: int = 1) -> float:
    """Median seconds of forward + backward + SGD step on a random batch (one worker's compute)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model.train()
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-6)
        x = torch.randn(batch_size, *input_shape)
        times = []
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            out = model(x)
            out = out[0] if isinstance(out, (tuple, list)) else out
            out.float().square().mean().backward()
            opt.step()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        times.sort()
        return times[len(times) // 2]
    finally:
        torch.set_num_threads(old)


# ------------------------------------------------------------------------------------------ advice
def dl4j_band(compute: float) -> Tuple[str, str]:
    """DL4J's rule for a step of ``compute`` seconds: (band, explanation)."""
    ms = compute * 1e3
    if compute <= NOT_WORTH_S:
        return "not-worth-distributing", f"{ms:.3g} ms per step (<= 1 ms): one machine may be as fast"
    if compute >= SCALES_WELL_S:
        return "scales-well", f"{ms:.3g} ms per step (>= 100 ms): distributing scales well"
    return "sub-linear", f"{ms:.3g} ms per step (1-100 ms; ~10 ms scales sub-linearly)"


def suggest_frequency(params: int, workers: int, link: cm.Link, compute: float,
                      optimizer_state_factor: float = 0.0) -> Tuple[Optional[int], str]:
    """Smallest averaging frequency k <= 20 whose amortised traffic costs <= 10% of compute (None if none)."""
    if workers < 2:
        return None, "one worker: nothing to average"
    full = link.time(cm.dense_allreduce_bytes(workers, params) * (1 + optimizer_state_factor), 2 * (workers - 1))
    k = max(1, math.ceil(full / (COMM_BUDGET * compute))) if compute > 0 else None
    if k is None or k > MAX_FREQUENCY:
        return None, (f"averaging takes {full * 1e3:.3g} ms; keeping it under {COMM_BUDGET:.0%} of compute needs "
                      f"more than {MAX_FREQUENCY} steps between rounds, where convergence suffers (DL4J)")
    return k, (f"average every {k} step(s): {full * 1e3:.3g} ms per averaging, {full / k * 1e3:.3g} ms per step "
               f"amortised (<= {COMM_BUDGET:.0%} of compute); DL4J default 5, keep <= {MAX_FREQUENCY}")


def fitting_density(params: int, workers: int, link: cm.Link, compute: float) -> float:
    """Largest message size (a fraction of a float32 buffer) whose all-gather costs <= 10% of compute (may be 0)."""
    if workers < 2 or params == 0:
        return 1.0
    budget = COMM_BUDGET * compute - 2 * (workers - 1) * link.latency
    nbytes = budget * link.bandwidth * link.efficiency / 8.0 / (workers - 1) - cm.LENGTH_BYTES
    entries = nbytes / cm.WORD_BYTES - HEADER_WORDS
    return max(0.0, min(1.0, entries / params))


def suggest_compression(params: int, workers: int, link: cm.Link, compute: float, density: float) -> dict:
    """What sharing should send on this link (gradshare.compression), from the defaults' own message size (the
    top 5% as signs, for SGD and Adam alike): the defaults when their message costs <= 10% of compute, else the
    densest TopK that fits, down to MIN_TOPK_DENSITY, else parameter averaging or local steps. ``density``: the
    message size the sharing row was modelled at (for the crossover)."""
    fit = fitting_density(params, workers, link, compute)
    crossover = cm.sharing_crossover_workers(density)
    default = default_compression()
    default_size = message_density(default, params)
    sent: Optional[TopK] = default               # the TopK the advice sends, for its warm-up
    out = {"fitting_density": fit, "crossover_workers": crossover, "default_density": default.density,
           "default_message": default_size}
    if workers >= crossover:
        sent = None
        out.update(algorithm="ThresholdState(optimizer=opt)", why=(
            f"at {workers} workers the all-gather of messages of {density:.3g} of a float32 buffer moves more than "
            f"a dense allreduce (N > 2/d = {crossover:.3g}): gradshare falls back to the dense allreduce on those "
            f"steps; parameter averaging or fewer, larger workers suit this better"))
    elif fit >= default_size:
        out.update(algorithm="ThresholdState(optimizer=opt)",
                   why=f"the defaults: the top {100 * default.density:g}% of each step as signs ({default_size:.3g} "
                       f"of a float32 buffer), for SGD and Adam alike, costs <= {COMM_BUDGET:.0%} of compute on "
                       f"this link")
    else:
        d = _one_digit_down(topk_density_within(fit, params, default.values))   # 0.004, not 0.00437...
        if d >= MIN_TOPK_DENSITY:
            sent = TopK(d, values=default.values)
            code = f'TopK({d:g}, values="{default.values}")'
            out.update(algorithm=f"ThresholdState(optimizer=opt, compression=gradshare.{code})",
                       why=f"{COMM_BUDGET:.0%} of compute carries {code} ({message_density(sent, params):.3g} "
                           f"of a float32 buffer) but not the defaults' top {100 * default.density:g}% as signs "
                           f"({default_size:.3g})")
        else:
            sent = None
            out.update(algorithm="ParameterAveraging (local steps)",
                       why=f"{COMM_BUDGET:.0%} of compute carries messages of {fit:.2g} of a float32 buffer at most, "
                           f"less than TopK({MIN_TOPK_DENSITY:g}) sends: per-step sharing that sparse trains "
                           f"noticeably worse; average every few steps instead")
    if sent is not None and sent.warmup_steps:
        steps = warmup_bytes(params, sent) * (workers - 1) / cm.dense_allreduce_bytes(max(2, workers), params)
        out["warmup"] = (f"TopK's warm-up (its first {sent.warmup_steps} steps, from {100 * sent.warmup_density:g}% "
                         f"down to {100 * sent.density:g}% of entries) sends about {steps:.2g} dense allreduce steps' "
                         f"worth of bytes more, once")
    return out


@renamed_kwargs(averaging_period="frequency")
def make_plan(params: int, workers: int, bandwidth: float, compute: float, *, latency: float = cm.LATENCY_SECONDS,
              efficiency: float = cm.LINK_EFFICIENCY, density: Optional[float] = None, powersgd_rank: int = 2,
              shapes=None, frequency: Optional[int] = None, optimizer_state_factor: float = 0.0,
              overlap: float = 0.0, encode_per_element: float = cm.ENCODE_SECONDS_PER_ELEMENT) -> dict:
    """The whole plan as a dict (what --json prints). ``density``: gradshare's message size as a fraction of
    a float32 buffer (default: what the default compression sends after its warm-up); ``frequency``: model averaging every
    that many steps (default: suggested)."""
    if density is None:
        density = message_density(default_compression(), params)
    link = cm.Link(bandwidth=bandwidth, latency=latency, efficiency=efficiency)
    k_suggested, k_why = suggest_frequency(params, workers, link, compute, optimizer_state_factor)
    modelled = frequency or k_suggested or MAX_FREQUENCY
    costs = cm.scheme_costs(params, workers, link, compute, density=density, powersgd_rank=powersgd_rank,
                            shapes=shapes, frequency=modelled, optimizer_state_factor=optimizer_state_factor,
                            overlap=overlap, encode_per_element=encode_per_element)
    schemes = []
    for c in costs:
        d = c.as_dict()
        d["speedup"] = cm.speedup(c, workers)
        schemes.append(d)
    by_name = {s["name"]: s for s in schemes}
    band, band_why = dl4j_band(compute)
    best = min((by_name[n] for n in CHOICES), key=lambda s: s["step_time"])
    reasons = [band_why]
    if workers < 2:
        choice = "single"
        reasons.append("one worker: nothing to exchange")
    elif band == "not-worth-distributing":
        choice = "single"
        reasons.append("per-step overheads (launch, synchronisation, stragglers) outweigh so little compute: "
                       "train on one machine (ParallelWrapper on its devices)")
    elif best["speedup"] < MIN_SPEEDUP:
        choice = "single"
        reasons.append(f"best scheme ({best['name']}) gives {best['speedup']:.2f}x the throughput of one worker "
                       f"(< {MIN_SPEEDUP}x): train on one machine (ParallelWrapper on its devices)")
    elif by_name["allreduce"]["step_time"] <= ALLREDUCE_TOLERANCE * best["step_time"]:
        choice = "allreduce"
        reasons.append(f"dense allreduce is within {ALLREDUCE_TOLERANCE - 1:.0%} of the fastest scheme "
                       f"({best['name']}): the step is compute-bound, compression would buy little and costs "
                       f"accuracy risk")
    else:
        choice = best["name"]
        ar = by_name["allreduce"]
        reasons.append(f"{choice} is fastest: {best['step_time'] * 1e3:.4g} ms per step against "
                       f"{ar['step_time'] * 1e3:.4g} ms for dense allreduce "
                       f"({ar['step_time'] / best['step_time']:.3g}x), {best['bytes_per_step']:.4g} bytes per step")
        if choice == "sharing":
            reasons.append("ThresholdState(optimizer=opt) is link-aware: on steps where compressing turns out "
                           "slower than DDP's all-reduce on this link, it takes the all-reduce")
        if choice == "powersgd" and shapes is None:
            reasons.append("PowerSGD bytes are a square-matrix estimate without --model; real models move more")
    if choice in ("sharing", "averaging", "powersgd", "fp16"):
        reasons.append("compressed/averaged updates converge differently per step: confirm accuracy on a short run")
    return {
        "params": params, "workers": workers, "bandwidth_bps": bandwidth, "latency_s": latency,
        "efficiency": efficiency, "compute_s": compute, "density": density,
        "dl4j_band": band, "recommendation": choice, "reasons": reasons,
        "schemes": schemes,
        "compression": suggest_compression(params, workers, link, compute, density),
        "averaging": {"frequency": k_suggested, "why": k_why, "modelled_frequency": modelled},
        "sparse_allgather_crossover_workers": cm.sharing_crossover_workers(density),
    }


def format_plan(plan: dict) -> str:
    lines = [f"gradshare plan: {plan['params']:,} parameters, {plan['workers']} workers, "
             f"{plan['bandwidth_bps'] / 1e6:g} Mbit/s, compute {plan['compute_s'] * 1e3:.4g} ms per step, "
             f"sharing modelled at messages of {plan['density']:.3g} of a float32 buffer",
             "",
             f"{'scheme':<10} {'bytes/step':>12} {'comm ms':>9} {'encode ms':>9} {'step ms':>9} {'speedup':>8}  note"]
    for s in plan["schemes"]:
        lines.append(f"{s['name']:<10} {s['bytes_per_step']:>12,.0f} {s['communicate'] * 1e3:>9.3f} "
                     f"{s['encode'] * 1e3:>9.3f} {s['step_time'] * 1e3:>9.3f} {s['speedup']:>7.2f}x  {s['note']}")
    lines += ["", f"DL4J rule: {plan['dl4j_band']}", f"use: {plan['recommendation']}"]
    lines += [f"  - {r}" for r in plan["reasons"]]
    th = plan["compression"]
    lines.append(f"sharing: {th['algorithm']} -- {th['why']}")
    if th.get("warmup"):
        lines.append(f"  - {th['warmup']}")
    avg = plan["averaging"]
    lines.append(f"averaging frequency: {avg['frequency'] if avg['frequency'] else 'none fits'} -- {avg['why']}")
    lines.append(f"sparse all-gather beats the dense allreduce only below N = 2/d = "
                 f"{plan['sparse_allgather_crossover_workers']:.3g} workers; above it gradshare sends dense")
    return "\n".join(lines)


def _refuse(message: str) -> int:
    print(f"gradshare plan: error: {message}", file=sys.stderr)
    return 2


def run(args) -> int:
    shapes = None
    if args.model:
        try:
            kwargs = json.loads(args.model_kwargs)
        except ValueError as exc:
            return _refuse(f"--model-kwargs: not JSON ({exc})")
        if not isinstance(kwargs, dict):
            return _refuse("--model-kwargs: expected a JSON object of keyword arguments")
        try:
            model = load_model(args.model, kwargs)
        except Exception as exc:   # an import error, a missing name, a constructor that refuses the arguments
            return _refuse(f"--model {args.model}: {type(exc).__name__}: {exc}")
        shapes = model_shapes(model)
        params = sum(math.prod(s) for s in shapes)
    else:
        params = args.params
    if args.measure:
        if not args.model or not args.input_shape:
            return _refuse("--measure needs --model and --input-shape")
        try:
            shape = [int(x) for x in args.input_shape.split(",") if x]
        except ValueError:
            return _refuse(f"--input-shape: expected sizes like 1,28,28, got {args.input_shape!r}")
        if not shape or min(shape) < 1:
            return _refuse(f"--input-shape: expected positive sizes like 1,28,28, got {args.input_shape!r}")
        compute = measure_step_time(model, shape, args.batch_size, args.measure_steps, threads=args.threads)
    elif args.step_time is not None:
        compute = args.step_time / 1e3
    else:
        return _refuse("give --step-time MS or --measure")
    plan = make_plan(params, args.workers, args.bandwidth, compute,
                     latency=args.latency_ms / 1e3, efficiency=args.efficiency, density=args.density,
                     powersgd_rank=args.powersgd_rank, shapes=shapes, frequency=args.frequency,
                     optimizer_state_factor=args.optimizer_state, overlap=args.overlap,
                     encode_per_element=args.encode_ns * 1e-9)
    plan["measured"] = bool(args.measure)
    print(json.dumps(plan, indent=2) if args.json else format_plan(plan))
    return 0
