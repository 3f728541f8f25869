"""SGD's momentum masked where an update that waited in the residual swings back (``momentum_masking``, on by
default where it applies).

Sharing SGD's updates with error feedback, an element's update waits in the residual until it is among the
largest. While it waits its parameter does not move, so the gradient the optimizer sees is stale, step after
step, and SGD's momentum fills with it. Where the gradient's signal builds up in the residual (least squares,
fine-tuning close to a minimum: every parameter matters and keeps its direction) the update finally sent
overshoots, and the momentum, full of the stale gradient, keeps pushing: the element swings from side to side
and the loss stalls (the quality table's ``regression``: 3.7x DDP's error without this, within 8% with it).
Classification workloads hide it: most of their gradient is noise that cancels in the residual.

The sign of such a swing: an element sent after waiting whose update has the opposite sign of the one it sent
last. There the optimizer's momentum buffer is zeroed: Deep Gradient Compression's momentum factor masking, for
the elements where staleness showed. DGC masks every element sent, which cost the classification workloads up
to 0.7 points (it takes the momentum from every element that is sent often); elements sent at consecutive
steps are left alone here, so with nothing held back (``Dense``, where masking is off) the shared steps are
synchronous SGD's. Swings from gradient noise are masked too, which costs the noisy workloads a little (README,
"Training quality": up to 0.25 points against the same sharing unmasked).

Where it applies: torch.optim.SGD (of several optimizers, the SGD ones) whose updates are shared with a
compression that holds something back (not ``Dense``), each step's mean applied at once (``delay=0``). Each
rank masks its own momentum (the optimizer states are local when updates are shared), from what it sent itself.
``momentum_masking=False`` turns it off; ``True`` asks for it and is refused where it cannot apply.

State: one int8 per element (0: never sent; +-1: last sent with that sign, before the previous step; +-2: sent
at the previous step), saved in gradshare's checkpoints (the bucket's ``last_sent``).
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch


def applies(optimizer) -> bool:
    """Masking is for torch's SGD (its ``momentum_buffer``); other optimizers are left as they are."""
    return isinstance(optimizer, torch.optim.SGD)


class MomentumMasking:
    """Watches what each bucket sends and zeroes the optimizer's momentum where a waiting element swung back."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def before(self, buckets: Sequence, deltas: Sequence[torch.Tensor]) -> List[Tuple[object, torch.Tensor]]:
        """Before the exchange: residual + update of every bucket, what the encoder chooses from."""
        return [(b, b.residual + d) for b, d in zip(buckets, deltas)]

    @torch.no_grad()
    def after(self, watched: Sequence[Tuple[object, torch.Tensor]]) -> None:
        """After a completed exchange (the residual is what was kept): an element was sent where the kept value
        differs from what the encoder chose from (the encoder adds residual and update as the line above
        does, bit for bit, and keeps that sum where it sends nothing)."""
        for b, chosen_from in watched:
            sent = b.residual != chosen_from
            sign = torch.sign(chosen_from).to(torch.int8)
            if b.last_sent is None:
                b.last_sent = torch.zeros(b.n, dtype=torch.int8, device=b.device)
            last = b.last_sent
            swung = sent & (last * sign == -1)            # waited (|last| is 1), and the other way
            if bool(swung.any()):
                self._mask(b, swung)
            last.copy_(torch.where(sent, sign * 2, torch.sign(last)))

    def _mask(self, b, swung: torch.Tensor) -> None:
        state = self.optimizer.state
        for p, off, n in zip(b.params, b.offsets, b.numels):
            st = state.get(p)
            buf = st.get("momentum_buffer") if st else None
            if buf is None:
                continue
            buf.view(-1).masked_fill_(swung[off:off + n], 0)
