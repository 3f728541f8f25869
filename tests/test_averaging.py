import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gradshare.averaging import ParameterAveraging, allreduce_bytes
from gradshare.models import SmallCNN
from gradshare.workers import run_local

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
    inner = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if opt_name == "sgd"
             else torch.optim.Adam(model.parameters(), lr=1e-2))
    pa = ParameterAveraging(model, inner, frequency=3)
    _train(model, pa, rank, 2)                      # no round yet: replicas differ
    before = _gather(_flat(model, inner))
    _train(model, pa, rank, 1)                      # step 3: a round
    after = _gather(_flat(model, inner))
    return (not torch.equal(before[0], before[1]), torch.equal(after[0], after[1]),
            pa.rounds, pa.bytes_sent, pa.dense_bytes, after[0].numel())


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_ranks_bitwise_identical_after_a_round(results, opt_name):
    out = [r[f"bitwise_{opt_name}"] for r in results]
    for differed, same, rounds, sent, dense, numel in out:
        assert differed, "replicas should differ between rounds"
        assert same, "replicas (params and optimizer state) must be bitwise identical after a round"
        assert rounds == 1
        assert sent == allreduce_bytes(4 * numel, 2)   # one flat buffer: params + optimizer state
        n_params = sum(p.numel() for p in _model().parameters())
        assert dense == 3 * allreduce_bytes(4 * n_params, 2)


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


def _all_checks():
    # One group runs every check (starting worker processes is the slow part).
    return {"bitwise_sgd": _bitwise_after_round("sgd"), "bitwise_adam": _bitwise_after_round("adam"),
            "frequency1": _frequency1_equals_gradient_averaging(5), "schedule": _schedule_and_options(),
            "broadcast": _initial_broadcast()}


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


def _bitwise_on_cuda():
    torch.cuda.set_device(dist.get_rank())
    return _bitwise_after_round("adam", device=f"cuda:{dist.get_rank()}")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_bitwise_identical_on_nccl():
    for differed, same, rounds, *_ in run_local(_bitwise_on_cuda, 2, backend="nccl", timeout=300):
        assert differed and same and rounds == 1
