"""Check that every rank holds bitwise the same parameters (after gradient sharing, a restore, ...).

``verify_replicas(model)`` hashes every parameter (its bytes, shape and dtype) on each rank, all-gathers
one 64-bit digest per rank and, only when they differ, the per-parameter digests, then raises
ReplicaMismatchError naming the first differing parameter and the ranks that disagree with rank 0.
Costs one pass over the parameters (copied to the CPU) and one or two small collectives; call it every
few hundred steps or after a restore, not every step.
"""
from __future__ import annotations

import hashlib
from typing import Dict, Iterable, List, Tuple, Union

import torch
import torch.distributed as dist

from gradshare._deprecation import renamed_kwargs


class ReplicaMismatchError(RuntimeError):
    """Ranks hold different parameters; ``name`` is the first differing one, ``ranks`` those that differ."""

    def __init__(self, name: str, ranks: List[int], detail: str = ""):
        super().__init__(f"replicas differ: parameter {name!r} on rank(s) {ranks} differs from rank 0{detail}")
        self.name = name
        self.ranks = ranks


def _named(model_or_params, include_buffers: bool) -> List[Tuple[str, torch.Tensor]]:
    if isinstance(model_or_params, torch.nn.Module):
        m = model_or_params.module if hasattr(model_or_params, "module") and isinstance(
            getattr(model_or_params, "module"), torch.nn.Module) else model_or_params
        items = list(m.named_parameters())
        if include_buffers:
            items += list(m.named_buffers())
        return items
    if isinstance(model_or_params, dict):
        return [(str(k), v) for k, v in model_or_params.items() if isinstance(v, torch.Tensor)]
    if isinstance(model_or_params, torch.Tensor):
        return [("tensor", model_or_params)]
    return [(f"param[{i}]", p) for i, p in enumerate(model_or_params)]


def _digest(t: torch.Tensor) -> int:
    t = t.detach()
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{tuple(t.shape)}|{t.dtype}".encode())
    c = t.contiguous().cpu()
    if c.numel():
        h.update(c.view(-1).view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest(), "little", signed=True)


def parameter_digests(model_or_params: Union[torch.nn.Module, Iterable[torch.Tensor], Dict[str, torch.Tensor]],
                      include_buffers: bool = False) -> List[Tuple[str, int]]:
    """(name, 64-bit digest) per parameter, locally (no communication)."""
    return [(n, _digest(t)) for n, t in _named(model_or_params, include_buffers)]


def _device(process_group) -> torch.device:
    if dist.get_backend(process_group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@renamed_kwargs(group="process_group")
def verify_replicas(model_or_params, process_group=None, *, include_buffers: bool = False) -> int:
    """Raises ReplicaMismatchError unless every rank of ``process_group`` (None: the default group; ``group``
    is its former name) holds bitwise equal parameters.

    ``model_or_params``: an nn.Module (DDP-wrapped or not; parameters by name), an iterable of tensors,
    or a dict name -> tensor. ``include_buffers``: hash module buffers too (BatchNorm statistics are not
    shared by SharedOptimizer, so they are left out by default). Returns the common 64-bit digest.
    Every rank must call it (it is a collective).
    """
    items = parameter_digests(model_or_params, include_buffers)
    world = dist.get_world_size(process_group)
    dev = _device(process_group)
    h = hashlib.blake2b(digest_size=8)
    for _, d in items:
        h.update(d.to_bytes(8, "little", signed=True))
    total = int.from_bytes(h.digest(), "little", signed=True)
    head = torch.tensor([len(items), total], dtype=torch.int64, device=dev)
    heads = torch.empty(world * 2, dtype=torch.int64, device=dev)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(heads, head, group=process_group)
    table = heads.view(world, 2).tolist()
    counts = [r[0] for r in table]
    if len(set(counts)) != 1:
        raise ReplicaMismatchError("<count>", [r for r, c in enumerate(counts) if c != counts[0]],
                                   f": ranks hold {counts} parameters")
    if all(r[1] == table[0][1] for r in table):
        return total
    mine = torch.tensor([d for _, d in items], dtype=torch.int64, device=dev)
    every = torch.empty(world * len(items), dtype=torch.int64, device=dev)
    gather(every, mine, group=process_group)
    rows = every.view(world, len(items)).tolist()
    for j, (name, _) in enumerate(items):
        differ = [r for r in range(1, world) if rows[r][j] != rows[0][j]]
        if differ:
            raise ReplicaMismatchError(name, differ)
    raise ReplicaMismatchError("<order>", [r for r in range(world) if table[r][1] != table[0][1]],
                               ": same parameters in a different order")
