import gzip
import os
import struct
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from gradshare import Adaptive, SharedOptimizer, ThresholdState, TopK, threshold_hook, verify_replicas
from gradshare.models import TiedLSTM
from gradshare.workers import run_local


class _P(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.zeros(3))
        self.b = nn.Parameter(torch.zeros(2, 2))
        self.c = nn.Parameter(torch.zeros(5))


def test_residuals_follow_parameters_when_buckets_are_rebuilt():
    st = ThresholdState(compression=Adaptive(initial=0.5))
    m = _P()
    a, b, c = m.a, m.b, m.c
    first = st.bucket_for([c, b, a], torch.zeros(12))       # DDP's initial layout (reverse order)
    first.residual.copy_(torch.arange(12.0))
    first.compression.observe(0, 12, "sparse")
    tau = first.compression.tau
    left = st.bucket_for([a, c], torch.zeros(8))             # rebuilt: another composition and order
    right = st.bucket_for([b], torch.zeros(4))
    assert torch.equal(left.residual, torch.tensor([9.0, 10, 11, 0, 1, 2, 3, 4]))
    assert torch.equal(right.residual, torch.tensor([5.0, 6, 7, 8]))
    assert left.compression.tau == tau and right.compression.tau == tau
    assert len(st._buckets) == 2                              # the old layout is dropped
    # Checkpoint -> fresh state with new parameter objects met in the same order.
    sd = st.state_dict()
    st2 = ThresholdState(compression=Adaptive(initial=0.5))
    m2 = _P()
    st2.load_state_dict(sd)
    again = st2.bucket_for([m2.c, m2.b, m2.a], torch.zeros(12))
    assert torch.equal(again.residual, torch.arange(12.0))
    assert again.compression.tau == tau


# --------------------------------------------------------------------------------------------------
# Convergence on MNIST: threshold hook vs plain DDP allreduce
# --------------------------------------------------------------------------------------------------

def _read_idx(path, count):
    with gzip.open(path, "rb") as f:
        magic = struct.unpack(">I", f.read(4))[0]
        dims = [struct.unpack(">I", f.read(4))[0] for _ in range(magic & 0xFF)]
        per = int(np.prod(dims[1:])) if len(dims) > 1 else 1
        n = min(count, dims[0])
        return np.frombuffer(f.read(n * per), dtype=np.uint8).reshape([n] + dims[1:]).copy()


def _mnist(folder, ntrain, ntest):
    def images(name, n):
        x = torch.from_numpy(_read_idx(os.path.join(folder, name), n)).float().div_(255).unsqueeze(1)
        return (x - 0.1307) / 0.3081

    def labels(name, n):
        return torch.from_numpy(_read_idx(os.path.join(folder, name), n).astype(np.int64))
    return (images("train-images-idx3-ubyte.gz", ntrain), labels("train-labels-idx1-ubyte.gz", ntrain),
            images("t10k-images-idx3-ubyte.gz", ntest), labels("t10k-labels-idx1-ubyte.gz", ntest))


class _CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(1, 16, 5), nn.Conv2d(16, 32, 5)
        self.f1, self.f2 = nn.Linear(512, 64), nn.Linear(64, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.c1(x)), 2)
        x = F.max_pool2d(F.relu(self.c2(x)), 2)
        return self.f2(F.relu(self.f1(x.flatten(1))))


def _fit_mnist(data, hook, epochs=2, bs=32, lr=0.05):
    xs, ys, xt, yt = data
    r, w = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = _CNN()
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
    state = None
    if hook:   # the README's one line, defaults, compressing at every step (not link-aware: link=None)
        state = ThresholdState(optimizer=opt, link=None)
        ddp.register_comm_hook(state, threshold_hook)
    mine = torch.arange(r, len(xs), w)
    steps = 0
    for ep in range(epochs):
        order = mine[torch.randperm(len(mine), generator=torch.Generator().manual_seed(ep))]
        for i in range(0, len(order) - bs + 1, bs):
            idx = order[i:i + bs]
            loss = F.cross_entropy(ddp(xs[idx]), ys[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += 1
    verify_replicas(model)
    with torch.no_grad():
        acc = (model(xt).argmax(1) == yt).float().mean().item()
    n = sum(p.numel() for p in model.parameters())
    dense = steps * 2 * (w - 1) * 4 * n // w      # what DDP's fp32 ring allreduce sends per rank
    if state is None:
        return {"acc": acc, "bytes": dense}
    assert state.stats.dense_bytes == dense
    return {"acc": acc, "bytes": state.stats.bytes_sent, "summary": str(state.stats),
            "csv_rows": sum(1 for _ in state.stats.records)}


def _convergence(folder, ntrain, ntest):
    warnings.simplefilter("ignore")
    data = _mnist(folder, ntrain, ntest)
    return _fit_mnist(data, hook=False), _fit_mnist(data, hook=True)


@pytest.mark.slow
def test_hook_converges_near_ddp_with_40x_fewer_bytes(mnist_dir):
    # A short run at a constant learning rate (374 steps, no decay): the hardest case for error feedback,
    # whose residual is still large when training stops. Measured here: DDP 0.963, the defaults 0.945 at
    # 44x (the warm-up's bytes weigh more in a short run). With a decaying rate over ~1000 steps the gap
    # closes (README, "Training quality").
    dense, shared = run_local(_convergence, 2, (mnist_dir, 12000, 5000), timeout=300)[0]
    print(f"\nDDP allreduce acc {dense['acc']:.4f}; threshold hook acc {shared['acc']:.4f}; "
          f"bytes ratio {dense['bytes'] / shared['bytes']:.1f}x\n{shared['summary']}")
    assert dense["acc"] > 0.9
    assert shared["acc"] >= dense["acc"] - 0.025
    assert dense["bytes"] >= 40 * shared["bytes"]


# -- a compiled DDP model: torch.compile keeps the hook, and the run repeats the eager one bit for bit --------
def _compiled_or_eager(compiled, error_feedback="buffer"):
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    state = ThresholdState(optimizer=opt, link=None, error_feedback=error_feedback)
    ddp.register_comm_hook(state, threshold_hook)
    fwd = torch.compile(ddp, backend="aot_eager") if compiled else ddp
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(20):
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        F.cross_entropy(fwd(x), y).backward()
        opt.step()
    verify_replicas(model)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy(), state.sharing.step


@pytest.mark.parametrize("error_feedback", ["buffer", "model"])   # model: the own model put on by its forward
def test_a_compiled_ddp_model_shares_as_the_eager_one(error_feedback):
    eager = run_local(_compiled_or_eager, 2, (False, error_feedback), threads=1, timeout=300)
    compiled = run_local(_compiled_or_eager, 2, (True, error_feedback), threads=1, timeout=300)
    assert eager[0][1] == compiled[0][1] == 20                  # every step went through the hook
    assert np.array_equal(eager[0][0], compiled[0][0]) and np.array_equal(compiled[0][0], compiled[1][0])


# -- uneven inputs under DDP.join(): a rank out of batches takes part in the others' exchanges ----------------
def _uneven_inputs_under_join(front, opt_name, link):
    from torch.distributed.algorithms.join import Join, Joinable, JoinHook
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    inner = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=3e-3),
             "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)}[opt_name](model.parameters())
    kw = dict(link=None if link in ("none", "gradients") else "auto")
    if front == "hook":
        net = DDP(model)
        state = opt = ThresholdState(optimizer=inner, **kw)
        net.register_comm_hook(state, threshold_hook)
        step, joinable = inner, net
    else:
        net = model
        state = opt = step = joinable = SharedOptimizer(inner, mode="gradients" if link == "gradients" else "updates",
                                                        **kw)
    if link == "allreduce":                   # as a run that chose DDP's all-reduce: every step takes it
        lk = state.sharing.link
        lk.load_state_dict(dict(lk.state_dict(), choice="allreduce", plan=[], next_probe=10 ** 6))
    flat = lambda: torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()  # noqa: E731
    seen = {}

    class Probe(Joinable):
        """Records this rank's parameters when the join ends, before DDP broadcasts the last joiner's."""

        def __init__(self):
            super().__init__()

        def join_hook(self, **kwargs):
            class Hook(JoinHook):
                def post_hook(self, is_last_joiner):
                    seen["params"] = flat()
            return Hook()

        @property
        def join_device(self):
            return torch.device("cpu")

        @property
        def join_process_group(self):
            return dist.group.WORLD

    probe = Probe()
    g = torch.Generator().manual_seed(dist.get_rank())
    with Join([probe, joinable]):
        for _ in range(12 if dist.get_rank() == 0 else 5):        # rank 1 runs out of batches after 5
            Join.notify_join_context(probe)
            x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
            step.zero_grad()
            F.cross_entropy(net(x), y).backward()
            step.step()
    return seen["params"], state.sharing.step, state.sharing.stats.format_counts["allreduce"]


@pytest.mark.parametrize("front,opt_name,link", [
    ("hook", "adamw", "none"), ("hook", "sgd", "none"), ("hook", "adamw", "allreduce"), ("hook", "sgd", "allreduce"),
    ("hook", "adamw", "auto"), ("optimizer", "adamw", "none"), ("optimizer", "sgd", "allreduce"),
    ("optimizer", "sgd", "gradients")])
def test_uneven_inputs_under_join_keep_replicas_identical(front, opt_name, link):
    # Before the join ends (and DDP copies the last joiner's model to every rank), the rank that ran out of
    # inputs 7 steps earlier holds the same parameters: it took part in every exchange with a zero update
    # (the hook: under ddp.join(); SharedOptimizer: a Joinable itself).
    a, b = run_local(_uneven_inputs_under_join, 2, (front, opt_name, link), threads=1, timeout=120)
    assert a[1] == b[1] == 12
    assert np.array_equal(a[0], b[0])
    if link != "auto":
        assert a[2] == b[2] == (12 if link == "allreduce" else 0)


# -- DDP's own options and gradient accumulation with no_sync(): the hook works wherever plain DDP does ------
class _Branchy(nn.Module):
    def __init__(self, unused):
        super().__init__()
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 10)
        self.unused = nn.Linear(64, 10) if unused else None     # never used: needs find_unused_parameters

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _ddp_option_run(ddp_kw, accumulate, sharing):
    import contextlib

    import gradshare
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = _Branchy(unused=ddp_kw.get("find_unused_parameters", False))
    ddp = DDP(model, **ddp_kw)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    state = {"ddp": None,
             "dense_gradients": lambda: ThresholdState(compression=gradshare.Dense()),
             "updates": lambda: ThresholdState(optimizer=opt, link=None)}[sharing]
    if state is not None:
        state = state()
        ddp.register_comm_hook(state, threshold_hook)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(12):
        opt.zero_grad()
        for m in range(accumulate):
            with ddp.no_sync() if m < accumulate - 1 else contextlib.nullcontext():
                x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
                F.cross_entropy(ddp(x), y).backward()
        opt.step()
    verify_replicas(model)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()
    return flat, None if state is None else state.sharing.step


@pytest.mark.parametrize("ddp_kw,accumulate", [({}, 3), ({"gradient_as_bucket_view": True}, 2),
                                               ({"find_unused_parameters": True}, 1), ({"static_graph": True}, 1)])
def test_ddp_options_and_no_sync_accumulation(ddp_kw, accumulate):
    ddp = run_local(_ddp_option_run, 2, (ddp_kw, accumulate, "ddp"), threads=1, timeout=300)[0][0]
    # nothing compressed, gradients averaged by the hook: DDP's result bit for bit (2 ranks)
    dense = run_local(_ddp_option_run, 2, (ddp_kw, accumulate, "dense_gradients"), threads=1, timeout=300)
    assert np.array_equal(dense[0][0], ddp) and dense[0][1] == 12
    # the defaults, compressed every step: one shared step per optimizer step, replicas identical
    shared = run_local(_ddp_option_run, 2, (ddp_kw, accumulate, "updates"), threads=1, timeout=300)
    assert shared[0][1] == shared[1][1] == 12 and np.array_equal(shared[0][0], shared[1][0])
    assert not np.array_equal(shared[0][0], ddp) and np.abs(shared[0][0] - ddp).max() < 0.05


# -- users' scripts as they come: the one line added, whatever else the script does -------------------------
def _copy_task(step, rank, vocab=24):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, vocab, (8, 16), generator=g)
    return x, torch.roll(x, 1, 1)                                # predict the previous token


def _user_script(variant, sharing, steps=60):
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = TiedLSTM()
    if variant == "bf16_parameters":
        model = model.to(torch.bfloat16)
    ddp = DDP(model)
    if variant == "no_decay_groups":
        named = list(ddp.named_parameters())
        opt = torch.optim.AdamW([{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.1},
                                 {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}], lr=3e-3)
    else:
        opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3, fused=variant == "fused_adamw")
    model_feedback = dict(error_feedback="model", compression=TopK(0.05, values="sign"))
    state = ThresholdState(optimizer=opt, link=None, **(model_feedback if sharing == "model" else {})) \
        if sharing else None
    if state is not None:
        ddp.register_comm_hook(state, threshold_hook)
    rounds = 2 if variant == "accumulate_without_no_sync" else 1   # two backward passes a step, no no_sync()
    for s in range(steps):
        for r in range(rounds):
            x, y = _copy_task(s * rounds + r, dist.get_rank())
            (F.cross_entropy(ddp(x).float().flatten(0, 1), y.flatten()) / rounds).backward()
        opt.step()
        opt.zero_grad()
    flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]).numpy().copy()
    with torch.no_grad():
        held_out = [F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()).item()
                    for x, y in (_copy_task(10 ** 6 + i, 0) for i in range(4))]
    return flat, sum(held_out) / len(held_out), None if state is None else state.sharing.step


@pytest.mark.parametrize("variant,sharing", [
    (v, True) for v in ("bf16_parameters", "accumulate_without_no_sync", "no_decay_groups", "fused_adamw")] + [
    pytest.param(v, "model", marks=pytest.mark.slow) for v in ("accumulate_without_no_sync", "no_decay_groups",
                                                                 "fused_adamw")])
def test_users_scripts_with_the_one_line_train_like_ddp(variant, sharing):
    """Tied weights, an LSTM and a LayerNorm in every variant; bfloat16 parameters, gradient accumulation
    without no_sync(), AdamW's usual no-decay parameter groups, the fused AdamW: the replicas stay identical
    and the held-out loss ends near DDP's (this copy task: DDP from 8.9 to 1.4-1.6 in 60 steps). Also with what
    waits in each rank's model, sent as the top 5% as signs (at 1% the mean result that the replicas show lags
    this fast-falling loss: README, "What waits, in each rank's model"); not with bfloat16 parameters, which
    cannot hold a rank's own model (the mean result minus a residual below their precision)."""
    ddp = run_local(_user_script, 2, (variant, False), threads=1, timeout=300)
    shared = run_local(_user_script, 2, (variant, sharing), threads=1, timeout=300)
    assert np.array_equal(ddp[0][0], ddp[1][0]) and np.array_equal(shared[0][0], shared[1][0])
    assert np.isfinite(shared[0][0]).all() and not np.array_equal(shared[0][0], ddp[0][0])
    assert shared[0][2] == 60                                   # one shared update per opt.step()
    assert ddp[0][1] < 2.0                                                   # the task is learnt
    assert shared[0][1] < ddp[0][1] * 1.1, (shared[0][1], ddp[0][1])


# -- a second optimizer: parameters the hook's optimizer does not step are all-reduced as DDP does ----------
def _two_optimizers(lr_first, sharing, given="first", error_feedback=None):
    warnings.simplefilter("always")
    torch.manual_seed(0)
    model = _Branchy(unused=False)
    ddp = DDP(model)
    first = torch.optim.AdamW(model.a.parameters(), lr=lr_first)
    second = torch.optim.SGD(model.b.parameters(), lr=0.05, momentum=0.9)
    state = None
    with warnings.catch_warnings(record=True) as caught:
        if sharing:
            state = ThresholdState(optimizer=first if given == "first" else [first, second], link=None,
                                   error_feedback=error_feedback)
            ddp.register_comm_hook(state, threshold_hook)
        g = torch.Generator().manual_seed(dist.get_rank())
        for _ in range(8):
            first.zero_grad(), second.zero_grad()
            x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
            F.cross_entropy(ddp(x), y).backward()
            first.step(), second.step()
    verify_replicas(model)
    said = [str(w.message) for w in caught if "not in the optimizer given to ThresholdState" in str(w.message)]
    uncovered = None if state is None else sum(r.n for r in state.stats.history if r.bucket == -1)
    out = ([p.detach().clone() for p in model.b.parameters()], [p.detach().clone() for p in model.a.parameters()],
           said, uncovered)
    if given == "both":
        out += ([sh.step for sh in state.sharings], [type(sh.compression).__name__ for sh in state.sharings],
                sorted({r.bucket for r in state.stats.history}), state.bytes_sent / state.dense_bytes)
    return out


def test_a_second_optimizers_parameters_are_all_reduced_as_ddp_does():
    ddp = run_local(_two_optimizers, 2, (0.0, False), threads=1, timeout=300)[0]
    # The hook's optimizer holds its parameters still (lr 0): the second optimizer's parameters then follow
    # DDP's bit for bit, which they can only if their gradients are the ranks' mean on every rank.
    still = run_local(_two_optimizers, 2, (0.0, True), threads=1, timeout=300)
    for r in still:
        assert all(torch.equal(a, b) for a, b in zip(r[0], ddp[0]))
        assert len(r[2]) == 1 and "2 parameter(s) (650 elements)" in r[2][0]      # said once, with what
        assert r[3] == 8 * 650                                                     # counted: every step
    moving = run_local(_two_optimizers, 2, (3e-3, True), threads=1, timeout=300)   # replicas checked inside
    assert not all(torch.equal(a, b) for a, b in zip(moving[0][1], ddp[1]))       # the first one did step


def _zero_refused():
    from torch.distributed.optim import ZeroRedundancyOptimizer
    model = nn.Linear(4, 2)
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    try:
        ThresholdState(optimizer=zero)
    except ValueError as e:
        return str(e)
    finally:
        del zero
    return None


def test_zero_redundancy_optimizer_is_refused_with_what_to_do():
    said = run_local(_zero_refused, 1, threads=1, timeout=120)[0]
    assert said is not None and "ZeRO steps each rank's shard" in said and "without optimizer=" in said


def _gradients_mode_told(opt_name, given):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ddp = DDP(model)
    opt = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
           "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)}[opt_name](ddp.parameters())
    other = torch.optim.Adam(nn.Linear(2, 2).parameters())          # an Adam that steps another model
    state = ThresholdState(optimizer=opt) if given else ThresholdState()
    ddp.register_comm_hook(state, threshold_hook)
    g = torch.Generator().manual_seed(dist.get_rank())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            other.step()
            F.cross_entropy(ddp(torch.randn(8, 8, generator=g)), torch.randint(0, 4, (8,), generator=g)).backward()
            opt.step()                                                  # the line a warning names
            opt.zero_grad()
    told = [w for w in caught if "without optimizer=" in str(w.message)]
    return [(str(w.message), w.filename, w.lineno) for w in told]


def _optimizer_built_again(variant, feedback="buffer"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    ddp.register_comm_hook(ThresholdState(optimizer=opt, link=None, error_feedback=feedback), threshold_hook)
    g = torch.Generator().manual_seed(dist.get_rank())

    def steps(net, o, k):
        for _ in range(k):
            F.cross_entropy(net(torch.randn(8, 8, generator=g)), torch.randint(0, 4, (8,), generator=g)).backward()
            o.step()
            o.zero_grad()

    class Wrapper(torch.optim.Optimizer):            # a wrapper of the given optimizer (Accelerate's, Lookahead)
        def __init__(self, inner):
            self.optimizer, self.param_groups, self.defaults, self.state = inner, inner.param_groups, {}, {}
            self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}

        def step(self, closure=None):
            return self.optimizer.step(closure)

    steps(ddp, opt, 2)
    said = None
    if variant == "rebuilt":                        # the loop goes on with a new optimizer, the hook's state not told
        try:
            steps(ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-2), 2)
        except RuntimeError as e:
            said = str(e)
    elif variant == "new_ddp":                      # done as the error says: a new DDP model and state
        opt2 = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ddp2 = DDP(model)
        ddp2.register_comm_hook(ThresholdState(optimizer=opt2, link=None, error_feedback=feedback), threshold_hook)
        steps(ddp2, opt2, 2)
    else:
        steps(ddp, Wrapper(opt), 2)
    # the refused step did not happen: nothing differs (error_feedback="model": the mean result shown again, and
    # a new state over the model starts from it, not from each rank's own model that the old state held back)
    verify_replicas(model)
    return said


@pytest.mark.parametrize("feedback", ["buffer", "model"])
@pytest.mark.parametrize("variant", ["rebuilt", "new_ddp", "wrapper"])
def test_an_optimizer_the_state_was_not_given_is_refused_before_replicas_differ(variant, feedback):
    said = run_local(_optimizer_built_again, 2, (variant, feedback), threads=1, timeout=300)
    if variant != "rebuilt":
        assert said == [None, None]
        return
    for s in said:
        assert s is not None and "AdamW that ThresholdState(optimizer=...) was not given" in s
        assert "replicas would differ" in s


@pytest.mark.parametrize("opt_name,given", [("adamw", False), ("sgd", False), ("adamw", True)])
def test_an_adaptive_optimizer_stepping_shared_gradients_is_told_to_be_given(opt_name, given):
    told = run_local(_gradients_mode_told, 2, (opt_name, given), threads=1, timeout=300)
    if opt_name == "sgd" or given:                # SGD on shared gradients is the gradients mode's case; updates
        assert told == [[], []]
        return
    for rank in told:                             # once per rank, at the user's opt.step(), naming the fix
        assert len(rank) == 1
        message, filename, lineno = rank[0]
        assert "AdamW then steps on their compressed mean" in message and "optimizer=opt" in message
        assert filename == __file__
        with open(__file__) as f:
            assert "opt.step()" in f.read().splitlines()[lineno - 1]



@pytest.mark.parametrize("feedback", [None, "buffer"], ids=["defaults", "buffer"])
def test_several_optimizers_each_share_their_updates_compressed(feedback):
    res = run_local(_two_optimizers, 2, (3e-3, True, "both", feedback), threads=1, timeout=300)   # replicas checked
    for r in res:
        assert r[2] == [] and r[3] == 0                      # nothing left to all-reduce uncompressed, no warning
        assert r[4] == [8, 8]                                # both cores shared every step
        # the defaults: the top 5% as signs for each; the buffer: each optimizer's own (AdamW, SGD)
        assert r[5] == (["TopK", "TopK"] if feedback is None else ["Ternary", "TopK"])
        assert r[6] == [0, 1]                                # one bucket numbering over both
        assert r[7] < 1 / 10                                 # 16x to ~90x on the elements: well under a tenth


def _two_optimizers_resume(split):
    """Several optimizers' sharing state saved after ``split`` steps and loaded into a fresh setup: the
    continued run ends bit for bit where an uninterrupted one does."""
    import copy
    warnings.simplefilter("ignore")
    g = torch.Generator().manual_seed(dist.get_rank())
    batches = [(torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(12)]

    def setup():
        torch.manual_seed(0)
        model = _Branchy(unused=False)
        ddp = DDP(model)
        opts = [torch.optim.AdamW(model.a.parameters(), lr=3e-3),
                torch.optim.SGD(model.b.parameters(), lr=0.05, momentum=0.9)]
        state = ThresholdState(optimizer=opts, link=None)
        ddp.register_comm_hook(state, threshold_hook)
        return model, ddp, opts, state

    def train(ddp, opts, todo):
        for x, y in todo:
            for o in opts:
                o.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            for o in opts:
                o.step()

    model, ddp, opts, state = setup()
    train(ddp, opts, batches[:split])
    saved = copy.deepcopy({"model": model.state_dict(), "opts": [o.state_dict() for o in opts],
                           "sharing": state.state_dict()})
    train(ddp, opts, batches[split:])
    again, ddp2, opts2, state2 = setup()
    again.load_state_dict(saved["model"])
    for o, sd in zip(opts2, saved["opts"]):
        o.load_state_dict(sd)
    state2.load_state_dict(saved["sharing"])
    train(ddp2, opts2, batches[split:])
    verify_replicas(again)
    one = ThresholdState(optimizer=torch.optim.SGD(_Branchy(False).parameters(), lr=0.1), link=None)
    try:
        one.load_state_dict(saved["sharing"])
        refused = None
    except ValueError as e:
        refused = str(e)
    return ([p.detach().clone() for p in model.parameters()], [p.detach().clone() for p in again.parameters()],
            len(saved["sharing"]["others"]), refused)


def test_several_optimizers_resume_bit_for_bit():
    for full, resumed, others, refused in run_local(_two_optimizers_resume, 2, (5,), threads=1, timeout=300):
        assert others == 1
        assert all(torch.equal(a, b) for a, b in zip(full, resumed))
        assert refused is not None and "updates of 2 optimizer(s), this state of 1" in refused


def test_several_optimizers_are_checked():
    a, b = nn.Linear(3, 3), nn.Linear(3, 1)
    first = torch.optim.AdamW(a.parameters())
    with pytest.raises(ValueError, match="both step a parameter of shape"):
        ThresholdState(optimizer=[first, torch.optim.SGD(list(a.parameters())[:1], lr=0.1)])
    with pytest.raises(TypeError, match="a torch.optim.Optimizer or a list of them, got Linear"):
        ThresholdState(optimizer=[first, b])
    with pytest.raises(ValueError, match="delay=1 shares one optimizer"):
        ThresholdState(optimizer=[first, torch.optim.SGD(b.parameters(), lr=0.1)], delay=1)
    with pytest.raises(ValueError, match="an empty list"):
        ThresholdState(optimizer=[])
