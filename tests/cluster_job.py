"""A small self-contained per-rank training function for the launcher tests (torchrun, Spark, run_local).

``train(config, ctx)``: DDP over the initialised process group, a dropout + linear classifier, SGD with
momentum, a deterministic per-epoch data order sharded by rank, checkpoints through ``ctx``. It returns the
same value on every rank (final parameters, statistics totals, test accuracy, where it resumed from), as
Spark's local mode requires. ``config`` keys (all optional): data ("synthetic" or "mnist:DIR"), steps,
batch, lr, seed, train_size (training rows used), kill_at_step + kill_rank (SIGKILL that rank before that
step on the first attempt only: torchrun's restart count is 0 and kill_once_file does not exist yet),
hang_at_step (that rank stops answering instead), attempt_log (a file each rank appends the steps it
executes to), step_sleep (seconds per step), hook (register gradshare's threshold hook on the DDP model),
local (local steps instead of DDP: a dict of gradshare.ParameterAveraging options frequency, outer_lr,
outer_momentum, density, residual_decay, fragments, overlap, error_feedback; each rank checkpoints its own model, which differs mid-round).
"""
import gzip
import os
import signal
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def _idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    shape = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def load_data(spec, seed=0, train_size=2048):
    """-> (x_train, y_train, x_test, y_test) float32 / int64 tensors."""
    if spec.startswith("mnist:"):
        d, n = spec[len("mnist:"):], train_size
        xtr = torch.from_numpy(_idx(os.path.join(d, "train-images-idx3-ubyte.gz"))[:n].reshape(-1, 784)
                               .astype(np.float32) / 255.0)
        ytr = torch.from_numpy(_idx(os.path.join(d, "train-labels-idx1-ubyte.gz"))[:n].astype(np.int64))
        xte = torch.from_numpy(_idx(os.path.join(d, "t10k-images-idx3-ubyte.gz")).reshape(-1, 784)
                               .astype(np.float32) / 255.0)
        yte = torch.from_numpy(_idx(os.path.join(d, "t10k-labels-idx1-ubyte.gz")).astype(np.int64))
        return xtr, ytr, xte, yte
    g = torch.Generator().manual_seed(1234 + seed)
    w = torch.randn(16, 4, generator=g)
    x = torch.randn(1024 + 512, 16, generator=g)
    y = (x @ w + 0.3 * torch.randn(x.shape[0], 4, generator=g)).argmax(1)
    return x[:1024], y[:1024], x[1024:], y[1024:]


def _batch_indices(n, step, batch, rank, world, seed):
    """Step `step`'s rows for `rank`: epoch-seeded permutation, global batch split by rank (no RNG state used)."""
    per_epoch = n // (batch * world)
    epoch, i = divmod(step, per_epoch)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch))
    start = (i * world + rank) * batch
    return perm[start:start + batch], epoch, i


def _first_time(marker):
    """True the first time a run reaches this point (marker file created), always True without a marker."""
    if not marker:
        return True
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def train(config, ctx):
    config = dict(config or {})
    steps, batch, lr, seed = config.get("steps", 60), config.get("batch", 16), config.get("lr", 0.1), \
        config.get("seed", 0)
    torch.set_num_threads(1)
    xtr, ytr, xte, yte = load_data(config.get("data", "synthetic"), seed,
                                 config.get("train_size", 2048))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Dropout(0.2), torch.nn.Linear(xtr.shape[1], int(ytr.max()) + 1))
    local = config.get("local")
    ddp = model if local else DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
    if local:
        import gradshare

        outer = None
        if local.get("outer_lr"):
            m = local.get("outer_momentum", 0.9)
            outer = lambda ps: torch.optim.SGD(ps, lr=local["outer_lr"], momentum=m, nesterov=m > 0)  # noqa: E731
        opt = gradshare.ParameterAveraging(
            model, opt, frequency=local.get("frequency", 5), outer_optimizer=outer,
            compression=gradshare.TopK(local["density"], warmup_steps=0) if local.get("density") else None,
            residual_decay=local.get("residual_decay", 1.0), fragments=local.get("fragments", 1),
            overlap=local.get("overlap", 0), error_feedback=local.get("error_feedback", "buffer"))
    if config.get("hook"):
        import gradshare

        # link=None: compressed at every step, so that a resumed run repeats an uninterrupted one bit for bit
        # (link-aware choices follow measured times, which differ from run to run).
        ddp.register_comm_hook(gradshare.ThresholdState(optimizer=opt, link=None), gradshare.threshold_hook)
    torch.manual_seed(seed * 7919 + ctx.rank)  # dropout masks differ per rank; restored from checkpoints
    totals = {"steps": 0, "samples": 0, "steps_seen": []}
    shared, own = ({"model": model}, {"model": model, "optimizer": opt}) if local else \
        ({"model": model, "optimizer": opt}, None)
    if ctx.restore(objects=shared, rank_objects=own):
        totals = ctx.resumed.state["stats"]
    log = open(config["attempt_log"], "a") if config.get("attempt_log") else None
    loss_fn = torch.nn.CrossEntropyLoss()
    for step in range(ctx.start_step, steps):
        if (step == config.get("kill_at_step") and ctx.rank == config.get("kill_rank", 1)
                and ctx.restart_count == 0 and _first_time(config.get("kill_once_file"))):
            os.kill(os.getpid(), signal.SIGKILL)
        if step == config.get("hang_at_step") and ctx.rank == config.get("kill_rank", 1):
            time.sleep(3600)  # alive but silent: the peers' next collective must time out
        idx, epoch, pos = _batch_indices(xtr.shape[0], step, batch, ctx.rank, ctx.world_size, seed)
        opt.zero_grad()
        loss = loss_fn(ddp(xtr[idx]), ytr[idx])
        loss.backward()
        opt.step()
        counted = torch.tensor([1.0, float(len(idx))])
        dist.all_reduce(counted)
        totals["steps"] += 1
        totals["samples"] += int(counted[1])
        totals["steps_seen"].append(step)
        if log:
            log.write(f"attempt={ctx.restart_count} rank={ctx.rank} step={step}\n")
            log.flush()
        if config.get("step_sleep"):
            time.sleep(config["step_sleep"])
        done = step + 1
        if ctx.should_save(done):
            nxt = _batch_indices(xtr.shape[0], done, batch, 0, ctx.world_size, seed)
            ctx.save(done, dict(shared, stats=totals, epoch=nxt[1], data_position=nxt[2]), own)
    if log:
        log.close()
    model.eval()
    with torch.no_grad():
        acc = float((model(xte).argmax(1) == yte).float().mean())
    return {"params": torch.cat([p.detach().flatten() for p in model.parameters()]).tolist(),
            "stats": totals, "accuracy": acc, "resumed_from": ctx.resumed.step if ctx.resumed else None,
            "restart_count": ctx.restart_count, "world_size": ctx.world_size}


def fail_on_rank_1(marker_dir):
    """Rank 1 raises; every call on every rank leaves a file in marker_dir (counts attempts)."""
    rank = int(os.environ["RANK"])
    open(os.path.join(marker_dir, f"attempt-{rank}-{os.getpid()}-{time.time_ns()}"), "w").close()
    dist.init_process_group("gloo")
    try:
        if rank == 1:
            raise ValueError("boom from rank 1")
        dist.barrier()
        return "unreachable"
    finally:
        dist.destroy_process_group()


def exchange_once(config, ctx):
    """One asynchronous gradshare exchange on the default channel (its private group must not outlive the run)."""
    import gradshare

    g = torch.full((64,), 0.5)
    fut = gradshare.exchange_async(g, torch.zeros(64), 0.25)
    return {"stats": {"steps": int(fut.wait().count > 0)}}


def reference(config):
    """The uninterrupted run of ``train`` on ``config``: 2 local workers, no checkpoints; rank 0's result (what a
    restarted, resumed or differently launched run must equal)."""
    from gradshare import cluster
    from gradshare.workers import run_local

    return run_local(cluster.run, 2, (train, config), timeout=120, collective_timeout=60)[0]
