"""The per-rank training, evaluation and prediction loops shared by every launcher.

:func:`train_rank` is the one training loop: ParallelWrapper and ``gradshare train --launcher local`` run
it on local worker processes, and a cluster trainer runs the very same function under torchrun or Spark.
It relies only on an initialised torch.distributed process group (RANK / WORLD_SIZE), takes a picklable
:class:`TrainConfig` and returns a picklable result (rank 0 carries the trained model state).

The loop's position is explicit (:class:`TrainState`: epoch, global step, batch within the epoch), every
epoch's data order is a function of (seed, epoch), and ``TrainConfig.on_step`` / ``TrainConfig.resume``
let a caller checkpoint after any step and resume mid-epoch at the same batch.
"""
from __future__ import annotations

import copy
import functools
import math
import os
import pickle
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from gradshare import data as gdata
from gradshare import metrics as gmetrics
from gradshare._deprecation import RenamedAttribute, renamed_kwargs
from gradshare.averaging import ParameterAveraging
from gradshare.stats import ReportsTraffic

MODES = ("shared_gradients", "averaging")
OptimizerSpec = Union[Callable[..., torch.optim.Optimizer], Tuple[type, Dict[str, Any]]]


def make_optimizer(spec: OptimizerSpec, params) -> torch.optim.Optimizer:
    """``spec`` is a factory ``f(params) -> Optimizer`` (an optimizer class works: SGD/Adam/... with their
    defaults) or ``(OptimizerClass, kwargs)``."""
    if isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[1], dict):
        return spec[0](params, **spec[1])
    if callable(spec):
        return spec(params)
    raise TypeError(f"optimizer: expected a factory f(params) or (class, kwargs), got {type(spec).__name__}")


def check_picklable(name: str, value: Any) -> None:
    """Raises a clear TypeError when ``value`` cannot be sent to a spawned worker."""
    try:
        pickle.dumps(value)
    except Exception as exc:
        raise TypeError(f"{name}: must be picklable to reach the worker processes (use a module-level "
                        f"function, functools.partial, or (class, kwargs); not a lambda or a local "
                        f"function): {exc}") from None


def default_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over logits, averaged over the batch."""
    return nn.functional.cross_entropy(outputs, targets)


@dataclass
class TrainConfig:
    """Everything one rank needs to train; picklable (module-level callables only).

    ``batch_size`` is per worker. ``mode``: "shared_gradients" (gradshare.optim.SharedOptimizer with
    ``compression`` (None: chosen for the optimizer, gradshare.compression) and ``clipping`` (for +-tau
    thresholds); ``shared`` picks what is encoded: "updates" (default) or "gradients"; ``link``: "auto"
    (link-aware, gradshare.link) or None (compression at every step: runs repeat bit for bit)) or
    "averaging" (ParameterAveraging every ``frequency`` steps; with ``outer_optimizer`` (a spec as
    for ``optimizer``) and/or ``compression`` only the pseudo-gradient is shared, with ``residual_decay`` and
    ``error_feedback``:
    DiLoCo and SparseLoCo, gradshare.averaging; ``error_feedback`` also for shared updates, gradshare.sharing; ``fragments`` and ``overlap``: its streaming rounds). ``devices``: device i % len
    for rank i (default CPU). ``on_step(state)`` runs after every step on every rank (checkpointing);
    ``resume`` is a dict from :meth:`TrainState.state_dict` or a function rank -> such a dict.
    ``train_data``: anything gradshare.data.as_dataset takes (a Dataset, a DataLoader, ready-made batches,
    tensors, a spec string); a batch is a tuple (inputs, targets, ...) or a dict read at ``batch_keys``.
    """
    model: nn.Module
    optimizer: OptimizerSpec
    train_data: Any
    loss_fn: Callable = default_loss
    epochs: int = 1
    batch_size: int = 32
    mode: str = "shared_gradients"
    shared: str = "updates"
    compression: Any = None
    clipping: Any = "default"
    link: Any = "auto"
    frequency: int = 5
    average_optimizer_state: Optional[bool] = None
    outer_optimizer: Optional[OptimizerSpec] = None
    residual_decay: float = 1.0
    error_feedback: Optional[str] = None
    fragments: int = 1
    overlap: int = 0
    warmup_steps: int = 0
    validation_data: Any = None
    metrics: Sequence[Any] = ("loss", "accuracy")
    eval_batch_size: int = 256
    seed: int = 0
    devices: Optional[Sequence[str]] = None
    prefetch_buffer: int = 2
    progress: bool = True
    record_steps: bool = True
    on_step: Optional[Callable[["TrainState"], None]] = None
    resume: Any = None
    batch_keys: Tuple[str, str] = ("input", "target")

    averaging_frequency = RenamedAttribute("frequency")      # the former name (not a field)

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {self.mode!r}")
        if self.shared not in ("gradients", "updates"):
            raise ValueError(f"shared: expected 'gradients' or 'updates', got {self.shared!r}")
        for name in ("epochs", "batch_size", "frequency", "eval_batch_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if int(self.prefetch_buffer) < 0:
            raise ValueError(f"prefetch_buffer: must be >= 0, got {self.prefetch_buffer}")
        gmetrics.check_metrics(self.metrics)


# The dataclass's own __init__, taking the former keyword too.
TrainConfig.__init__ = renamed_kwargs(  # type: ignore[method-assign]
    averaging_frequency="frequency")(TrainConfig.__init__)


@dataclass
class TrainState:
    """Where a rank is: ``epoch`` (0-based, the one in progress), ``step`` (optimizer steps done in total),
    ``batch`` (batches of this epoch done). With the model, the optimizer wrapper and the history so far."""
    model: nn.Module
    optimizer: Any
    rank: int
    world_size: int
    epoch: int = 0
    step: int = 0
    batch: int = 0
    history: List[Dict[str, Any]] = field(default_factory=list)
    # this rank's running totals for the epoch in progress (see new_epoch_totals)
    epoch_totals: Dict[str, float] = field(default_factory=lambda: new_epoch_totals((0, 0)))

    def state_dict(self) -> Dict[str, Any]:
        """Everything needed to resume this rank at this exact point (model, optimizer incl. residuals,
        position, history, the epoch's running totals)."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "epoch": self.epoch, "step": self.step, "batch": self.batch, "history": list(self.history),
                "epoch_totals": dict(self.epoch_totals)}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        self.model.load_state_dict(sd["model"])
        self.optimizer.load_state_dict(sd["optimizer"])
        self.epoch, self.step, self.batch = int(sd["epoch"]), int(sd["step"]), int(sd["batch"])
        self.history = list(sd.get("history", []))
        self.epoch_totals = dict(sd.get("epoch_totals", self.epoch_totals))


# ------------------------------------------------------------------------------------------- helpers
def _rank_world() -> Tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def rank_device(devices: Optional[Sequence[str]], rank: int) -> torch.device:
    """Device ``rank % len(devices)`` (CPU when no devices are given)."""
    if not devices:
        return torch.device("cpu")
    dev = torch.device(devices[rank % len(devices)])
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev


def _allreduce_sum(values: List[float], device: torch.device) -> List[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.cpu().tolist()


def _build_trainer(cfg: TrainConfig, model: nn.Module):
    inner = make_optimizer(cfg.optimizer, model.parameters())
    if cfg.mode == "averaging":
        outer = cfg.outer_optimizer
        return ParameterAveraging(model, inner, frequency=cfg.frequency,
                                  average_optimizer_state=cfg.average_optimizer_state,
                                  warmup_steps=cfg.warmup_steps, compression=copy.deepcopy(cfg.compression),
                                  outer_optimizer=None if outer is None else functools.partial(make_optimizer, outer),
                                  residual_decay=cfg.residual_decay, fragments=cfg.fragments,
                                  overlap=cfg.overlap,
                                  **({} if cfg.error_feedback is None else {"error_feedback": cfg.error_feedback}))
    from gradshare.optim import SharedOptimizer

    kwargs = {"mode": cfg.shared, "compression": copy.deepcopy(cfg.compression), "link": copy.deepcopy(cfg.link)}
    if cfg.error_feedback is not None:
        kwargs["error_feedback"] = cfg.error_feedback
    if cfg.clipping != "default":
        kwargs["clipping"] = copy.deepcopy(cfg.clipping)
    # Replicas must start equal: the sharing keeps them equal only if they are.
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        with torch.no_grad():
            for t in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(t.data, src=0)
    return SharedOptimizer(inner, **kwargs)


def new_epoch_totals(comm: Tuple[int, int]) -> Dict[str, float]:
    """A rank's running totals for one epoch: loss * samples, correct, samples, byte counters at the
    epoch's start, and the sum / number of per-step densities."""
    return {"loss_sum": 0.0, "correct": 0.0, "samples": 0.0, "sent0": float(comm[0]), "dense0": float(comm[1]),
            "density_sum": 0.0, "density_steps": 0.0}


def comm_totals(opt) -> Tuple[int, int]:
    """(bytes this rank sent, bytes a dense all-reduce at every step would have sent) so far."""
    if not isinstance(opt, ReportsTraffic):
        return 0, 0
    return int(opt.bytes_sent), int(opt.dense_bytes)


def comm_step_info(opt) -> Dict[str, Any]:
    """Per-step details of the last step where the optimizer exposes them (density, tau)."""
    if isinstance(opt, ParameterAveraging):
        info = {"averaged": float(opt.last_round)}
        if opt.last_round and opt.stats is not None:         # a pseudo-gradient round: what it sent
            info.update(last_exchange(opt.stats))
        return info
    return last_exchange(getattr(opt, "stats", None))


def last_exchange(stats) -> Dict[str, Any]:
    """Density (weighted by bucket size), tau and format of the last exchange a Statistics recorded."""
    records = getattr(stats, "records", None)
    if not records:
        return {}
    step = records[-1].step
    last = []
    for r in reversed(records):
        if r.step != step:
            break
        last.append(r)
    n = sum(r.n for r in last)
    # density weighted by bucket size; tau of the largest bucket (+-tau schemes only)
    tau = max(last, key=lambda r: r.n).tau
    return {"density": sum(r.density * r.n for r in last) / max(n, 1),
            "tau": float("nan") if tau is None else float(tau),
            "format": "+".join(sorted({r.format for r in last}))}


def fmt_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000.0
    return f"{n:.1f} GB"


def vs_dense(sent: float, dense: float, digits: int = 1) -> str:
    """The bytes sent against a dense all-reduce's, as "12.3x less" or, where more went (link-aware all-reduce
    steps after compressed ones also average what the ranks held back and their optimizer states), "1.1x more"."""
    if sent <= 0:
        return ""
    return f"{dense / sent:.{digits}f}x less" if dense >= sent else f"{sent / max(dense, 1e-9):.{digits}f}x more"


# --------------------------------------------------------------------------------------------- train
def train_rank(cfg: TrainConfig, ctx: Any = None) -> Dict[str, Any]:
    """Trains this rank's replica for ``cfg.epochs`` epochs; collective (every rank calls it).

    ``ctx``: a gradshare.cluster.Context when run by gradshare.cluster.run (torchrun / Spark): the loop
    resumes from ``ctx.resumed`` and saves a checkpoint whenever ``ctx.should_save(step)``. Shared state:
    the model and the position; per rank: the optimizer (residuals, inner state) and epoch totals.

    Returns ``{"rank", "history", "steps", "state"}``: ``history`` holds one dict per epoch (loss and
    accuracy over all ranks' training samples, ``val_<metric>`` when ``validation_data`` is set,
    bytes sent / dense bytes summed over ranks, ``traffic`` = their ratio, ``density`` = mean fraction of
    elements sent per step (gradient sharing), seconds); ``steps`` per-step records of this
    rank; ``state`` the trained model's state dict (on CPU) on rank 0, None elsewhere.
    """
    cfg.validate()
    rank, world = _rank_world()
    device = rank_device(cfg.devices, rank)
    torch.manual_seed(cfg.seed + rank)
    model = copy.deepcopy(cfg.model).to(device)  # a private copy: the template may live in shared memory
    opt = _build_trainer(cfg, model)
    ts = TrainState(model=model, optimizer=opt, rank=rank, world_size=world)
    if cfg.resume is not None:
        ts.load_state_dict(cfg.resume(rank) if callable(cfg.resume) else cfg.resume)
    if ctx is not None and ctx.resumed is not None:
        _restore_from_context(ts, ctx)
    if ctx is not None and getattr(ctx, "checkpoint_dir", None):
        user_hook = cfg.on_step

        def on_step(state: TrainState) -> None:
            if ctx.should_save(state.step):
                _save_to_context(state, ctx)
            if user_hook is not None:
                user_hook(state)

        cfg = copy.copy(cfg)
        cfg.on_step = on_step
    train_ds = gdata.as_dataset(cfg.train_data, "train", seed=cfg.seed)
    val_ds = gdata.as_dataset(cfg.validation_data, "test", seed=cfg.seed) if cfg.validation_data is not None \
        else None
    n = len(train_ds)
    per_rank = -(-n // world)
    steps_per_epoch = -(-per_rank // gdata.samples_per_batch(train_ds, cfg.batch_size))
    bar = None
    if cfg.progress and rank == 0:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps_per_epoch * cfg.epochs, initial=ts.step, unit="step", dynamic_ncols=True)
    steps: List[Dict[str, Any]] = []
    t_start = time.perf_counter()
    try:
        while ts.epoch < cfg.epochs:
            if bar is not None:
                bar.set_description(f"{cfg.mode} x{world} epoch {ts.epoch + 1}/{cfg.epochs}")
            t0 = time.perf_counter()
            _train_epoch(cfg, ts, train_ds, device, steps_per_epoch, steps, bar, t_start)
            ts.history.append(_end_epoch(cfg, ts, val_ds, device, time.perf_counter() - t0))
            ts.epoch += 1
            ts.batch = 0
    finally:
        if bar is not None:
            bar.close()
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()} if rank == 0 else None
    return {"rank": rank, "history": ts.history, "steps": steps if cfg.record_steps else [], "state": state,
            "seconds": time.perf_counter() - t_start}


def _position(ts: TrainState) -> Dict[str, Any]:
    return {"epoch": ts.epoch, "step": ts.step, "batch": ts.batch, "history": list(ts.history)}


def _save_to_context(ts: TrainState, ctx: Any) -> None:
    mine = {"optimizer": ts.optimizer, "epoch_totals": dict(ts.epoch_totals)}
    # replicas differ between rounds (local steps), and with error_feedback="model" a checkpoint taken inside a
    # step holds each rank's own model: each rank keeps its own
    if isinstance(ts.optimizer, ParameterAveraging) or ts.optimizer.sharing.own_models:
        mine["model"] = ts.model
    ctx.save(ts.step, {"model": ts.model, "position": _position(ts)}, mine)


def _restore_from_context(ts: TrainState, ctx: Any) -> None:
    ctx.restore(objects={"model": ts.model})
    pos = ctx.resumed.state["position"]
    ts.epoch, ts.step, ts.batch = int(pos["epoch"]), int(pos["step"]), int(pos["batch"])
    ts.history = list(pos["history"])
    mine = ctx.rank_state()
    if mine is not None:  # same world size as the save: this rank's optimizer state and totals
        if "model" in mine:
            ts.model.load_state_dict(mine["model"])
        ts.optimizer.load_state_dict(mine["optimizer"])
        ts.epoch_totals = dict(mine["epoch_totals"])


def _train_epoch(cfg: TrainConfig, ts: TrainState, ds, device, steps_per_epoch: int, steps: list, bar,
                 t_start: float) -> None:
    model, opt = ts.model, ts.optimizer
    model.train()
    idx = gdata.train_shard(len(ds), ts.rank, ts.world_size, seed=cfg.seed, epoch=ts.epoch)
    if ts.batch == 0:
        ts.epoch_totals = new_epoch_totals(comm_totals(opt))
    sums = ts.epoch_totals
    t_epoch = time.perf_counter()
    samples0 = sums["samples"]
    loss_ema = None
    with gdata.batches(ds, idx, cfg.batch_size, start_batch=ts.batch, device=device,
                       prefetch=cfg.prefetch_buffer) as it:
        for batch in it:
            x, y = gdata.split_batch(batch, cfg.batch_keys)
            t0 = time.perf_counter()
            opt.zero_grad()
            out = model(x)
            loss = cfg.loss_fn(out, y)
            loss.backward()
            opt.step()
            lv = float(loss.detach())
            if not math.isfinite(lv):
                raise FloatingPointError(f"rank {ts.rank}: loss is {lv} at epoch {ts.epoch} step {ts.step}")
            bs = y.shape[0]
            sums["loss_sum"] += lv * bs
            sums["samples"] += bs
            if out.dim() == 2 and y.dim() == 1 and not y.is_floating_point():
                sums["correct"] += float((out.detach().argmax(1) == y).sum())
            ts.step += 1
            ts.batch += 1
            sent, dense = comm_totals(opt)
            info = comm_step_info(opt)
            if "density" in info:
                sums["density_sum"] += info["density"]
                sums["density_steps"] += 1
            if cfg.record_steps:
                rec = {"step": ts.step, "epoch": ts.epoch, "loss": lv, "batch_size": bs,
                       "bytes_sent": sent, "dense_bytes": dense, "seconds": time.perf_counter() - t0,
                       "elapsed": time.perf_counter() - t_start}
                rec.update(info)
                steps.append(rec)
            loss_ema = lv if loss_ema is None else 0.9 * loss_ema + 0.1 * lv
            if bar is not None:
                bar.update(1)
                if ts.batch % 5 == 0 or ts.batch == steps_per_epoch:
                    el = max(time.perf_counter() - t_epoch, 1e-9)
                    post = {"loss": f"{loss_ema:.4f}",
                            "samples/s": f"{(sums['samples'] - samples0) * ts.world_size / el:.0f}",
                            "sent": fmt_bytes(sent)}
                    if sent > 0:
                        post["vs dense"] = vs_dense(sent, dense, 0)
                    bar.set_postfix(post, refresh=False)
            if cfg.on_step is not None:
                cfg.on_step(ts)


def _end_epoch(cfg: TrainConfig, ts: TrainState, val_ds, device, seconds: float) -> Dict[str, Any]:
    opt = ts.optimizer
    if isinstance(opt, ParameterAveraging) and not opt.last_averaged:
        opt.average()  # the epoch ends with replicas in agreement
    elif not isinstance(opt, ParameterAveraging):
        opt.merge()    # error_feedback="model": what each rank holds back goes out (nothing to do otherwise)
    sent, dense = comm_totals(opt)
    t = ts.epoch_totals
    sums = _allreduce_sum([t["loss_sum"], t["correct"], t["samples"], sent - t["sent0"], dense - t["dense0"]],
                          device)
    rec: Dict[str, Any] = {"epoch": ts.epoch + 1, "step": ts.step,
                           "loss": sums[0] / max(sums[2], 1.0),
                           "accuracy": sums[1] / max(sums[2], 1.0),
                           "samples": int(sums[2]), "bytes_sent": int(sums[3]), "dense_bytes": int(sums[4]),
                           "traffic": (sums[3] / sums[4]) if sums[4] else None,
                           # the same on every rank: each step's density is already a mean over ranks
                           "density": (t["density_sum"] / t["density_steps"]) if t["density_steps"] else None,
                           "seconds": seconds}
    if val_ds is not None:
        vals = evaluate_shard(ts.model, val_ds, cfg.metrics, cfg.loss_fn, cfg.eval_batch_size, device,
                              cfg.batch_keys)
        rec.update({f"val_{k}": v for k, v in vals.items()})
    return rec


# ------------------------------------------------------------------------------- evaluate / predict
@torch.no_grad()
def evaluate_shard(model: nn.Module, ds, metrics: Sequence[Any], loss_fn: Callable, batch_size: int,
                   device: torch.device, batch_keys: Tuple[str, str] = ("input", "target")) -> Dict[str, float]:
    """Metrics of ``model`` over the whole ``ds``: this rank scores its contiguous block, the (sum,
    count) pairs are summed over the group (collective), so every rank returns the exact totals."""
    rank, world = _rank_world()
    block = gdata.eval_shard(len(ds), rank, world)
    names = [gmetrics.metric_name(m) for m in metrics]
    acc = {n: [0.0, 0.0] for n in names}
    was_training = model.training
    model.eval()
    try:
        with gdata.batches(ds, block, batch_size, device=device, prefetch=0) as it:
            for batch in it:
                x, y = gdata.split_batch(batch, batch_keys)
                out = model(x)
                for k, (s, c) in gmetrics.batch_sums(metrics, out, y, loss_fn).items():
                    acc[k][0] += s
                    acc[k][1] += c
    finally:
        model.train(was_training)
    flat = _allreduce_sum([v for n in names for v in acc[n]], device)
    return {n: flat[2 * i] / flat[2 * i + 1] if flat[2 * i + 1] else float("nan") for i, n in enumerate(names)}


@torch.no_grad()
def _inputs(batch, keys: Tuple[str, str]):
    """A batch's inputs (prediction data may have no targets)."""
    return batch[keys[0]] if isinstance(batch, dict) else batch[0]


def predict_shard(model: nn.Module, ds, batch_size: int, device: torch.device,
                  batch_keys: Tuple[str, str] = ("input", "target")) -> Optional[torch.Tensor]:
    """Outputs of ``model`` for every sample of ``ds`` in order; collective. Each rank predicts its
    contiguous block; the blocks are gathered (padded to equal size, then trimmed) to rank 0, which
    returns the (len(ds), ...) CPU tensor; other ranks return None."""
    rank, world = _rank_world()
    n = len(ds)
    block = gdata.eval_shard(n, rank, world)
    model.eval()
    outs = []
    with gdata.batches(ds, block, batch_size, device=device, prefetch=0) as it:
        for batch in it:
            outs.append(model(_inputs(batch, batch_keys)))
    if outs:
        mine = torch.cat(outs)
    else:  # fewer samples than ranks: learn the output shape from one sample
        probe = model(_inputs(gdata.to_device(gdata.collate(ds, torch.tensor([0])), device), batch_keys))
        mine = probe[:0]
    if world == 1:
        return mine.cpu()
    rows = -(-n // world)
    padded = mine.new_zeros((rows,) + tuple(mine.shape[1:]))
    padded[:mine.shape[0]] = mine
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    if rank != 0:
        return None
    parts = [g[:len(gdata.eval_shard(n, r, world))] for r, g in enumerate(gathered)]
    return torch.cat(parts).cpu()


@dataclass
class EvalConfig:
    """What :func:`evaluate_rank` / :func:`predict_rank` need: a model, data and batch settings."""
    model: nn.Module
    data: Any
    metrics: Sequence[Any] = ("loss", "accuracy")
    loss_fn: Callable = default_loss
    batch_size: int = 256
    devices: Optional[Sequence[str]] = None
    seed: int = 0
    split: str = "test"
    batch_keys: Tuple[str, str] = ("input", "target")


def evaluate_rank(cfg: EvalConfig) -> Dict[str, float]:
    """Collective: metrics of ``cfg.model`` over all of ``cfg.data`` (every rank returns them)."""
    gmetrics.check_metrics(cfg.metrics)
    rank, _ = _rank_world()
    device = rank_device(cfg.devices, rank)
    model = copy.deepcopy(cfg.model).to(device)
    ds = gdata.as_dataset(cfg.data, cfg.split, seed=cfg.seed)
    return evaluate_shard(model, ds, cfg.metrics, cfg.loss_fn, cfg.batch_size, device, cfg.batch_keys)


def predict_rank(cfg: EvalConfig) -> Optional[torch.Tensor]:
    """Collective: outputs for every sample of ``cfg.data`` in order, on rank 0 (None elsewhere)."""
    rank, _ = _rank_world()
    device = rank_device(cfg.devices, rank)
    model = copy.deepcopy(cfg.model).to(device)
    ds = gdata.as_dataset(cfg.data, cfg.split, seed=cfg.seed)
    return predict_shard(model, ds, cfg.batch_size, device, cfg.batch_keys)
