"""Statistics of gradient sharing: one record per step and bucket, running totals, CSV / JSON lines.

Every exchange adds a StepRecord (a few Python numbers, no tensor copies). Totals are kept separately
and never truncated; the history keeps the last ``max_records`` records. The residual norm costs one
pass over the residual, so it is computed only every ``norm_every`` steps (None on other steps).

Byte counts are per rank, as a ring algorithm moves them (gradshare.costmodel computes every one): a
padded all-gather of W rows of L words sends (W-1)*L*4 bytes (plus the small lengths exchange); a dense
fp32 ring allreduce of n elements sends 2*(W-1)/W*n*4 bytes. ``compression`` = dense_bytes / bytes_sent.
Everything that exchanges (Statistics, ThresholdState, SharedOptimizer, ParameterAveraging) reports its
totals the same way: :class:`ReportsTraffic`.

Use ``stats.summary()`` or ``print(stats)`` for a run's figures, ``stats.to_csv(path)`` /
``stats.to_jsonl(path)`` for the history, and ``log_every`` / ``callback`` to watch a run live.
"""
from __future__ import annotations

import csv
import json
import logging
import math
import threading
from collections import deque
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable, Deque, Dict, Iterable, List, Optional, Protocol, TextIO, Union, runtime_checkable

import torch

log = logging.getLogger("gradshare")

FORMATS = ("sparse", "bitmap", "dense", "allreduce", "skipped")


@runtime_checkable
class ReportsTraffic(Protocol):
    """An object that counts its exchanges' bytes: what this rank sent, and what a float32 all-reduce of
    the gradients at every step would have sent (per rank, ring model)."""

    @property
    def bytes_sent(self) -> int: ...

    @property
    def dense_bytes(self) -> int: ...


@dataclass
class StepRecord:
    """What one bucket's exchange did on one step (all ranks see the same numbers except residual_norm).

    format: "sparse" / "bitmap" (largest message of the step), "dense" (allreduce fallback),
    "allreduce" (gradients all-reduced: the link-aware choice, gradshare.link) or "skipped" (a non-finite
    step dropped). density: mean over ranks of count/n. tau: this rank's tau.
    """
    step: int
    bucket: int
    n: int
    tau: float
    count: int            # mean entries sent per rank (rounded down)
    density: float
    format: str
    bytes_sent: int
    dense_bytes: int
    residual_norm: Optional[float] = None

    @property
    def compression(self) -> float:
        return self.dense_bytes / self.bytes_sent if self.bytes_sent else math.nan

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


COLUMNS = [f.name for f in fields(StepRecord)]


class Statistics:
    """Per step, per bucket records and totals of one SharedOptimizer or ThresholdState.

    Args:
        max_records: history length (oldest dropped first; None keeps all). Totals are never dropped.
        norm_every: compute the residual L2 norm every this many steps (0 or None: never).
        log_every: every this many steps, call ``callback`` with that step's records, or log a one-line
            summary at INFO level on the "gradshare" logger when no callback is given.
        callback: ``callback(records: list[StepRecord])``.
    """

    def __init__(self, max_records: Optional[int] = 100_000, norm_every: Optional[int] = 10,
                 log_every: Optional[int] = None, callback: Optional[Callable[[List[StepRecord]], None]] = None):
        self.records: Deque[StepRecord] = deque(maxlen=max_records)
        self.norm_every = norm_every or 0
        self.log_every = log_every or 0
        self.callback = callback
        self.bytes_sent = 0
        self.dense_bytes = 0
        self.exchanges = 0
        self.format_counts: Dict[str, int] = {f: 0 for f in FORMATS}
        self._pending: List[StepRecord] = []
        self._pending_step: Optional[int] = None
        self._lock = threading.Lock()   # DDP hook callbacks may record from collective threads

    # -- recording (called by the exchange users) ---------------------------------------------------
    def wants_norm(self, step: int) -> bool:
        return self.norm_every > 0 and step % self.norm_every == 0

    def add(self, record: StepRecord) -> None:
        with self._lock:
            self._add(record)

    def _add(self, record: StepRecord) -> None:
        self.records.append(record)
        self.bytes_sent += record.bytes_sent
        self.dense_bytes += record.dense_bytes
        self.exchanges += 1
        self.format_counts[record.format] = self.format_counts.get(record.format, 0) + 1
        if self.log_every:
            if self._pending_step is not None and record.step != self._pending_step:
                self._flush()
            self._pending_step = record.step
            if record.step % self.log_every == 0:
                self._pending.append(record)

    def end_step(self) -> None:
        """Called once a step's exchanges are done: emits the step's log line / callback if due."""
        if self.log_every:
            with self._lock:
                self._flush()

    def _flush(self) -> None:
        recs, self._pending, self._pending_step = self._pending, [], None
        if not recs:
            return
        if self.callback is not None:
            self.callback(recs)
        else:
            log.info(format_step(recs))

    # -- reading --------------------------------------------------------------------------------------
    @property
    def compression(self) -> float:
        """dense_bytes / bytes_sent over the whole run (nan before any bytes were sent)."""
        return self.dense_bytes / self.bytes_sent if self.bytes_sent else math.nan

    @property
    def history(self) -> List[StepRecord]:
        return list(self.records)

    def summary(self) -> Dict[str, Any]:
        recs = self.records
        dens = [r.density for r in recs if r.format != "skipped"]
        return {"exchanges": self.exchanges, "bytes_sent": self.bytes_sent, "dense_bytes": self.dense_bytes,
                "compression": self.compression, "formats": dict(self.format_counts),
                "mean_density": (sum(dens) / len(dens)) if dens else math.nan,
                "last_tau": {r.bucket: r.tau for r in list(recs)[-64:]}}

    def __str__(self) -> str:
        s = self.summary()
        fm = ", ".join(f"{k} {v}" for k, v in s["formats"].items() if v)
        return (f"gradshare: {s['exchanges']} exchanges, sent {_mb(s['bytes_sent'])} vs dense "
                f"{_mb(s['dense_bytes'])} ({s['compression']:.1f}x), mean density {s['mean_density']:.3g}; {fm}")

    def to_csv(self, path_or_file: Union[str, TextIO]) -> None:
        with _open(path_or_file) as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            for r in self.records:
                w.writerow(r.as_dict())

    def to_jsonl(self, path_or_file: Union[str, TextIO]) -> None:
        with _open(path_or_file) as f:
            for r in self.records:
                f.write(json.dumps(r.as_dict()) + "\n")

    # -- checkpoints ----------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Totals only (the history is a log, not training state)."""
        return {"bytes_sent": self.bytes_sent, "dense_bytes": self.dense_bytes, "exchanges": self.exchanges,
                "format_counts": dict(self.format_counts)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.bytes_sent = int(state["bytes_sent"])
        self.dense_bytes = int(state["dense_bytes"])
        self.exchanges = int(state["exchanges"])
        self.format_counts = {f: 0 for f in FORMATS}
        self.format_counts.update(state.get("format_counts", {}))


def residual_norm(residual: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(residual))


def format_step(records: Iterable[StepRecord]) -> str:
    recs = list(records)
    sent = sum(r.bytes_sent for r in recs)
    dense = sum(r.dense_bytes for r in recs)
    parts = [f"b{r.bucket}:{r.format} tau={r.tau:.3g} d={r.density:.2e}" for r in recs]
    ratio = dense / sent if sent else math.nan
    return f"step {recs[0].step}: sent {_mb(sent)} vs dense {_mb(dense)} ({ratio:.1f}x) " + " ".join(parts)


def _mb(b: int) -> str:
    return f"{b / 1e6:.3f} MB" if b >= 1e5 else f"{b / 1e3:.1f} kB"


class _open:
    """Context manager accepting a path or an open text file (left open)."""

    def __init__(self, target):
        self.target = target
        self.f = None

    def __enter__(self) -> TextIO:
        if isinstance(self.target, (str, bytes)) or hasattr(self.target, "__fspath__"):
            self.f = open(self.target, "w", newline="")
            return self.f
        return self.target

    def __exit__(self, *exc):
        if self.f is not None:
            self.f.close()
        return False
