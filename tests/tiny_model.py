"""The small deterministic model and batches the gradient-sharing tests train (importable by spawned workers)."""
import io

import torch
import torch.nn as nn


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 48), nn.ReLU(), nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, 4))


class _Temperature(nn.Module):
    """Logits times a learnable 0-dim parameter (a temperature, as in CLIP): its optimizer state is 0-dim too."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.0))

    def forward(self, x):
        return x * self.scale


def net_with_temperature():
    """:func:`net` followed by a 0-dim parameter."""
    return nn.Sequential(net(), _Temperature())


class GroupAdaptive(torch.optim.Optimizer):
    """SGD with momentum whose step is scaled by a value it keeps in each parameter group and estimates from the
    gradients it sees, as D-Adaptation's and Prodigy's ``d`` are: ranks that step on their own gradients end
    with different values."""

    def __init__(self, params, lr=0.05, momentum=0.9):
        super().__init__(params, dict(lr=lr, momentum=momentum, d=1.0))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            grads = [p.grad for p in group["params"] if p.grad is not None]
            if grads:
                norm = float(torch.stack([g.norm() for g in grads]).norm())
                group["d"] = 0.9 * group["d"] + 0.1 * min(norm, 10.0)
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(p.grad)
                p.add_(buf, alpha=-group["lr"] * group["d"])


def batch(rank, step):
    """A batch that differs per rank and step, the same on every run."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 20, generator=g)
    return x, x[:, :4].argmax(1)


# ---------------------------------------------------------------- the MNIST CNN, for framework integrations
_IMAGES = {}


def images():
    """(x, y): MNIST training images (the first 4096) where this machine has the MNIST files (conftest's
    MNIST_DIR), else scikit-learn's bundled 8x8 digits; the same on every run."""
    if not _IMAGES:
        from conftest import MNIST_DIR, have_mnist
        from gradshare.data import load_digits, load_mnist

        train = load_mnist(MNIST_DIR)[0] if have_mnist() else load_digits(seed=0)[0]
        x, y = train.tensors
        _IMAGES["xy"] = (x[:4096].contiguous(), y[:4096].contiguous())
    return _IMAGES["xy"]


def cnn():
    """The benchmarks' MNIST CNN (gradshare.models.SmallCNN) for the images of :func:`images`, the same weights
    on every run."""
    from gradshare.models import SmallCNN

    side = images()[0].shape[-1]
    torch.manual_seed(0)
    return SmallCNN(in_channels=1, num_classes=10, image_size=side)


def image_batch(rank, step, size=16):
    """Batch ``step`` of ``rank``: a different slice of :func:`images` per rank and step, the same on every run."""
    x, y = images()
    start = ((2 * step + rank) * size) % (len(y) - size)
    return x[start:start + size], y[start:start + size]


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def snapshot(*objects) -> bytes:
    """The state_dicts of ``objects`` (model, optimizer, ...) as one checkpoint blob."""
    buf = io.BytesIO()
    torch.save(tuple(o.state_dict() for o in objects), buf)
    return buf.getvalue()


def restore(blob: bytes, *objects) -> None:
    """Loads a ``snapshot`` blob back into the same objects, in the same order."""
    for o, state in zip(objects, torch.load(io.BytesIO(blob), weights_only=False)):
        o.load_state_dict(state)


def grad_scaler(enabled=True):
    """The GradScaler the mixed-precision tests use (a power-of-two scale, as every GradScaler's)."""
    return torch.amp.GradScaler("cpu", init_scale=2.0**12, enabled=enabled)


class OwnStepScaler(torch.amp.GradScaler):
    """A user's GradScaler subclass that overrides ``step`` (as Lightning's and FSDP's may)."""

    def step(self, optimizer, *args, **kwargs):
        return super().step(optimizer, *args, **kwargs)


def step_with(opt, loss, scaler=None, update=True):
    """``loss.backward(); opt.step()``, or the same through ``scaler`` (a GradScaler: scaled backward,
    ``scaler.step(opt)``, then ``scaler.update()`` unless ``update`` is False)."""
    if scaler is None:
        loss.backward()
        opt.step()
        return
    scaler.scale(loss).backward()
    scaler.step(opt)
    if update:
        scaler.update()


def scaled_steps(model, net, opt, steps=6, bad_at=None, enabled=True, scaler=None):
    """``steps`` training steps under a torch.amp.GradScaler (``scaler``, or a new :func:`grad_scaler`; an Inf in
    rank 1's input at step ``bad_at``): the flat parameters after them and the scale after each step."""
    import torch.distributed as dist
    import torch.nn.functional as F

    r = dist.get_rank()
    scaler = scaler if scaler is not None else grad_scaler(enabled)
    scales = []
    for step in range(steps):
        x, y = batch(r, step)
        if step == bad_at and r == 1:
            x[0, 0] = float("inf")
        opt.zero_grad()
        step_with(opt, F.cross_entropy(net(x), y), scaler)
        scales.append(scaler.get_scale())
    return flat(model), scales


def residual_of(state_dict):
    """The residuals in a ThresholdState's (or SharedOptimizer's gradshare) state_dict, as one numpy array."""
    return torch.cat([b["residual"] for b in state_dict["sharing"]["buckets"]]).numpy()


def first_moment(optimizer_state):
    """A copy of the first parameter's Adam exp_avg in an optimizer state_dict (training goes on updating the
    optimizer's tensors in place)."""
    return next(iter(optimizer_state["state"].values()))["exp_avg"].numpy().copy()


def count_hook_calls(module):
    """Wraps ``module.threshold_hook``, the name a framework integration registers, in this worker only; returns
    the list that receives one entry per call."""
    calls = []
    hook = module.threshold_hook

    def counted(state, bucket):
        calls.append(bucket.index())
        return hook(state, bucket)

    module.threshold_hook = counted
    return calls


def one_line_result(state, calls, model):
    """What check_one_line_run reads from one rank: the ThresholdState's mode, steps and formats, the hook's
    calls and the trained parameters."""
    return {"mode": state.mode, "step_count": state.step_count, "formats": dict(state.stats.format_counts),
            "hook_calls": len(calls), "params": flat(model)}


def both_paths_link():
    """The link-aware policy of the defaults with a schedule that does not depend on this machine's speed: 1 + 4
    compressed steps (min_seconds=0: no more however short the steps), then all-reduce steps (probe=False: the
    link probe rules nothing out), then whichever is faster. The defaults differ only in when they switch (their
    measurements go on until they cover 0.1 s, and the probe may rule the all-reduce out on a slow link), so an
    integration run with this one takes both paths, and the switches between them, on every machine."""
    from gradshare import LinkAware
    return LinkAware(min_seconds=0, probe=False)


def check_one_line_run(results, steps, initial=net):
    """What a framework integration's run with :func:`both_paths_link` must show on every rank (a list of
    one_line_result dicts): updates mode, the hook called at every backward and every step shared, both
    link-aware paths taken (timed compressed steps first, then all-reduce ones; gradshare.link), identical
    replicas, and parameters that moved from ``initial()``'s."""
    import numpy as np

    for r in results:
        assert r["mode"] == "updates"
        assert r["hook_calls"] >= steps, r["hook_calls"]
        assert r["step_count"] == steps, r["step_count"]
        compressed = sum(n for f, n in r["formats"].items() if f not in ("allreduce", "skipped"))
        assert r["formats"]["allreduce"] > 0 and compressed > 0, r["formats"]
        assert np.array_equal(r["params"], results[0]["params"])
    assert not np.array_equal(results[0]["params"], flat(initial()))
