"""The optimizer's momentum (SGD's buffer, Adam's first moment) masked where an update that waited in the residual
swings back (``momentum_masking``, on by default where it applies).

Sharing SGD's updates with error feedback, an element's update waits in the residual until it is among the
largest. While it waits its parameter does not move, so the gradient the optimizer sees is stale, step after
step, and SGD's momentum fills with it. Where the gradient's signal builds up in the residual (least squares,
fine-tuning close to a minimum: every parameter matters and keeps its direction) the update finally sent
overshoots, and the momentum, full of the stale gradient, keeps pushing: the element swings from side to side
and the loss stalls (the quality table's ``regression``: 3.7x DDP's error without this, within 7% with it).
Classification workloads hide it: most of their gradient is noise that cancels in the residual. Adam's first
moment fills the same way; at a forced top-k density of 1% the regression trained with Adam ends at 7.6x DDP's
error without this (README, "Training quality").

The sign of such a swing: an element sent after waiting whose update has the opposite sign of the one it sent
last. There the optimizer's momentum buffer is zeroed: Deep Gradient Compression's momentum factor masking, for
the elements where staleness showed. DGC masks every element sent, which cost the classification workloads up
to 0.7 points (it takes the momentum from every element that is sent often); elements sent at consecutive
steps are left alone here, so with nothing held back (``Dense``, where masking is off) the shared steps are
synchronous SGD's. Swings from gradient noise are masked too, which costs the noisy workloads a little (README,
"Training quality": the MLP 0.22 points against the same sharing unmasked, the CNNs nothing).

Where it applies by default: updates shared, each step's mean applied at once (``delay=0``), what waits kept in
the residual (``error_feedback="buffer"``: in each rank's model, the default, its gradients see what waits and
nothing stale builds up), and
torch.optim.SGD with a compression that holds something back (not ``Dense``), or Adam's kin (Adam, AdamW,
NAdam, RAdam, Adamax: their ``exp_avg``) with top-k (:func:`by_default` says why not with their Ternary). Of
several optimizers, those. Each rank masks its own momentum (the optimizer states are local when updates are
shared), from what it sent itself. ``momentum_masking=False`` turns it off; ``True`` asks for it with any
compression and is refused where it cannot apply (another optimizer, gradients shared, ``delay=1``).

State: one int8 per element (0: never sent; +-1: last sent with that sign, before the previous step; +-2: sent
at the previous step), saved in gradshare's checkpoints (the bucket's ``last_sent``). With top-k compression (SGD's
default) a step reads what its rank sent from the rank's own message and touches only those elements and the
previous step's (a few percent of the bucket); other compressions compare the kept residual with residual +
update, a few passes over the bucket.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from gradshare import reference
from gradshare.compression import Dense, TopK


# Optimizers whose first moment masking zeroes, and the state entry that holds it. Adam's kin divide it by
# the second moment's root, so a stale first moment overshoots there as SGD's momentum does (the regression
# with Adam at 1%: 7.6x DDP's error unmasked, 2.5x masked; README, "Training quality").
_ADAM_KIN = (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adamax)


def buffer_name(optimizer) -> Optional[str]:
    """The optimizer state entry masking zeroes: SGD's ``momentum_buffer``, Adam's kin's ``exp_avg``; None for
    other optimizers (left as they are)."""
    if isinstance(optimizer, torch.optim.SGD):
        return "momentum_buffer"
    if isinstance(optimizer, _ADAM_KIN):
        return "exp_avg"
    return None


def applies(optimizer) -> bool:
    """Whether masking can apply to the optimizer (``momentum_masking=True`` is refused otherwise)."""
    return buffer_name(optimizer) is not None


def by_default(optimizer, compression) -> bool:
    """Where ``momentum_masking=None`` turns it on: SGD with a compression that holds something back (not
    Dense), Adam's kin with top-k. Adam's default, Ternary, sends at every step every element whose
    accumulated step passes a fraction of its chunk's largest (where top-k at 1% holds 99% back); masking it
    changed nothing measurable (seed 0: the LM 2.1809 -> 2.1819, the regression with Adam 0.0298 -> 0.0301,
    with AdamW 0.0208 -> 0.0202) and would cost the residual comparison's passes at every step."""
    if isinstance(optimizer, torch.optim.SGD):
        return not isinstance(compression, Dense)
    return applies(optimizer) and isinstance(compression, TopK)


class MomentumMasking:
    """Watches what each bucket sends and zeroes the optimizer's momentum where a waiting element swung back."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.key = buffer_name(optimizer)                # the state entry zeroed
        # per bucket: (its last_sent tensor, the elements sent at the last step), so that a top-k step only
        # touches what it and the step before sent (rebuilt from last_sent's +-2 after a checkpoint is loaded)
        self._sent_last: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}

    def before(self, buckets: Sequence, deltas: Sequence[torch.Tensor]) -> List[Tuple[object, Optional[torch.Tensor]]]:
        """Before the exchange. A top-k bucket's sends are read from its own message afterwards (nothing kept);
        for other compressions, residual + update, what the encoder chooses from."""
        return [(b, None if isinstance(b.compression, TopK) else b.residual + d) for b, d in zip(buckets, deltas)]

    @torch.no_grad()
    def after(self, watched: Sequence[Tuple[object, Optional[torch.Tensor]]], results: Sequence) -> None:
        """After a completed exchange (``results``: (bucket, ExchangeResult) pairs): what each bucket sent, as
        (indices, signs), from its own top-k message (a step that fell back to a dense all-reduce is left out),
        or, for other compressions, where the kept value differs from what the encoder chose from (the encoder
        adds residual and update as :meth:`before` does, bit for bit, and keeps that sum where it sends nothing)."""
        messages = {id(b): r.message for b, r in results}
        for b, chosen_from in watched:
            if b.last_sent is None:
                b.last_sent = torch.zeros(b.n, dtype=torch.int8, device=b.device)
            if chosen_from is None:
                message = messages.get(id(b))
                sent = None if message is None else reference.sent_signs(message, b.n)
                if sent is not None:
                    self._record(b, *sent)
                continue
            sent = (b.residual != chosen_from).nonzero().view(-1)
            self._record(b, sent, torch.sign(chosen_from[sent]).to(torch.int8))

    def _record(self, b, idx: torch.Tensor, sign: torch.Tensor) -> None:
        """Elements ``idx`` (ascending) were sent with ``sign``: mask those that waited and swung back, then note
        the send. index_select / index_copy_ rather than advanced indexing: a few times faster on the CPU, and
        this runs at every compressed step."""
        last = b.last_sent
        cached = self._sent_last.get(id(b))
        before = cached[1] if cached is not None and cached[0] is last else (last.abs() == 2).nonzero().view(-1)
        # waited (|last| is 1), and the other way
        swung = torch.masked_select(idx, last.index_select(0, idx) * sign == -1)
        last.index_copy_(0, before, last.index_select(0, before).sign())  # sent at the previous step -> before it
        last.index_copy_(0, idx, sign * 2)
        self._sent_last[id(b)] = (last, idx)
        if swung.numel():
            self._mask(b, swung)

    def _mask(self, b, swung: torch.Tensor) -> None:
        """Zeroes the momentum of the elements ``swung`` (ascending bucket positions), parameter by parameter."""
        state = self.optimizer.state
        bounds = torch.tensor(b.offsets + [b.n], dtype=swung.dtype, device=swung.device)
        cuts = torch.searchsorted(swung, bounds).tolist()
        for p, off, lo, hi in zip(b.params, b.offsets, cuts, cuts[1:]):
            st = state.get(p)
            buf = st.get(self.key) if st else None
            if buf is not None and hi > lo:
                buf.view(-1).index_fill_(0, swung[lo:hi] - off, 0)
