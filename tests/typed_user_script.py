"""A user's training script that imports gradshare's public API (checked with mypy --strict)."""
import torch
import torch.distributed as dist

import gradshare
from gradshare import ParallelWrapper, ParameterAveraging, SharedOptimizer, ThresholdState, threshold_hook


def train(model: torch.nn.Module) -> None:
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    ddp.register_comm_hook(ThresholdState(optimizer=opt), threshold_hook)
    shared = SharedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    sched = torch.optim.lr_scheduler.OneCycleLR(shared, max_lr=0.1, total_steps=10)
    shared.step()
    sched.step()
    avg = ParameterAveraging(model, torch.optim.SGD(model.parameters(), lr=0.1), frequency=5)
    avg.step()
    gradshare.verify_replicas(model)
    pw = ParallelWrapper(model, (torch.optim.Adam, {"lr": 3e-3}), workers=2)
    print(pw, dist.is_initialized(), gradshare.__version__)
