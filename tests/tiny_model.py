"""The small deterministic model and batches the gradient-sharing tests train (importable by spawned workers)."""
import torch
import torch.nn as nn


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 48), nn.ReLU(), nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, 4))


def batch(rank, step):
    """A batch that differs per rank and step, the same on every run."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 20, generator=g)
    return x, x[:, :4].argmax(1)


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()
