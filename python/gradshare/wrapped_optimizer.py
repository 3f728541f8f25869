"""The torch.optim.Optimizer that gradshare's optimizer wrappers are.

SharedOptimizer and ParameterAveraging wrap a user's optimizer and ARE torch optimizers: LR schedulers,
GradScaler, Lightning's optimizer config, clipping utilities and torch.distributed.checkpoint accept them.
They hold no parameter groups of their own: ``param_groups``, ``state`` and ``defaults`` are the inner
optimizer's (the same objects, read through on every access, so a scheduler on either one sets the same
lr, and a load of the inner optimizer's state is seen at once).

``state_dict()`` is torch-shaped: the inner optimizer's ``{"state", "param_groups"}`` plus one entry,
``"gradshare"``, with the wrapper's own state (residuals, counters). ``load_state_dict`` takes that, or a
torch-shaped dict without it (torch.distributed.checkpoint keeps only ``state`` and ``param_groups``):
then only the inner optimizer's state is loaded and gradshare's is left as it is.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

import torch

GRADSHARE_KEY = "gradshare"


class WrappedOptimizer(torch.optim.Optimizer):
    """A torch.optim.Optimizer over ``self.optimizer``'s parameter groups (module docstring)."""

    optimizer: torch.optim.Optimizer

    def _wrap(self, optimizer: torch.optim.Optimizer) -> None:
        """Sets the inner optimizer, and torch's own optimizer set-up minus its copy of the parameter groups:
        the step and state-dict hooks and step profiling (torch.optim.Optimizer.__setstate__ makes them)."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, WrappedOptimizer):
            raise TypeError(f"optimizer: {type(optimizer).__name__} wraps an optimizer already; wrap the "
                            "torch optimizer itself")
        self.optimizer = optimizer
        torch.optim.Optimizer.__setstate__(self, {})
        self._stepping = 0                        # inside this wrapper's step(): the inner one may step
        _guard(optimizer, self)

    def _ranks(self) -> int:
        """How many ranks this wrapper's steps keep alike (with one, a direct step of the inner optimizer
        loses nothing)."""
        raise NotImplementedError

    # The inner optimizer's (torch.optim.Optimizer.load_state_dict replaces its param_groups list: read
    # through, never copy).
    @property  # type: ignore[override]
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value) -> None:
        self.optimizer.param_groups = value

    @property  # type: ignore[override]
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value) -> None:
        self.optimizer.state = value

    @property  # type: ignore[override]
    def defaults(self):
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value) -> None:
        self.optimizer.defaults = value

    def __getstate__(self) -> Dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: Dict[str, Any]) -> None:
        torch.optim.Optimizer.__setstate__(self, state)
        # A copy of the inner optimizer (deepcopy, pickle) has none of its hooks (torch's __getstate__ keeps
        # none): the copy is guarded afresh; a shallow copy shares the inner optimizer and its guard.
        _guard(self.optimizer, self)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Adds the group to the inner optimizer (torch's checks and defaults), then to what is shared."""
        self.optimizer.add_param_group(param_group)
        self._share_new_group(self.optimizer.param_groups[-1]["params"])

    def _share_new_group(self, params: Iterable[torch.Tensor]) -> None:
        raise NotImplementedError

    # -- checkpoints: torch-shaped, plus gradshare's entry ----------------------------------------------------
    def _gradshare_state(self) -> Dict[str, Any]:
        raise NotImplementedError

    def _load_gradshare_state(self, state: Dict[str, Any]) -> None:
        raise NotImplementedError

    def state_dict(self) -> Dict[str, Any]:
        """The inner optimizer's state_dict (``state``, ``param_groups``) plus ``"gradshare"``: this wrapper's."""
        sd = dict(self.optimizer.state_dict())
        sd[GRADSHARE_KEY] = self._gradshare_state()
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads :meth:`state_dict`'s output; a torch-shaped dict with no ``"gradshare"`` entry loads the inner
        optimizer only (module docstring). gradshare's part is checked and loaded first, so a checkpoint
        that does not fit changes nothing."""
        inner, own = split_state_dict(state_dict)
        if own is not None:
            self._load_gradshare_state(own)
        self.optimizer.load_state_dict(inner)


def steps_the_inner_optimizer(step: Callable) -> Callable:
    """For a wrapper's ``step()``: the inner optimizer's own ``step()`` is allowed inside it (and refused outside
    it, :func:`_only_through_wrapper`)."""

    @functools.wraps(step)
    def run(self, *args, **kwargs):
        self._stepping += 1
        try:
            return step(self, *args, **kwargs)
        finally:
            self._stepping -= 1

    return run


def _guard(inner: torch.optim.Optimizer, wrapper: WrappedOptimizer) -> None:
    """Registers :func:`_only_through_wrapper` on ``inner`` once, for every wrapper of it (held weakly)."""
    wrappers = inner.__dict__.get("_gradshare_wrappers")
    if not isinstance(wrappers, weakref.WeakSet):
        wrappers = inner.__dict__["_gradshare_wrappers"] = weakref.WeakSet()
        inner.register_step_pre_hook(_only_through_wrapper(wrappers))
    wrappers.add(wrapper)


def _only_through_wrapper(wrappers: "weakref.WeakSet[WrappedOptimizer]") -> Callable:
    """The inner optimizer's step pre-hook: a direct ``inner.step()`` while a wrapper of it lives and shares with
    other ranks raises before it steps. It would step each rank on its own gradient, with no exchange (and,
    for ParameterAveraging, no round ever due): the replicas would drift apart, silently."""

    def hook(opt, args, kwargs) -> None:
        live = list(wrappers)
        if any(w._stepping for w in live):
            return
        sharing = [w for w in live if w._ranks() > 1]
        if not sharing:
            return
        inner, outer = type(opt).__name__, type(sharing[0]).__name__
        for w in sharing:                  # error_feedback="model": the mean result again, the same on every rank
            core = getattr(w, "sharing", None)
            if core is not None:
                core.show_mean_now()
        raise RuntimeError(f"gradshare: {inner}.step() was called directly, but a {outer} wraps it: call the "
                           f"{outer}'s step() (give the {outer} to a GradScaler, scheduler or training framework "
                           f"too). Stepped directly, each rank steps on its own gradient and nothing is shared.")

    return hook


def split_state_dict(state_dict: Dict[str, Any]) -> Tuple[Dict[str, Any], Optional[Dict[str, Any]]]:
    """(the inner optimizer's state_dict, gradshare's entry or None). Also reads the layout of gradshare
    0.x checkpoints: ``{"optimizer": inner, ...gradshare's entries}``."""
    if not isinstance(state_dict, dict):
        raise TypeError(f"load_state_dict: expected a dict, got {type(state_dict).__name__}")
    if "state" in state_dict and "param_groups" in state_dict:
        inner = {k: v for k, v in state_dict.items() if k != GRADSHARE_KEY}
        return inner, state_dict.get(GRADSHARE_KEY)
    if "optimizer" in state_dict:
        own = {k: v for k, v in state_dict.items() if k != "optimizer"}
        if GRADSHARE_KEY in own:
            own["sharing"] = own.pop(GRADSHARE_KEY)
        return state_dict["optimizer"], own
    raise ValueError("load_state_dict: not an optimizer state_dict (no 'state' and 'param_groups'; keys: "
                     f"{sorted(map(str, state_dict))})")
