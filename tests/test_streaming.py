"""Streaming rounds of ParameterAveraging's pseudo-gradient modes: fragments of the model synced in turn, and
exchanges that travel while training goes on (``fragments=``, ``overlap=``)."""
import copy

import pytest
import torch
import torch.distributed as dist

import gradshare
from gradshare.averaging import ParameterAveraging
from gradshare.workers import run_local
from test_averaging import _flat, _gather, _model, _train


def _one_rank(steps=11, **kw):
    model = _model()
    pa = ParameterAveraging(model, torch.optim.Adam(model.parameters(), lr=1e-2), frequency=4, **kw)
    _train(model, pa, 0, steps)
    pa.flush()
    return _flat(model), pa


@pytest.mark.parametrize("kw, rounds", [
    (dict(compression="dense", fragments=2), 5),              # fragment 0 after steps 4, 8; fragment 1 after 2, 6, 10
    (dict(compression="dense", overlap=2), 2),                # sent after steps 4 and 8, applied after 6 and 10
    (dict(compression="dense", fragments=2, overlap=2), 5),
    (dict(outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0), fragments=3, overlap=1), 8),
    (dict(compression=gradshare.TopK(0.05, warmup_steps=0), error_feedback="model", fragments=2, overlap=2), 5),
], ids=["fragments", "overlap", "both", "outer_lr_1", "model_feedback"])
def test_on_one_rank_the_rounds_apply_the_ranks_own_change_and_lose_no_step(kw, rounds):
    # One rank: the mean change is the rank's own, so a round must leave the parameters where training took
    # them, steps taken while the exchange travelled included (they are carried on top of the new start).
    plain, _ = _one_rank()
    streamed, pa = _one_rank(**kw)
    assert pa.rounds == rounds
    assert torch.allclose(streamed, plain, atol=1e-5, rtol=0)


def test_fragments_are_consecutive_parameters_of_about_equal_size():
    model = _mlp()          # 4160, 4160 and 650 elements: the last two layers make the third fragment
    pa = ParameterAveraging(model, torch.optim.SGD(model.parameters(), lr=0.1), frequency=6, compression="dense",
                            fragments=3)
    frags = pa._fragments
    assert [sum(b.n for b in f) for f in frags] == [4160, 4160, 650]
    assert [b for f in frags for b in f] == pa.sharing.buckets
    assert [p for b in pa.sharing.buckets for p in b.params] == list(model.parameters())
    cnn = _model()          # one layer holds most elements: still a fragment each, as long as there are parameters
    frags = ParameterAveraging(cnn, torch.optim.SGD(cnn.parameters(), lr=0.1), frequency=6, compression="dense",
                               fragments=4)._fragments
    assert len(frags) == 4 and all(frags)
    assert pa.due_fragments(2) == [1] and pa.due_fragments(4) == [2] and pa.due_fragments(6) == [0]
    assert "fragments=3" in repr(pa)


def test_streaming_arguments_are_checked():
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="fragments"):
        ParameterAveraging(model, sgd, frequency=4, compression="dense", fragments=5)
    with pytest.raises(ValueError, match="overlap"):
        ParameterAveraging(model, sgd, frequency=4, compression="dense", fragments=2, overlap=3)
    with pytest.raises(ValueError, match="pseudo-gradient"):
        ParameterAveraging(model, sgd, frequency=4, fragments=2)
    with pytest.raises(TypeError, match="fragments"):
        ParameterAveraging(model, sgd, frequency=4, compression="dense", fragments=True)
    with pytest.raises(ValueError, match="trainable parameters"):
        one = torch.nn.Linear(4, 4, bias=False)
        ParameterAveraging(one, torch.optim.SGD(one.parameters(), lr=0.1), frequency=4, compression="dense",
                           fragments=2)
    plain = ParameterAveraging(model, sgd, frequency=4, compression="dense")
    streamed = ParameterAveraging(model, sgd, frequency=4, compression="dense", fragments=2)
    with pytest.raises(ValueError, match="fragments=1, overlap=0"):
        streamed.load_state_dict(plain.state_dict())


def _nesterov(ps):
    return torch.optim.SGD(ps, lr=0.8, momentum=0.5, nesterov=True)


def _mlp():
    torch.manual_seed(0)        # layers of about equal size, so that two fragments are about equal too
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                               torch.nn.ReLU(), torch.nn.Linear(64, 10))


def _make(**kw):
    model = _mlp()
    inner = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, inner, ParameterAveraging(model, inner, frequency=4, outer_optimizer=_nesterov,
                                            compression=gradshare.TopK(0.05, warmup_steps=0), residual_decay=0.9,
                                            **kw)


def _two_ranks():
    rank = dist.get_rank()
    out = {}
    # Every step: the rounds' starting parameters (the global model) agree on every rank; the parameters agree
    # after average(), the inner optimizer's state never.
    model, inner, pa = _make(fragments=2, overlap=2)
    starts_same, rounds, sent = [], [], []
    for s in range(12):
        before = pa.bytes_sent
        _train(model, pa, rank * 100 + s, 1)
        starts_same.append(torch.equal(*_gather(torch.cat([b.snapshot for b in pa.sharing.buckets]))))
        rounds.append(pa.rounds)
        sent.append(pa.bytes_sent - before)
    mid_differs = not torch.equal(*_gather(_flat(model)))
    pa.average()
    out["schedule"] = {"starts_same": starts_same, "rounds": rounds, "sent": sent, "mid_differs": mid_differs,
                       "end_same": torch.equal(*_gather(_flat(model))),
                       "inner_local": not torch.equal(*_gather(_flat(model, inner)[_flat(model).numel():]))}
    # The bytes of one whole round, for the peak's comparison.
    model, _, whole = _make()
    _train(model, whole, rank, 4)
    out["whole_round_bytes"] = whole.bytes_sent
    # A checkpoint taken while an exchange travels resumes bit for bit.
    model, inner, pa = _make(fragments=2, overlap=2)
    _train(model, pa, rank, 5)                                   # fragment 0 sent after step 4, lands after 6
    travelling = len(pa._inflight)
    sd = {"model": copy.deepcopy(model.state_dict()), "inner": copy.deepcopy(inner.state_dict()),
          "pa": copy.deepcopy(pa.state_dict())}
    _train(model, pa, rank + 7, 7)
    m2, inner2, pa2 = _make(fragments=2, overlap=2)
    m2.load_state_dict(sd["model"])
    pa2.load_state_dict(sd["pa"])
    _train(m2, pa2, rank + 7, 7)
    out["resume"] = {"travelling": travelling, "exact": torch.equal(_flat(model, inner), _flat(m2, inner2)),
                     "rounds": (pa.rounds, pa2.rounds), "bytes": (pa.bytes_sent, pa2.bytes_sent)}
    out["model_feedback"] = _model_feedback_overlapped(rank)
    return out


def _make_model_feedback():
    model = _mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)       # its steps as they are (no rescaling)
    return model, inner, ParameterAveraging(model, inner, frequency=4, compression=gradshare.TopK(0.05, warmup_steps=0),
                                            error_feedback="model", fragments=2, overlap=2)


def _model_feedback_overlapped(rank):
    # error_feedback="model" with exchanges that travel: when a round lands, each rank's model becomes the new
    # start minus what it has not sent plus its steps since the launch, so no landing moves the mean of the
    # ranks' models (what they trained to); the starts agree on every rank, the models differ by what each kept.
    model, inner, pa = _make_model_feedback()
    stepped = []
    inner.register_step_post_hook(lambda *a: stepped.append(_flat(model).clone()))
    starts_same, mean_moved, landed = [], [], 0
    for s in range(12):
        rounds = pa.rounds
        _train(model, pa, rank * 100 + s, 1)
        landed += pa.rounds - rounds
        starts_same.append(torch.equal(*_gather(torch.cat([b.snapshot for b in pa.sharing.buckets]))))
        mean_moved.append((sum(_gather(_flat(model))) - sum(_gather(stepped[-1]))).abs().max().item() / 2)
    kept = sum(b.residual.abs().sum().item() for b in pa.sharing.buckets)
    mid_differs = not torch.equal(*_gather(_flat(model)))
    before = sum(_gather(_flat(model))) / 2
    pa.average()
    after = _gather(_flat(model))
    out = {"landed": landed, "starts_same": starts_same, "mean_moved": max(mean_moved), "kept": kept,
           "mid_differs": mid_differs, "end_same": torch.equal(*after), "end_mean_moved": (after[0] - before).abs().max().item(),
           "end_residual": sum(b.residual.abs().sum().item() for b in pa.sharing.buckets)}
    # a checkpoint taken while an exchange travels resumes bit for bit
    model, inner, pa = _make_model_feedback()
    _train(model, pa, rank, 5)
    out["travelling"] = len(pa._inflight)
    sd = {"model": copy.deepcopy(model.state_dict()), "inner": copy.deepcopy(inner.state_dict()),
          "pa": copy.deepcopy(pa.state_dict())}
    _train(model, pa, rank + 7, 7)
    m2, inner2, pa2 = _make_model_feedback()
    m2.load_state_dict(sd["model"])
    inner2.load_state_dict(sd["inner"])
    pa2.load_state_dict(sd["pa"])
    _train(m2, pa2, rank + 7, 7)
    out["resume_exact"] = torch.equal(_flat(model, inner), _flat(m2, inner2)) and pa.rounds == pa2.rounds
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_local(_two_ranks, 2, threads=1, timeout=180)


@pytest.mark.slow
def test_streaming_rounds_keep_the_global_model_identical_and_halve_the_peak(two_ranks):
    for r in two_ranks:
        s = r["schedule"]
        assert all(s["starts_same"]), "every round's start (the global model) is the same on every rank"
        # fragment 1 sent after steps 2, 6, 10 and fragment 0 after 4, 8, 12; each applied 2 steps later
        assert s["rounds"] == [0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5]
        assert s["mid_differs"] and s["end_same"] and s["inner_local"]
        # one fragment a round: the largest round sends well under a whole round's bytes
        assert 0 < max(s["sent"]) < 0.6 * r["whole_round_bytes"]


@pytest.mark.slow
def test_a_checkpoint_with_an_exchange_in_flight_resumes_bit_for_bit(two_ranks):
    for r in two_ranks:
        res = r["resume"]
        assert res["travelling"] == 1
        assert res["exact"]
        assert res["rounds"][0] == res["rounds"][1] and res["bytes"][0] == res["bytes"][1]


@pytest.mark.slow
def test_error_feedback_in_the_model_with_travelling_exchanges_keeps_the_ranks_mean(two_ranks):
    for r in [x["model_feedback"] for x in two_ranks]:
        assert r["landed"] == 5 and all(r["starts_same"])
        assert r["mean_moved"] < 1e-6, "a landing moves no rank's progress out of the ranks' mean model"
        assert r["kept"] > 0 and r["mid_differs"], "each rank's model keeps what it has not sent"
        assert r["end_same"] and r["end_mean_moved"] < 1e-6 and r["end_residual"] == 0
        assert r["travelling"] == 1 and r["resume_exact"]
