"""Evaluation metrics that combine exactly across data-parallel shards.

Each metric maps a batch (outputs, targets) to a (sum, count) pair; shards add their pairs and the
value is sum / count, so a metric over N workers equals the metric over the whole dataset in one process
(counts exactly, float sums in float64). Names: "loss", "accuracy", "top5_accuracy"; or pass your own
callable ``f(outputs, targets) -> (sum, count)`` (module level, so that workers can unpickle it).
"""
from __future__ import annotations

from typing import Callable, Dict, Sequence, Tuple, Union

import torch

MetricFn = Callable[[torch.Tensor, torch.Tensor], Tuple[float, float]]
MetricSpec = Union[str, MetricFn]


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> Tuple[float, float]:
    """Correct top-1 predictions (sum) over samples (count)."""
    return float((outputs.argmax(dim=1) == targets).sum()), float(targets.numel())


def top5_accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> Tuple[float, float]:
    """Samples whose target is among the five largest outputs."""
    k = min(5, outputs.shape[1])
    hit = (outputs.topk(k, dim=1).indices == targets.unsqueeze(1)).any(dim=1)
    return float(hit.sum()), float(targets.numel())


_BUILTIN: Dict[str, MetricFn] = {"accuracy": accuracy, "top5_accuracy": top5_accuracy}


def metric_name(m: MetricSpec) -> str:
    return m if isinstance(m, str) else getattr(m, "__name__", type(m).__name__)


def check_metrics(metrics: Sequence[MetricSpec]) -> None:
    for m in metrics:
        if isinstance(m, str) and m != "loss" and m not in _BUILTIN:
            raise ValueError(f"metrics: unknown metric {m!r} (known: loss, {', '.join(sorted(_BUILTIN))})")
        if not isinstance(m, str) and not callable(m):
            raise TypeError(f"metrics: expected a name or a callable, got {type(m).__name__}")


def batch_sums(metrics: Sequence[MetricSpec], outputs: torch.Tensor, targets: torch.Tensor,
               loss_fn: Callable) -> Dict[str, Tuple[float, float]]:
    """(sum, count) of each metric on one batch. "loss" assumes ``loss_fn`` averages over the batch
    (PyTorch's default reduction), so the batch contributes loss * batch size."""
    out = {}
    for m in metrics:
        if m == "loss":
            n = targets.shape[0]
            out["loss"] = (float(loss_fn(outputs, targets).double()) * n, float(n))
        else:
            fn = _BUILTIN[m] if isinstance(m, str) else m
            s, c = fn(outputs, targets)
            out[metric_name(m)] = (float(s), float(c))
    return out
