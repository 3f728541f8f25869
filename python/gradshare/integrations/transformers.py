"""Hugging Face Transformers Trainer with gradshare's DDP hook, every rank's sharing state in its checkpoints.

Use it for a Trainer run with DDP (``torchrun`` / ``accelerate launch`` on several processes) when
exchanging gradients is what limits the step. One line after building the Trainer::

    trainer = Trainer(model=model, args=args, train_dataset=train)
    gradshare.integrations.transformers.share(trainer)
    trainer.train()

``share`` adds a GradshareCallback to the Trainer. When training begins (after the Trainer has wrapped the
model in DistributedDataParallel, built the optimizer and loaded any checkpoint; before the first backward)
it registers :func:`gradshare.threshold_hook` with ``ThresholdState(optimizer=...)`` on the Trainer's torch
optimizer: gradshare shares the optimizer's updates ("updates" mode), with the compression chosen for that
optimizer and the link-aware choice of gradshare.link. Keyword arguments go to ThresholdState
(compression=, link=, nonfinite=, bucket_cap_mb=, stats=, ...). ``callback.state`` is the ThresholdState once
training has begun. With one process there is nothing to share: the callback does nothing.

Checkpoints: each rank's optimizer steps on its own gradient, so its residuals and optimizer state differ
from the other ranks', while the Trainer writes ``optimizer.pt`` from process 0 only. Before each checkpoint
(when the Trainer's control says it will save) the callback gathers every rank's sharing and optimizer
state to the saving process, which stores them in ``optimizer.pt`` itself, under
``param_groups[0]["gradshare"] = {"world_size": W, "step": S, "ranks": [bytes, ...]}`` (each rank's entry a
``torch.save`` blob, read back with ``weights_only=True``; the file holds W optimizer states). The Trainer
loads that file into every process on ``train(resume_from_checkpoint=...)``, wherever the folder is; the
callback then gives each rank its own entry back, which needs the same number of processes. A checkpoint
without the entry resumes with a warning, every rank from process 0's optimizer state with zero residuals.

Limits: DDP only (not FSDP or DeepSpeed, which keep their own communication); ``save_only_model=True``
checkpoints hold no optimizer state, hence no gradshare state.
"""
import io
import warnings
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
import transformers
from torch.nn.parallel import DistributedDataParallel

from gradshare.hooks import ThresholdState, threshold_hook
from gradshare.integrations.per_rank import STATE_OPTIONS, check_world_size, to_cpu

__all__ = ["GradshareCallback", "share", "CHECKPOINT_KEY"]

CHECKPOINT_KEY = "gradshare"


def _blob(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


class GradshareCallback(transformers.TrainerCallback):
    """Registers gradshare's hook on ``trainer``'s DDP model and keeps every rank's state in its
    checkpoints (module docstring). ``share(trainer)`` builds one and adds it to the Trainer."""

    def __init__(self, trainer: "transformers.Trainer", **state_kwargs: Any):
        if not isinstance(trainer, transformers.Trainer):
            raise TypeError(f"GradshareCallback: expected the transformers.Trainer to train, got "
                            f"{type(trainer).__name__}")
        unknown = sorted(set(state_kwargs) - STATE_OPTIONS)
        if unknown:
            raise TypeError(f"GradshareCallback: {', '.join(unknown)} not ThresholdState options "
                            f"(these are: {', '.join(sorted(STATE_OPTIONS))})")
        self.trainer = trainer
        self.state_kwargs = state_kwargs
        self.state: Optional[ThresholdState] = None
        self._optimizer: Optional[torch.optim.Optimizer] = None
        self._payload: Optional[Dict[str, Any]] = None     # every rank's entries, for the next optimizer.pt
        self._gathering = False

    # -- training begins: the model is wrapped, the optimizer built and any checkpoint loaded ---------------
    def on_train_begin(self, args, state, control, **kwargs):
        if args.world_size == 1 or not dist.is_initialized():
            return
        ddp = getattr(self.trainer.model_wrapped, "_orig_mod", self.trainer.model_wrapped)
        if not isinstance(ddp, DistributedDataParallel):
            raise TypeError(f"GradshareCallback: the Trainer wrapped the model in {type(ddp).__name__}, not "
                            f"DistributedDataParallel: gradshare's hook is a DDP hook (FSDP and DeepSpeed keep "
                            f"their own communication)")
        opt = getattr(self.trainer.optimizer, "optimizer", self.trainer.optimizer)   # inside AcceleratedOptimizer
        saved = opt.param_groups[0].pop(CHECKPOINT_KEY, None)
        if self.state is None or opt is not self._optimizer:
            self._optimizer = opt
            self.state = ThresholdState(ddp.process_group, optimizer=opt, **self.state_kwargs)
            try:
                ddp.register_comm_hook(self.state, threshold_hook)
            except RuntimeError as e:
                if "only be called once" not in str(e):
                    raise
                raise RuntimeError("GradshareCallback: the Trainer's DDP model has a communication hook already "
                                   "(a second GradshareCallback, or another hook); DDP takes one") from None
            opt.register_state_dict_post_hook(self._embed)
        if saved is not None:
            self._restore(saved, dist.get_world_size(), dist.get_rank())
        elif state.global_step > 0:
            warnings.warn(f"resuming at step {state.global_step} from a checkpoint without gradshare state "
                          f"(optimizer.pt param_groups[0]['{CHECKPOINT_KEY}']): every rank starts from process 0's "
                          f"optimizer state and sharing starts with zero residuals", stacklevel=2)

    def _restore(self, saved: Dict[str, Any], world: int, rank: int) -> None:
        check_world_size(saved["world_size"], world)
        assert self.state is not None and self._optimizer is not None   # on_train_begin built them
        mine = torch.load(io.BytesIO(saved["ranks"][rank]), map_location="cpu", weights_only=True)
        self._optimizer.load_state_dict(mine["optimizer"])    # over process 0's, which the Trainer loaded
        self.state.load_state_dict(mine["sharing"])

    # -- checkpoints: gather before the Trainer saves, embed when process 0 writes optimizer.pt -------------
    def on_step_end(self, args, state, control, **kwargs):
        self._gather_if_saving(args, state, control)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._gather_if_saving(args, state, control)

    def _gather_if_saving(self, args, state, control) -> None:
        # Every rank runs the same callbacks with the same control, so all of them join the gather. With
        # save_strategy="best" the save is decided after evaluating: gather whenever evaluating.
        best = getattr(args.save_strategy, "value", args.save_strategy) == "best"
        saving = control.should_save or (best and control.should_evaluate)
        if self.state is None or self._optimizer is None or not saving or args.save_only_model:
            return
        self._gathering = True
        try:
            mine = _blob({"sharing": self.state.state_dict(),
                          "optimizer": to_cpu(self._optimizer.state_dict())})
        finally:
            self._gathering = False
        world = dist.get_world_size()
        ranks = [None] * world
        if args.save_on_each_node:      # each node's first process writes a checkpoint
            dist.all_gather_object(ranks, mine)
        else:
            dist.gather_object(mine, ranks if dist.get_rank() == 0 else None, dst=0)
        if args.should_save:
            self._payload = {"world_size": world, "step": state.global_step, "ranks": ranks}

    def _embed(self, optimizer, state_dict):
        if self._gathering or self._payload is None:
            return None
        payload, self._payload = self._payload, None
        if payload["step"] != self.trainer.state.global_step:
            warnings.warn(f"gradshare state gathered at step {payload['step']} but the checkpoint is written at "
                          f"step {self.trainer.state.global_step}: it holds process 0's optimizer state only",
                          stacklevel=2)
            return None
        state_dict["param_groups"][0][CHECKPOINT_KEY] = payload   # param_groups are fresh dicts: training's own
        return state_dict                                          # groups are left as they are


def share(trainer: "transformers.Trainer", **state_kwargs: Any) -> GradshareCallback:
    """Adds a GradshareCallback to ``trainer`` (module docstring) and returns it."""
    callback = GradshareCallback(trainer, **state_kwargs)
    trainer.add_callback(callback)
    return callback
