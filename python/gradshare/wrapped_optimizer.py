"""The torch.optim.Optimizer surface shared by gradshare's optimizer wrappers.

SharedOptimizer and ParameterAveraging wrap a user's optimizer; schedulers, clipping utilities and
training loops reach through them to ``param_groups``, ``state``, ``defaults`` and ``zero_grad``.
"""
from __future__ import annotations

import torch


class WrappedOptimizer:
    """Forwards the read side of the optimizer API to ``self.optimizer``."""

    optimizer: torch.optim.Optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
