"""Small reference models for examples, tests and `gradshare train`."""
from __future__ import annotations

import torch
from torch import nn


class SmallCNN(nn.Module):
    """A two-convolution classifier for small images: 8x8 digits (about 38k parameters) or 28x28 MNIST.

    conv3x3(16) -> ReLU [-> maxpool2 for images of 16 px or more] -> conv3x3(32) -> ReLU -> maxpool2
    -> linear(64) -> ReLU -> linear(num_classes). Returns logits.
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 8):
        super().__init__()
        if image_size < 2:
            raise ValueError(f"image_size: must be >= 2, got {image_size}")
        early_pool = image_size >= 16
        layers = [nn.Conv2d(in_channels, 16, 3, padding=1), nn.ReLU()]
        side = image_size
        if early_pool:
            layers.append(nn.MaxPool2d(2))
            side //= 2
        layers += [nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
        side //= 2
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(32 * side * side, 64), nn.ReLU(),
                                        nn.Linear(64, num_classes))
        self.image_size = image_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class TiedLSTM(nn.Module):
    """A small language model whose output layer is its embedding (tied weights): embedding(width) -> one LSTM
    layer -> LayerNorm -> the embedding's transpose. Takes token ids (batch, length), returns logits."""

    def __init__(self, vocab: int = 24, width: int = 24):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.rnn = nn.LSTM(width, width, batch_first=True)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.rnn(self.emb(x))[0]))
