"""The models, data and training recipes the benchmarks train (bench/quality.py, bench/e2e_worker.py).

Each workload is a recipe a user would run with DDP: a model, its optimizer and learning rate (decayed to zero
along a cosine over the run, as most training does), a batch size per rank, the data and the metric it is
judged by.

- ``mnist_cnn``: gradshare.models.SmallCNN on MNIST, SGD lr 0.05 momentum 0.9, batch 32 per rank.
- ``mlp``: 784-2048-1024-10 perceptron (3.7M parameters, a dense step is 15 MB), SGD lr 0.05 momentum 0.9.
- ``bn_cnn``: a three-block conv net with BatchNorm on MNIST, SGD lr 0.05 momentum 0.9, weight decay 5e-4.
- ``char_lm``: a 4-layer causal transformer (d=96, 4 heads, context 64, 0.5M parameters) on the bytes of
  Python's own standard library sources (the text ships with every Python), AdamW lr 3e-3, weight decay
  0.01, batch 16 windows per rank; judged by validation loss on held-out modules.
- ``char_lm_clip``: the same with the gradients' norm clipped to 1 before each step
  (``torch.nn.utils.clip_grad_norm_``), as most transformer training scripts do.
- ``char_lm_1200``: the same for 1200 steps (local steps at H=20 get 60 rounds instead of 15).
- ``mnist_cnn_adam``: the MNIST CNN trained with Adam (lr 1e-3), as many users train small conv nets.
- ``char_lm_rmsprop``: the transformer LM trained with RMSprop (lr 5e-4).
- ``char_lm_muon``: the transformer LM trained with two optimizers, Muon (lr 3e-2) for the blocks' weight
  matrices and AdamW (lr 3e-3) for the embeddings, the head and the norms.
- ``regression``: a 16-256-256-4 perceptron (70k parameters) fitting a linear map of Gaussian inputs from noisy
  targets (noise 0.1) by mean squared error, SGD lr 0.05 momentum 0.9, batch 32 fresh samples per rank; judged
  by the mean squared error to the noiseless targets on held-out inputs. Gradients with little noise, every
  parameter mattering: where the classification workloads forgive what sparse updates delay, this one does not.
- ``regression_adam``, ``regression_adamw``: the same fit with Adam (lr 1e-3) and with AdamW (lr 3e-3, weight
  decay 0.01).
- ``vit_mnist``: a vision transformer (16 patches of 7x7, 4 pre-norm blocks of width 64, 0.14M parameters) on MNIST,
  trained the way transformer recipes train: AdamW lr 2e-3 with weight decay 0.05 on the weight matrices only, the
  learning rate warmed up linearly over the first 10% of the steps and then decayed along a cosine, the gradients'
  norm clipped to 1, label smoothing 0.1, batch 32 per rank, one epoch; judged by test accuracy.
- ``recommender``: matrix factorization as recommenders train it: a 32-wide embedding per user (2000) and per item
  (1000) and a bias for each, scored by their dot product (99k parameters), fitting ratings of a hidden rank-8 model
  (noise 0.3) by mean squared error, Adam lr 2e-2, batch 64 fresh (user, item) pairs per rank, 1000 steps. Users and
  items are drawn by popularity (Zipf-like: the most popular item about 100 times as often as the least), so a step's
  gradient touches only the rows of its batch and a rare row's few gradients must all count; judged by the mean
  squared error to the noiseless ratings of held-out pairs. The only workload here whose gradients are mostly zero.
- ``copy_lstm``: an LSTM with tied embeddings (vocabulary 256, width 64, 50k parameters) learning to repeat the
  previous token of random sequences, AdamW lr 3e-3, batch 16 sequences of 32 per rank, 300 steps; judged by the
  loss on held-out sequences. A task that is learnt exactly, so its loss falls fast throughout a short run and
  its gradients carry little noise: a model that lags the ranks' progress shows it.
"""
from __future__ import annotations

import math
import os
import sysconfig
from dataclasses import dataclass
from typing import Callable, Dict, Tuple

import torch
from torch import nn
from torch.nn import functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
MNIST_DIR = os.path.join(HERE, "..", "..", "shared", "data", "mnist")


class MLP(nn.Module):
    """784-2048-1024-10 perceptron, 3.7M parameters: a dense step is ~15 MB, communication-bound at 100 Mbit/s."""

    def __init__(self, hidden=(2048, 1024), num_classes: int = 10):
        super().__init__()
        layers, width = [nn.Flatten()], 28 * 28
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


class RegressionMLP(nn.Module):
    """16-256-256-4 perceptron with ReLUs (70k parameters)."""

    def __init__(self, inputs: int = 16, hidden: int = 256, outputs: int = 4):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, outputs))

    def forward(self, x):
        return self.net(x)


class BNNet(nn.Module):
    """Three conv-BatchNorm-ReLU blocks and a linear head (24k parameters)."""

    def __init__(self, num_classes: int = 10):
        super().__init__()

        def block(i, o):
            return [nn.Conv2d(i, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU()]

        self.net = nn.Sequential(*block(1, 16), nn.MaxPool2d(2), *block(16, 32), nn.MaxPool2d(2), *block(32, 64),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes))

    def forward(self, x):
        return self.net(x)


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.mlp(self.ln2(x))


class TinyViT(nn.Module):
    """A vision transformer for 28x28 digits: 16 patches of 7x7, a class token, 4 pre-norm blocks (d=64, 4 heads,
    GELU MLP of 128), 0.14M parameters."""

    def __init__(self, dim: int = 64, depth: int = 4, heads: int = 4, patch: int = 7, num_classes: int = 10):
        super().__init__()
        self.patch = patch
        tokens = (28 // patch) ** 2
        self.embed = nn.Linear(patch * patch, dim)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, tokens + 1, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        p = self.patch
        x = x.reshape(x.shape[0], 28 // p, p, 28 // p, p).permute(0, 1, 3, 2, 4).reshape(x.shape[0], -1, p * p)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), self.embed(x)], 1) + self.pos
        return self.head(self.norm(self.blocks(x))[:, 0])


class CharLM(nn.Module):
    """Byte-level causal transformer: 256-token vocabulary, learned positions, pre-norm blocks."""

    def __init__(self, d: int = 96, layers: int = 4, heads: int = 4, context: int = 64):
        super().__init__()
        self.tok, self.pos = nn.Embedding(256, d), nn.Embedding(context, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, 256)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.ln(self.blocks(x)))


class CharLSTM(nn.Module):
    """Byte-level two-layer LSTM language model with tied input and output embeddings."""

    def __init__(self, d: int = 256, layers: int = 2):
        super().__init__()
        self.tok = nn.Embedding(256, d)
        self.rnn = nn.LSTM(d, d, layers, batch_first=True)
        self.head = nn.Linear(d, 256)
        self.head.weight = self.tok.weight

    def forward(self, idx):
        return self.head(self.rnn(self.tok(idx))[0])


class Recommender(nn.Module):
    """Matrix factorization: user and item embeddings and biases, a rating scored by the embeddings' dot product."""

    def __init__(self, users: int = 2000, items: int = 1000, d: int = 32):
        super().__init__()
        self.user, self.item = nn.Embedding(users, d), nn.Embedding(items, d)
        self.user_bias, self.item_bias = nn.Embedding(users, 1), nn.Embedding(items, 1)
        for e in (self.user, self.item):
            nn.init.normal_(e.weight, std=0.1)
        for e in (self.user_bias, self.item_bias):
            nn.init.zeros_(e.weight)

    def forward(self, pairs):
        u, i = pairs[:, 0], pairs[:, 1]
        return (self.user(u) * self.item(i)).sum(1) + self.user_bias(u)[:, 0] + self.item_bias(i)[:, 0]


# ----------------------------------------------------------------------------------------------- text
TRAIN_MODULES = ("argparse.py", "collections/__init__.py", "dataclasses.py", "inspect.py", "typing.py", "pathlib.py",
                 "subprocess.py", "tarfile.py", "threading.py", "logging/__init__.py", "enum.py", "functools.py")
VALID_MODULES = ("json/decoder.py", "json/encoder.py", "textwrap.py", "string.py")
CONTEXT = 64


def stdlib_bytes(modules) -> torch.Tensor:
    lib = sysconfig.get_paths()["stdlib"]
    data = b"".join(open(os.path.join(lib, m), "rb").read() for m in modules)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


# ----------------------------------------------------------------------------------------------- recipes
@dataclass
class Workload:
    name: str
    model: Callable[[], nn.Module]
    optimizer: Callable[[object], torch.optim.Optimizer]
    batch: int                    # per rank
    steps: int
    metric: str                   # "accuracy" (higher is better) or "loss" (lower is better)
    clip: float = 0.0             # > 0: the script clips the gradients' norm to this before each step
    warmup: int = 0               # > 0: the learning rate rises linearly over these steps before its cosine decay
    label_smoothing: float = 0.0  # of the training loss (the metric is unchanged)


def _copy_lstm():
    from gradshare.models import TiedLSTM

    return TiedLSTM(vocab=COPY_VOCAB, width=64)


COPY_VOCAB, COPY_LENGTH = 256, 32


def _sgd(lr=0.05, momentum=0.9, weight_decay=0.0):
    return lambda ps: torch.optim.SGD(ps, lr=lr, momentum=momentum, weight_decay=weight_decay)


MUON_LR = float(os.environ.get("GRADSHARE_BENCH_MUON_LR", "3e-2"))   # of 3e-3, 1e-2, 3e-2 the best under DDP


def _muon_adamw(params):
    """Muon (``adjust_lr_fn="match_rms_adamw"``, so AdamW's learning rate suits it) for CharLM's blocks' weight
    matrices, AdamW for the rest (the embeddings come first among its parameters, the head's weight last),
    as Muon is used: a tuple of two optimizers."""
    params = list(params)
    hidden = [p for p in params[2:-2] if p.ndim == 2]
    ids = {id(p) for p in hidden}
    return (torch.optim.Muon(hidden, lr=MUON_LR, weight_decay=0.01, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW([p for p in params if id(p) not in ids], lr=3e-3, weight_decay=0.01))


def _adamw_no_decay(lr: float, weight_decay: float):
    """AdamW as most transformer recipes set it up: weight decay on the weight matrices only, none on biases, norms,
    embeddings of position and the class token (two parameter groups)."""
    def make(params):
        params = list(params)
        matrix = [p.ndim >= 2 and p.shape[0] > 1 for p in params]   # the class token and positions are (1, ., d)
        return torch.optim.AdamW([{"params": [p for p, m in zip(params, matrix) if m]},
                                  {"params": [p for p, m in zip(params, matrix) if not m], "weight_decay": 0.0}],
                                 lr=lr, weight_decay=weight_decay)
    return make


def _small_cnn():
    from gradshare.models import SmallCNN

    return SmallCNN(in_channels=1, num_classes=10, image_size=28)


WORKLOADS: Dict[str, Workload] = {
    "mnist_cnn": Workload("mnist_cnn", _small_cnn, _sgd(), 32, 938, "accuracy"),
    "mlp": Workload("mlp", MLP, _sgd(), 32, 600, "accuracy"),
    "bn_cnn": Workload("bn_cnn", BNNet, _sgd(weight_decay=5e-4), 32, 938, "accuracy"),
    "char_lm": Workload("char_lm", CharLM, lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.01), 16, 300,
                        "loss"),
    "mnist_cnn_adam": Workload("mnist_cnn_adam", _small_cnn, lambda ps: torch.optim.Adam(ps, lr=1e-3), 32, 938,
                               "accuracy"),
    # the LM with RMSprop (an adaptive optimizer that keeps no mean gradient: gradshare.second_moment)
    "char_lm_rmsprop": Workload("char_lm_rmsprop", CharLM, lambda ps: torch.optim.RMSprop(ps, lr=5e-4), 16, 300,
                                "loss"),
    # the LM with Muon for the blocks' weight matrices and AdamW for the rest: two optimizers
    "char_lm_muon": Workload("char_lm_muon", CharLM, lambda ps: _muon_adamw(ps), 16, 300, "loss"),
    # the LM as most transformer scripts train it: the gradients' norm clipped to 1 before each step
    "char_lm_clip": Workload("char_lm_clip", CharLM, lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.01),
                             16, 300, "loss", clip=1.0),
    # an LSTM LM trained the classic way: plain SGD at a large learning rate, the gradients' norm clipped
    "char_lm_lstm": Workload("char_lm_lstm", CharLSTM, _sgd(lr=1.0, momentum=0.0), 16, 300, "loss", clip=0.25),
    # the same LSTM with Adam, as most recurrent models train now
    "char_lm_lstm_adam": Workload("char_lm_lstm_adam", CharLSTM, lambda ps: torch.optim.Adam(ps, lr=2e-3), 16, 300,
                                  "loss", clip=1.0),
    # least squares with little gradient noise (Data: fresh samples of a linear map every step)
    "regression": Workload("regression", RegressionMLP, _sgd(), 32, 600, "loss"),
    # the same with Adam and with AdamW (whose first moment fills with a waiting element's stale gradient too)
    "regression_adam": Workload("regression_adam", RegressionMLP, lambda ps: torch.optim.Adam(ps, lr=1e-3), 32, 600,
                                "loss"),
    "regression_adamw": Workload("regression_adamw", RegressionMLP,
                                 lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.01), 32, 600, "loss"),
    # the same, four times longer: local steps get 60 rounds at H=20 instead of 15
    "char_lm_1200": Workload("char_lm_1200", CharLM, lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.01),
                             16, 1200, "loss"),
    # a vision transformer trained by a modern recipe: AdamW with no decay on biases and norms, the learning rate
    # warmed up over the first 10% of the run then decayed along a cosine, the gradients' norm clipped to 1, label
    # smoothing 0.1; one epoch of MNIST
    "vit_mnist": Workload("vit_mnist", TinyViT, _adamw_no_decay(lr=2e-3, weight_decay=0.05), 32, 938, "accuracy",
                          clip=1.0, warmup=94, label_smoothing=0.1),
    # embeddings whose rows only their batch's pairs touch: mostly-zero gradients, under Adam
    "recommender": Workload("recommender", Recommender, lambda ps: torch.optim.Adam(ps, lr=2e-2), 64, 1000, "loss"),
    # a task learnt exactly: the loss falls fast through the whole run, with little gradient noise
    "copy_lstm": Workload("copy_lstm", _copy_lstm, lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.01), 16,
                          300, "loss"),
}


class Data:
    """A workload's data: ``batch(step, rank, world)`` -> (inputs, targets), the same on every run for a seed;
    ``evaluate(model)`` -> the metric on held-out data."""

    def __init__(self, workload: str, seed: int, data_dir: str = MNIST_DIR):
        self.workload, self.seed = workload, seed
        if workload.startswith("regression"):
            # The map is the same for every seed; the seed picks the training samples. Validation targets are
            # noiseless: the metric is the model's error, not the noise's.
            self.map = torch.randn(16, 4, generator=torch.Generator().manual_seed(7))
            x = torch.randn(4096, 16, generator=torch.Generator().manual_seed(8))
            self.valid = (x, x @ self.map)
        elif workload.startswith("char_lm"):
            self.train, self.valid = stdlib_bytes(TRAIN_MODULES), stdlib_bytes(VALID_MODULES)
        elif workload == "recommender":
            # The hidden model is the same for every seed; the seed picks the training pairs. Validation targets are
            # noiseless, as for the regressions.
            g = torch.Generator().manual_seed(7)
            self.factors = (torch.randn(2000, 8, generator=g) / 8 ** 0.25, torch.randn(1000, 8, generator=g) / 8 ** 0.25)
            self.biases = (0.5 * torch.randn(2000, generator=g), 0.5 * torch.randn(1000, generator=g))
            self.popularity = (1.0 / (torch.arange(2000) + 20.0), 1.0 / (torch.arange(1000) + 10.0))
            self.valid = self._ratings(torch.Generator().manual_seed(9), 8192)
        elif workload == "copy_lstm":
            self.valid = self._copy(torch.Generator().manual_seed(9), 512)      # the same for every seed
        else:
            from gradshare.data import load_mnist

            train, test = load_mnist(data_dir)
            self.train, self.valid = train.tensors, test.tensors

    def batch(self, step: int, rank: int, world: int, size: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if self.workload.startswith("regression"):
            g = torch.Generator().manual_seed(self.seed * 100003 + step)
            x = torch.randn(world, size, 16, generator=g)[rank]
            noise = torch.randn(world, size, 4, generator=g)[rank]
            return x, x @ self.map + 0.1 * noise
        if self.workload == "recommender":
            g = torch.Generator().manual_seed(self.seed * 100003 + step)
            x, y = self._ratings(g, world * size)
            y = y + 0.3 * torch.randn(len(y), generator=g)
            return x[rank * size:(rank + 1) * size], y[rank * size:(rank + 1) * size]
        if self.workload == "copy_lstm":
            g = torch.Generator().manual_seed(self.seed * 100003 + step)
            x, y = self._copy(g, world * size)
            return x[rank * size:(rank + 1) * size], y[rank * size:(rank + 1) * size]
        if self.workload.startswith("char_lm"):
            g = torch.Generator().manual_seed(self.seed * 100003 + step)
            starts = torch.randint(0, len(self.train) - CONTEXT - 1, (world, size), generator=g)[rank]
            seq = self.train[starts[:, None] + torch.arange(CONTEXT + 1)]
            return seq[:, :-1], seq[:, 1:]
        x, y = self.train
        per_epoch = len(y) // (world * size)
        epoch, i = divmod(step, per_epoch)
        perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(self.seed * 1000 + epoch))
        idx = perm[(i * world + rank) * size:(i * world + rank + 1) * size]
        return x[idx], y[idx]

    @staticmethod
    def _copy(g: torch.Generator, n: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """copy_lstm: ``n`` random sequences and their targets, each token the one before it (the first, 0)."""
        x = torch.randint(1, COPY_VOCAB, (n, COPY_LENGTH), generator=g)
        return x, torch.cat([torch.zeros(n, 1, dtype=x.dtype), x[:, :-1]], 1)

    def _ratings(self, g: torch.Generator, n: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """recommender: ``n`` (user, item) pairs drawn by popularity and their noiseless ratings."""
        u = torch.multinomial(self.popularity[0], n, replacement=True, generator=g)
        i = torch.multinomial(self.popularity[1], n, replacement=True, generator=g)
        rating = (self.factors[0][u] * self.factors[1][i]).sum(1) + self.biases[0][u] + self.biases[1][i]
        return torch.stack([u, i], 1), rating

    def loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.workload.startswith("regression") or self.workload == "recommender":
            return F.mse_loss(out, target)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1),
                               label_smoothing=WORKLOADS[self.workload].label_smoothing)

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> float:
        was = model.training
        model.eval()
        if self.workload.startswith("regression") or self.workload == "recommender":
            x, y = self.valid
            result = float(F.mse_loss(model(x), y))
        elif self.workload == "copy_lstm":
            x, y = self.valid
            result = float(F.cross_entropy(model(x).reshape(-1, COPY_VOCAB), y.reshape(-1)))
        elif self.workload.startswith("char_lm"):
            starts = torch.arange(0, len(self.valid) - CONTEXT - 1, CONTEXT)[:512]
            total = 0.0
            for i in range(0, len(starts), 128):
                seq = self.valid[starts[i:i + 128, None] + torch.arange(CONTEXT + 1)]
                total += float(F.cross_entropy(model(seq[:, :-1]).reshape(-1, 256), seq[:, 1:].reshape(-1),
                                               reduction="sum"))
            result = total / (len(starts) * CONTEXT)
        else:
            x, y = self.valid
            correct = sum(int((model(x[i:i + 2000]).argmax(1) == y[i:i + 2000]).sum()) for i in range(0, len(y), 2000))
            result = correct / len(y)
        model.train(was)
        return result if math.isfinite(result) else float("nan")
