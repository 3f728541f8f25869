"""Hugging Face Accelerate with gradshare's DDP hook, every rank's sharing state in ``save_state`` folders.

Use it in an Accelerate script that trains with DDP (``accelerate launch`` on several processes) when
exchanging gradients is what limits the step. One line after ``prepare``::

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    gradshare.integrations.accelerate.share(accelerator, model, optimizer)

``share`` registers :func:`gradshare.threshold_hook` on the prepared DistributedDataParallel model with
``ThresholdState(optimizer=...)`` built on the torch optimizer inside Accelerate's AcceleratedOptimizer (a list
of prepared optimizers: each one's updates shared, every rank's states of all of them in its file):
gradshare shares the optimizer's updates ("updates" mode), with the compression chosen for that optimizer
and the link-aware choice of gradshare.link. Keyword arguments go to ThresholdState (compression=, link=,
nonfinite=, bucket_cap_mb=, stats=, ...). It returns the ThresholdState (``state.stats``, ``state.step_count``).
Call it before the first backward and before ``accelerator.load_state``. Accelerate's own
``DistributedDataParallelKwargs(comm_hook=...)`` must be left unset: DDP takes one hook.

Checkpoints: each rank's optimizer steps on its own gradient, so its residuals and optimizer state differ
from the other ranks', while Accelerate writes the optimizer, and objects registered for checkpointing, from
the main process only. ``share`` therefore adds Accelerate save/load pre-hooks: ``accelerator.save_state(dir)``
makes every rank write ``dir/gradshare_rank<R>.pt`` (its sharing and optimizer state, a gradshare.checkpoint
file: atomic, checksummed, plain data), next to Accelerate's per-rank ``random_states_<R>.pkl`` and, like
them, on storage every rank reads back. ``accelerator.load_state(dir)`` gives each rank its own entry back;
its optimizer state replaces the main process's copy that Accelerate loads. This needs the same number of
processes; a folder without gradshare files (saved before ``share``) loads with a warning, every rank then
starting from the main process's optimizer state with zero residuals.

With one process there is nothing to share: ``share`` returns None and registers nothing.
"""
import functools
import os
import warnings
import weakref
from typing import Any, Dict, Optional

import accelerate
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gradshare.checkpoint import load, write_atomic
from gradshare.hooks import ThresholdState, threshold_hook
from gradshare.integrations.per_rank import check_world_size, optimizer_entry, optimizer_states

__all__ = ["share", "state_file", "read_state"]

_shared: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()   # accelerator -> share() calls


def state_file(directory: str, rank: int, index: int = 0) -> str:
    """Where ``save_state`` puts rank ``rank``'s state of the ``index``-th ``share`` of an accelerator."""
    return os.path.join(directory, f"gradshare{index or ''}_rank{rank}.pt")


def read_state(path: str, world_size: int) -> Dict[str, Any]:
    """One rank's entry of a ``save_state`` folder (``{"sharing": ..., "optimizer": ...}``, ``"optimizers": [...]``
    with several), checked to come from a
    run of ``world_size`` processes."""
    saved = load(path)
    check_world_size(saved.world_size, world_size, path)
    return saved.ranks[0]


def share(accelerator: "accelerate.Accelerator", model: torch.nn.Module, optimizer: Any,
          **state_kwargs: Any) -> Optional[ThresholdState]:
    """Shares ``optimizer``'s updates of the prepared ``model`` through gradshare (module docstring); a list of
    prepared optimizers shares each one's (``ThresholdState(optimizer=[...])``)."""
    if not isinstance(accelerator, accelerate.Accelerator):
        raise TypeError(f"share: expected an accelerate.Accelerator first, got {type(accelerator).__name__}")
    if accelerator.num_processes == 1:
        return None
    ddp = getattr(model, "_orig_mod", model)          # torch.compile'd by prepare: DDP is inside
    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(f"share: the model must be what accelerator.prepare returned under multi-process DDP (a "
                        f"DistributedDataParallel); got {type(ddp).__name__} with distributed type "
                        f"{accelerator.distributed_type} (FSDP, DeepSpeed and Megatron keep their own communication)")
    given = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    inners = [getattr(o, "optimizer", o) for o in given]   # AcceleratedOptimizer wraps the torch optimizer
    mine = {id(p) for p in ddp.parameters()}
    for o, inner in zip(given, inners):
        if not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(f"share: expected the optimizer that accelerator.prepare returned (or a list of them), "
                            f"got {type(o).__name__}")
        if not all(id(p) in mine for g in inner.param_groups for p in g["params"]):
            raise ValueError("share: the optimizer steps parameters that are not the model's: pass the model and "
                             "the optimizer built on its parameters, both as accelerator.prepare returned them")
    state = ThresholdState(ddp.process_group, optimizer=inners if len(inners) > 1 else inners[0], **state_kwargs)
    try:
        ddp.register_comm_hook(state, threshold_hook)
    except RuntimeError as e:
        if "only be called once" not in str(e):
            raise
        raise RuntimeError("share: this DDP model has a communication hook already (an earlier share(), or "
                           "DistributedDataParallelKwargs(comm_hook=...)); DDP takes one") from None
    index = _shared.get(accelerator, 0)
    _shared[accelerator] = index + 1
    rank, world = dist.get_rank(), dist.get_world_size()
    pending: Dict[int, Any] = {}   # this rank's optimizer states, waiting for Accelerate to load the main process's

    def save_pre_hook(models, weights, output_dir) -> None:
        # Runs on every process (save_state is called by all of them), unlike Accelerate's own saves.
        entry = {"sharing": state.state_dict(), **optimizer_entry([inner.state_dict() for inner in inners])}
        write_atomic({"state": {"rank": rank}, "ranks": [entry]}, state_file(output_dir, rank, index),
                     step=state.step_count, world_size=world)

    def load_pre_hook(models, input_dir) -> None:
        pending.clear()
        path = state_file(input_dir, rank, index)
        if not os.path.exists(path):
            warnings.warn(f"{path}: no gradshare state for rank {rank} (a folder saved before share()?): this rank "
                          f"starts from the main process's optimizer state with zero residuals", stacklevel=3)
            return
        entry = read_state(path, world)
        states = optimizer_states(entry, len(inners), path)
        state.load_state_dict(entry["sharing"])
        pending.update(enumerate(states))

    def optimizer_pre_hook(i, opt, state_dict):
        # Accelerate loads the main process's optimizer file into every process next; this rank takes its own.
        return pending.pop(i, None)

    accelerator.register_save_state_pre_hook(save_pre_hook)
    accelerator.register_load_state_pre_hook(load_pre_hook)
    for i, inner in enumerate(inners):
        inner.register_load_state_dict_pre_hook(functools.partial(optimizer_pre_hook, i))
    return state
