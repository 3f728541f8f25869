"""The second moment of parameters whose gradients are mostly zero, averaged over the ranks now and then.

Sharing updates, each rank's adaptive optimizer divides by a second moment of its *own* gradients, which
gradshare.second_moment converts to the global batch's. That estimate is sound where every step's gradient
touches the element. An embedding table's row (a recommender's users and items, a word model's rare tokens)
or a parameter only some steps use (a mixture's expert) gets a gradient only on the steps whose batch holds
it: each rank's second moment there counts the events of its own share of the batch, W times fewer than
DDP's, so it is far noisier, and Adam, which moves such an element by about the same amount per event
whatever the gradient's size, moves it by a noisy amount. Averaging the ranks' second moments gives each
the events of the whole batch again (averaging keeps it a rank's own estimate: gradshare.second_moment).

Measured on bench/quality.py's ``recommender`` (matrix factorization, Adam, 2 ranks, 3 seeds; README, "Embedding
tables"), the defaults without it ended +3.4% of DDP's validation error, and about as much with every update sent
whole: the gap came from the second moment, not the compression. Averaged every 25 / 50 / 100 / 200 steps they
ended -5.1% / -5.0% / -3.0% / +1.0%, at 31.7x / 46.5x / 60.5x / 71.3x fewer bytes than DDP (86.7x without).

So the ranks average only the second moment of parameters whose gradients are mostly zero: over the first
:data:`DETECT_STEPS` steps that share updates, each rank counts, per parameter, the share of the elements its
optimizer has seen a gradient for (second moment above zero) whose gradient in this step is exactly zero (or
missing); the ranks agree the mean of those shares (one all-reduce of a float per parameter), and a parameter
at :data:`SPARSE_SHARE` or above is averaged every ``every`` steps from then on, in bfloat16 (one all-reduce,
2 bytes an element; rounding each time is no drift: the optimizer's average goes on from the value). Dense
parameters (every conv and linear layer, the LM's embeddings) cost nothing and train bit for bit as before.

Covers Adam's kin (``exp_avg_sq``, amsgrad's ``max_exp_avg_sq`` too), RMSprop and Adadelta (``square_avg``) and
Adagrad (``sum``): the optimizers whose step divides by a running mean square the optimizer keeps itself. Not
Adamax and Adafactor, whose divisor is no mean square (gradshare.second_moment keeps theirs itself). Local steps
(gradshare.averaging) do not use it: there the inner optimizer's state stays each rank's own, as DiLoCo keeps it.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from gradshare import second_moment
from gradshare.costmodel import ring_allreduce_bytes

EVERY = 50            # steps between two averagings (0: never): where a shorter period stopped paying (docstring)
DETECT_STEPS = 10     # steps sharing updates over which each parameter's share of zero gradients is counted
SPARSE_SHARE = 0.5    # a parameter is averaged when at least this share of its seen elements gets no gradient
KEYS = {"adam": "exp_avg_sq", "nadam": "exp_avg_sq", "radam": "exp_avg_sq", "rmsprop": "square_avg",
        "adadelta": "square_avg", "adagrad": "sum"}


def keys(optimizer: Optional[torch.optim.Optimizer], group: Dict[str, Any]) -> List[str]:
    """The second-moment state keys this module averages for a parameter of ``group`` (amsgrad's running maximum
    too: the step divides by it); none for an optimizer it does not cover. The same on every rank."""
    key = KEYS.get(second_moment.kind(optimizer) or "")
    if key is None:
        return []
    return [key, "max_exp_avg_sq"] if key == "exp_avg_sq" and group.get("amsgrad") else [key]


def moment(optimizer: torch.optim.Optimizer, p: torch.Tensor, key: str) -> Optional[torch.Tensor]:
    """``p``'s state tensor ``key`` where it is one this module can average (dense, real, one value per element);
    None before the parameter's first step."""
    t = optimizer.state.get(p, {}).get(key)
    ok = (torch.is_tensor(t) and t.is_floating_point() and not t.is_sparse and t.numel() == p.numel()
          and t.dim() > 0)
    return t if ok else None


class SparseMoments:
    """Per-parameter detection and periodic averaging of the second moment (module docstring) for one sharing
    core's parameters, in their order. ``every``: steps between two averagings (0 or None: off)."""

    def __init__(self, optimizer: Optional[torch.optim.Optimizer], every: Optional[int] = EVERY):
        if every is None:
            every = 0
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"sparse_moments: expected None or an int >= 0 (steps between two averagings), "
                             f"got {every!r}")
        self.optimizer = optimizer
        self.every = every if second_moment.kind(optimizer) in KEYS else 0
        self.observed = 0                          # steps counted so far (up to DETECT_STEPS)
        self.zero_share: Optional[torch.Tensor] = None   # per parameter, the sum of its shares over those steps
        self.sparse: Optional[List[bool]] = None   # decided, the same on every rank
        self.averaged = 0                          # averagings done (statistics)

    @property
    def active(self) -> bool:
        return self.every > 0

    def config(self) -> Dict[str, Any]:
        return {"every": self.every, "detect steps": DETECT_STEPS, "sparse share": SPARSE_SHARE}

    @torch.no_grad()
    def _shares(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """Per parameter, the share of its elements with a second moment above zero whose gradient is zero now
        (a missing gradient: all of them); 0 where nothing was seen yet."""
        out = torch.zeros(len(params), dtype=torch.float64)
        groups = second_moment.groups_of(self.optimizer)
        for i, p in enumerate(params):
            names = keys(self.optimizer, groups[id(p)]) if id(p) in groups else []
            v = moment(self.optimizer, p, names[0]) if names else None
            if v is None:
                continue
            seen = v.reshape(-1) > 0
            n = int(seen.sum())
            g = p.grad
            if n == 0 or (g is not None and g.is_sparse):
                continue
            out[i] = 1.0 if g is None else int((seen & (g.detach().reshape(-1) == 0)).sum()) / n
        return out

    def after_step(self, params: Sequence[torch.Tensor], step: int, process_group=None) -> int:
        """Called on every rank after each step that shared updates (``step``: the steps completed), with the
        same ``params``: counts, decides, or averages (collectives, the same on every rank). Returns the bytes
        this rank sent."""
        if not self.active or len(params) == 0:
            return 0
        world = dist.get_world_size(process_group) if dist.is_available() and dist.is_initialized() else 1
        if world <= 1:
            return 0
        held = len(self.sparse) if self.sparse is not None else (
            self.zero_share.numel() if self.zero_share is not None else len(params))
        if held != len(params):
            # Parameters were added (SharedOptimizer's add_param_group, on every rank alike): detect again over all
            self.sparse, self.zero_share, self.observed = None, None, 0
        if self.sparse is None:
            shares = self._shares(params)
            self.zero_share = shares if self.zero_share is None else self.zero_share + shares
            self.observed += 1
            if self.observed < DETECT_STEPS:
                return 0
            mean = self.zero_share.to(self._device(params)).div(self.observed * world)
            dist.all_reduce(mean, group=process_group)
            self.sparse = [bool(x >= SPARSE_SHARE) for x in mean.tolist()]
            self.zero_share = None
            return ring_allreduce_bytes(world, len(params), 8)
        if step % self.every:
            return 0
        return self.average(params, world, process_group)

    @torch.no_grad()
    def average(self, params: Sequence[torch.Tensor], world: int, process_group=None) -> int:
        """The sparse parameters' second moments replaced by their mean over the ranks (one bfloat16 all-reduce).
        Every rank sends the same layout (each chosen parameter's keys, from its group); a rank with no state yet
        for one (no gradient seen) sends zeros there, its own estimate, and keeps having none."""
        groups = second_moment.groups_of(self.optimizer)
        slots = [(p, moment(self.optimizer, p, k)) for p, s in zip(params, self.sparse or []) if s
                 for k in keys(self.optimizer, groups[id(p)])]
        if not slots:
            return 0
        device = self._device(params)
        flat = torch.cat([t.detach().reshape(-1).float() if t is not None else torch.zeros(p.numel(), device=device)
                          for p, t in slots])
        message = flat.div_(world).to(torch.bfloat16)
        dist.all_reduce(message, group=process_group)
        mean = message.float()
        off = 0
        for p, t in slots:
            if t is not None:
                t.copy_(mean[off:off + p.numel()].view_as(t))
            off += p.numel()
        self.averaged += 1
        return ring_allreduce_bytes(world, mean.numel(), 2)

    @staticmethod
    def _device(params: Sequence[torch.Tensor]) -> torch.device:
        return params[0].device if len(params) else torch.device("cpu")

    def state_dict(self) -> Dict[str, Any]:
        """The detection's progress or decision (the period is the constructor's)."""
        return {"observed": self.observed, "sparse": self.sparse, "averaged": self.averaged,
                "zero share": None if self.zero_share is None else self.zero_share.clone()}

    def load_state_dict(self, state: Optional[Dict[str, Any]], count: int) -> None:
        """``count``: the parameters this core holds (a checkpoint's decision must cover as many)."""
        if not state:                               # a checkpoint from before: detect again
            self.observed, self.zero_share, self.sparse, self.averaged = 0, None, None, 0
            return
        sparse = state.get("sparse")
        share = state.get("zero share")
        if sparse is not None and len(sparse) != count:
            raise ValueError(f"load_state_dict: the checkpoint's sparse second moments are for {len(sparse)} "
                             f"parameters, this state holds {count}")
        if share is not None and (not torch.is_tensor(share) or share.numel() != count):
            raise ValueError(f"load_state_dict: the checkpoint's zero-gradient shares are for "
                             f"{share.numel() if torch.is_tensor(share) else type(share).__name__} parameters, "
                             f"this state holds {count}")
        self.observed = int(state.get("observed", 0))
        self.sparse = None if sparse is None else [bool(s) for s in sparse]
        self.zero_share = None if share is None else share.double().clone()
        self.averaged = int(state.get("averaged", 0))
