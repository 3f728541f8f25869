"""Checkpoints that survive a kill at any moment: atomic files, the last K kept, per-rank state gathered.

Use this for every periodic save of a training run (the cluster trainer, `gradshare train`, your own loop).
A checkpoint is one file ``<dir>/ckpt-<step>.pt`` holding:

- ``state``: what every rank shares (model, inner optimizer, step/epoch, data position, statistics totals).
  Values with a ``state_dict()`` method (modules, optimizers, thresholds, statistics) are stored as their
  state dict; anything else picklable is stored as is.
- ``ranks``: one dict per rank, gathered to rank 0: what differs between ranks (gradient-sharing residuals,
  a rank's data position) plus each rank's RNG states (torch, CUDA when present, numpy, python ``random``),
  which are captured automatically under the key ``"rng"``.

Writing is atomic: rank 0 writes a temporary file in the same directory (created with its final mode),
fsyncs it, ``os.replace``s it over the final name and fsyncs the directory, so a kill at any point leaves
either the old set of checkpoints or the old set plus the complete new one; never a partial file under a
checkpoint name. ``latest(dir)`` returns the newest checkpoint whose checksum verifies, skipping temporary
leftovers and unreadable files, without unpickling anything. Pruning keeps the ``keep_last`` newest
checkpoints up to the one just written and never deletes a newer one, whatever failed to read when the run
resumed (a newer file that could not be read for a moment is still there for the next restart).

Checkpoints are data, not programs. A file is one header line (JSON: format, version, step, world size,
payload length and a SHA-256 over those and the payload) and the payload, a ``torch.save`` of plain data: tensors, numbers, strings,
bytes, lists, tuples and dicts (numpy arrays and scalars are stored as tensors and numbers; anything else is
refused when saving, naming the key). Loading reads the header, checks the checksum and only then reads the
payload, with ``torch.load(weights_only=True)``, once the payload is a zip archive as torch.save writes it, every record
stored, in bounds and matching its CRC (torch's own reader trusts the archive's directory, so a damaged one could
read past the payload, or leave a record's buffer unfilled and unpickle whatever memory held):
a corrupt, truncated or foreign file is rejected with a one-line reason, and a file holding pickled code is never
executed.

Under an initialised process group :func:`save` is collective (every rank calls it with the same step): the
per-rank dicts are gathered to rank 0, rank 0 writes, and the outcome is broadcast, so every rank returns
only once the file is durable and every rank raises if the write failed.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
import secrets
import warnings
import zipfile
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional

import numpy as np
import torch
import torch.distributed as dist

from gradshare._deprecation import renamed_kwargs

FORMAT = "gradshare-checkpoint"
VERSION = 2
MAX_HEADER = 4096                 # bytes of the JSON header line, at most
_NAME = re.compile(r"^ckpt-(\d+)\.pt$")
_TMP_PREFIX = ".tmp-ckpt-"


# ----------------------------------------------------------------------------------------------- RNG state
def rng_state() -> Dict[str, Any]:
    """This process's random number generator states: torch (CPU and every CUDA device), numpy, python; as
    tensors, numbers, strings and tuples (plain data that a weights-only load reads back)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos),
                                                       int(has_gauss), float(gauss)),
             "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restores states captured by :func:`rng_state`; the next random draws repeat the captured ones."""
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys.numpy() if torch.is_tensor(keys) else keys, dtype=np.uint32),
                         int(pos), int(has_gauss), float(gauss)))
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


def plain(value: Any, where: str = "checkpoint") -> Any:
    """``value`` as plain data a weights-only load reads back: tensors, numbers, strings, bytes, lists, tuples,
    dicts (numpy arrays become tensors, numpy scalars numbers); raises TypeError naming what is not."""
    if value is None or isinstance(value, (bool, int, float, str, bytes, torch.Tensor, torch.dtype, torch.Size,
                                           torch.device)):
        return value
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value).copy())
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        items = [plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        out = OrderedDict() if isinstance(value, OrderedDict) else {}
        for k, v in value.items():
            if not isinstance(k, (str, int, float, bool)) and k is not None:
                raise TypeError(f"{where}: key {k!r} has type {type(k).__name__}; checkpoint keys are strings or numbers")
            out[k] = plain(v, f"{where}[{k!r}]")
        return out
    raise TypeError(f"{where} has type {type(value).__name__}: a checkpoint holds tensors, numbers, strings, lists "
                    f"and dicts (save its state_dict(), or convert it)")


def write_atomic(payload: Dict[str, Any], path: str, *, step: int = 0, world_size: int = 1) -> None:
    """Writes ``payload`` (plain data: see :func:`plain`) as a checkpoint file at ``path``, complete or not at all.

    The file is a JSON header line (format, version, step, world size, payload bytes, and a SHA-256 over
    those fields and the payload), then
    the ``torch.save`` bytes of the payload. It is written to a temporary file in the same directory (same
    file system, so the rename is atomic) created with its final mode, flushed and fsynced, ``os.replace``d
    over ``path``, and the directory is fsynced so the rename itself is durable.
    """
    buf = io.BytesIO()
    torch.save(plain(payload), buf)
    data = buf.getvalue()
    fields = {"format": FORMAT, "version": VERSION, "step": int(step), "world_size": int(world_size),
              "bytes": len(data)}
    head = json.dumps(dict(fields, sha256=_digest(fields, data))).encode() + b"\n"
    assert len(head) <= MAX_HEADER
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f"{_TMP_PREFIX}{secrets.token_hex(8)}.pt")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)   # the umask applies, as for any new file
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(head)
            f.write(data)
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


def _digest(fields: Dict[str, Any], data: bytes) -> str:
    """SHA-256 over the header's fields (canonical JSON) and the payload: a flipped bit anywhere is caught."""
    h = hashlib.sha256(json.dumps(fields, sort_keys=True).encode())
    h.update(b"\n")
    h.update(data)
    return h.hexdigest()


class CheckpointError(ValueError):
    """A file is not a complete, intact gradshare checkpoint (the message says why, in one line)."""


def read_header(path: str) -> Dict[str, Any]:
    """The header of a checkpoint file, after checking it and the payload against the checksum (nothing is
    unpickled)."""
    try:
        with open(path, "rb") as f:
            line = f.readline(MAX_HEADER + 1)
            try:
                head = json.loads(line) if line.endswith(b"\n") else None
            except ValueError:
                head = None
            if not isinstance(head, dict) or head.get("format") != FORMAT:
                raise CheckpointError(f"{path}: not a gradshare checkpoint")
            if head.get("version") != VERSION:
                raise CheckpointError(f"{path}: checkpoint version {head.get('version')!r}, this gradshare reads "
                                      f"{VERSION}")
            for key, kind in (("step", int), ("world_size", int), ("bytes", int), ("sha256", str)):
                if not isinstance(head.get(key), kind) or isinstance(head.get(key), bool):
                    raise CheckpointError(f"{path}: checkpoint header has no valid {key!r}")
            if head["step"] < 0 or head["world_size"] < 1 or head["bytes"] < 0:
                raise CheckpointError(f"{path}: checkpoint header holds an impossible step, world size or length")
            digest = hashlib.sha256(json.dumps({k: v for k, v in head.items() if k != "sha256"},
                                               sort_keys=True).encode() + b"\n")
            left = head["bytes"]
            while left > 0:
                block = f.read(min(left, 1 << 20))
                if not block:
                    raise CheckpointError(f"{path}: truncated checkpoint ({head['bytes'] - left} of {head['bytes']} "
                                          "payload bytes)")
                digest.update(block)
                left -= len(block)
            if f.read(1):
                raise CheckpointError(f"{path}: checkpoint has bytes after its payload")
    except OSError as exc:
        raise CheckpointError(f"{path}: not a readable checkpoint ({type(exc).__name__}: {exc})") from exc
    if digest.hexdigest() != head["sha256"]:
        raise CheckpointError(f"{path}: checkpoint does not match its checksum (corrupt file)")
    return head


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
    # Never a checkpoint newer than the one just written: this run may have resumed from an older one only
    # because the newer could not be read at that moment, and a later restart may read it again.
    kept = [p for p, s in zip(paths, steps) if s <= step]
    doomed = kept[:-keep_last] if keep_last > 0 else []
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


def _group_info(process_group) -> tuple:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(process_group), dist.get_world_size(process_group), True
    return 0, 1, False


def _first_rank(process_group) -> int:
    """The global rank of ``process_group``'s rank 0 (the writer)."""
    return dist.get_global_rank(process_group, 0) if process_group is not None else 0


@renamed_kwargs(group="process_group")
def save(directory: str, step: int, state: Optional[Mapping[str, Any]] = None,
         rank_state: Optional[Mapping[str, Any]] = None, *, keep_last: int = 3, process_group=None,
         rng: bool = True) -> str:
    """Writes the checkpoint for ``step``; returns its path (on every rank).

    ``state``: values identical on every rank, saved from rank 0 (objects with ``state_dict()`` are saved as
    their state dict). ``rank_state``: values that differ per rank (e.g. a gradient-sharing optimizer whose
    residuals are per rank), gathered from every rank; ``rng=True`` adds each rank's RNG states under
    ``"rng"``. Keeps the ``keep_last`` newest checkpoints (0 keeps all). Collective under an initialised
    process group: call it on every rank of ``process_group`` (None: the default group; ``group`` is its former
    name) with the same ``step``.
    """
    if keep_last < 0:
        raise ValueError(f"keep_last: must be >= 0, got {keep_last}")
    path = checkpoint_path(directory, step)
    rank, world, distributed = _group_info(process_group)
    mine = _snapshot(rank_state)
    if rng:
        mine["rng"] = rng_state()
    if distributed and world > 1:
        gathered: Optional[List[Any]] = [None] * world if rank == 0 else None
        dist.gather_object(mine, gathered, dst=_first_rank(process_group), group=process_group)
    else:
        gathered = [mine]
    error = None
    if rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            _remove_stale_temporaries(directory)
            write_atomic({"state": _snapshot(state), "ranks": gathered}, path, step=step, world_size=world)
            _prune(directory, step, keep_last)
        except Exception as exc:  # every rank must learn about it, not wait at the next collective
            error = f"{type(exc).__name__}: {exc}"
            if not (distributed and world > 1):
                raise
    if distributed and world > 1:
        outcome = [error]
        dist.broadcast_object_list(outcome, src=_first_rank(process_group),
                                   group=process_group)
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
    """Reads a checkpoint file; raises CheckpointError (a ValueError) with a one-line reason when it is not a
    complete, intact gradshare checkpoint. The payload is unpickled only after its checksum verifies, and then
    with ``torch.load(weights_only=True)``: no code in a file runs."""
    head = read_header(path)
    try:
        with open(path, "rb") as f:
            f.readline(MAX_HEADER + 1)
            data = f.read(head["bytes"])
        _check_archive(data)
        with warnings.catch_warnings():   # torch warns about the pickle protocol of files it then refuses
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except CheckpointError:
        raise
    except Exception as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise CheckpointError(f"{path}: checkpoint payload is not plain data ({type(exc).__name__}: {reason})") \
            from None
    if not isinstance(raw, dict) or not isinstance(raw.get("state"), dict) or not isinstance(raw.get("ranks"), list):
        raise CheckpointError(f"{path}: checkpoint payload lacks its state or per-rank state")
    return Checkpoint(path=path, step=head["step"], world_size=head["world_size"], state=raw["state"],
                      ranks=raw["ranks"])


def _check_archive(data: bytes) -> None:
    """Raises unless ``data`` is a zip archive as torch.save writes it: stored (uncompressed), unencrypted file
    records that all lie inside it and match their CRCs. A payload behind a valid checksum can still be damaged
    (or written by hand), and torch's reader trusts what the archive's directory says: a wrong size reads past
    the record, and a record marked as a directory (or with no stored bytes) is "extracted" by writing nothing,
    so torch unpickles whatever its buffer held before (a different result from one read to the next)."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            infos = z.infolist()
            names = set()
            for info in infos:
                if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 0x41:
                    raise ValueError(f"record {info.filename!r} is compressed or encrypted")
                if info.file_size != info.compress_size:
                    raise ValueError(f"record {info.filename!r} states {info.file_size} bytes and stores "
                                     f"{info.compress_size}")
                if info.external_attr & 0x10 or info.filename.endswith("/"):
                    raise ValueError(f"record {info.filename!r} is marked as a directory")
                if info.filename in names:
                    raise ValueError(f"record {info.filename!r} appears twice")
                names.add(info.filename)
            bad = z.testzip()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError, NotImplementedError,
            RuntimeError) as exc:
        raise ValueError(f"not a sound zip archive: {exc}") from None
    if bad is not None:
        raise ValueError(f"record {bad!r} does not match its CRC")


def latest(directory: str) -> Optional[str]:
    """Path of the newest checkpoint in ``directory`` whose checksum verifies, or None (missing directory, none,
    all broken). Reads headers and payload bytes only: nothing is unpickled."""
    for path in reversed(list_checkpoints(directory)):
        try:
            read_header(path)
        except CheckpointError:
            continue
        return path
    return None


def load_latest(directory: str, map_location: Any = "cpu") -> Optional[Checkpoint]:
    """The newest checkpoint in ``directory`` that loads, loaded; None when there is none."""
    for path in reversed(list_checkpoints(directory)):
        try:
            return load(path, map_location)
        except CheckpointError:
            continue
    return None
