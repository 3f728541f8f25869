"""What the framework integrations share: each rank's own state in a checkpoint that one process writes.

In updates mode every rank's optimizer steps on its own gradient, so its residuals and optimizer state
differ from the other ranks'; frameworks write optimizer state from one process. Each integration stores
every rank's entry and gives each rank its own back, which needs the same number of processes.
"""
import inspect
from typing import Any, Dict, List

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


def optimizer_entry(states: List[Any]) -> Dict[str, Any]:
    """A rank entry's optimizer part: ``{"optimizer": state}`` for one optimizer, ``{"optimizers": [...]}`` for
    several (in the order the sharing state was given them)."""
    return {"optimizer": states[0]} if len(states) == 1 else {"optimizers": list(states)}


def optimizer_states(entry: Dict[str, Any], expected: int, where: str = "the checkpoint") -> List[Any]:
    """The optimizer states of a rank entry (:func:`optimizer_entry`), refused unless there are ``expected``."""
    states = entry["optimizers"] if "optimizers" in entry else [entry["optimizer"]]
    if len(states) != expected:
        raise ValueError(f"{where} holds the state of {len(states)} optimizer(s) per rank, this run shares "
                         f"{expected}: give it the same optimizers")
    return list(states)


def to_cpu(value: Any) -> Any:
    """``value`` with every tensor on the CPU, so that no process unpickles another's tensors onto its GPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    return value
