"""Checkpoints that survive a kill at any moment: atomic files, the last K kept, per-rank state gathered.

Use this for every periodic save of a training run (the cluster trainer, `gradshare train`, your own loop).
A checkpoint is one file ``<dir>/ckpt-<step>.pt`` holding:

- ``state``: what every rank shares (model, inner optimizer, step/epoch, data position, statistics totals).
  Values with a ``state_dict()`` method (modules, optimizers, thresholds, statistics) are stored as their
  state dict; anything else picklable is stored as is.
- ``ranks``: one dict per rank, gathered to rank 0: what differs between ranks (gradient-sharing residuals,
  a rank's data position) plus each rank's RNG states (torch, CUDA when present, numpy, python ``random``),
  which are captured automatically under the key ``"rng"``.

Writing is atomic: rank 0 writes a temporary file in the same directory, fsyncs it, ``os.replace``s it over
the final name and fsyncs the directory, so a kill at any point leaves either the old set of checkpoints or
the old set plus the complete new one; never a partial file under a checkpoint name. ``latest(dir)`` returns
the newest checkpoint that loads, skipping temporary leftovers and unreadable files.

Under an initialised process group :func:`save` is collective (every rank calls it with the same step): the
per-rank dicts are gathered to rank 0, rank 0 writes, and the outcome is broadcast, so every rank returns
only once the file is durable and every rank raises if the write failed.

Checkpoints are pickles (``torch.load(weights_only=False)``): load only files your own runs wrote.
"""
from __future__ import annotations

import os
import random
import re
import tempfile
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional

import numpy as np
import torch
import torch.distributed as dist

FORMAT = "gradshare-checkpoint"
VERSION = 1
_NAME = re.compile(r"^ckpt-(\d+)\.pt$")
_TMP_PREFIX = ".tmp-ckpt-"


# ----------------------------------------------------------------------------------------------- RNG state
def rng_state() -> Dict[str, Any]:
    """This process's random number generator states: torch (CPU and every CUDA device), numpy, python."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restores states captured by :func:`rng_state`; the next random draws repeat the captured ones."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ------------------------------------------------------------------------------------------------ files
def checkpoint_path(directory: str, step: int) -> str:
    """The file name of the checkpoint taken after ``step`` steps."""
    if step < 0:
        raise ValueError(f"step: must be >= 0, got {step}")
    return os.path.join(directory, f"ckpt-{step:09d}.pt")


def list_checkpoints(directory: str) -> List[str]:
    """Checkpoint files in ``directory`` (complete names only, readable or not), oldest step first."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = sorted((int(m.group(1)), n) for n in names if (m := _NAME.match(n)))
    return [os.path.join(directory, n) for _, n in found]


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(obj: Any, path: str) -> None:
    """``torch.save(obj)`` to ``path`` so that the file appears complete or not at all.

    Writes a temporary file in the same directory (same file system, so the rename is atomic), flushes and
    fsyncs it, ``os.replace``s it over ``path`` and fsyncs the directory so the rename itself is durable.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=".pt", dir=directory)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600 files; a checkpoint gets the usual permissions
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(directory)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _remove_stale_temporaries(directory: str) -> None:
    # Only rank 0 writes into a checkpoint directory, and only one save runs at a time: any temporary file
    # present before a save started was left by a writer that was killed.
    for name in os.listdir(directory):
        if name.startswith(_TMP_PREFIX):
            try:
                os.unlink(os.path.join(directory, name))
            except FileNotFoundError:
                pass


def _prune(directory: str, step: int, keep_last: int) -> None:
    paths = list_checkpoints(directory)
    steps = [int(_NAME.match(os.path.basename(p)).group(1)) for p in paths]
    # Checkpoints from beyond `step` belong to a run that was abandoned (this run resumed from an older one):
    # left in place, latest() would prefer them over the run that is being written now.
    doomed = [p for p, s in zip(paths, steps) if s > step]
    kept = [p for p, s in zip(paths, steps) if s <= step]
    if keep_last > 0:
        doomed += kept[:-keep_last]
    for p in doomed:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
    if doomed:
        _fsync_dir(directory)


# ------------------------------------------------------------------------------------------ save / load
def _snapshot(values: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    out = {}
    for k, v in (values or {}).items():
        out[k] = v.state_dict() if hasattr(v, "state_dict") and callable(v.state_dict) else v
    return out


def _group_info(group) -> tuple:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group), True
    return 0, 1, False


def save(directory: str, step: int, state: Optional[Mapping[str, Any]] = None,
         rank_state: Optional[Mapping[str, Any]] = None, *, keep_last: int = 3, group=None,
         rng: bool = True) -> str:
    """Writes the checkpoint for ``step``; returns its path (on every rank).

    ``state``: values identical on every rank, saved from rank 0 (objects with ``state_dict()`` are saved as
    their state dict). ``rank_state``: values that differ per rank (e.g. a gradient-sharing optimizer whose
    residuals are per rank), gathered from every rank; ``rng=True`` adds each rank's RNG states under
    ``"rng"``. Keeps the ``keep_last`` newest checkpoints (0 keeps all). Collective under an initialised
    process group: call it on every rank of ``group`` with the same ``step``.
    """
    if keep_last < 0:
        raise ValueError(f"keep_last: must be >= 0, got {keep_last}")
    path = checkpoint_path(directory, step)
    rank, world, distributed = _group_info(group)
    mine = _snapshot(rank_state)
    if rng:
        mine["rng"] = rng_state()
    if distributed and world > 1:
        gathered: Optional[List[Any]] = [None] * world if rank == 0 else None
        dist.gather_object(mine, gathered, dst=dist.get_global_rank(group, 0) if group is not None else 0,
                           group=group)
    else:
        gathered = [mine]
    error = None
    if rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            _remove_stale_temporaries(directory)
            write_atomic({"format": FORMAT, "version": VERSION, "step": int(step), "world_size": world,
                          "state": _snapshot(state), "ranks": gathered}, path)
            _prune(directory, step, keep_last)
        except Exception as exc:  # every rank must learn about it, not wait at the next collective
            error = f"{type(exc).__name__}: {exc}"
            if not (distributed and world > 1):
                raise
    if distributed and world > 1:
        outcome = [error]
        dist.broadcast_object_list(outcome, src=dist.get_global_rank(group, 0) if group is not None else 0,
                                   group=group)
        if outcome[0] is not None:
            raise RuntimeError(f"checkpoint {path} was not written: {outcome[0]}")
    return path


@dataclass
class Checkpoint:
    """A loaded checkpoint. ``state`` is shared; ``ranks[r]`` is rank r's own state (with ``"rng"``)."""

    path: str
    step: int
    world_size: int
    state: Dict[str, Any]
    ranks: List[Dict[str, Any]] = field(default_factory=list)

    def rank_state(self, rank: int) -> Dict[str, Any]:
        """Rank ``rank``'s saved state; the run must resume with the world size it was saved with."""
        if not 0 <= rank < len(self.ranks):
            raise ValueError(f"checkpoint {self.path} holds {len(self.ranks)} ranks' state, not rank {rank}'s "
                             f"(it was written by a run of world size {self.world_size})")
        return self.ranks[rank]

    def restore(self, rank: int = 0, *, objects: Optional[Mapping[str, Any]] = None,
                rank_objects: Optional[Mapping[str, Any]] = None, rng: bool = True) -> None:
        """Loads saved state dicts back into live objects and restores this rank's RNG states.

        ``objects``: name -> object with ``load_state_dict`` for entries of ``state``; ``rank_objects``: the
        same for this rank's entries. Plain values (step, epoch, totals) are read from ``state`` directly.
        """
        for name, obj in (objects or {}).items():
            obj.load_state_dict(self.state[name])
        mine = self.rank_state(rank) if (rank_objects or rng) else {}
        for name, obj in (rank_objects or {}).items():
            obj.load_state_dict(mine[name])
        if rng and "rng" in mine:
            set_rng_state(mine["rng"])


def load(path: str, map_location: Any = "cpu") -> Checkpoint:
    """Reads a checkpoint file; raises ValueError when it is not a complete gradshare checkpoint."""
    try:
        raw = torch.load(path, map_location=map_location, weights_only=False)
    except Exception as exc:
        raise ValueError(f"{path}: not a readable checkpoint ({type(exc).__name__}: {exc})") from exc
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ValueError(f"{path}: not a gradshare checkpoint")
    if raw.get("version") != VERSION:
        raise ValueError(f"{path}: checkpoint version {raw.get('version')}, this gradshare reads {VERSION}")
    return Checkpoint(path=path, step=raw["step"], world_size=raw["world_size"], state=raw["state"],
                      ranks=raw["ranks"])


def latest(directory: str) -> Optional[str]:
    """Path of the newest checkpoint in ``directory`` that loads, or None (missing dir, none, all broken)."""
    for path in reversed(list_checkpoints(directory)):
        try:
            load(path)
        except ValueError:
            continue
        return path
    return None


def load_latest(directory: str, map_location: Any = "cpu") -> Optional[Checkpoint]:
    """The newest loadable checkpoint in ``directory``, loaded; None when there is none."""
    for path in reversed(list_checkpoints(directory)):
        try:
            return load(path, map_location)
        except ValueError:
            continue
    return None
