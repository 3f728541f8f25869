"""What the framework integrations share: each rank's own state in a checkpoint that one process writes.

In updates mode every rank's optimizer steps on its own gradient, so its residuals and optimizer state
differ from the other ranks'; frameworks write optimizer state from one process. Each integration stores
every rank's entry and gives each rank its own back, which needs the same number of processes.
"""
import inspect
from typing import Any

import torch

from gradshare._deprecation import renamed_from
from gradshare.hooks import ThresholdState

# The ThresholdState keyword arguments an integration passes through (it supplies the group and optimizer),
# former names included.
STATE_OPTIONS = (frozenset(inspect.signature(ThresholdState).parameters)
                 | frozenset(renamed_from(ThresholdState.__init__))) - {"process_group", "optimizer"}


def check_world_size(saved: int, world: int, where: str = "the checkpoint") -> None:
    """Refuses per-rank state saved by a different number of processes, saying what to do."""
    if int(saved) != int(world):
        raise ValueError(f"{where} holds gradshare state of {saved} ranks, this run has {world}: residuals and "
                         f"optimizer states are per rank, so resume with {saved} processes")


def to_cpu(value: Any) -> Any:
    """``value`` with every tensor on the CPU, so that no process unpickles another's tensors onto its GPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    return value
