"""Synchronous parameter averaging (DL4J's ParameterAveragingTrainingMaster / ParallelWrapper AVERAGING).

Use it when every rank should train on its own for a few steps and then agree: it talks once every
``frequency`` steps instead of every step, at the price of some convergence for large frequencies
(DL4J's guidance: much above ~20 hurts).

How an averaging round works: the parameters, floating-point buffers and (by default) the floating-point
optimizer state (SGD momentum, Adam moments, ...) are copied into ONE flat float32 buffer, summed with
one ``all_reduce`` and scaled by 1/world_size with :func:`gradshare.ops.average`, then copied back. An
all-reduce (rather than all-gather + average) moves 2(W-1)/W of the buffer per rank instead of (W-1)
buffers and needs no W-fold memory; ring/tree all-reduce hands every rank the same reduced bits, and
the scaling is the same local operation everywhere, so after a round all ranks hold bitwise-identical
values (verified by the tests). Works on any process group (gloo on CPU, NCCL on CUDA).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from gradshare import ops
from gradshare.wrapped_optimizer import WrappedOptimizer


def allreduce_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``nbytes``: 2 (W-1)/W of the buffer."""
    return 0 if world_size <= 1 else int(2 * (world_size - 1) * nbytes // world_size)


class ParameterAveraging(WrappedOptimizer):
    """Wraps an optimizer: ``step()`` runs it, and every ``frequency`` steps averages across ranks.

    Args:
        model: the module whose parameters ``optimizer`` updates (its floating buffers are averaged too).
        optimizer: any torch optimizer over ``model``'s parameters.
        frequency: average after every ``frequency`` optimizer steps (1 = after each step).
        average_optimizer_state: also average floating-point optimizer state tensors (not step counters).
        warmup_steps: the first ``warmup_steps`` steps average after every step (a synchronous start,
            when the model moves fastest), then every ``frequency`` steps.
        process_group: the group to average over (default: the global group).
        sync_initial: broadcast rank 0's parameters and buffers at construction (a collective), so that
            all ranks start from the same point.

    Use ``opt.zero_grad(); loss.backward(); opt.step()`` as with the wrapped optimizer. ``average()``
    forces a round now (collective). ``bytes_sent`` / ``dense_bytes``: what this rank sent, and what an
    all-reduce of the gradients at every step would have sent.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, frequency: int = 5,
                 average_optimizer_state: bool = True, warmup_steps: int = 0, process_group=None,
                 sync_initial: bool = True):
        if int(frequency) < 1:
            raise ValueError(f"frequency: must be >= 1, got {frequency}")
        if int(warmup_steps) < 0:
            raise ValueError(f"warmup_steps: must be >= 0, got {warmup_steps}")
        self.model = model
        self.optimizer = optimizer
        self.frequency = int(frequency)
        self.average_optimizer_state = bool(average_optimizer_state)
        self.warmup_steps = int(warmup_steps)
        self.process_group = process_group
        self.step_count = 0
        self.rounds = 0
        self.bytes_sent = 0
        self.dense_bytes = 0
        self.last_averaged = False
        self._flat: Optional[torch.Tensor] = None
        self._param_bytes = 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)
        if sync_initial and self.world_size > 1:
            self._broadcast_from_rank0()

    # ------------------------------------------------------------------------------------ optimizer API
    def step(self, closure=None):
        """One optimizer step; then an averaging round when one is due. Returns the closure's loss."""
        loss = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        self.step_count += 1
        self.dense_bytes += allreduce_bytes(self._param_bytes, self.world_size)
        self.last_averaged = self.due(self.step_count)
        if self.last_averaged:
            self.average()
        return loss

    def due(self, step: int) -> bool:
        """Whether an averaging round follows optimizer step number ``step`` (1-based)."""
        return step <= self.warmup_steps or (step - self.warmup_steps) % self.frequency == 0

    # ------------------------------------------------------------------------------------- averaging
    @property
    def world_size(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group)

    def tensors(self) -> List[torch.Tensor]:
        """What a round averages, in a fixed order: parameters, floating buffers, optimizer state."""
        out = [p.data for p in self.model.parameters()]
        out += [b for b in self.model.buffers() if b.is_floating_point()]
        if self.average_optimizer_state:
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    st = self.optimizer.state.get(p, {})
                    for key in sorted(st):
                        v = st[key]
                        # Per-element state only: 0-dim tensors are counters such as Adam's "step".
                        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0:
                            out.append(v)
        return out

    def _flatten(self, ts: List[torch.Tensor]) -> torch.Tensor:
        n = sum(t.numel() for t in ts)
        dev = ts[0].device
        if self._flat is None or self._flat.numel() != n or self._flat.device != dev:
            self._flat = torch.empty(n, dtype=torch.float32, device=dev)
        off = 0
        for t in ts:
            self._flat[off:off + t.numel()].copy_(t.reshape(-1))
            off += t.numel()
        return self._flat

    @staticmethod
    def _unflatten(flat: torch.Tensor, ts: List[torch.Tensor]) -> None:
        off = 0
        for t in ts:
            t.copy_(flat[off:off + t.numel()].view_as(t))
            off += t.numel()

    @torch.no_grad()
    def average(self) -> None:
        """Averages now across the group (a collective: every rank must call it)."""
        world = self.world_size
        self.rounds += 1
        if world <= 1:
            return
        ts = self.tensors()
        flat = self._flatten(ts)
        dist.all_reduce(flat, group=self.process_group)
        ops.average([flat], weights=[1.0 / world], out=flat)
        self._unflatten(flat, ts)
        self.bytes_sent += allreduce_bytes(4 * flat.numel(), world)

    @torch.no_grad()
    def _broadcast_from_rank0(self) -> None:
        ts = [p.data for p in self.model.parameters()] + [b for b in self.model.buffers() if b.is_floating_point()]
        if not ts:
            return
        flat = self._flatten(ts)
        src = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        dist.broadcast(flat, src=src, group=self.process_group)
        self._unflatten(flat, ts)

    # ------------------------------------------------------------------------------------- state
    def state_dict(self) -> Dict[str, Any]:
        """The inner optimizer's state plus the step and round counters and byte totals."""
        return {"optimizer": self.optimizer.state_dict(), "step": self.step_count, "rounds": self.rounds,
                "bytes_sent": self.bytes_sent, "dense_bytes": self.dense_bytes, "frequency": self.frequency,
                "warmup_steps": self.warmup_steps}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.step_count = int(state["step"])
        self.rounds = int(state.get("rounds", 0))
        self.bytes_sent = int(state.get("bytes_sent", 0))
        self.dense_bytes = int(state.get("dense_bytes", 0))

    def __repr__(self) -> str:
        return (f"ParameterAveraging({type(self.optimizer).__name__}, frequency={self.frequency}, "
                f"average_optimizer_state={self.average_optimizer_state}, warmup_steps={self.warmup_steps})")
