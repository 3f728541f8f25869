"""Optimizer state across ranks: which tensors are averaged, and the same entries on every rank first.

Where ranks step on their own gradients (compressed updates, local steps), a parameter that has a gradient
on one rank and not on another (a branch only some batches take, a layer only rank 0 uses) is stepped by
the first rank's optimizer only. Its state then differs in more than values: Adam's ``step`` counter is
ahead on that rank, and a rank that never stepped the parameter has no state for it at all. Averaging
such states tensor by tensor would all-reduce buffers of different lengths, and two optimizers with the
same moments but different counters take different steps from the same gradient: replicas drift apart.

:func:`agree` runs before states are averaged. One small all-reduce tells whether every rank holds the same
entries (a checksum of keys, shapes and dtypes) and the same ``step`` counters. Where entries differ
(rare), ranks exchange their layouts and a rank lacking an entry creates it as zeros; where counters
differ, a parameter's scalar entries are taken from the rank that stepped it most (ties: the lowest rank).
Adaptive values an optimizer keeps in its ``param_groups`` (D-Adaptation's and Prodigy's ``d``, estimated from
each rank's own gradients) are made equal too: one that differs across ranks becomes the ranks' mean; values
equal everywhere (learning rates, betas) are left as they are, bit for bit.
"""
from __future__ import annotations

import numbers
import zlib
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

Entry = Tuple[str, str, Tuple[int, ...], str, bool]   # key, kind, shape, dtype, on the parameter's device


def state_tensors(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor],
                  per_element: bool = True) -> Iterable[Tuple[str, torch.Tensor, torch.Tensor]]:
    """(key, parameter, tensor) for the floating state tensors of ``params``, in a fixed order. ``per_element``:
    only tensors shaped like their parameter (else every one: Adafactor's factored moments, an optimizer's
    running scalar per parameter). A step counter (``step``, the same on every rank) never counts."""
    for p in params:
        st = optimizer.state.get(p, {})
        for key in sorted(st):
            t = st[key]
            if not (torch.is_tensor(t) and t.is_floating_point()) or key == "step":
                continue
            if per_element and t.shape != p.shape:
                continue
            yield key, p, t


def _scalar(v: Any) -> bool:
    return (torch.is_tensor(v) and v.dim() == 0) or (isinstance(v, numbers.Real) and not isinstance(v, bool))


def _layout(p: torch.Tensor, st: Dict[str, Any]) -> List[Entry]:
    out = []
    for key in sorted(st):
        v = st[key]
        if torch.is_tensor(v):
            kind = "scalar" if v.dim() == 0 else "tensor"
            out.append((key, kind, tuple(v.shape), str(v.dtype), v.device == p.device))
        elif _scalar(v):
            out.append((key, "scalar", (), type(v).__name__, False))
        else:
            out.append((key, "other", (), type(v).__name__, False))
    return out


def _create(p: torch.Tensor, entry: Entry) -> Any:
    key, kind, shape, dtype, on_param = entry
    if kind == "other":
        raise RuntimeError(f"optimizer state: parameter of shape {tuple(p.shape)} has entry {key!r} "
                           f"({dtype}) on some ranks only, and it is not a tensor or a number: cannot "
                           "make the ranks' states alike")
    if dtype in ("int", "float"):
        return 0 if dtype == "int" else 0.0
    return torch.zeros(shape, dtype=getattr(torch, dtype.split(".")[-1]),
                       device=p.device if on_param else torch.device("cpu"))


def _max(values: List[float], device: torch.device, group: Any) -> List[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def _steps(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> float:
    v = optimizer.state.get(p, {}).get("step", 0)
    return _value(v) if _scalar(v) else 0.0


@torch.no_grad()
def agree(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor], process_group: Any = None,
          device: Optional[torch.device] = None) -> None:
    """Makes the state entries of ``params`` alike on every rank (a collective; module docstring): the same
    keys, shapes and dtypes (missing ones created as zeros) and, where the ``step`` counters differ, the
    scalar entries of the rank that stepped most; and the floating values of their parameter groups that
    differ across ranks replaced by the mean. When every rank already holds the same entries and counters
    (the usual case) this is two all-reduces of a few numbers per parameter and group value."""
    params = list(params)
    world = dist.get_world_size(process_group)
    if world <= 1 or not params:
        return
    dev = device if device is not None else params[0].device
    rank = dist.get_rank(process_group)
    layouts = [_layout(p, optimizer.state.get(p, {})) for p in params]
    crc = float(zlib.crc32(repr(layouts).encode()))
    steps = [_steps(optimizer, p) for p in params]
    # One MAX all-reduce: the layout checksums (the state's, the groups' keys) both ways (equal everywhere iff
    # max == min), each parameter's largest step with the rank that has it (ties to the lowest rank), and each
    # one's smallest step.
    groups = _group_scalars(optimizer, params)
    gcrc = float(zlib.crc32(repr([(i, k) for i, k, _ in groups]).encode()))
    agreed = _max([crc, -crc, gcrc, -gcrc] + [s * world + (world - 1 - rank) for s in steps] + [-s for s in steps],
                  dev, process_group)
    if agreed[2] != -agreed[3]:
        raise RuntimeError("optimizer state: the ranks' param_groups hold different keys; every rank must build "
                           "the same optimizer with the same parameter groups")
    _agree_group_scalars(groups, world, dev, process_group)
    n = len(params)
    ranked, low = agreed[4:4 + n], [-v for v in agreed[4 + n:]]
    differ = {i for i in range(n) if int(round(ranked[i])) // world != low[i]}
    if agreed[0] != -agreed[1]:                # some rank's entries differ: exchange the layouts
        everyone: List[Optional[List[List[Entry]]]] = [None] * world
        dist.all_gather_object(everyone, layouts, group=process_group)
        for i, p in enumerate(params):
            union: Dict[str, Entry] = {}
            for lay in everyone:
                for e in lay[i]:                                     # type: ignore[index]
                    seen = union.setdefault(e[0], e)
                    if seen[:4] != e[:4]:
                        raise RuntimeError(f"optimizer state: entry {e[0]!r} of a parameter of shape "
                                           f"{tuple(p.shape)} differs across ranks ({seen[1:4]} vs {e[1:4]})")
            mine = {e[0] for e in layouts[i]}
            if any(len(lay[i]) < len(union) for lay in everyone):   # type: ignore[index]
                differ.add(i)
            for key, e in union.items():
                if key not in mine:
                    optimizer.state[p][key] = _create(p, e)
    keys = [(i, k) for i in sorted(differ) for k in sorted(optimizer.state.get(params[i], {}))
            if _scalar(optimizer.state[params[i]][k])]
    if not keys:
        return
    source = {i: world - 1 - int(round(ranked[i])) % world for i in differ}
    vals = torch.tensor([_value(optimizer.state[params[i]][k]) if source[i] == rank else 0.0 for i, k in keys],
                        dtype=torch.float64, device=dev)
    dist.all_reduce(vals, group=process_group)
    for (i, k), v in zip(keys, vals.tolist()):
        st = optimizer.state[params[i]]
        old = st[k]
        if torch.is_tensor(old):
            old.fill_(v)
        else:
            st[k] = type(old)(v)


def _group_scalars(optimizer: torch.optim.Optimizer, params: List[torch.Tensor]) -> List[Tuple[int, str, Dict]]:
    """(group index, key, group) for each floating number a parameter group of ``params`` holds."""
    mine = {id(p) for p in params}
    out = []
    for i, g in enumerate(optimizer.param_groups):
        if any(id(p) in mine for p in g["params"]):
            out += [(i, k, g) for k in sorted(g) if k != "params" and _float_scalar(g[k])]
    return out


def _float_scalar(v: Any) -> bool:
    if torch.is_tensor(v):
        return v.dim() == 0 and v.is_floating_point()
    return isinstance(v, float)


def _agree_group_scalars(groups: List[Tuple[int, str, Dict]], world: int, device: torch.device, group: Any) -> None:
    """Each group value that differs across ranks replaced by the ranks' mean (one MAX all-reduce tells which;
    a sum only when one does)."""
    if not groups:
        return
    vals = [_value(g[k]) for _, k, g in groups]
    m = _max(vals + [-v for v in vals], device, group)
    differ = [j for j in range(len(vals)) if m[j] != -m[len(vals) + j]]
    if not differ:
        return
    mean = torch.tensor([vals[j] for j in differ], dtype=torch.float64, device=device)
    dist.all_reduce(mean, group=group)
    for j, v in zip(differ, mean.div_(world).tolist()):
        _, k, g = groups[j]
        if torch.is_tensor(g[k]):
            g[k].fill_(v)
        else:
            g[k] = v


def _value(v: Any) -> float:
    return float(v.item()) if torch.is_tensor(v) else float(v)
