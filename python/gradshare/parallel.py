"""ParallelWrapper: data-parallel training on one machine's devices without writing distributed code.

Use it to train a PyTorch model on several GPUs, or several CPU worker processes, of one host (DL4J's
ParallelWrapper). It starts the workers (gradshare.workers.run_local), shards the data, runs the chosen
scheme (threshold gradient sharing or periodic parameter averaging), and loads the trained weights back
into your model. For several hosts run gradshare.loop.train_rank under torchrun or Spark instead.
"""
from __future__ import annotations

import os
import pickle
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader

from gradshare import data as gdata
from gradshare import loop
from gradshare._deprecation import RenamedAttribute, renamed_kwargs
from gradshare.workers import run_local

_DAY = 24 * 3600.0


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def default_workers(devices: Optional[Sequence[str]] = None) -> int:
    """One worker per device when devices are given or CUDA is present; else up to 4 CPU workers, no
    more than the cores (each then gets cores // workers torch threads)."""
    if devices:
        return len(devices)
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return max(1, min(4, available_cores()))


def default_devices() -> Optional[List[str]]:
    if torch.cuda.is_available():
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return None


def launch_local(fn: Callable, config: Any, workers: int, *, devices: Optional[Sequence[str]] = None,
                 timeout: float = 7 * _DAY) -> List[Any]:
    """Runs ``fn(config)`` on ``workers`` local processes (gloo on CPU, NCCL when the devices are CUDA);
    each worker's torch threads are the cores split between them. Returns the results by rank; a worker
    that fails raises gradshare.workers.WorkerError with its traceback."""
    cuda = bool(devices) and all(str(d).startswith("cuda") for d in devices)
    threads = max(1, available_cores() // workers)
    out = run_local(_call_and_pickle, workers, (fn, config), backend="nccl" if cuda else "gloo",
                    threads=threads, timeout=timeout, collective_timeout=600.0)
    return [pickle.loads(b) for b in out]


def _call_and_pickle(fn: Callable, config: Any) -> bytes:
    # Results travel as plain pickles: a tensor sent through torch's shared-memory reduction would refer
    # to a file descriptor of a worker that has exited by the time the caller reads it.
    return pickle.dumps(fn(config))


class ParallelWrapper:
    """Trains ``model`` data-parallel on ``workers`` local processes; ``fit``, ``evaluate``, ``predict``.

    Args:
        model: the module to train; after ``fit`` it holds the trained weights (on its original device).
        optimizer: a factory ``f(params) -> Optimizer`` (module-level or functools.partial), an optimizer
            class (with ``optimizer_kwargs``), or ``(class, kwargs)``. Each worker builds its own.
        loss_fn: ``loss(outputs, targets)`` averaged over the batch (default cross-entropy).
        workers: worker processes (default: one per GPU, else a CPU count that fits the cores).
        mode: "shared_gradients" (threshold-encoded gradient sharing, gradshare.optim.SharedOptimizer)
            or "averaging" (parameters and optimizer state averaged every ``frequency`` steps;
            with ``outer_optimizer`` and/or ``compression``, only the pseudo-gradient: DiLoCo, SparseLoCo).
        frequency: steps between averaging rounds (averaging mode), as ParameterAveraging's ``frequency``.
        outer_optimizer: averaging mode: the outer optimizer, given like ``optimizer`` (a picklable factory
            or ``(class, kwargs)``), e.g. ``(torch.optim.SGD, dict(lr=0.7, momentum=0.9, nesterov=True))``.
        residual_decay: averaging mode with ``compression``: the pseudo-gradient's error-feedback decay.
        error_feedback: None (each mode's default), "buffer" or "model": averaging mode with ``compression``,
            ParameterAveraging's (default "buffer"); sharing updates (shared_gradients), SharedOptimizer's (default:
            what a step does not send kept in each worker's model; gradshare.sharing.default_error_feedback).
        fragments, overlap: averaging mode with a pseudo-gradient: streaming rounds (ParameterAveraging's).
        prefetch_buffer: batches each worker prepares ahead in a background thread.
        compression: what sharing sends (gradshare.compression; default: chosen for the optimizer); in
            averaging mode, what a round sends of the pseudo-gradient (default: parameters averaged).
        threshold, averaging_frequency: the former names of ``compression`` and ``frequency`` (deprecated).
        link: shared_gradients with the default compression: "auto" (link-aware: steps by float32 all-reduce
            where compressing is slower, gradshare.link) or None (compression at every step: a fit repeats
            bit for bit).
        devices: devices to place workers on (worker i on devices[i % len]); default the GPUs, else CPU.
        seed: fixes the data order of every epoch (and each worker's torch RNG).
        batch_keys: the keys of the inputs and the targets in dict batches (default "input", "target").
        progress: show a tqdm progress bar (rank 0).
        timeout: seconds after which a whole fit/evaluate/predict gives up (TimeoutError; each worker still
            running prints its threads' stacks to its stderr first).
        shared, clipping, average_optimizer_state, warmup_steps: see gradshare.loop.TrainConfig.
    """

    averaging_frequency = RenamedAttribute("frequency")

    @renamed_kwargs(threshold="compression", averaging_frequency="frequency")
    def __init__(self, model: nn.Module, optimizer: Any, loss_fn: Optional[Callable] = None,
                 workers: Optional[int] = None, mode: str = "shared_gradients", frequency: int = 5,
                 prefetch_buffer: int = 2, compression: Any = None, devices: Optional[Sequence[str]] = None,
                 seed: int = 0, *, optimizer_kwargs: Optional[Dict[str, Any]] = None, shared: str = "updates",
                 clipping: Any = "default", average_optimizer_state: Optional[bool] = None, warmup_steps: int = 0,
                 progress: bool = True, timeout: float = 7 * _DAY,
                 outer_optimizer: Any = None, residual_decay: float = 1.0, link: Any = "auto",
                 fragments: int = 1, overlap: int = 0, batch_keys: Sequence[str] = ("input", "target"),
                 error_feedback: Optional[str] = None):
        if mode not in loop.MODES:
            raise ValueError(f"mode: expected one of {loop.MODES}, got {mode!r}")
        if isinstance(optimizer, type):
            optimizer = (optimizer, dict(optimizer_kwargs or {}))
        elif optimizer_kwargs:
            raise ValueError("optimizer_kwargs: only with an optimizer class")
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn or loop.default_loss
        self.devices = list(devices) if devices else default_devices()
        self.workers = int(workers) if workers is not None else default_workers(self.devices)
        if self.workers < 1:
            raise ValueError(f"workers: must be >= 1, got {workers}")
        self.mode = mode
        self.frequency = int(frequency)
        self.prefetch_buffer = int(prefetch_buffer)
        self.compression = compression
        self.seed = int(seed)
        self.shared = shared
        self.clipping = clipping
        self.average_optimizer_state = average_optimizer_state
        self.outer_optimizer = outer_optimizer
        self.residual_decay = float(residual_decay)
        self.error_feedback = error_feedback
        self.fragments, self.overlap = int(fragments), int(overlap)
        self.link = link
        if isinstance(batch_keys, str) or len(batch_keys) != 2:
            raise ValueError(f"batch_keys: expected (inputs key, targets key), got {batch_keys!r}")
        self.batch_keys = (str(batch_keys[0]), str(batch_keys[1]))
        self.warmup_steps = int(warmup_steps)
        self.progress = progress
        self.timeout = float(timeout)
        self.steps: List[Dict[str, Any]] = []  # per-step records of rank 0 in the last fit
        for name in ("optimizer", "loss_fn", "compression", "clipping", "outer_optimizer", "link"):
            loop.check_picklable(name, getattr(self, name))

    def config(self, data, epochs: int = 1, batch_size: Optional[int] = None, validation_data=None,
               metrics: Sequence[Any] = ("loss", "accuracy")) -> loop.TrainConfig:
        """The TrainConfig ``fit`` runs (also usable with gradshare.loop.train_rank under other launchers)."""
        if batch_size is None:
            batch_size = getattr(data, "batch_size", None) if isinstance(data, DataLoader) else None
            batch_size = 32 if batch_size is None else batch_size
        cfg = loop.TrainConfig(
            model=self.model, optimizer=self.optimizer, train_data=_shareable(data, "train", self.seed),
            loss_fn=self.loss_fn, epochs=epochs, batch_size=batch_size, mode=self.mode, shared=self.shared,
            compression=self.compression, clipping=self.clipping, link=self.link,
            frequency=self.frequency,
            average_optimizer_state=self.average_optimizer_state, warmup_steps=self.warmup_steps,
            outer_optimizer=self.outer_optimizer, residual_decay=self.residual_decay, fragments=self.fragments,
            overlap=self.overlap, error_feedback=self.error_feedback,
            validation_data=None if validation_data is None else _shareable(validation_data, "test", self.seed),
            metrics=tuple(metrics), seed=self.seed, devices=self.devices, prefetch_buffer=self.prefetch_buffer,
            progress=self.progress, batch_keys=self.batch_keys)
        cfg.validate()
        return cfg

    def fit(self, data, epochs: int = 1, batch_size: Optional[int] = None, validation_data=None,
            metrics: Sequence[Any] = ("loss", "accuracy")) -> List[Dict[str, Any]]:
        """Trains for ``epochs`` epochs over ``data``: a Dataset, a DataLoader (its dataset, batch size and
        collate_fn; gradshare deals the samples to the workers and shuffles them per epoch, in place of the
        loader's sampler), ready-made batches (a list, or any finite iterable, read once; each batch goes
        whole to one worker and ``batch_size`` does not apply), a tuple of tensors, or "digits" /
        "mnist:PATH" for their training split. Batches are tuples (inputs, targets, ...) or dicts (read at
        ``batch_keys``). ``batch_size`` is per worker (default: the DataLoader's, else 32). Loads the trained weights
        into ``self.model`` and returns the history: per epoch, training loss and accuracy over all
        workers, bytes sent and what dense all-reduce would have sent (all workers), density, seconds,
        and ``val_<metric>`` for ``validation_data``. Each fit builds fresh optimizers (their state is
        not carried from one fit to the next); ``self.steps`` then holds rank 0's per-step records."""
        loop.check_picklable("metrics", tuple(metrics))
        cfg = self.config(data, epochs, batch_size, validation_data, metrics)
        results = launch_local(loop.train_rank, cfg, self.workers, devices=self.devices, timeout=self.timeout)
        r0 = results[0]
        self.model.load_state_dict(r0["state"])
        self.steps = r0["steps"]
        return r0["history"]

    def evaluate(self, data, metrics: Sequence[Any] = ("loss", "accuracy"), batch_size: int = 256) -> Dict[str, float]:
        """Metrics of the model over all of ``data`` (a spec string means its test split), computed by the
        workers on disjoint blocks and combined exactly: equal to evaluating the whole dataset in one
        process. Several metrics in one pass; names or callables (see gradshare.metrics)."""
        from gradshare import metrics as gmetrics

        gmetrics.check_metrics(metrics)
        loop.check_picklable("metrics", tuple(metrics))
        cfg = loop.EvalConfig(model=self.model, data=_shareable(data, "test", self.seed),
                              metrics=tuple(metrics), loss_fn=self.loss_fn, batch_size=batch_size,
                              devices=self.devices, seed=self.seed, batch_keys=self.batch_keys)
        return launch_local(loop.evaluate_rank, cfg, self.workers, devices=self.devices,
                            timeout=self.timeout)[0]

    def predict(self, data, batch_size: int = 256) -> torch.Tensor:
        """Model outputs for every sample of ``data``, in the original order (nothing dropped or repeated,
        whatever the dataset size); inputs only are used (a Dataset's first item, or a tensor)."""
        if isinstance(data, torch.Tensor):
            data = (data,)
        cfg = loop.EvalConfig(model=self.model, data=_shareable(data, "test", self.seed),
                              batch_size=batch_size, devices=self.devices, seed=self.seed,
                              batch_keys=self.batch_keys)
        return launch_local(loop.predict_rank, cfg, self.workers, devices=self.devices,
                            timeout=self.timeout)[0]

    def __repr__(self) -> str:
        return (f"ParallelWrapper({type(self.model).__name__}, workers={self.workers}, mode={self.mode!r}, "
                f"frequency={self.frequency}, devices={self.devices})")


def _shareable(data, split: str, seed: int):
    """Spec strings travel as strings (each worker loads its own copy); tensors go through shared memory
    (workers copy the model before training, so the caller's weights are only replaced at the end)."""
    if isinstance(data, str):
        if data != "digits" and not data.startswith("mnist:"):
            raise ValueError(f"data: expected 'digits' or 'mnist:PATH', got {data!r}")
        return data
    ds = gdata.as_dataset(data, split, seed=seed)
    if isinstance(ds, gdata.LoaderDataset):
        loop.check_picklable("the DataLoader's collate_fn", ds.collate_fn)
    return ds
