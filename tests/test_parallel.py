import os
import time

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from gradshare import ParallelWrapper, TopK
from gradshare.data import load_digits
from gradshare.models import SmallCNN
from gradshare.parallel import default_workers
from gradshare.workers import WorkerError

pytestmark = pytest.mark.slow

ADAM = (torch.optim.Adam, {"lr": 3e-3})
EPOCHS = 12
# Test accuracy on digits after EPOCHS epochs, 2 workers, batch 32 per worker. Measured here: 0.97-0.99
# (gradient sharing) and 0.97-0.99 (averaging every 5 steps) over seeds 0-2.
FLOOR = 0.93


def _wrapper(mode, **kw):
    torch.manual_seed(0)
    return ParallelWrapper(SmallCNN(), ADAM, workers=2, mode=mode, progress=False, timeout=300, **kw)


def _single_process_eval(model, ds):
    x, y = ds.tensors
    model.eval()
    with torch.no_grad():
        out = model(x)
    return out, float((out.argmax(1) == y).sum()) / len(y), float(nn.functional.cross_entropy(out, y))


@pytest.fixture(scope="module")
def digits():
    return load_digits(seed=0)


@pytest.fixture(scope="module")
def trained(digits):
    """One fit per mode, shared by the tests below (starting workers is the slow part)."""
    tr, te = digits
    out = {}
    for mode in ("shared_gradients", "averaging"):
        # link=None: compression at every step, whose bytes test_history_bytes checks (link-aware fits
        # would mostly all-reduce on this loopback link)
        w = _wrapper(mode, link=None) if mode == "shared_gradients" else _wrapper(mode)
        before = [p.detach().clone() for p in w.model.parameters()]
        hist = w.fit(tr, epochs=EPOCHS, batch_size=32, validation_data=te)
        out[mode] = (w, hist, before)
    return out


@pytest.mark.parametrize("mode", ["shared_gradients", "averaging"])
def test_fit_reaches_accuracy_floor_and_returns_the_trained_model(trained, digits, mode):
    w, hist, before = trained[mode]
    assert len(hist) == EPOCHS
    assert hist[-1]["val_accuracy"] >= FLOOR
    assert hist[-1]["loss"] < hist[0]["loss"]
    assert hist[-1]["samples"] == 2 * ((len(digits[0]) + 1) // 2)   # both workers' samples counted
    # the calling process holds the trained weights: its own evaluation matches the workers' last one
    assert any(not torch.equal(a, b) for a, b in zip(before, w.model.parameters()))
    _, acc, loss = _single_process_eval(w.model, digits[1])
    assert acc == hist[-1]["val_accuracy"]
    assert loss == pytest.approx(hist[-1]["val_loss"], rel=1e-5)


def test_history_bytes(trained):
    _, shared, _ = trained["shared_gradients"]
    _, avg, _ = trained["averaging"]
    for h in shared + avg:
        assert 0 < h["bytes_sent"] < h["dense_bytes"]
    # Adam's updates go ternary-coded (2 bits per element: 16x fewer bytes than dense allreduce, whatever
    # fraction of the elements is sent); averaging every 5 steps with Adam's two moments averaged too sends
    # 3/5 of dense (plus one round at each epoch end)
    assert sum(h["bytes_sent"] for h in shared) * 15 < sum(h["dense_bytes"] for h in shared)
    assert all(0 < h["density"] <= 1 for h in shared)
    assert all(h["density"] is None for h in avg)


def test_evaluate_equals_single_process_evaluation(trained, digits):
    w, _, _ = trained["averaging"]
    got = w.evaluate(digits[1], metrics=("accuracy", "loss", "top5_accuracy"))
    out, acc, loss = _single_process_eval(w.model, digits[1])
    assert set(got) == {"accuracy", "loss", "top5_accuracy"}
    assert got["accuracy"] == acc
    assert got["loss"] == pytest.approx(loss, rel=1e-5)
    top5 = float((out.topk(5, 1).indices == digits[1].tensors[1][:, None]).any(1).sum()) / len(out)
    assert got["top5_accuracy"] == top5


def test_predict_keeps_order_when_size_does_not_divide(trained, digits):
    w, _, _ = trained["shared_gradients"]
    x, y = digits[1].tensors
    x = x[:359]                                   # odd: 180 + 179 rows on two workers
    pred = w.predict(TensorDataset(x))
    w.model.eval()
    with torch.no_grad():
        ref = w.model(x)
    assert pred.shape == (359, 10)
    assert torch.allclose(pred, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(pred.argmax(1), ref.argmax(1))


class FailingLoss:
    """Cross-entropy that raises on rank 1 at its ``at``-th call (mid-epoch)."""

    def __init__(self, at):
        self.at = at
        self.calls = 0

    def __call__(self, out, y):
        self.calls += 1
        if os.environ.get("RANK") == "1" and self.calls == self.at:
            raise RuntimeError(f"injected failure on rank 1 at step {self.at}")
        return nn.functional.cross_entropy(out, y)


@pytest.mark.parametrize("mode", ["averaging"])
def test_worker_failure_ends_fit_with_its_message(digits, mode):
    w = _wrapper(mode, loss_fn=FailingLoss(at=7))
    before = [p.detach().clone() for p in w.model.parameters()]
    t0 = time.monotonic()
    # a hang would end in TimeoutError after the wrapper's 300 s, failing this test
    with pytest.raises(WorkerError, match="injected failure on rank 1 at step 7") as info:
        w.fit(digits[0], epochs=3, batch_size=32)
    print(f"fit raised after {time.monotonic() - t0:.1f} s")
    assert info.value.rank == 1 and "Traceback" in info.value.detail
    assert all(torch.equal(a, b) for a, b in zip(before, w.model.parameters()))   # model untouched


def _unpicklable_factory():
    return lambda params: torch.optim.SGD(params, lr=0.1)


def test_arguments_are_checked_before_starting_workers():
    with pytest.raises(TypeError, match="picklable"):
        ParallelWrapper(SmallCNN(), _unpicklable_factory(), workers=2)
    with pytest.raises(ValueError, match="mode"):
        ParallelWrapper(SmallCNN(), ADAM, mode="async")
    with pytest.raises(ValueError, match="workers"):
        ParallelWrapper(SmallCNN(), ADAM, workers=0)
    w = ParallelWrapper(SmallCNN(), torch.optim.SGD, optimizer_kwargs={"lr": 0.1}, workers=1)
    assert w.optimizer == (torch.optim.SGD, {"lr": 0.1})
    with pytest.raises(ValueError, match="digits"):
        w.fit("cifar")
    with pytest.raises(ValueError, match="unknown metric"):
        w.evaluate("digits", metrics=("f1",))
    with pytest.raises(TypeError, match="outer_optimizer: must be picklable"):
        ParallelWrapper(SmallCNN(), ADAM, workers=1, mode="averaging", outer_optimizer=lambda ps: None)
    outer = (torch.optim.SGD, {"lr": 0.7, "momentum": 0.9, "nesterov": True})
    cfg = ParallelWrapper(SmallCNN(), ADAM, workers=1, mode="averaging", outer_optimizer=outer,
                          residual_decay=0.9, fragments=2, overlap=1).config("digits")
    assert cfg.outer_optimizer == outer and cfg.residual_decay == 0.9 and cfg.average_optimizer_state is None
    # None: each mode's default (averaging: the buffer; sharing updates: each rank's model)
    assert (cfg.fragments, cfg.overlap) == (2, 1) and cfg.error_feedback is None
    kept = ParallelWrapper(SmallCNN(), ADAM, workers=1, mode="averaging", compression=TopK(0.02),
                           error_feedback="model").config("digits")
    assert kept.error_feedback == "model"


def test_default_workers():
    assert default_workers(["cuda:0", "cuda:1", "cuda:2"]) == 3
    if not torch.cuda.is_available():
        assert 1 <= default_workers() <= max(1, min(4, os.cpu_count() or 1))


class _DigitsDicts(torch.utils.data.Dataset):
    """Digits as dict samples, the way many datasets hand them out."""

    def __init__(self, ds):
        self.x, self.y = ds.tensors

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"image": self.x[i], "label": self.y[i]}


def test_fit_takes_a_dataloader_of_dict_batches_and_ready_made_batches(digits):
    """A DataLoader of dict samples trains exactly as the same data given as tensors (link=None: both
    compress at every step, so the runs repeat bit for bit)."""
    from torch.utils.data import DataLoader

    tr, te = digits

    def fitted(data, **kw):
        torch.manual_seed(0)
        w = ParallelWrapper(SmallCNN(), ADAM, workers=2, progress=False, timeout=300, link=None, **kw)
        return w, w.fit(data, epochs=2, **({} if isinstance(data, DataLoader) else {"batch_size": 48}))

    w, hist = fitted(DataLoader(_DigitsDicts(tr), batch_size=48, shuffle=True), batch_keys=("image", "label"))
    w_t, hist_t = fitted(tr.tensors)
    per_rank = -(-len(tr) // 2)
    assert len(w.steps) == 2 * -(-per_rank // 48)                       # the loader's batch size
    assert [h["loss"] for h in hist] == [h["loss"] for h in hist_t]
    assert all(torch.equal(a, b) for a, b in zip(w.model.state_dict().values(), w_t.model.state_dict().values()))
    res = w.evaluate(DataLoader(_DigitsDicts(te), batch_size=64))
    _, acc, _ = _single_process_eval(w.model, te)
    assert res["accuracy"] == pytest.approx(acc, abs=1e-6)

    x, y = tr.tensors
    ready = [(x[i:i + 40], y[i:i + 40]) for i in range(0, 400, 40)]       # 10 batches, one generator
    w2 = ParallelWrapper(SmallCNN(), ADAM, workers=2, progress=False, timeout=300)
    w2.fit((b for b in ready), epochs=1)
    assert len(w2.steps) == 5 and all(s["batch_size"] == 40 for s in w2.steps)
