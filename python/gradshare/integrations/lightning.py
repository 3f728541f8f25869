"""Lightning strategy that trains with gradshare: DDP whose communication hook is gradshare's.

Use it for a LightningModule trained with ``strategy="ddp"`` when exchanging gradients is what limits
the step (links between nodes, shared or slow networks). One line of the training script changes::

    import gradshare.integrations.lightning
    trainer = L.Trainer(strategy=gradshare.integrations.lightning.GradshareStrategy(), ...)

The strategy registers :func:`gradshare.threshold_hook` on CPU (gloo) and GPU (NCCL) alike, after
Lightning has built the optimizer and before the first forward, with ``ThresholdState(optimizer=...)``:
gradshare shares the optimizer's updates ("updates" mode), with the compression chosen for that optimizer
and the link-aware choice of gradshare.link. Keyword arguments that ThresholdState takes (compression=,
link=, nonfinite=, bucket_cap_mb=, stats=, ...) configure the sharing; the others go to DDPStrategy
(find_unused_parameters=, static_graph=, process_group_backend=, ...). ``strategy.state`` is the
ThresholdState once ``fit`` has set up.

Lightning runs forward and backward inside ``optimizer.step(closure)``; the strategy runs that closure
before gradshare's step hooks so that they see the gradients of the step they share.

Checkpoints: each rank's optimizer steps on its own gradient, so its residuals and optimizer state differ
from the other ranks', while Lightning writes its checkpoint from global rank 0 only. The strategy gathers
every rank's sharing state (``state.state_dict()``) and optimizer state into the checkpoint, under
``checkpoint["gradshare"] = {"world_size": W, "ranks": [{"sharing": ..., "optimizer": ...}, ...]}`` (with
several optimizers ``"optimizers": [...]`` in each rank's entry; plain
data: a weights-only ``torch.load`` reads it; the file holds W optimizer states), and
``trainer.fit(ckpt_path=...)`` gives each rank its own entry back, which needs the same number of
processes. Weights-only checkpoints leave it out.

Several optimizers (``configure_optimizers`` returning several, with manual optimization): each one's
updates are shared (``ThresholdState(optimizer=[...])``), and every rank's states of all of them go into the
checkpoint. Not LBFGS, whose step evaluates the closure several times.
"""
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from gradshare.checkpoint import plain
from gradshare.hooks import ThresholdState, threshold_hook
from gradshare.integrations.per_rank import STATE_OPTIONS, check_world_size, optimizer_entry, optimizer_states, to_cpu

__all__ = ["GradshareStrategy", "CHECKPOINT_KEY"]

CHECKPOINT_KEY = "gradshare"
_HOOK_ARGS = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")


def _closure_first(optimizer, args, kwargs):
    """Optimizer step pre-hook, registered before ThresholdState's: runs ``step(closure)``'s closure
    (Lightning's zero_grad, forward, backward, clipping) now, so that gradshare's pre-hook sees this step's
    gradients and non-finite flags; the step itself then gets the closure's result back."""
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if closure is None:
        return None
    with torch.enable_grad():
        loss = closure()
    return args[:1], {**kwargs, "closure": lambda: loss}


class GradshareStrategy(DDPStrategy):
    """DDPStrategy sharing the optimizer's updates through gradshare (module docstring)."""

    def __init__(self, **kwargs: Any) -> None:
        given = [k for k in _HOOK_ARGS if k in kwargs]
        if given:
            raise TypeError(f"GradshareStrategy registers gradshare's threshold_hook itself; it does not take "
                            f"{', '.join(given)} (use DDPStrategy for another hook)")
        self.state_kwargs: Dict[str, Any] = {k: kwargs.pop(k) for k in list(kwargs) if k in STATE_OPTIONS}
        super().__init__(**kwargs)
        self.state: Optional[ThresholdState] = None

    def setup(self, trainer) -> None:
        super().setup(trainer)   # wraps the model in DDP, then builds the optimizers
        if trainer.state.fn != TrainerFn.FITTING:
            return
        if not self.optimizers:
            raise ValueError("GradshareStrategy shares an optimizer's updates; configure_optimizers returned none")
        if any(isinstance(o, torch.optim.LBFGS) for o in self.optimizers):
            raise ValueError("GradshareStrategy: LBFGS evaluates its closure several times per step, which "
                             "gradshare's step hooks cannot follow; use a first-order optimizer")
        for opt in self.optimizers:
            opt.register_step_pre_hook(_closure_first)   # before ThresholdState registers its own step hooks
        optimizer = self.optimizers[0] if len(self.optimizers) == 1 else list(self.optimizers)
        self.state = ThresholdState(self._ddp_kwargs.get("process_group"), optimizer=optimizer, **self.state_kwargs)
        assert isinstance(self.model, DistributedDataParallel)   # DDPStrategy.setup wrapped it when fitting
        self.model.register_comm_hook(self.state, threshold_hook)

    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        # Every rank runs this (Trainer.save_checkpoint) with its own dump; rank 0 writes: gather to rank 0.
        if self.state is not None and "optimizer_states" in checkpoint:
            # On CPU, so that rank 0 does not unpickle the other ranks' tensors onto their GPUs.
            # this rank's own optimizer state(s): with compressed updates each rank's differs
            own = optimizer_entry(checkpoint["optimizer_states"])
            mine = plain(to_cpu({"sharing": self.state.state_dict(), **own}), "gradshare sharing state")
            world = dist.get_world_size()
            ranks = [None] * world if dist.get_rank() == 0 else None
            dist.gather_object(mine, ranks, dst=0)
            if ranks is not None:
                # Rank 0's own entry, not its gathered copy: on CPU its optimizer tensors are those of
                # checkpoint["optimizer_states"], which torch.save then stores once.
                ranks[0] = mine
                checkpoint[CHECKPOINT_KEY] = {"world_size": world, "ranks": ranks}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_optimizer_state_dict(self, checkpoint) -> None:
        saved = checkpoint.get(CHECKPOINT_KEY)
        if self.state is None or saved is None:
            if self.state is not None:
                rank_zero_warn(f"the checkpoint has no gradshare state (checkpoint['{CHECKPOINT_KEY}']; written by "
                               "another strategy?): every rank starts from rank 0's optimizer state and sharing "
                               "starts with zero residuals")
            super().load_optimizer_state_dict(checkpoint)
            return
        check_world_size(saved["world_size"], self.world_size)
        mine = saved["ranks"][self.global_rank]
        states = optimizer_states(mine, len(self.optimizers))
        super().load_optimizer_state_dict({**checkpoint, "optimizer_states": states})
        self.state.load_state_dict(mine["sharing"])
