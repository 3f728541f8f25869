"""SGD's momentum masked where an element that waited in the residual swung back (gradshare.momentum_masking)."""
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import gradshare
from gradshare import momentum_masking, ops, reference
from gradshare.compression import Dense, TopK
from gradshare.thresholds import TargetSparsity
from gradshare.sharing import Bucket, Sharing
from gradshare.workers import run_local
from tiny_model import restore, snapshot


def _bucket_and_sgd():
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([a, b], lr=0.1, momentum=0.9)
    for p in (a, b):
        opt.state[p]["momentum_buffer"] = torch.ones(2)
    return Bucket(0, [a, b], Dense()), opt, (a, b)      # not top-k: sends read from the residual


def _exchange(masking, bucket, update, sent):
    """One exchange as the encoder makes it: residual + update, all of it sent where ``sent``, kept elsewhere."""
    watched = masking.before([bucket], [update])
    chosen_from = watched[0][1]
    bucket.residual = torch.where(torch.tensor(sent), torch.full_like(chosen_from, 1e-3), chosen_from)
    masking.after(watched, [])


class _Sent:
    def __init__(self, message):
        self.message = message


@pytest.mark.parametrize("values", ["int8", "bf16"])
def test_a_topk_message_names_the_sends_the_residual_shows(values):
    # The top-k path reads each step's sends from the rank's own message and touches only them; the general
    # path compares the kept residual with residual + update. Same masks, same signs, step after step.
    torch.manual_seed(0)
    sets = [[nn.Parameter(torch.zeros(300)), nn.Parameter(torch.zeros(212))] for _ in range(2)]
    opts = [torch.optim.SGD(ps, lr=0.1, momentum=0.9) for ps in sets]
    for opt, ps in zip(opts, sets):
        for p in ps:
            opt.state[p]["momentum_buffer"] = torch.ones(p.numel())
    by_message, by_residual = Bucket(0, sets[0], TopK()), Bucket(0, sets[1], Dense())
    masks = [momentum_masking.MomentumMasking(o) for o in opts]
    residual = torch.zeros(512)
    for step in range(40):
        update = torch.randn(512) * (1 + (step % 3))
        kept = torch.empty(512)
        message = ops.encode_topk(update, residual, 16, chunk=128, values=values, kept=kept)
        watched = masks[0].before([by_message], [update])
        assert watched[0][1] is None                                  # nothing copied for top-k
        by_message.residual = kept.clone()
        masks[0].after(watched, [(by_message, _Sent(message))])
        by_residual.residual = residual.clone()
        watched = masks[1].before([by_residual], [update])
        by_residual.residual = kept.clone()
        masks[1].after(watched, [])
        residual = kept
        assert torch.equal(by_message.last_sent, by_residual.last_sent), step
    buffers = [torch.cat([o.state[p]["momentum_buffer"] for p in ps]) for o, ps in zip(opts, sets)]
    assert torch.equal(buffers[0], buffers[1])
    assert 0 < int((buffers[0] == 0).sum()) < 512                     # some elements swung back, not all
    assert set(by_message.last_sent.unique().tolist()) <= {-2, -1, 0, 1, 2}


@pytest.mark.parametrize("values", ["int8", "bf16"])
@pytest.mark.parametrize("n,chunk,k", [(1000, 128, 5), (70001, 4096, 82), (5, 4096, 1), (100, 16, 0)])
def test_the_sends_read_from_a_message_are_what_decoding_it_moves(values, n, chunk, k):
    # Chunks of zeros but one (selected zeros send nothing), values that round to zero beside a large one
    # (8-bit), a shorter last chunk: the indices and signs read are the elements decoding moves, and their way.
    torch.manual_seed(n)
    update = torch.randn(n)
    update[:chunk] = 0.0
    update[min(3, n - 1)] = 2.0
    update[chunk:2 * chunk] *= 1e-4
    update[min(chunk + 1, n - 1)] = -50.0
    message = ops.encode_topk(update, torch.zeros(n), k, chunk=chunk, values=values)
    moved = torch.zeros(n)
    ops.decode(moved, message)
    idx, sign = reference.sent_signs(message, n)
    assert torch.equal(idx, moved.nonzero().view(-1))
    assert sign.dtype == torch.int8 and torch.equal(sign, moved[idx].sign().to(torch.int8))
    assert torch.equal(reference.sent_mask(message, n)[idx], torch.ones(idx.numel(), dtype=torch.bool))


def test_masks_only_the_momentum_of_elements_that_waited_and_swung_back():
    bucket, opt, (a, b) = _bucket_and_sgd()
    masking = momentum_masking.MomentumMasking(opt)
    buffers = lambda: torch.cat([opt.state[a]["momentum_buffer"], opt.state[b]["momentum_buffer"]]).tolist()
    # step 1: elements 0, 1 and 3 sent, upwards; element 2 waits
    _exchange(masking, bucket, torch.tensor([1.0, 1.0, 0.5, 1.0]), [True, True, False, True])
    assert buffers() == [1, 1, 1, 1] and bucket.last_sent.tolist() == [2, 2, 0, 2]
    # step 2: element 0 sent again, the other way: sent at consecutive steps, left alone; the others wait
    _exchange(masking, bucket, torch.tensor([-3.0, 0.0, 0.1, 0.0]), [True, False, False, False])
    assert buffers() == [1, 1, 1, 1] and bucket.last_sent.tolist() == [-2, 1, 0, 1]
    # step 3: element 1 sent the other way after waiting: masked; element 3 the same way: left; element 2's first
    _exchange(masking, bucket, torch.tensor([-1.0, -4.0, 0.1, 2.0]), [True, True, True, True])
    assert buffers() == [1, 0, 1, 1] and bucket.last_sent.tolist() == [-2, -2, 2, 2]


@pytest.mark.parametrize("kind", [torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam,
                                  torch.optim.Adamax])
def test_adams_first_moment_is_masked_where_sgds_momentum_would_be(kind):
    a = nn.Parameter(torch.zeros(4))
    opt = kind([a], lr=0.1)
    opt.state[a].update(exp_avg=torch.ones(4), step=torch.tensor(3.0))
    opt.state[a]["exp_avg_sq" if kind is not torch.optim.Adamax else "exp_inf"] = torch.full((4,), 2.0)
    bucket, masking = Bucket(0, [a], Dense()), momentum_masking.MomentumMasking(opt)
    _exchange(masking, bucket, torch.tensor([1.0, 1.0, 0.5, 1.0]), [True, True, False, True])
    _exchange(masking, bucket, torch.tensor([0.0, 0.0, 0.1, 0.0]), [False, False, False, False])
    # element 1 sent the other way after waiting: its first moment zeroed; element 3 the same way: left
    _exchange(masking, bucket, torch.tensor([0.0, -4.0, 0.1, 2.0]), [False, True, False, True])
    assert opt.state[a]["exp_avg"].tolist() == [1, 0, 1, 1]
    assert opt.state[a]["exp_avg_sq" if kind is not torch.optim.Adamax else "exp_inf"].tolist() == [2.0] * 4


def test_on_where_it_applies_and_refused_where_asked_for_and_it_cannot_apply():
    p = [nn.Parameter(torch.zeros(3))]
    sgd = torch.optim.SGD(p, lr=0.1, momentum=0.9)
    # What waits in the residual (error_feedback="buffer"): on by default for SGD
    buffer = dict(error_feedback="buffer")
    assert Sharing(optimizer=sgd, mode="updates", **buffer).masking is not None
    assert Sharing(optimizer=sgd, mode="updates", momentum_masking=False, **buffer).masking is None
    assert gradshare.SharedOptimizer(sgd, link=None, **buffer).sharing.masking is not None
    assert gradshare.ThresholdState(optimizer=sgd, **buffer).sharing.masking is not None
    # What waits in each rank's model (the defaults): its gradients see what waits, nothing stale to mask
    assert Sharing(optimizer=sgd, mode="updates").masking is None
    assert gradshare.ThresholdState(optimizer=sgd).sharing.masking is None
    assert gradshare.SharedOptimizer(sgd, compression=TopK(0.01), link=None).sharing.masking is None
    # Not where it cannot apply: an optimizer without a momentum it knows, gradients shared, a step late
    off = (dict(optimizer=torch.optim.Adagrad(p), mode="updates"), dict(optimizer=sgd, mode="gradients"),
           dict(optimizer=sgd, mode="updates", delay=1, link=None))
    for kwargs in off:
        assert Sharing(**kwargs).masking is None
        with pytest.raises(ValueError, match="momentum_masking"):
            Sharing(momentum_masking=True, **kwargs)
    # With nothing held back nothing waits, so there is nothing to mask: off unless asked for (a no-op then)
    assert Sharing(optimizer=sgd, mode="updates", compression=Dense()).masking is None
    assert Sharing(optimizer=sgd, mode="updates", compression=Dense(), momentum_masking=True).masking is not None
    with pytest.raises(ValueError, match="momentum_masking: expected None"):
        Sharing(optimizer=sgd, mode="updates", momentum_masking="yes")
    with pytest.raises(ValueError, match="momentum_masking=True masks the momentum of torch.optim.SGD or Adam's"):
        gradshare.ThresholdState(optimizer=torch.optim.RMSprop(p), momentum_masking=True)
    assert gradshare.ThresholdState().sharing.masking is None                            # gradients mode
    # Adam's kin: their first moment, by default with top-k (elements wait long), not with their Ternary
    for adam in (torch.optim.Adam(p), torch.optim.AdamW(p), torch.optim.NAdam(p), torch.optim.RAdam(p),
                 torch.optim.Adamax(p)):
        assert Sharing(optimizer=adam, mode="updates", **buffer).masking is None         # Ternary()
        masked = Sharing(optimizer=adam, mode="updates", compression=TargetSparsity(0.01), **buffer).masking
        assert masked is not None and masked.key == "exp_avg"
        assert Sharing(optimizer=adam, mode="updates", momentum_masking=True).masking is not None
    assert gradshare.SharedOptimizer(torch.optim.AdamW(p), compression=TopK(0.01), link=None, **buffer).sharing.masking
    adam, sgd2 = torch.optim.Adam([nn.Parameter(torch.zeros(2))]), torch.optim.SGD(p, lr=0.1, momentum=0.9)
    for asked, masked in ((None, [False, True]), (True, [True, True]), (False, [False, False])):
        state = gradshare.ThresholdState(optimizer=[adam, sgd2], momentum_masking=asked, link=None, **buffer)
        assert [sh.masking is not None for sh in state.sharings] == masked, asked
    ada = torch.optim.Adagrad([nn.Parameter(torch.zeros(2))])
    state = gradshare.ThresholdState(optimizer=[ada, sgd2], momentum_masking=True, link=None)
    assert [sh.masking is not None for sh in state.sharings] == [False, True]          # the ones it applies to


def test_the_signs_last_sent_round_trip_and_a_damaged_entry_is_refused():
    params = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2))]
    sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    sharing = Sharing(optimizer=sgd, mode="updates", momentum_masking=True, link=None)
    (bucket,) = sharing.build(params)
    bucket.last_sent = torch.tensor([2, -1, 0, 1, -2], dtype=torch.int8)
    saved = sharing.state_dict()
    bucket.last_sent = None
    sharing.load_state_dict(saved)
    assert bucket.last_sent.tolist() == [2, -1, 0, 1, -2]
    for bad in (torch.zeros(4, dtype=torch.int8), [2, -1, 0, 1, -2]):
        saved["buckets"][0]["last sent"] = bad
        with pytest.raises(ValueError, match="signs last sent should be a tensor of 5 elements"):
            sharing.load_state_dict(saved)
    assert bucket.last_sent.tolist() == [2, -1, 0, 1, -2]          # nothing loaded from a refused checkpoint


# ------------------------------------------------------------------------------------------ training
def _regression_batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(32, 16, generator=g)
    w = torch.randn(16, 4, generator=torch.Generator().manual_seed(7))
    return x, x @ w + 0.1 * torch.randn(32, 4, generator=g)


def _regression_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def _fit(kind, steps=300, start=0, ckpt=None, save_at=None, compression=None):
    """SGD with momentum on a least-squares fit with little gradient noise: DDP, or the hook sharing updates
    (TopK 2%, compressed every step, what waits in the residual) with its default masking (``masked``), with
    momentum_masking=True (``asked``) or with momentum_masking=False (``plain``); or the hook at its defaults
    (``defaults``: what waits in each rank's model, the top 5% as signs, no masking)."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    model = _regression_net()
    net = DDP(model)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    state = None
    if kind == "defaults":
        state = gradshare.ThresholdState(optimizer=opt, link=None)
        net.register_comm_hook(state, gradshare.threshold_hook)
    elif kind != "ddp":
        state = gradshare.ThresholdState(optimizer=opt, compression=compression or TopK(0.02), link=None,
                                         momentum_masking={"masked": None, "asked": True}.get(kind, False),
                                         error_feedback="buffer")
        net.register_comm_hook(state, gradshare.threshold_hook)
    objects = (model, opt) + ((state,) if state is not None else ())
    if ckpt is not None:
        restore(ckpt[rank], *objects)
    losses, saved = [], None
    for step in range(start, steps):
        if step == save_at:
            saved = snapshot(*objects)
        x, y = _regression_batch(rank, step)
        loss = F.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    gradshare.verify_replicas(model)
    last = None if state is None else [None if b.last_sent is None else b.last_sent.clone()
                                       for b in state.sharing.buckets]
    return {"loss": float(np.mean(losses[-50:])), "saved": saved, "last_sent": last,
            "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()}


def _four():
    return [_fit(k) for k in ("ddp", "masked", "plain", "defaults")]


@pytest.mark.slow
def test_low_noise_regression_with_sgd_momentum_trains_as_ddp_does():
    ddp, masked, plain, defaults = run_local(_four, 2, timeout=400)[0]
    # Without the masking the waiting elements swing and the loss stalls far above DDP's (about 100x here).
    assert plain["loss"] > 5 * ddp["loss"], (ddp["loss"], plain["loss"])
    assert masked["loss"] < 2 * ddp["loss"], (ddp["loss"], masked["loss"])
    assert any(t is not None and bool((t != 0).any()) for t in masked["last_sent"])
    assert all(t is None for t in plain["last_sent"])
    # What waits kept in each rank's model: its gradient sees it, so nothing swings and nothing needs masking
    assert defaults["loss"] < 2 * ddp["loss"], (ddp["loss"], defaults["loss"])
    assert all(t is None for t in defaults["last_sent"])


def _save(steps, save_at):
    return _fit("masked", steps, save_at=save_at)


def _resume(steps, start, ckpts):
    return _fit("masked", steps, start=start, ckpt=ckpts)


@pytest.mark.slow
def test_a_checkpoint_holds_the_signs_last_sent_and_resumes_exactly():
    full = run_local(_save, 2, (80, 40), timeout=400)
    resumed = run_local(_resume, 2, (80, 40, [r["saved"] for r in full]), timeout=400)
    for a, b in zip(full, resumed):
        assert np.array_equal(a["params"], b["params"])
        assert all(torch.equal(u, v) for u, v in zip(a["last_sent"], b["last_sent"]))


def _dense_pair():
    return [_fit(k, steps=40, compression=Dense()) for k in ("asked", "plain")]


@pytest.mark.slow
def test_with_nothing_held_back_nothing_is_masked():
    # Every element whose update is not zero is sent every step: none waits, so the steps stay synchronous SGD's,
    # bit for bit. (Elements of units that never receive a gradient are never sent: 0.)
    masked, plain = run_local(_dense_pair, 2, timeout=400)[0]
    assert np.array_equal(masked["params"], plain["params"])
    last = torch.cat(masked["last_sent"])
    assert not bool((last.abs() == 1).any()) and float((last.abs() == 2).float().mean()) > 0.5
