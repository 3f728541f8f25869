import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradshare
from gradshare.averaging import ParameterAveraging
from gradshare.costmodel import ring_allreduce_bytes
from gradshare.models import SmallCNN
from gradshare.workers import run_local
from tiny_model import GroupAdaptive

pytestmark = pytest.mark.slow


def _model():
    torch.manual_seed(0)
    return SmallCNN(image_size=8)


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.rand(16, 1, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g)


def _train(model, opt, rank, steps):
    dev = next(model.parameters()).device
    for s in range(steps):
        x, y = (t.to(dev) for t in _batch(rank, s))
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _flat(model, opt=None):
    ts = [p.detach().reshape(-1) for p in model.parameters()]
    if opt is not None:
        for st in opt.state.values():
            ts += [v.reshape(-1) for k, v in sorted(st.items()) if torch.is_tensor(v) and v.dim() > 0]
    return torch.cat(ts)


def _gather(t):
    t = t.contiguous()
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def _bitwise_after_round(opt_name, device="cpu"):
    rank = dist.get_rank()
    model = _model().to(device)
    inner = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
             "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
             "group_adaptive": lambda ps: GroupAdaptive(ps, lr=0.1)}[opt_name](model.parameters())
    pa = ParameterAveraging(model, inner, frequency=3)
    _train(model, pa, rank, 2)                      # no round yet: replicas differ
    before = _gather(_flat(model, inner))
    _train(model, pa, rank, 1)                      # step 3: a round
    after = _gather(_flat(model, inner))
    return (not torch.equal(before[0], before[1]), torch.equal(after[0], after[1]),
            pa.rounds, pa.bytes_sent, pa.dense_bytes, after[0].numel(), [g.get("d") for g in inner.param_groups])


@pytest.mark.parametrize("opt_name", ["sgd", "adam", "group_adaptive"])
def test_ranks_bitwise_identical_after_a_round(results, opt_name):
    out = [r[f"bitwise_{opt_name}"] for r in results]
    assert out[0][-1] == out[1][-1]                 # a value adapted in the param_groups (D-Adaptation's d) too
    for differed, same, rounds, sent, dense, numel, _ in out:
        assert differed, "replicas should differ between rounds"
        assert same, "replicas (params and optimizer state) must be bitwise identical after a round"
        assert rounds == 1
        assert sent == ring_allreduce_bytes(2, numel)   # one flat buffer: params + optimizer state
        n_params = sum(p.numel() for p in _model().parameters())
        assert dense == 3 * ring_allreduce_bytes(2, n_params)


def _frequency1_equals_gradient_averaging(steps):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    pa = ParameterAveraging(model, torch.optim.SGD(model.parameters(), lr=0.1), frequency=1)
    _train(model, pa, rank, steps)
    # reference in one process: synchronous SGD on the mean of every rank's gradient
    ref = _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for s in range(steps):
        grads = []
        for r in range(world):
            ref.zero_grad()
            x, y = _batch(r, s)
            nn.functional.cross_entropy(ref(x), y).backward()
            grads.append([p.grad.clone() for p in ref.parameters()])
        for i, p in enumerate(ref.parameters()):
            p.grad = sum(g[i] for g in grads) / world
        ref_opt.step()
    return (_flat(model) - _flat(ref)).abs().max().item(), (_flat(_model()) - _flat(ref)).abs().max().item()


def test_frequency_1_sgd_equals_synchronous_gradient_averaging(results):
    for diff, moved in [r["frequency1"] for r in results]:
        assert moved > 1e-3            # training moved the parameters noticeably
        assert diff < 1e-5             # ... and the same way as gradient averaging, up to float rounding


def _schedule_and_options():
    rank = dist.get_rank()
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    pa = ParameterAveraging(model, inner, frequency=4, average_optimizer_state=False, warmup_steps=2)
    averaged = []
    for s in range(10):
        _train(model, pa, rank + 10 * s, 1)
        averaged.append(pa.last_averaged)
    params = _gather(_flat(model))
    momentum = _gather(torch.cat([st["momentum_buffer"].reshape(-1) for st in inner.state.values()]))
    sd = pa.state_dict()
    model2 = _model()
    pa2 = ParameterAveraging(model2, torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9), frequency=4)
    pa2.load_state_dict(sd)
    return (averaged, torch.equal(params[0], params[1]), torch.equal(momentum[0], momentum[1]),
            pa2.step_count, pa2.rounds)


def test_warmup_schedule_and_optimizer_state_option(results):
    for averaged, params_same, momentum_same, steps, rounds in [r["schedule"] for r in results]:
        # warmup: steps 1 and 2 average; then every 4 steps after warmup: steps 6 and 10
        assert averaged == [True, True, False, False, False, True, False, False, False, True]
        assert params_same                # step 10 was a round
        assert not momentum_same          # optimizer state left alone when asked
        assert steps == 10 and rounds == 4


def _initial_broadcast():
    torch.manual_seed(dist.get_rank())    # different initialisations on purpose
    model = SmallCNN()
    ParameterAveraging(model, torch.optim.SGD(model.parameters(), lr=0.1))
    flats = _gather(_flat(model))
    return torch.equal(flats[0], flats[1])


def test_construction_broadcasts_rank0_parameters(results):
    assert [r["broadcast"] for r in results] == [True, True]


def _nesterov(ps):
    return torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)


def _dense_pseudo_gradient_equals_averaging():
    # An outer SGD step of lr 1 on the mean change is the mean of the parameters (up to float rounding).
    rank = dist.get_rank()
    a, b = _model(), _model()
    pa = ParameterAveraging(a, torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9), frequency=3,
                            average_optimizer_state=False)
    pb = ParameterAveraging(b, torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9), frequency=3,
                            outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0))
    _train(a, pa, rank, 6)
    _train(b, pb, rank, 6)
    return (_flat(a) - _flat(b)).abs().max().item(), pb.rounds, pb.bytes_sent, pa.bytes_sent


def _resumes_mid_round_exactly(make, model, pa, rank):
    # a checkpoint one step into a round, restored into a new model and wrapper, continues bit for bit
    _train(model, pa, rank + 7, 1)
    sd = {"model": copy.deepcopy(model.state_dict()), "pa": copy.deepcopy(pa.state_dict())}
    _train(model, pa, rank + 9, 4)                                      # crosses a round
    m2, _, pa2 = make()
    m2.load_state_dict(sd["model"])
    pa2.load_state_dict(sd["pa"])
    _train(m2, pa2, rank + 9, 4)
    return torch.equal(_flat(model), _flat(m2)) and pa2.rounds == pa.rounds, sd


def _sparse_pseudo_gradient(mid_round_resume, inner_name="adam"):
    # SparseLoCo-like: top-k of a decayed error-feedback pseudo-gradient, outer Nesterov, inner Adam (or
    # RMSprop with momentum, whose rescaling keeps state of gradshare's: second_moment.GlobalBatchStep).
    rank = dist.get_rank()

    def make(m=None):
        m = _model() if m is None else m
        inner = (torch.optim.Adam(m.parameters(), lr=1e-2) if inner_name == "adam" else
                 torch.optim.RMSprop(m.parameters(), lr=1e-3, momentum=0.9))
        return m, inner, ParameterAveraging(m, inner, frequency=3, outer_optimizer=_nesterov,
                                            compression=gradshare.TopK(0.05, warmup_steps=0), residual_decay=0.9)
    model, inner, pa = make()
    _train(model, pa, rank, 2)
    before = _gather(_flat(model))
    _train(model, pa, rank, 1)                                          # step 3: a round
    after, state = _gather(_flat(model)), _gather(_flat(model, inner))
    outer_state = _gather(torch.cat([st["momentum_buffer"].reshape(-1) for st in pa.outer.state.values()]))
    residual = pa.sharing.buckets[0].residual.abs().sum().item()
    out = {"differed": not torch.equal(before[0], before[1]), "same": torch.equal(after[0], after[1]),
           "inner_local": not torch.equal(state[0], state[1]), "outer_same": torch.equal(*outer_state),
           "residual": residual, "sent": pa.bytes_sent, "dense_round": ring_allreduce_bytes(2, after[0].numel())}
    if mid_round_resume:
        out["resume_exact"], sd = _resumes_mid_round_exactly(make, model, pa, rank)
        # The model loaded first, then wrapped: the initial broadcast replaces rank 1's own mid-round model
        # with rank 0's, which load_state_dict says (on the rank that lost its own).
        m3 = _model()
        m3.load_state_dict(sd["model"])
        _, _, pa3 = make(m3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pa3.load_state_dict(sd["pa"])
        out["warned_wrong_order"] = any("replaced by rank 0's" in str(w.message) for w in caught)
    return out


def _model_error_feedback(values="int8", chunk=65536):
    # error_feedback="model": what a round does not send stays in the rank's own model, so a round keeps the
    # mean of the ranks' models where it was (no progress lost) and average() ends with identical replicas.
    # values="sign": the same with the top entries sent as +-scale (format 7); chunk=None: each bucket one chunk.
    rank = dist.get_rank()

    def make(m=None):
        m = _model() if m is None else m
        inner = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)    # its steps as they are (no rescaling)
        return m, inner, ParameterAveraging(m, inner, frequency=3, error_feedback="model",
                                            compression=gradshare.TopK(0.05, warmup_steps=0, values=values,
                                                                       chunk=chunk))
    model, inner, pa = make()
    ends = []                                       # the rank's model after each inner step, before any round
    inner.register_step_post_hook(lambda *a: ends.append(_flat(model).clone()))
    _train(model, pa, rank, 3)                      # step 3: a round
    b = pa.sharing.buckets
    snapshot = torch.cat([x.snapshot for x in b])
    kept = torch.cat([x.residual for x in b])
    models, snapshots = _gather(_flat(model)), _gather(snapshot)
    out = {"global_same": torch.equal(*snapshots), "models_differ": not torch.equal(*models),
           "model_is_global_minus_kept": torch.equal(_flat(model), snapshot - kept),
           "mean_kept": (sum(_gather(ends[-1])) / 2 - sum(models) / 2).abs().max().item(),
           "kept": kept.abs().sum().item(), "sent": pa.bytes_sent,
           "dense_round": ring_allreduce_bytes(2, snapshot.numel())}
    out["resume_exact"], _ = _resumes_mid_round_exactly(make, model, pa, rank)
    before = sum(_gather(_flat(model))) / 2
    sent = pa.bytes_sent
    pa.average()                                    # the whole change, float32: identical replicas
    after = _gather(_flat(model))
    out["average_same"] = torch.equal(*after)
    out["average_mean_kept"] = (after[0] - before).abs().max().item()
    out["average_sent"] = pa.bytes_sent - sent
    out["average_residual"] = sum(x.residual.abs().sum().item() for x in b)
    return out


def _model_error_feedback_skips_a_nonfinite_round(nonfinite="skip"):
    # nonfinite="skip": a round whose change holds a NaN on one rank is dropped on every rank, and each rank's
    # model goes back to its own start of the round (the mean result minus what it kept), finite; "raise": the
    # same, and the round raises NonFiniteStepError on every rank
    rank = dist.get_rank()
    model = _model()
    pa = ParameterAveraging(model, torch.optim.SGD(model.parameters(), lr=0.1), frequency=3, nonfinite=nonfinite,
                            compression=gradshare.TopK(0.05, warmup_steps=0), error_feedback="model")
    _train(model, pa, rank, 3)                                          # a round: something kept back
    b = pa.sharing.buckets[0]
    start = (b.snapshot - b.residual).clone()
    snapshot, rounds = b.snapshot.clone(), pa.rounds
    _train(model, pa, rank, 2)
    if rank == 1:
        with torch.no_grad():
            next(model.parameters()).view(-1)[0] = float("nan")
    raised = False
    try:
        _train(model, pa, rank, 1)                                      # the round: dropped everywhere
    except gradshare.comm.NonFiniteStepError:
        raised = True
    if nonfinite == "raise":
        return {"raised": raised, "back_to_start": torch.equal(_flat(model), start),
                "snapshot_kept": torch.equal(b.snapshot, snapshot)}
    return {"skipped": pa.sharing.step_skipped, "back_to_start": torch.equal(_flat(model), start),
            "snapshot_kept": torch.equal(b.snapshot, snapshot), "kept_back": b.residual.abs().sum().item() > 0,
            "rounds": pa.rounds - rounds}


def _all_checks():
    # One group runs every check (starting worker processes is the slow part).
    return {"bitwise_sgd": _bitwise_after_round("sgd"), "bitwise_adam": _bitwise_after_round("adam"),
            "bitwise_group_adaptive": _bitwise_after_round("group_adaptive"),
            "frequency1": _frequency1_equals_gradient_averaging(5), "schedule": _schedule_and_options(),
            "broadcast": _initial_broadcast(), "dense_pseudo": _dense_pseudo_gradient_equals_averaging(),
            "sparse_pseudo": _sparse_pseudo_gradient(True),
            "sparse_pseudo_rmsprop": _sparse_pseudo_gradient(True, "rmsprop"),
            "model_error_feedback": _model_error_feedback(),
            "model_error_feedback_sign": _model_error_feedback("sign"),
            "model_error_feedback_whole_bucket": _model_error_feedback("sign", chunk=None),
            "model_error_feedback_skip": _model_error_feedback_skips_a_nonfinite_round(),
            "model_error_feedback_raise": _model_error_feedback_skips_a_nonfinite_round("raise")}


def test_outer_sgd_of_lr_1_on_the_dense_pseudo_gradient_is_parameter_averaging(results):
    for diff, rounds, sent, classic_sent in [r["dense_pseudo"] for r in results]:
        assert rounds == 2
        assert diff < 1e-5
        assert sent == classic_sent          # parameters only either way (no optimizer state averaged)


@pytest.mark.parametrize("key", ["sparse_pseudo", "sparse_pseudo_rmsprop"])
def test_sparse_pseudo_gradient_keeps_replicas_identical_and_resumes_exactly(results, key):
    for r in [r[key] for r in results]:
        assert r["differed"] and r["same"], "parameters must be bitwise identical after a round"
        assert r["inner_local"], "the inner optimizer's state stays on its rank"
        assert r["outer_same"], "the outer optimizer's state is the same on every rank"
        assert r["residual"] > 0, "what top-k did not send waits in the residual"
        assert 0 < r["sent"] < r["dense_round"] / 5
        assert r["resume_exact"]
    assert [r[key]["warned_wrong_order"] for r in results] == [False, True]   # rank 1's model was replaced


@pytest.mark.parametrize("key", ["model_error_feedback", "model_error_feedback_sign",
                                 "model_error_feedback_whole_bucket"])
def test_error_feedback_in_the_model_keeps_the_ranks_mean_and_average_merges_it(results, key):
    for r in [r[key] for r in results]:
        assert r["global_same"], "the round's mean result (the snapshot) is the same on every rank"
        assert r["models_differ"] and r["kept"] > 0, "each rank's model keeps what it did not send"
        assert r["model_is_global_minus_kept"]
        assert r["mean_kept"] < 1e-6, "a round moves no rank's progress out of the ranks' mean model"
        assert 0 < r["sent"] < r["dense_round"] / 5
        assert r["resume_exact"]
        assert r["average_same"], "average() ends with bitwise-identical replicas"
        assert r["average_mean_kept"] < 1e-6 and r["average_residual"] == 0
        assert r["average_sent"] >= r["dense_round"]
    assert results[0][key]["mean_kept"] == results[1][key]["mean_kept"]


def test_error_feedback_in_the_model_drops_a_nonfinite_round_back_to_each_ranks_own_start(results):
    for r in [r["model_error_feedback_skip"] for r in results]:
        assert r["skipped"] and r["snapshot_kept"] and r["kept_back"] and r["rounds"] == 1
        assert r["back_to_start"], "the rank's model is its own start of the round: the mean result minus what it kept"
    for r in [r["model_error_feedback_raise"] for r in results]:
        assert r["raised"] and r["snapshot_kept"]
        assert r["back_to_start"], "a round that raises leaves each rank at its own start of the round too"


@pytest.fixture(scope="module")
def results():
    return run_local(_all_checks, 2, timeout=300)


def test_single_process_without_group_and_argument_checks():
    model = _model()
    before = copy.deepcopy(model)
    pa = ParameterAveraging(model, torch.optim.SGD(model.parameters(), lr=0.1), frequency=1)
    _train(model, pa, 0, 2)
    assert pa.world_size == 1 and pa.rounds == 2 and pa.bytes_sent == 0
    assert not torch.equal(_flat(model), _flat(before))
    with pytest.raises(ValueError, match="frequency"):
        ParameterAveraging(model, torch.optim.SGD(model.parameters(), lr=0.1), frequency=0)


def test_pseudo_gradient_on_one_process_and_argument_checks():
    # One rank: nothing is sent; an outer optimizer still applies the rank's own change.
    def run(**kw):
        model = _model()
        pa = ParameterAveraging(model, torch.optim.SGD(model.parameters(), lr=0.1), frequency=2, **kw)
        _train(model, pa, 0, 4)
        return _flat(model), pa
    plain, _ = run()
    sparse, pa = run(compression=gradshare.TopK(0.01, warmup_steps=0))
    assert torch.equal(plain, sparse) and pa.rounds == 2 and pa.bytes_sent == 0
    outer, pa = run(outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0, momentum=0.9))
    assert pa.rounds == 2 and not torch.allclose(plain, outer)   # momentum 0.9 on the second round's change
    lr1, _ = run(outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0))
    assert torch.allclose(plain, lr1, atol=1e-6)
    # weights loaded after construction are the starting point, not a change to share
    model, pretrained = _model(), _model()
    with torch.no_grad():
        for p in pretrained.parameters():
            p.add_(1.0)
    pa = ParameterAveraging(model, torch.optim.SGD(model.parameters(), lr=0.0), frequency=1,
                            outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9))
    model.load_state_dict(pretrained.state_dict())
    _train(model, pa, 0, 2)
    assert torch.equal(_flat(model), _flat(pretrained))          # lr 0: no change, nothing applied
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="average_optimizer_state"):
        ParameterAveraging(model, sgd, compression="dense", average_optimizer_state=True)
    with pytest.raises(TypeError, match="callable"):
        ParameterAveraging(model, sgd, outer_optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
    with pytest.raises(ValueError, match="residual_decay"):
        ParameterAveraging(model, sgd, compression="dense", residual_decay=0.0)
    with pytest.raises(ValueError, match="error_feedback='model'.*compression="):
        ParameterAveraging(model, sgd, outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0), error_feedback="model")
    with pytest.raises(ValueError, match="'buffer' or 'model'"):
        ParameterAveraging(model, sgd, compression=gradshare.TopK(0.1), error_feedback="models")
    with pytest.raises(ValueError, match="local steps"):
        gradshare.sharing.Sharing(gradshare.TopK(0.1), optimizer=sgd, mode="gradients", error_feedback="model")
    # one rank: nothing is kept back, the model trains as without error feedback
    sparse_model, _ = run(compression=gradshare.TopK(0.01, warmup_steps=0), error_feedback="model")
    assert torch.equal(plain, sparse_model)
    with pytest.raises(ValueError, match="pseudo-gradient"):
        ParameterAveraging(model, sgd).load_state_dict(ParameterAveraging(model, sgd, compression="dense").state_dict())


def _bitwise_on_cuda():
    torch.cuda.set_device(dist.get_rank())
    return _bitwise_after_round("adam", device=f"cuda:{dist.get_rank()}")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_bitwise_identical_on_nccl():
    for differed, same, rounds, *_ in run_local(_bitwise_on_cuda, 2, backend="nccl", timeout=300):
        assert differed and same and rounds == 1


# -- another optimizer stepping other parameters of the model, before ParameterAveraging does -----------------
def _second_optimizer_first(compression):
    import warnings
    warnings.simplefilter("ignore")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    head = torch.optim.SGD(model[2].parameters(), lr=0.05, momentum=0.9)
    kw = {"outer_optimizer": lambda ps: torch.optim.SGD(ps, lr=1.0)} if compression is None else {
        "compression": compression, "residual_decay": 0.9}
    pa = ParameterAveraging(model, torch.optim.AdamW(model[0].parameters(), lr=1e-2), frequency=4, **kw)
    g = torch.Generator().manual_seed(rank)
    same = []
    for step in range(12):
        x = torch.randn(32, 16, generator=g)
        pa.zero_grad(), head.zero_grad()
        nn.functional.cross_entropy(model(x), x[:, :4].argmax(1)).backward()
        head.step()                 # before pa.step(): the first round's start is held after it stepped
        pa.step()
        if pa.last_averaged:
            flat = _flat(model)
            every = [torch.empty_like(flat) for _ in range(2)]
            dist.all_gather(every, flat)
            same.append(torch.equal(every[0], every[1]))
    return same


@pytest.mark.parametrize("compression", [None, gradshare.Ternary()], ids=["diloco", "ternary"])
def test_a_round_ends_with_identical_replicas_when_another_optimizer_steps_first(compression):
    for same in run_local(_second_optimizer_first, 2, (compression,), threads=1, timeout=120):
        assert same == [True, True, True]
